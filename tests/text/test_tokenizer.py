"""hotstart.text.tokenizer against transformers' AutoTokenizer on the same folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotstart.errors import HotstartError
from hotstart.text.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
)

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve façade, Ångström, São Paulo, Łódź",
    "日本語のテキストと中文文本，还有한국어도 있습니다。",
    "Emoji: 🙂👍🏽🇫🇷 👨‍👩‍👧‍👦 🧑🏿‍🚀 and math ∑∫√∞ ≠ ≤",
    "  leading   spaces\t\ttabs\n\n\nnewlines    trailing   ",
    "code:\n    def f(x):\n        return x ** 2  # comment\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Name a cheese."},
        {"role": "assistant", "content": "Le comté."},
        {"role": "user", "content": "Et un vin ?"},
    ],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}],
]

# Qwen2.5-style: tools as JSON, namespace + loop variables, raise_exception, extra kwargs, {% generation %}
QWEN_STYLE = r"""{{- bos_token if add_bos is defined and add_bos else '' }}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\n\n# Tools\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen. Today is ' + strftime_now('%Y') + '.<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1, n_tools=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- elif message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if loop.index0 > ns.last_user and message.reasoning_content is defined %}
            {{- '\n<think>\n' + message.reasoning_content + '\n</think>' }}
        {%- endif %}
        {% generation %}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}{% endgeneration %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- set ns.n_tools = ns.n_tools + 1 %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments | tojson(indent=2, sort_keys=True) }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
{{- '' if ns.n_tools < 100 else raise_exception('too many tool calls') }}
{%- set meta = dict(a=1, b='ü') %}
{{- '' if meta | tojson == '{"a": 1, "b": "ü"}' else raise_exception('tojson') }}"""

WEATHER = {"name": "get_weather", "description": "Weather in a city (°C)",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]

TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "reasoning": "Call the tool.",  # aliased to reasoning_content
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
     },
    {"role": "tool", "content": "21°C, sunny"},
    {"role": "tool", "content": "UV index 5"},
    {"role": "assistant", "content": "It is 21 °C and sunny ☀️."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def model_dir(default_model_dir) -> Path:
    return Path(default_model_dir)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_ids(hf, messages, **kwargs) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def test_torch_free_and_no_imports_after_loading(model_dir):
    # Requests run on threads, which must not import modules: loading imports everything up front
    code = f"""
import sys
import hotstart.text.tokenizer as t
assert 'torch' not in sys.modules and 'transformers' not in sys.modules
tok = t.Tokenizer.from_dir({str(model_dir)!r})
loaded = set(sys.modules)
tok.encode_chat([{{"role": "user", "content": "hé 🙂"}}], tools=[{{"name": "f"}}], enable_thinking=True)
detok = t.IncrementalDetokenizer(tok)
detok.add(tok.encode("héllo 🙂")), detok.flush()
try:
    tok.apply_chat_template([{{"role": "user", "content": [1]}}])
except t.ChatTemplateError:
    pass
assert set(sys.modules) == loaded, sorted(set(sys.modules) - loaded)
assert 'torch' not in sys.modules and 'transformers' not in sys.modules
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_attributes_match_transformers(tok, hf):
    assert tok.vocab_size == len(hf)
    assert (tok.bos_token, tok.eos_token) == (hf.bos_token, hf.eos_token)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert set(hf.all_special_ids) <= tok.all_special_ids
    assert tok.has_chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_chat_template_matches_transformers(tok, hf, messages, add_generation_prompt):
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == theirs
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_ids(hf, messages, add_generation_prompt=add_generation_prompt)
    assert (ids[-4:] == tok.encode("<|im_start|>assistant\n", False)) == add_generation_prompt


def test_continue_final_message_matches_transformers(tok, hf):
    messages = CONVERSATIONS[3][:1] + [{"role": "assistant", "content": "The answer is  "}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    theirs = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours == theirs and ours.endswith("\nThe answer is  ")  # cut right after the message


@pytest.fixture(scope="module")
def qwen_dir(model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen_style")
    shutil.copy(model_dir / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    # The named-list form of tokenizer_config.json, with a tool_use template chosen when tools are given
    config["chat_template"] = [{"name": "default", "template": QWEN_STYLE.replace("You are Qwen", "Default")},
                               {"name": "tool_use", "template": QWEN_STYLE}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def qwen_pair(qwen_dir):
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(qwen_dir), AutoTokenizer.from_pretrained(qwen_dir)


@pytest.mark.parametrize("case", ["plain", "system", "tools", "tools_no_gen", "thinking_off", "bos"])
def test_qwen_style_template_matches_transformers(qwen_pair, case):
    tok, hf = qwen_pair
    messages, kwargs = {
        "plain": (CONVERSATIONS[0], {}),
        "system": (CONVERSATIONS[2], {"add_generation_prompt": False}),
        "tools": (TOOL_CHAT, {"tools": TOOLS}),
        "tools_no_gen": (TOOL_CHAT[:4], {"tools": TOOLS, "add_generation_prompt": False}),
        "thinking_off": (CONVERSATIONS[1], {"enable_thinking": False}),
        "bos": (CONVERSATIONS[1], {"add_bos": True, "bos_token": "<|endoftext|>"}),
    }[case]
    kwargs.setdefault("add_generation_prompt", True)
    text = tok.apply_chat_template(messages, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tok.encode_chat(messages, **kwargs) == hf_ids(hf, messages, **kwargs)
    assert ("<tools>" in text) == ("tools" in kwargs)  # the tool_use template was picked only with tools
    assert ("<think>\nCall the tool." in text) == (case == "tools_no_gen")


def test_template_exception_is_a_clear_error(qwen_pair, tok):
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(ChatTemplateError, match="rejected the messages: Unknown role: robot"):
        qwen_pair[0].apply_chat_template(bad)
    # SmolLM2's template concatenates content to a str, so a list of parts is a TypeError inside it
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(ChatTemplateError, match="failed on the messages: TypeError"):
        tok.apply_chat_template(parts)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]: expected a JSON object"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        tok.apply_chat_template([])


def test_bad_folders_give_clear_errors(tmp_path, model_dir):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: unreadable JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    plain = Tokenizer.from_dir(tmp_path)  # no template: loads, but chat needs one
    assert not plain.has_chat_template and plain.eos_token_id == 2
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja\) line 1: "):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 42}))
    with pytest.raises(HotstartError, match=r"tokenizer_config\.json: chat_template: expected a string"):
        Tokenizer.from_dir(tmp_path)


def stream(tok, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return deltas


def test_incremental_detokenizer_never_splits_characters(tok):
    text = "".join(t for t in TEXTS if "<|" not in t) + " 🦜🦜 — «ok» 👩🏾‍🔬"
    ids = tok.encode(text)
    # The text really has characters split across byte-level tokens, which decode alone to U+FFFD
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_incremental_detokenizer_special_tokens_and_prompt(tok):
    prompt = tok.encode_chat(CONVERSATIONS[1])
    answer = {"role": "assistant", "content": "Un côtes-du-rhône 🍷"}
    ids = tok.encode_chat(CONVERSATIONS[2] + [answer], add_generation_prompt=False)
    for skip in (True, False):
        deltas = stream(tok, ids, skip_special_tokens=skip, prompt_ids=prompt)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)
    # Several ids at once, and an incomplete character left at the end comes out on flush
    detok = IncrementalDetokenizer(tok)
    emoji = tok.encode("🍷", add_special_tokens=False)
    assert len(emoji) > 1
    assert detok.add(tok.encode("Wine: ")) == "Wine: "
    assert detok.add(emoji[:-1]) == ""
    assert detok.flush() == tok.decode(emoji[:-1]) and detok.text.endswith("\ufffd")


def test_incremental_detokenizer_cost_does_not_grow_with_length(tok):
    ids = tok.encode("Streaming text, token by token; ünïcödé 🙂. " * 1500)  # ~25k tokens
    detok = IncrementalDetokenizer(tok)
    start = time.perf_counter()
    for i in ids:
        detok.add([i])
    elapsed = time.perf_counter() - start
    assert detok.text == tok.decode(ids)
    # Re-decoding the whole sequence per token would decode ~3e8 tokens here (minutes); windows: < 0.2 s
    assert elapsed < 2.0, f"{len(ids)} tokens took {elapsed:.2f} s"


def test_incremental_detokenizer_sentencepiece_style():
    # Llama-2-style pipeline: '▁' for spaces, the first space stripped, unknown characters as <0xNN> bytes
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    pieces = ["▁", "H", "e", "l", "o", "w", "r", "d", "è", "▁H", "▁w"]
    vocab.update({p: 259 + n for n, p in enumerate(pieces)})
    merges = [("▁", "H"), ("▁", "w")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok = Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})
    for text in ["Hello world 🙂 Hèllo", " Hello  wor日ld", "🦜🦜 Hello"]:
        ids = tok.encode(text)
        assert any(tok.id_to_token(i).startswith("<0x") for i in ids)
        for prompt in ([], tok.encode("Hello")):
            deltas = stream(tok, ids, prompt_ids=prompt)
            assert not any("\ufffd" in d for d in deltas)
            # The first delta carries the space between the prompt and the generated text
            assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
