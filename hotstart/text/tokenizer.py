"""Tokenizer and chat template for the API process, without transformers or torch.

Ids come from the `tokenizers` library on the model's tokenizer.json. Chat templates are rendered by
hotstart.text.chat_template the way transformers renders them, so prompts and ids match
`AutoTokenizer.apply_chat_template` on the same folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from hotstart.errors import HotstartError
from hotstart.gguf_file import GGUFFile, is_gguf
from hotstart.text import gguf_tokenizer
from hotstart.text.chat_template import (  # noqa: F401 - ChatTemplateError is part of this module's API
    ChatTemplateError,
    _alias_reasoning,
    _cut_at_tag,
    _environment,
    _load_chat_templates,
    _plain,
    _plain_message,
    _tag_final_message,
)

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")
_DETOKENIZE_CONTEXT = 5  # prompt tokens kept as left context for the first generated tokens
_RELEASE_GIL_ABOVE = 4096  # characters to encode / ids to decode from which the GIL is released meanwhile


class TokenizerError(HotstartError):
    """tokenizer.json or tokenizer_config.json is missing or unreadable."""


class Tokenizer:
    """Encode/decode and chat-template rendering for one model folder."""

    def __init__(self, backend: _Backend, config: dict | None = None,
                 chat_templates: dict[str, tuple[str, str]] | None = None, name: str = "model"):
        """`config`: tokenizer_config.json's content; `chat_templates`: name -> (source, where it is from)."""
        self._backend, self._config, self._name = backend, config or {}, name
        self._templates = dict(chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}
        # Truncation/padding baked into tokenizer.json would change ids; transformers' __call__ drops them
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(self._config.get("split_special_tokens", False))
        self.special_tokens_map, extra = _special_tokens(self._config)
        declared = [*self.special_tokens_map.values(), *extra]
        # transformers adds declared special tokens that tokenizer.json lacks; so do we, for the same ids
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = list(dict.fromkeys(t for t in declared if t not in added))
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True) for t in missing])
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token)
        self.eos_token_id: int | None = self.token_to_id(self.eos_token)
        # What decode(skip_special_tokens=True) drops: declared special tokens + added tokens marked special
        self.all_special_ids: set[int] = {i for t in declared if (i := self.token_to_id(t)) is not None}
        self.all_special_ids |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        if "default" in self._templates:
            self._template("default")  # a broken template fails at startup, not on the first request
        self.max_token_chars()  # a walk over the vocabulary (~10 ms on 49k tokens): here, not in a request

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template(s) of a model folder."""
        folder = Path(model_dir)
        if not folder.is_dir() and is_gguf(folder):
            return cls.from_gguf(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found (hotstart needs the model's tokenizer.json)")
        try:
            backend = _Backend.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust parser raises plain Exception
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise TokenizerError(f"{path}: not a valid tokenizers file ({reason})") from None
        config = _read_json_object(folder / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:
            # transformers reads the legacy special_tokens_map.json only then, and lets it win
            config.update(_read_json_object(folder / "special_tokens_map.json"))
        return cls(backend, config, _load_chat_templates(folder, config), name=str(folder))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat template(s) of a GGUF file, from its metadata (text/gguf_tokenizer.py)."""
        backend, config, templates = gguf_tokenizer.build(GGUFFile(path))
        return cls(backend, config, templates, name=str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Same ids as transformers' `tokenizer(text).input_ids`. A long text goes through the batch call,
        which releases the GIL while it runs (the single call holds it: 1.3 s for 1 MB here) and skips the
        offsets (3x faster), so the API process's worker threads tokenize beside its event loop; a short
        one through the single call, which never waits to take the GIL back."""
        if len(text) > _RELEASE_GIL_ABOVE:
            return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > _RELEASE_GIL_ABOVE:  # as encode(): the batch call releases the GIL
            return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary spells (byte-level pieces count their bytes,
        <0xNN> byte tokens their name: an upper bound). Computed once, when the tokenizer is built."""
        if "_max_token_chars" not in self.__dict__:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self.__dict__["_max_token_chars"] = max(map(len, vocab), default=1)
        return self.__dict__["_max_token_chars"]

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it: special tokens included, a piece of a character as
        U+FFFD (as vLLM shows them)."""
        texts = self.__dict__.setdefault("_token_texts", {})
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self._backend.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw UTF-8 bytes (OpenAI's logprobs `bytes`): a byte-level BPE piece or a <0xNN> byte
        token may be part of a character."""
        cache = self.__dict__.setdefault("_token_bytes", {})
        raw = cache.get(token_id)
        if raw is None:
            raw = cache[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._backend.get_added_tokens_decoder():
            return piece.encode()
        if type(self._backend.decoder).__name__ == "ByteLevel":
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def chat_template_source(self, tools: bool = False) -> str | None:
        """The text of the template a chat (with TOOLS: a chat with tools) is rendered with, or None."""
        try:
            name = self._pick_template(None, [] if tools else None)
        except ChatTemplateError:
            return None
        return self._templates[name][0]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, *,
                            documents=None, chat_template: str | None = None,
                            continue_final_message: bool | str = False, **kwargs) -> str:
        """Render `messages` as transformers' `apply_chat_template(..., tokenize=False)` does.

        `chat_template` names one of the model's templates, or is a template itself. Extra kwargs become
        template variables (enable_thinking, ...) and override the special tokens (bos_token, ...).
        """
        name = self._pick_template(chat_template, tools)
        if name is None:
            where, source = "the chat_template argument", chat_template
            template = self._compile(where, source)
        else:
            (source, where), template = self._templates[name], self._template(name)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatTemplateError("messages: expected a non-empty list of messages")
        for key, value in (("tools", tools), ("documents", documents)):
            if value is not None and not (isinstance(value, (list, tuple))
                                          and all(isinstance(v, Mapping) for v in value)):
                raise ChatTemplateError(f"{key}: expected a list of JSON objects")
        chat = _alias_reasoning([_plain_message(m, i) for i, m in enumerate(messages)])
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
            final = _tag_final_message(chat, continue_final_message, source)
        variables = _plain({**self.special_tokens_map, **kwargs})
        try:
            text = template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({where}) rejected the messages: {e}") from None
        except Exception as e:  # templates index, concatenate and call methods on user data
            raise ChatTemplateError(
                f"chat template ({where}) failed on the messages: {type(e).__name__}: {e}") from e
        return _cut_at_tag(text, final) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                    **kwargs) -> list[int]:
        """Same ids as transformers' `apply_chat_template(..., tokenize=True)`."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _pick_template(self, chat_template: str | None, tools) -> str | None:
        """The template's name, as transformers' get_chat_template picks it; None: use `chat_template`."""
        if chat_template is not None:
            return chat_template if chat_template in self._templates else None
        if not self._templates:
            raise ChatTemplateError(f"{self._name}: the model has no chat template (no chat_template.jinja, "
                                    "no chat_template in tokenizer_config.json); send a raw prompt instead")
        if tools is not None and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        raise ChatTemplateError(f"{self._name}: the model has several chat templates and none is named "
                                f"'default' (names: {sorted(self._templates)})")

    def _template(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            source, where = self._templates[name]
            self._compiled[name] = self._compile(where, source)
        return self._compiled[name]

    @staticmethod
    def _compile(where: str, source: str) -> jinja2.Template:
        try:
            return _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template ({where}) line {e.lineno}: {e.message}") from None


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, decoding only a few tokens per step.

    Two offsets into the ids (vLLM's scheme): text is decoded from `prefix`, so that tokens whose text
    depends on their left neighbour (byte pieces of one character, SentencePiece's leading space) decode
    as in the whole sequence, and only the text after `read` is new. New text ending in U+FFFD is an
    incomplete UTF-8 character: it is held back until later tokens complete it (or flush()).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None):
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        # Only the ids from `prefix` on are kept, so memory and work per step stay constant
        self._ids: list[int] = list(prompt_ids[-_DETOKENIZE_CONTEXT:]) if prompt_ids else []
        self._read = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[:read]), cached until the offsets move
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: the text held back (an incomplete character comes out as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._tokenizer.decode(self._ids[: self._read], self._skip)
        new_text = self._tokenizer.decode(self._ids, self._skip)
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._ids = self._ids[self._read:]  # the old read offset is the new prefix
        self._read = len(self._ids)
        self._prefix_text = None
        self._parts.append(delta)
        return delta


_BYTE_LEVEL: dict[str, int] = {}


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's alphabet: printable character -> the byte it stands for."""
    if not _BYTE_LEVEL:
        keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                *range(ord("\xae"), ord("\xff") + 1)]
        extra = 0
        for b in range(256):
            if b in keep:
                _BYTE_LEVEL[chr(b)] = b
            else:
                _BYTE_LEVEL[chr(256 + extra)] = b
                extra += 1
    return _BYTE_LEVEL


def _read_json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialised AddedToken
        return value["content"]
    return None


def _special_tokens(config: dict) -> tuple[dict[str, str], list[str]]:
    """(named special tokens, as transformers' special_tokens_map hands them to templates; extra ones)."""
    named = {}
    for key, value in config.items():
        content = _token_content(value)
        # model-specific names (image_token, ...) are special tokens and template variables too
        if content is not None and (key in NAMED_SPECIAL_TOKENS or key.endswith("_token")):
            named[key] = content
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        named.update({k: c for k, v in extra.items() if (c := _token_content(v)) is not None})
        extra = []
    return named, [c for v in extra if (c := _token_content(v)) is not None]


