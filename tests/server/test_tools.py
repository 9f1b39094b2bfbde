"""Tool calls without a model: the hermes / llama3_json parsers on Qwen- and Llama-formatted text (whole
and streamed in random splits), parser detection from chat templates, tool grammars (llguidance accepts
the calls it should and nothing else), and assistant tool calls through chat templates as transformers
renders them (arguments as a dict)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from helpers.models import DATA

from hotstart.errors import RequestError
from hotstart.frontend.tools import (
    HERMES,
    LLAMA3,
    ToolStream,
    chat_message,
    detect_parser,
    forced_names,
    parse,
    template_messages,
    tool_grammar,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
QWEN_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
LLAMA_TWO = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "UTC"}}'
)


def names_args(calls):
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) > 10 and c["type"] == "function"
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(parser: str, text: str, seed: int):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 15))))
    s, content, calls = ToolStream(parser), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        c, k = s.feed(text[a:b])
        content, calls = content + c, calls + k
    c, k = s.finish()
    return content + c, calls + k


def test_hermes_qwen_text():
    content, calls = parse(HERMES, QWEN_TWO)
    assert content == "Let me check."
    assert names_args(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                 ("get_time", {"tz": "Europe/Paris"})]
    assert len({c["id"] for c in calls}) == 2
    assert parse(HERMES, "The capital of France is Paris.") == ("The capital of France is Paris.", [])
    # a missing </tool_call> at the end still parses; a broken block stays text
    assert names_args(parse(HERMES, '<tool_call>\n{"name": "f", "arguments": {}}')[1]) == [("f", {})]
    broken = '<tool_call>\n{"name": "f", "argu'
    assert parse(HERMES, broken) == (broken, [])
    # arguments given as JSON text are accepted too
    assert names_args(
        parse(HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1]
    ) == [("f", {"a": 1})]


def test_llama3_json_text():
    content, calls = parse(LLAMA3, LLAMA_TWO)
    assert content is None
    assert names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert names_args(parse(LLAMA3, '<|python_tag|>{"name": "f", "arguments": {"x": 2}}')[1]) == [
        ("f", {"x": 2})
    ]
    assert parse(LLAMA3, "Paris is the capital.") == ("Paris is the capital.", [])
    assert parse(LLAMA3, '{"not": "a call"}') == ('{"not": "a call"}', [])


@pytest.mark.parametrize("seed", range(40))
def test_streaming_equals_whole_parse(seed):
    for parser, text in ((HERMES, QWEN_TWO), (LLAMA3, LLAMA_TWO), (HERMES, "plain <tool text> with < signs"),
                         (LLAMA3, "  plain text")):
        content, calls = streamed(parser, text, seed)
        whole_content, whole_calls = parse(parser, text)
        assert names_args(calls) == names_args(whole_calls)
        assert (content.strip() or None) == (whole_content.strip() if whole_content else None)


def test_hermes_stream_sends_each_call_once_complete():
    s = ToolStream(HERMES)
    assert s.feed("Sure. <tool") == ("Sure. ", [])  # "<tool" may become <tool_call>: held back
    assert s.feed('_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n') == ("", [])
    content, calls = s.feed("</tool_call>\n")
    assert content == "" and names_args(calls) == [("get_time", {"tz": "UTC"})]
    assert s.finish() == ("", [])


def test_chat_message_finish_reasons():
    msg, reason = chat_message(HERMES, QWEN_TWO, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check." and len(msg["tool_calls"]) == 2
    assert chat_message(HERMES, QWEN_TWO, "length")[1] == "length"
    assert chat_message(HERMES, "hi", "stop") == ({"role": "assistant", "content": "hi"}, "stop")
    assert chat_message(None, QWEN_TWO, "stop") == ({"role": "assistant", "content": QWEN_TWO}, "stop")


def test_detect_parser():
    assert detect_parser((DATA / "qwen2.5_chat_template.jinja").read_text()) == HERMES
    assert detect_parser((DATA / "llama3_tools_chat_template.jinja").read_text()) == LLAMA3
    assert detect_parser("{{ '<|python_tag|>' }}") == LLAMA3
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == HERMES
    assert detect_parser(None) == HERMES


def test_forced_names():
    assert forced_names([WEATHER], "auto") is None and forced_names(None, None) is None
    assert forced_names([WEATHER, TIME], "required") == ["get_weather", "get_time"]
    assert forced_names([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}) == [
        "get_time"
    ]
    for tools, choice in (([WEATHER], {"type": "function", "function": {"name": "nope"}}), (None, "required"),
                          ([WEATHER], "sometimes"), ([WEATHER], {"type": "function"})):
        with pytest.raises(RequestError) as e:
            forced_names(tools, choice)
        assert e.value.status == 400 and e.value.param == "tool_choice"


@pytest.fixture(scope="module")
def llg_tok(default_model_dir):
    import llguidance

    return llguidance.LLTokenizer((default_model_dir / "tokenizer.json").read_text())


def accepts(tok, grammar: str, text: str) -> bool:
    import llguidance

    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


def test_tool_grammars_accept_valid_calls_only(llg_tok):
    from hotstart.frontend.structured import compile_grammar

    hermes = compile_grammar(
        "lark", tool_grammar([WEATHER, TIME], ["get_weather", "get_time"], HERMES, True), "tools"
    )
    one = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>"
    )
    assert accepts(llg_tok, hermes, one)
    assert accepts(
        llg_tok, hermes, one + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    )
    assert not accepts(llg_tok, hermes, one.replace("celsius", "kelvin"))  # not in the enum
    assert not accepts(llg_tok, hermes, one.replace('"city": "Paris", ', ""))  # required argument missing
    assert not accepts(llg_tok, hermes, one.replace("get_weather", "get_wetter"))
    assert not accepts(llg_tok, hermes, "Sure! " + one)
    named = compile_grammar("lark", tool_grammar([WEATHER, TIME], ["get_time"], HERMES, False), "tools")
    assert not accepts(llg_tok, named, one) and not accepts(llg_tok, named, one + "\n" + one)
    llama = compile_grammar(
        "lark", tool_grammar([WEATHER, TIME], ["get_weather", "get_time"], LLAMA3, True), "tools"
    )
    assert accepts(llg_tok, llama, LLAMA_TWO)
    assert not accepts(llg_tok, llama, one)
    # tool_choice auto + response_format: calls, or the JSON answer
    both = compile_grammar("lark", tool_grammar([WEATHER], ["get_weather"], HERMES, True, {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}), "tools")
    assert accepts(llg_tok, both, one) and accepts(llg_tok, both, '{"answer": "42"}')
    assert not accepts(llg_tok, both, "42")


def test_tool_grammar_keeps_defs_references(llg_tok):
    from hotstart.frontend.structured import compile_grammar

    tool = {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {
                "$defs": {
                    "Address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    }
                },
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"],
            },
        },
    }
    g = compile_grammar("lark", tool_grammar([tool], ["ship"], HERMES, False), "tools")
    assert accepts(
        llg_tok, g, '<tool_call>\n{"name": "ship", "arguments": {"to": {"city": "Lyon"}}}\n</tool_call>'
    )


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.mark.parametrize(
    "template", ["default", "qwen2.5_chat_template.jinja", "llama3_tools_chat_template.jinja"]
)
def test_tool_round_trip_renders_as_transformers(default_model_dir, tmp_path, template):
    """OpenAI-shaped messages (arguments as JSON text) render as transformers renders the Hugging Face
    shape (arguments as a dict) on the default model's template and on Qwen2.5- / Llama-3-style ones."""
    from transformers import PreTrainedTokenizerFast

    from hotstart.text.tokenizer import Tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(default_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    if template != "default":
        shutil.copy(DATA / template, folder / "chat_template.jinja")
    ours = Tokenizer.from_dir(folder).apply_chat_template(template_messages(ROUND_TRIP), tools=[WEATHER])
    hf_messages = json.loads(json.dumps(ROUND_TRIP))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    theirs = hf.apply_chat_template(hf_messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    if template != "default":
        assert '{"city": "Paris"}' in ours and '"{\\"city' not in ours  # not JSON text encoded twice
    assert template_messages(ROUND_TRIP)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert ROUND_TRIP[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated
