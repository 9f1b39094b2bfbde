"""vLLM's `LLM`: generate() and chat() over hotstart's engine, every prompt submitted at once (continuous
batching), results in prompt order. Stops cleanly on close(), `with`, `del` / garbage collection and at
interpreter exit: no engine or forkserver process outlives it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
import weakref
from collections.abc import Sequence
from typing import Any

from hotstart.frontend.sampling import EngineLimits, resolve
from hotstart.llm.engine import EngineHandle
from hotstart.llm.outputs import CompletionOutput, RequestOutput, position_logprobs, sample_logprobs
from hotstart.llm.progress import progress_bar
from hotstart.sampling_params import SamplingParams

# vLLM engine arguments that mean nothing here (accepted, ignored)
IGNORED_ARGS = {"trust_remote_code", "enforce_eager", "download_dir", "load_format", "disable_log_stats",
                "swap_space", "cpu_offload_gb", "disable_custom_all_reduce", "tokenizer_mode", "quantization"}
_ENGINE_ARGS = {"dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                "kv_cache_memory", "gpu_memory_utilization", "seed", "compile", "enable_prefix_caching",
                "tensor_parallel_size", "speculative_config"}
_ids = itertools.count()


def _recording(feed: Any, ids: list[int]) -> Any:
    """Choice.feed that also keeps every token id the engine sent."""
    def wrapped(out: Any) -> Any:
        ids.extend(out.new_token_ids)
        return feed(out)

    return wrapped


def _close_handle(handle: EngineHandle) -> None:
    handle.close()


class LLM:
    """LLM(model, dtype="auto", tensor_parallel_size=1, max_model_len=None, seed=0, ...).

    MODEL is what `hotstart serve` takes (a folder, a Hugging Face id, s3://...; None: the default
    model). ENGINE "process" (the
    default) runs the engine in a process forked from the warm forkserver (or this user's zygote), as
    `serve` does; "inprocess" builds it in this process (imports torch here)."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, revision: str | None = None,
                 engine: str = "process", max_num_seqs: int = 256, **kwargs: Any) -> None:
        if engine not in ("process", "inprocess"):
            raise ValueError(f"engine must be 'process' or 'inprocess', got {engine!r}")
        if tokenizer not in (None, model):
            raise ValueError("a tokenizer other than the model's is not supported by hotstart")
        unknown = sorted(set(kwargs) - _ENGINE_ARGS - IGNORED_ARGS)
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {', '.join(unknown)}")
        engine_kwargs = {k: v for k, v in kwargs.items() if k in _ENGINE_ARGS and v is not None}
        engine_kwargs["max_num_seqs"] = max_num_seqs
        if "speculative_config" in engine_kwargs:  # vLLM's dict (or its JSON text); travels as JSON text
            from hotstart.spec_config import SpecConfig  # noqa: PLC0415 - only with the option

            try:
                spec = SpecConfig.parse(engine_kwargs["speculative_config"])
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
            engine_kwargs["speculative_config"] = spec.to_json()
        self._handle = EngineHandle(model, revision, engine_kwargs, engine == "process")
        self.tokenizer = self._handle.tokenizer
        self.model = model
        # stop at del / gc / interpreter exit (a finalizer runs at exit too), whichever comes first; it
        # holds the handle, not self
        self._finalizer = weakref.finalize(self, _close_handle, self._handle)

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def max_model_len(self) -> int:
        return self._handle.info.max_model_len

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # --- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, **_: Any) -> list[RequestOutput]:
        """PROMPTS: a string, a list of strings, a list of token ids, a list of token-id lists, or
        TokensPrompt / TextPrompt dicts ({"prompt_token_ids": [...]} / {"prompt": "..."})."""
        items = self._prompts(prompts)
        return self._run(items, sampling_params, use_tqdm)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, **_: Any) -> list[RequestOutput]:
        """MESSAGES: one conversation (a list of {"role", "content"}) or a list of them."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        items = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt, tools, **kwargs)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def _prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(type(t) is int for t in prompts)):
            prompts = [prompts]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p, add_special_tokens=True)))
            elif isinstance(p, (list, tuple)) and all(type(t) is int for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(
                    f"prompt {i}: expected a string, token ids or a prompt dict, got {type(p).__name__}")
            if not out[-1][1]:
                raise ValueError(f"prompt {i} encodes to no tokens")
        return out

    def _run(self, items: list[tuple[str | None, list[int]]], sampling_params: Any,
             use_tqdm: bool) -> list[RequestOutput]:
        if self._handle.client is None:
            raise RuntimeError("this LLM is closed")
        if sampling_params is None:
            sampling_params = SamplingParams()
        per = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(
            items)
        if len(per) != len(items):
            raise ValueError(f"{len(per)} sampling params for {len(items)} prompts")
        info, vocab = self._handle.info, getattr(self.tokenizer, "vocab_size", None)
        limits = EngineLimits(info.max_model_len, info.max_num_seqs, vocab)
        # the server's checks; a refusal is a RequestError, which is a ValueError
        wire = [resolve(sp, len(ids), limits) for sp, (_, ids) in zip(per, items)]
        done = [0]
        future = self._handle.submit(self._all(items, per, wire, done))
        with progress_bar(len(items), use_tqdm) as bar:
            while True:
                try:
                    gens = future.result(0.1)
                    break
                except concurrent.futures.TimeoutError:
                    bar.update_to(done[0])
            bar.update_to(len(items))
        return [self._output(g, text, sp) for g, (text, _), sp in zip(gens, items, per)]

    async def _all(self, items, per, wire, done) -> list[Any]:
        from hotstart.frontend.generation import Generation  # noqa: PLC0415 - imported before the thread
        from hotstart.frontend.metrics import Metrics  # noqa: PLC0415 - likewise (by the serving modules)

        metrics = Metrics()

        async def one(ids: list[int], sp: SamplingParams, params: Any) -> Any:
            gen = Generation(self._handle.client, self.tokenizer, f"llm-{next(_ids)}", ids, params,
                             sp.stop_strings, metrics, time.perf_counter())
            token_ids: list[list[int]] = [[] for _ in range(params.n)]
            for c in gen.choices:
                c.feed = _recording(c.feed, token_ids[c.index])
            stream = gen.deltas()
            async for _ in stream:
                pass
            gen.token_ids = token_ids
            done[0] += 1
            return gen

        return await asyncio.gather(*(one(ids, sp, w) for (_, ids), sp, w in zip(items, per, wire)))

    def _output(self, gen: Any, text: str | None, sp: SamplingParams) -> RequestOutput:
        outs = []
        for c in gen.choices:
            lps, cum = (None, None)
            if sp.logprobs is not None:
                lps, cum = sample_logprobs(self.tokenizer, c.logprobs)
            outs.append(CompletionOutput(c.index, c.text, gen.token_ids[c.index], cum, lps, c.finish_reason))
        prompt_lps = None
        if sp.prompt_logprobs is not None and gen.prompt_logprobs is not None:
            ids = gen.prompt_ids
            prompt_lps = [None] + [position_logprobs(self.tokenizer, t, lp)
                                   for t, lp in zip(ids[1:], gen.prompt_logprobs)]
        return RequestOutput(gen.request_id, text, gen.prompt_ids, prompt_lps, outs)
