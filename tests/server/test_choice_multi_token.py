"""Several tokens in one engine output (speculative decoding) end a choice at a stop string exactly as the
same tokens one output at a time do: the same text, token count and logprobs."""

import pytest

from hotstart.frontend.generation import Choice
from hotstart.messages import TokenLogprobs, TokenOutput


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from hotstart.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


def _run(tok, ids, chunk, stops):
    choice = Choice(0, tok, [1, 2, 3], stops, set())
    text, lps = "", []
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        last = i + chunk >= len(ids)
        out = TokenOutput("r", part, "length" if last else None,
                          logprobs=[TokenLogprobs(-0.5 - t / 1e5) for t in part])
        delta = choice.feed(out)
        text += delta.text
        lps += delta.logprobs or []
        if choice.finish_reason is not None:
            break
    return text, choice.completion_tokens, [(t, lp.logprob) for t, lp in lps], choice.finish_reason


@pytest.mark.parametrize("stops", [["lighthouse"], ["keeper climbed", "zzz"], []])
def test_a_stop_string_inside_a_multi_token_output_counts_as_one_at_a_time(tok, stops):
    ids = tok.encode(" The keeper climbed the steps of the lighthouse every evening and lit the lamp.",
                     add_special_tokens=False)
    one = _run(tok, ids, 1, stops)
    for chunk in (3, 5, len(ids)):
        assert _run(tok, ids, chunk, stops) == one
    if stops:
        assert one[3] == "stop" and one[1] < len(ids)
        assert all(s not in one[0] for s in stops)
    else:
        assert one[1] == len(ids) and one[3] == "length"
