"""Constrained decoding (JSON schema, regex, choice, Lark, tool calls) with llguidance.

The API process turns a request's constraint into an llguidance grammar (SamplingParams.grammar, the
JSON text `LLMatcher.grammar_from_*` returns) and validates it; here it becomes one LLMatcher per
sequence. Nothing of llguidance is imported until the first constrained request arrives; then, on
the engine's main thread:

  Grammars(...)      imports llguidance, starts one compile thread (it only calls into the library:
                     the tokenizer view and LLMatcher construction, which releases the GIL)
  submit(seq)        a sequence whose grammar is cached is ready at once (a deep copy of the compiled
                     matcher); else its grammar is queued for the thread and the sequence waits
                     outside the scheduler while the other streams step. The cache is keyed by the
                     grammar's SHA-256 and bounded in entries and in grammar bytes (hotstart/lru.py)
  ready()            (start of each step) the sequences whose matcher is built, or why it failed
  mask(logits, seqs) one of Sampler.transforms: the bitmasks of the constrained rows (GIL released; on
                     a GPU in one parallel llguidance call) into a [R, V/32] int32 buffer,
                     unpacked through a byte -> 8 bits table and applied as -inf; ids the tokenizer
                     lacks (logits wider than its vocabulary) are never allowed
  consume(...)       after sampling: each matcher takes its sequence's token

EOS is allowed exactly where the grammar accepts (llguidance sets the eos bits then); a matcher that
can take nothing more (is_stopped) ends its sequence with "stop" right away, as the forced EOS would.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import torch

from hotstart.engine.sequence import Sequence
from hotstart.errors import HotstartError
from hotstart.gguf_file import GGUFFile, is_gguf
from hotstart.lru import ByteLRU, digest

CACHE_SIZE = 64  # compiled grammars kept (pristine matchers, deep-copied per sequence)
CACHE_BYTES = 64 << 20  # and at most this much grammar text behind them (a matcher grows with its grammar)
WAIT_S = 0.005  # an idle step waits this long for a compile to finish (releases the GIL)


class GrammarError(Exception):
    """The engine cannot build a grammar's matcher (no tokenizer, a tokenizer wider than the logits)."""


def _tokenizer(llg: Any, model_path: str, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of the model's tokenizer.json (a GGUF file's: the one its metadata builds), as
    wide as the logits (vocab_size)."""
    if not Path(model_path).is_dir() and is_gguf(model_path):
        from hotstart.text import gguf_tokenizer  # noqa: PLC0415 - the tokenizers library, on first use

        try:
            text = gguf_tokenizer.build(GGUFFile(model_path))[0].to_str()
        except HotstartError as e:
            raise GrammarError(f"constrained decoding needs the model's tokenizer: {e}") from None
    else:
        path = Path(model_path) / "tokenizer.json"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise GrammarError(f"constrained decoding needs the model's tokenizer.json ({e.strerror})"
                               ) from None
    try:
        return llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain exceptions
        raise GrammarError(f"llguidance cannot use this tokenizer: {e}") from None


class Grammars:
    """Per-engine grammar state: the library, the tokenizer view, the compile thread, the cache and the
    sequences waiting for their matcher."""

    def __init__(self, sampler: Any, model_path: str, vocab_size: int, eos_ids: tuple[int, ...],
                 device: torch.device) -> None:
        import llguidance  # noqa: PLC0415 - loaded by the first constrained request

        self.llg, self.sampler, self.vocab_size, self.device = llguidance, sampler, vocab_size, device
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask row
        # On a GPU the masks of a step are computed by llguidance's own threads while the GPU idles; on
        # the CPU they run one after another on this thread: pool threads that spin after their work
        # take cores from the next forward (measured here: +40% per step at 16 streams, 2 cores)
        self.executor = llguidance.LLExecutor() if device.type == "cuda" else None
        self.tokenizer: Any = None  # built by the thread, on the first compile
        self.cache = ByteLRU(CACHE_SIZE, CACHE_BYTES)  # digest(grammar) -> pristine matcher
        self.waiting: dict[bytes, list[Sequence]] = {}  # digest(grammar) -> sequences waiting for it
        self.done: list[tuple[Sequence, str | None]] = []  # ready for the scheduler (error or None)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer = torch.zeros(0, self.words, dtype=torch.int32)
        # bit k of byte b -> True: unpacks llguidance's little-endian bitmask rows on the logits' device
        self._bits = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)
        self._thread = threading.Thread(target=self._compile_loop, name="hotstart-grammar", daemon=True,
                                        args=(model_path, eos_ids))
        self._thread.start()

    # --- compiling (the thread calls into llguidance only) -------------------------------------
    def _compile_loop(self, model_path: str, eos_ids: tuple[int, ...]) -> None:
        while True:
            key, grammar = self._jobs.get()
            try:
                if self.tokenizer is None:
                    self.tokenizer = _tokenizer(self.llg, model_path, self.vocab_size, eos_ids)
                matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
                error = matcher.get_error() if matcher.is_error() else None
            except GrammarError as e:
                matcher, error = None, str(e)
            except Exception as e:  # noqa: BLE001 - reported to the request, never kills the thread
                matcher, error = None, f"{type(e).__name__}: {e}"
            self._results.put((key, len(grammar), matcher, error))

    def submit(self, seq: Sequence) -> None:
        """SEQ (its params.grammar set, its sampler state registered) waits until its matcher is built."""
        grammar = seq.params.grammar
        key = digest(grammar)
        cached = self.cache.get(key)
        if cached is not None:
            self.sampler.attach_matcher(seq, cached.deep_copy())
            self.done.append((seq, None))
        elif key in self.waiting:
            self.waiting[key].append(seq)
        else:
            self.waiting[key] = [seq]
            self._jobs.put((key, grammar))

    @property
    def pending(self) -> bool:
        return bool(self.waiting or self.done)

    def cancel(self, seq: Sequence) -> None:
        """SEQ was aborted while waiting: it is not handed out."""
        for seqs in list(self.waiting.values()):
            if seq in seqs:
                seqs.remove(seq)
        self.done = [(s, e) for s, e in self.done if s is not seq]

    def ready(self, wait: float = 0.0) -> list[tuple[Sequence, str | None]]:
        """Sequences whose matcher is attached (error None) or could not be built (the message); waits
        up to WAIT seconds for the first result if none is there."""
        while True:
            try:
                key, size, matcher, error = (
                    self._results.get(timeout=wait) if wait else self._results.get_nowait()
                )
            except queue.Empty:
                break
            wait = 0.0
            seqs = self.waiting.pop(key, [])
            if error is None:
                self.cache.put(key, matcher, size)
            for seq in seqs:
                if error is None:
                    self.sampler.attach_matcher(seq, matcher.deep_copy())
                self.done.append((seq, None if error is None else f"grammar: {error}"))
        out, self.done = self.done, []
        return out

    # --- per step -------------------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sampler transform: -inf wherever a constrained row's grammar forbids the token."""
        if not self.sampler.num_constrained:
            return logits
        rows = [i for i, s in enumerate(seqs) if s.sampling is not None and s.sampling.matcher is not None]
        if not rows:
            return logits
        n = len(rows)
        if self._buffer.shape[0] < n:
            self._buffer = torch.zeros(max(n, 2 * self._buffer.shape[0]), self.words, dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        bitmask = self._buffer[:n]  # [R, W] int32, filled by llguidance's threads
        if self.executor is not None:
            matchers = [(seqs[i].sampling.matcher, k) for k, i in enumerate(rows)]
            self.executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), self.words * 4, n)
        else:
            ptr, row_bytes = bitmask.data_ptr(), self.words * 4
            for k, i in enumerate(rows):
                seqs[i].sampling.matcher.unsafe_compute_mask_ptr(ptr + k * row_bytes, row_bytes)
        packed = bitmask.to(self.device, non_blocking=True).view(torch.uint8)  # [R, 4W]
        allowed = self._bits[packed.long()].view(n, -1)  # [R, 32W] bool
        width = logits.shape[-1]
        if allowed.shape[1] < width:  # never: the bitmask covers vocab_size; kept for odd logits widths
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        allowed = allowed[:, :width]
        if n == len(seqs):
            return logits.masked_fill_(~allowed, float("-inf"))
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return logits

    def consume(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Each constrained sequence's matcher takes its sampled token."""
        pairs = [(s.sampling.matcher, t) for s, t in zip(seqs, tokens, strict=True)
                 if s.sampling is not None and s.sampling.matcher is not None]
        if self.executor is not None and len(pairs) > 1:
            self.executor.consume_token_par(pairs)
        else:
            for matcher, token in pairs:
                matcher.consume_token(token)


def grammar_finish(seq: Sequence) -> str | None:
    """"stop" once SEQ's grammar can take nothing more, "error" if its matcher failed, else None."""
    st = seq.sampling
    if st is None or st.matcher is None or not st.matcher.is_stopped():
        return None
    return "error" if st.matcher.is_error() else "stop"
