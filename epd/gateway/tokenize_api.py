"""vLLM's tokenizer routes on the HTTP API, answered by prefill, which holds the tokenizer and the
chat template (the stack's gateway calls `PrefillService.Tokenize` / `Detokenize` on the least
loaded replica; the colocated front door its own prefill stage):

    POST /tokenize     {"prompt": "..."} (add_special_tokens, default true), or {"messages": [...]}
                       (add_generation_prompt, default true; continue_final_message, default
                       false, not with add_generation_prompt; chat_template_kwargs, the
                       template's variables; tools, rendered as a chat request's, tool_choice
                       and parallel_tool_calls ignored, as vLLM's;
                       chat_template, with prefill's --trust-request-chat-template;
                       add_special_tokens, default false);
                       either with return_token_strs (default false)
                       -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": null | [...]}
    POST /detokenize   {"tokens": [...]} -> {"prompt": "..."} (special tokens kept)

A messages list is rendered exactly as a chat request's prompt: its `count` is the answer's
`usage.prompt_tokens`. As vLLM's, it may end with any role (an assistant's last turn counted
without a generation prompt, or left open with continue_final_message). Text only: a video or
image part is a 400 (its tokens depend on the frames the encoder samples). Each body is read,
admitted and guarded as a chat request's (their paths are `BODY_ROUTES`): the API key, the
admission limits, JSON only, no cross-site browser POST.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from epd.gateway.chat_messages import parse_messages
from epd.gateway.chat_request import template_options
from epd.gateway.http_body import defer_continue, read_json_body
from epd.gateway.http_error_responses import exception_response
from epd.gateway.json_fields import TOKEN_ID, boolean_field, check_collection, checked_text, number_item
from epd.gateway.request_fields import requested_model
from epd.gateway.tool_request import checked_tools
from epd.stages.errors import InvalidRequest
from epd.stages.request_id import current_request_id
from epd.stages.tokenize import MAX_DETOKENIZE_TOKENS, TokenizeInput

if TYPE_CHECKING:
    from epd.gateway.http_api import HttpApi


_REFUSED_CHAT_FIELDS = ("mm_processor_kwargs",)


def parse_tokenize_request(body: Any, served_model: str) -> TokenizeInput:
    """vLLM's TokenizeCompletionRequest ({"prompt"}) or TokenizeChatRequest ({"messages"});
    InvalidRequest (400) or NotFound (404, model)."""
    requested_model(body, served_model)
    return_token_strs = boolean_field(body, "return_token_strs", False)
    if "messages" in body:
        if "prompt" in body:
            raise InvalidRequest("send exactly one of 'prompt' (a text) and 'messages' (a conversation)")
        for name in _REFUSED_CHAT_FIELDS:
            if body.get(name) not in (None, False):
                raise InvalidRequest(f"'{name}' is not supported by this server; leave it unset")
        messages, _, _ = parse_messages(body["messages"])
        return TokenizeInput(
            messages=messages,
            add_special_tokens=boolean_field(body, "add_special_tokens", False),
            # the tools rendered as a chat request's are; tool_choice and parallel_tool_calls,
            # which shape an answer alone, are ignored (vLLM's TokenizeChatRequest has neither)
            template=replace(template_options(body), tools=checked_tools(body)),
            return_token_strs=return_token_strs,
        )
    if not isinstance(body.get("prompt"), str):
        raise InvalidRequest("send 'prompt' (a string) or 'messages' (a list of chat messages)")
    return TokenizeInput(
        prompt=checked_text(body["prompt"], "prompt"),
        add_special_tokens=boolean_field(body, "add_special_tokens", True),
        return_token_strs=return_token_strs,
    )


def parse_detokenize_request(body: Any, served_model: str) -> list[int]:
    requested_model(body, served_model)
    tokens = body.get("tokens")
    check_collection(tokens, list, "tokens", "a list of token ids", MAX_DETOKENIZE_TOKENS)
    return [number_item(t, TOKEN_ID, "tokens[]") for t in tokens]


def add_tokenize_routes(app: web.Application, api: HttpApi) -> None:
    """POST /tokenize and /detokenize over `api`'s pipeline, with its limits and errors."""
    # Imported here: http_api is the module that calls this one.
    from epd.gateway.http_api import client_gone_response

    config, pipeline = api.config, api.pipeline

    async def answer(
        request: web.Request, respond: Callable[[Any], Awaitable[dict[str, Any]]]
    ) -> web.StreamResponse:
        try:
            body = await read_json_body(request, api.max_body_bytes, config.body_timeout_s)
            return web.json_response(await respond(body))
        except ConnectionResetError:  # its client went while it sent its body: nobody to answer
            return client_gone_response(current_request_id(), "before its body arrived")
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped in status_of
            return exception_response(exc)

    # The gRPC API's Tokenize / Detokenize make the same pipeline calls (epd/gateway/servicer.py).
    async def tokenize(body: Any) -> dict[str, Any]:
        out = await pipeline.tokenize(
            parse_tokenize_request(body, config.http.served_model_name), current_request_id()
        )
        return {
            "count": len(out.token_ids),
            "max_model_len": out.max_model_len,
            "tokens": out.token_ids,
            "token_strs": out.token_strs,
        }

    async def detokenize(body: Any) -> dict[str, Any]:
        token_ids = parse_detokenize_request(body, config.http.served_model_name)
        return {"prompt": await pipeline.detokenize(token_ids, current_request_id())}

    app.router.add_post("/tokenize", lambda request: answer(request, tokenize), expect_handler=defer_continue)
    app.router.add_post(
        "/detokenize", lambda request: answer(request, detokenize), expect_handler=defer_continue
    )
