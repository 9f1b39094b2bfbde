"""The soak's workload (`hotstart bench soak`): the request kinds, the --mix deck every client draws from,
and each kind's request (prompts, lengths and temperatures drawn from the client's random generator).
The bad requests are the ones that must get a 4xx in OpenAI's error format."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from hotstart.bench.load import PROMPTS
from hotstart.errors import HotstartError

KINDS = ("chat", "chat_stream", "text", "text_stream", "n", "json_schema", "tools", "hangup", "bad")
COLORS = ["red", "green", "blue"]
COLOR_SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": COLORS}},
    "required": ["color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
STRUCTURED_TOKENS = 64  # room for a whole JSON answer / tool call (a cut one is only checked for shape)
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@dataclass
class Req:
    """One request to send: KIND (KINDS), VARIANT (the bad request's name), its path and body (or raw
    bytes), streamed or not."""

    kind: str
    model: str
    path: str
    body: dict | None = None
    raw: bytes | None = None
    variant: str = ""
    stream: bool = False
    extra: dict = field(default_factory=dict)


def parse_mix(spec: str) -> dict[str, int]:
    """'chat=2,bad=1' -> weights of the named kinds (the others 0); one-line errors."""
    mix: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, w = part.partition("=")
        if kind not in KINDS:
            raise HotstartError(f"--mix: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        try:
            mix[kind] = int(w) if sep else 1
        except ValueError:
            raise HotstartError(f"--mix: {part!r}: the weight must be an integer") from None
        if mix[kind] < 0:
            raise HotstartError(f"--mix: {part!r}: the weight must be >= 0")
    if not any(mix.values()):
        raise HotstartError("--mix: no kind with a weight above 0")
    return mix


class Deck:
    """Kinds in shuffled decks of WEIGHTS (every kind of weight > 0 once per deck at least), shared by
    all clients so that a short run still sends each kind."""

    def __init__(self, weights: dict[str, int], rng: random.Random):
        self.weights, self.rng, self.cards = weights, rng, []

    def draw(self) -> str:
        if not self.cards:
            self.cards = [k for k, w in self.weights.items() for _ in range(w)]
            self.rng.shuffle(self.cards)
        return self.cards.pop()


def chat_body(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **extra,
    }


def bad_requests(model: str) -> list[Req]:
    """Requests that must get a 4xx: malformed JSON, an unknown model, parameters out of range, a schema
    with a typo, a tool_choice naming no tool."""
    hi = [{"role": "user", "content": "hi"}]
    raw = json.dumps({"model": model, "messages": hi}).encode()[:-12]  # cut mid-object
    bad = {
        "unknown_model": chat_body("no-such-model-soak", "hi", 8),
        "temperature_negative": chat_body(model, "hi", 8, temperature=-1),
        "max_tokens_zero": {"model": model, "prompt": "hi", "max_tokens": 0},
        "n_zero": chat_body(model, "hi", 8, n=0),
        "schema_typo": chat_body(
            model,
            "hi",
            8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            },
        ),
        "tool_choice_unknown": chat_body(
            model,
            "hi",
            8,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}},
        ),
    }
    out = [Req("bad", model, CHAT, raw=raw, variant="malformed_json")]
    out += [
        Req("bad", model, TEXT if "prompt" in b else CHAT, body=b, variant=name) for name, b in bad.items()
    ]
    return out


BAD_VARIANTS = tuple(r.variant for r in bad_requests("m"))


def make_request(
    kind: str, model: str, rng: random.Random, min_tokens: int, max_tokens: int, bad_index: int = 0
) -> Req:
    """The request of KIND to MODEL (prompt, lengths and temperature drawn from RNG)."""
    prompt, n_tok = rng.choice(PROMPTS), rng.randint(min_tokens, max_tokens)
    # a seed of its own: two clients' identical requests in flight at two engine deaths in a row would be
    # taken for one poison request retried (frontend/crashes.py) and refused
    temp = {"temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(1 << 31)}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        return Req(kind, model, CHAT, chat_body(model, prompt, n_tok, **temp))
    if kind == "text":
        return Req(kind, model, TEXT, {"model": model, "prompt": prompt, "max_tokens": n_tok, **temp})
    if kind in ("chat_stream", "hangup"):
        return Req(
            kind,
            model,
            CHAT,
            chat_body(model, prompt, n_tok, **temp, **usage),
            stream=True,
            extra={"after": rng.randint(1, 4)} if kind == "hangup" else {},
        )
    if kind == "text_stream":
        return Req(
            kind,
            model,
            TEXT,
            {"model": model, "prompt": prompt, "max_tokens": n_tok, **temp, **usage},
            stream=True,
        )
    if kind == "n":
        body = chat_body(model, prompt, n_tok, n=2, temperature=0.7, seed=temp["seed"])
        return Req(kind, model, CHAT, body, extra={"n": 2})
    if kind == "json_schema":
        return Req(
            kind,
            model,
            CHAT,
            chat_body(
                model,
                f"Pick a colour: {', '.join(COLORS)}.",
                STRUCTURED_TOKENS,
                **temp,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "colour", "schema": COLOR_SCHEMA, "strict": True},
                },
            ),
        )
    if kind == "tools":
        return Req(
            kind,
            model,
            CHAT,
            chat_body(
                model,
                "What is the weather in Paris?",
                STRUCTURED_TOKENS,
                **temp,
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            ),
        )
    if kind == "bad":
        reqs = bad_requests(model)
        return reqs[bad_index % len(reqs)]
    raise ValueError(kind)
