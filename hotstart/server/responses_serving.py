"""`POST /v1/responses` over OpenAIServing (torch-free): the request through chat's preparation, the answer
as a Response object or as the documented event stream (server/responses.py has the conversions).

Stream events, each with `type` and `sequence_number`: response.created, response.in_progress, then per
output item response.output_item.added, (a message) response.content_part.added,
response.output_text.delta ..., response.output_text.done, response.content_part.done, (a function call)
response.function_call_arguments.delta / .done, response.output_item.done; last response.completed
(response.incomplete when max_output_tokens cut the answer, response.failed on an engine failure).
With function tools the answer is parsed whole, so its items are sent once it is complete.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from hotstart.errors import RequestError
from hotstart.frontend.client import EngineDeadError
from hotstart.frontend.generation import GenerationError, close_shielded, unless_disconnected
from hotstart.frontend.tools import chat_message
from hotstart.server.gate import caller, json_response
from hotstart.server.offload import WORK, ensure_imported
from hotstart.server.responses import (
    ResponsesRequest,
    ResponseStore,
    answer_messages,
    chat_request,
    check_unsupported,
    message_item,
    new_id,
    now,
    output_items,
    response_object,
)
from hotstart.server.sse import SSEResponse

if TYPE_CHECKING:
    from hotstart.frontend.generation import Generation
    from hotstart.server.api import OpenAIServing

_json = msgspec.json.Encoder()


class ResponsesServing:
    """The Responses endpoint of SERVING, with its store of past conversations (a many-models server
    shares one store between its models: server/multi_api.py)."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store

    async def create(self, request: Request, req: ResponsesRequest, t0: float) -> Response:
        s = self.serving
        check_unsupported(req)
        history: list[dict[str, Any]] = []
        owner = caller(request.scope).owner
        if req.previous_response_id is not None:
            found = self.store.get(req.previous_response_id, owner)
            if found is None:
                raise RequestError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                                   param="previous_response_id", code="previous_response_not_found")
            history = found
        ensure_imported(req)
        chat, conversation, (model, ids, params) = await WORK.run(self.prepare, req, history)
        rid = new_id("resp")
        gen = s.generation(rid, ids, params, [], t0)
        forced = chat.tool_choice not in (None, "auto", "none")
        parse = chat.tools and (forced or (chat.tool_choice != "none" and s.settings.auto_tool_choice))
        parser = s.tool_parser if parse else None
        run = _Run(self, req, model, rid, gen, parser, conversation, owner)
        if req.stream:
            return SSEResponse(run.events())
        try:
            finished, _ = await unless_disconnected(request.receive, lambda: s.collect(gen))
        except (EngineDeadError, GenerationError) as e:
            raise s.engine_error(e) from None
        if not finished:
            return Response(status_code=499)  # nobody reads it
        return json_response(run.finish(output_items(run.answer()[0])))


    def prepare(self, req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[Any, ...]:
        """(the chat request, the conversation, chat's (model, ids, params)): on the worker pool."""
        chat, conversation = chat_request(req, history)
        return chat, conversation, self.serving.prepare_chat(chat)


def store_routes(store: ResponseStore):
    """GET and DELETE /v1/responses/{response_id} over STORE: the caller's own responses only (another
    key's, like an unknown id, is a 404)."""

    def missing(rid: str) -> RequestError:
        return RequestError(404, f"Response with id '{rid[:100]}' not found.", param="response_id",
                            code="response_not_found")

    async def retrieve(response_id: str, request: Request) -> Response:
        found = store.response(response_id, caller(request.scope).owner)
        if found is None:
            raise missing(response_id)
        return json_response(found)

    async def delete(response_id: str, request: Request) -> Response:
        if not store.delete(response_id, caller(request.scope).owner):
            raise missing(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    return retrieve, delete


class _Run:
    """One response: its head, its end (stored), its event stream."""

    def __init__(self, owner: ResponsesServing, req: ResponsesRequest, model: str, rid: str, gen: Generation,
                 parser: str | None, conversation: list[dict[str, Any]], maker: str | None) -> None:
        self.owner, self.req, self.model, self.rid, self.gen = owner, req, model, rid, gen
        self.parser, self.conversation, self.created, self.maker = parser, conversation, now(), maker
        self.seq = 0

    def answer(self) -> tuple[dict[str, Any], str | None]:
        c = self.gen.choices[0]
        return chat_message(self.parser, c.text, c.finish_reason)

    def finish(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        reason = self.gen.choices[0].finish_reason
        status = "incomplete" if reason == "length" else "completed"
        obj = response_object(self.rid, self.req, self.model, self.created, status, items, self.gen.usage(),
                              reason)
        if self.req.store is not False:
            self.owner.store.put(self.rid, self.conversation + answer_messages(items), self.maker, obj)
        return obj

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"

    async def events(self) -> AsyncIterator[bytes]:
        head = response_object(self.rid, self.req, self.model, self.created, "in_progress", [], None)
        yield self.event("response.created", response=head)
        yield self.event("response.in_progress", response=head)
        streamed = self.parser is None  # text is sent as it comes; with tools, once parsed
        msg_id = new_id("msg")
        if streamed:
            for b in self.open_message(0, msg_id):
                yield b
        text: list[str] = []
        stream = self.gen.deltas()
        try:
            async for delta in stream:
                if streamed and delta.text:
                    text.append(delta.text)
                    yield self.event("response.output_text.delta", item_id=msg_id, output_index=0,
                                     content_index=0, delta=delta.text, logprobs=[])
        except Exception as e:  # noqa: BLE001 - the stream has begun: the failure is an event
            err = self.owner.serving.engine_error(e)
            failed = {**head, "status": "failed", "error": {"code": err.code, "message": err.message}}
            yield self.event("response.failed", response=failed)
            return
        finally:
            await close_shielded(stream)
        if streamed:
            items = [message_item("".join(text), msg_id)]
            for b in self.close_message(0, items[0]):
                yield b
        else:
            items = output_items(self.answer()[0])
            for i, item in enumerate(items):
                for b in self.whole_item(i, item):
                    yield b
        final = self.finish(items)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=final)

    def open_message(self, index: int, msg_id: str) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=index,
                           item=message_item("", msg_id, "in_progress")),
                self.event("response.content_part.added", item_id=msg_id, output_index=index,
                           content_index=0, part=part)]

    def close_message(self, index: int, item: dict[str, Any]) -> list[bytes]:
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **ids, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def whole_item(self, index: int, item: dict[str, Any]) -> list[bytes]:
        if item["type"] == "message":
            out = self.open_message(index, item["id"])
            text = item["content"][0]["text"]
            if text:
                out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=[]))
            return out + self.close_message(index, item)
        ids = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **ids, name=item["name"],
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]
