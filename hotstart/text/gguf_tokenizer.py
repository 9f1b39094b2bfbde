"""The tokenizer and chat template of a GGUF file, built from its metadata (`tokenizer.ggml.*`,
`tokenizer.chat_template`) with the `tokenizers` library, torch- and transformers-free.

Built to give llama.cpp's ids for the same file (llama-vocab.cpp; tests/text/test_gguf_tokenizer.py checks
them against ids llama.cpp produced):
  - "gpt2": byte-level BPE over the file's merges; the text split first by llama.cpp's regexes for the
    file's `tokenizer.ggml.pre` (applied in turn, each match isolated), words found whole in the
    vocabulary kept whole where llama.cpp does (ignore_merges: llama3, tekken);
  - "llama": SentencePiece BPE: spaces as U+2581, a space prefixed to every text piece (unless
    `tokenizer.ggml.add_space_prefix` is false), pieces merged best score first, bytes for what the
    vocabulary lacks (<0xNN>);
  - control, user-defined and unknown tokens are matched whole in the text first (control and unknown
    ones are special: skipped when decoding);
  - the bos (eos) token is prepended (appended) as `tokenizer.ggml.add_bos_token` (`add_eos_token`) says,
    else as llama.cpp's default for the model and pre-tokenizer.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from hotstart.errors import HotstartError
from hotstart.gguf_file import GGUFFile

CONTROL, USER_DEFINED, UNKNOWN = 3, 4, 2  # tokenizer.ggml.token_type values (llama.h's llama_token_type)
SPACE = "\u2581"

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CASED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CASED + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CASED + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CASED + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CASED}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CASED}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"
# llama.cpp's pre-tokenizer names -> (regexes applied in turn, ignore_merges, add_bos default)
_DEFAULT = ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], False, False)
_PRE: dict[str, tuple[list[str], bool, bool]] = {"default": _DEFAULT}
for _names, _spec in (
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     ([_LLAMA3], True, True)),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), ([_LLAMA3], False, False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), ([_QWEN2], False, False)),
    (("qwen35",), ([_QWEN35], False, False)),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     ([r"\p{N}", _GPT2], False, False)),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling", "jina-es",
      "jina-de", "jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0", "mellum"), ([_GPT2], False, False)),
    (("falcon",), ([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"], False, False)),
    (("deepseek-coder",),
     (["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False, False)),
    (("tekken",), ([_TEKKEN], True, True)),
    (("gpt-4o", "llama4"), ([_GPT4O], False, False)),
    (("poro-chat", "bloom", "gpt3-finnish"), ([_BLOOM], False, False)),
    (("viking",), ([_BLOOM, r"\p{N}"], False, False)),
):
    _PRE.update(dict.fromkeys(_names, _spec))


class GGUFTokenizerError(HotstartError):
    pass


def _ids(gf: GGUFFile, key: str, n: int) -> int | None:
    value = gf.get(f"tokenizer.ggml.{key}")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n else None


def build(gf: GGUFFile) -> tuple[Backend, dict, dict[str, tuple[str, str]]]:
    """(the tokenizers backend, tokenizer_config-like special tokens, chat templates name -> (source,
    where)) of GF. Raises GGUFTokenizerError naming the file and the key for what is not served."""
    kind = gf.get("tokenizer.ggml.model")
    tokens = gf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFTokenizerError(f"{gf.path}: GGUF key 'tokenizer.ggml.tokens' is missing or not a list of "
                                 "strings: no tokenizer in this file")
    types = gf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend, add_bos = _bpe(gf, tokens)
    elif kind == "llama":
        backend, add_bos = _spm(gf, tokens), True
    else:
        raise GGUFTokenizerError(f"{gf.path}: GGUF key 'tokenizer.ggml.model' {kind!r} is not served "
                                 "(gpt2, llama)")
    n = len(tokens)
    special = {name: _ids(gf, key, n) for name, key in (("bos_token", "bos_token_id"), ("eos_token",
               "eos_token_id"), ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    if kind == "llama":  # llama.cpp's SentencePiece defaults where the file says nothing
        special["bos_token"] = 1 if special["bos_token"] is None and n > 1 else special["bos_token"]
        special["eos_token"] = 2 if special["eos_token"] is None and n > 2 else special["eos_token"]
    added = [AddedToken(t, special=ty != USER_DEFINED, normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)]
    backend.add_tokens(added)
    add_bos = gf.get("tokenizer.ggml.add_bos_token", add_bos) is True
    add_eos = gf.get("tokenizer.ggml.add_eos_token", False) is True
    _post(backend, tokens, special["bos_token"] if add_bos else None,
          special["eos_token"] if add_eos else None)
    config = {name: tokens[i] for name, i in special.items() if i is not None}
    return backend, config, _templates(gf)


def _bpe(gf: GGUFFile, tokens: list[str]) -> tuple[Backend, bool]:
    pre = gf.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE:
        raise GGUFTokenizerError(f"{gf.path}: GGUF key 'tokenizer.ggml.pre' {pre!r}: this pre-tokenizer "
                                 f"is not served (served: {', '.join(sorted(_PRE))})")
    regexes, ignore_merges, add_bos = _PRE[pre]
    merges = gf.get("tokenizer.ggml.merges") or []
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp: the first space after the first character
        if cut > 0:
            pairs.append((m[:cut], m[cut + 1:]))
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, add_bos


def _spm(gf: GGUFFile, tokens: list[str]) -> Backend:
    scores = gf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    # merges from the vocabulary: every split of a piece into two pieces, the best resulting score first
    # (llama.cpp merges the pair whose joined text scores highest)
    merges = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, vocab[left], (left, right)))
    merges.sort()
    unk = _ids(gf, "unknown_token_id", len(tokens))
    backend = Backend(models.BPE(vocab, [m[3] for m in merges], unk_token=tokens[unk] if unk is not None
                                 else None, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE)] if gf.get("tokenizer.ggml.add_space_prefix", True) is True else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if steps else []  # the prefixed space of the first piece
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), *strip])
    return backend


def _post(backend: Backend, tokens: list[str], bos: int | None, eos: int | None) -> None:
    single = ([f"{tokens[bos]}:0"] if bos is not None else []) + ["$A:0"] + \
        ([f"{tokens[eos]}:0"] if eos is not None else [])
    pair = single + ["$B:1"]
    specials = [(tokens[i], i) for i in (bos, eos) if i is not None]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=list(dict.fromkeys(specials)))


def _templates(gf: GGUFFile) -> dict[str, tuple[str, str]]:
    """`tokenizer.chat_template` as "default", `tokenizer.chat_template.NAME` as NAME (e.g. tool_use)."""
    out = {}
    for key, value in gf.fields.items():
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
            if isinstance(value, str) and value:
                name = key.removeprefix("tokenizer.chat_template").lstrip(".") or "default"
                out[name] = (value, f"{gf.path}: {key}")
    return out
