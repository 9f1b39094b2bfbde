"""OpenAI's logprobs objects from the engine's raw TokenLogprobs (torch-free).

chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
completions:  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}; with echo the
              prompt's tokens come first and the first one has null logprobs (OpenAI and vLLM). A
              completions top_logprobs dict holds the top k and the chosen token (so up to k + 1 entries,
              as OpenAI documents). text_offset counts the characters of the tokens before, per choice,
              continuing across stream chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotstart.messages import TokenLogprobs
    from hotstart.text.tokenizer import Tokenizer

Items = list[tuple[int, "TokenLogprobs"]]  # (token id, its logprobs)


class LogprobsFormat:
    """Formats one request's logprobs; keeps each choice's text offset (completions)."""

    def __init__(self, tokenizer: Tokenizer, n: int = 1) -> None:
        self.tok = tokenizer
        self.offsets = [0] * n

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.tok.token_text(token_id), "logprob": logprob,
                "bytes": list(self.tok.token_bytes(token_id))}

    def chat(self, items: Items) -> dict[str, Any]:
        content = []
        for token_id, lp in items:
            entry = self._entry(token_id, lp.logprob)
            entry["top_logprobs"] = [
                self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            content.append(entry)
        return {"content": content}

    def completion(self, index: int, items: Items, prompt: tuple[list[int], list[TokenLogprobs]] | None = None
                   ) -> dict[str, Any]:
        """Choice INDEX's tokens ITEMS; PROMPT = (prompt ids, logprobs of ids[1:]) puts the echoed
        prompt first."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        rows: list[tuple[int, TokenLogprobs | None]] = []
        if prompt is not None:
            ids, lps = prompt
            rows += [(ids[0], None), *zip(ids[1:], lps)] if ids else []
        rows += items
        text = self.tok.token_text
        for token_id, lp in rows:
            token = text(token_id)
            out["tokens"].append(token)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(token)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp.logprob)
            top = {text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
            top.setdefault(token, lp.logprob)
            out["top_logprobs"].append(top)
        return out
