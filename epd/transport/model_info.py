"""What prefill says about its model over the wire: `ModelInfo` <-> `epd.v1.ModelInfo` (0 for a
size not known) and the gateway's read of a prefill replica's (`fetch_model_info`); a
`TokenizeInput` <-> `epd.v1.TokenizeRequest` and `TokenizeOutput` <-> `epd.v1.TokenizeResult`
(/tokenize). The service side is prefill's `GetModelInfo` and `Tokenize`
(`epd.prefill_svc.servicer`). The front door's public Tokenize (`epd.gateway.servicer`) reads its
own request into the same `TokenizeInput` and answers a `TokenizeAnswer`."""

from __future__ import annotations

import grpc

from epd.model_runtime.generation_defaults import SAMPLING_KEYS
from epd.stages.model_info import ModelInfo
from epd.stages.tokenize import TokenizeAnswer, TokenizeInput, TokenizeOutput
from epd.transport.message_convert import (
    messages_from_proto,
    messages_to_proto,
    template_from_proto,
    template_to_proto,
)
from epd.v1 import gateway_pb2, prefill_pb2, prefill_pb2_grpc


def model_info_to_proto(info: ModelInfo) -> prefill_pb2.ModelInfo:
    return prefill_pb2.ModelInfo(
        vocab_size=info.vocab_size or 0,
        context_tokens=info.context_tokens or 0,
        max_prompt_tokens=info.max_prompt_tokens,
        max_new_tokens=info.max_new_tokens,
        model_type=info.model_type,
        max_logprobs=info.max_logprobs,
        reasoning_markers=info.reasoning_markers,
        reasoning_marker_ids=info.reasoning_marker_ids,
        trust_request_chat_template=info.trust_request_chat_template,
        scheduling_policy=info.scheduling_policy,
        generation_defaults=None
        if info.generation_defaults is None
        else prefill_pb2.GenerationDefaults(**dict(info.generation_defaults)),  # type: ignore[arg-type]
    )


def model_info_from_proto(msg: prefill_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        vocab_size=msg.vocab_size or None,
        context_tokens=msg.context_tokens or None,
        max_prompt_tokens=msg.max_prompt_tokens,
        max_new_tokens=msg.max_new_tokens,
        model_type=msg.model_type,
        # unset: a prefill from before --max-logprobs, which refused every logprobs request
        max_logprobs=msg.max_logprobs if msg.HasField("max_logprobs") else 0,
        reasoning_markers=tuple(msg.reasoning_markers),
        reasoning_marker_ids=tuple(msg.reasoning_marker_ids),  # empty: a prefill from before them
        trust_request_chat_template=msg.trust_request_chat_template,
        scheduling_policy=msg.scheduling_policy or "fcfs",  # unset: a prefill from before the flag
        generation_defaults=_defaults_from_proto(msg.generation_defaults)
        if msg.HasField("generation_defaults")
        else None,  # a prefill from before them
    )


def _defaults_from_proto(msg: prefill_pb2.GenerationDefaults) -> tuple[tuple[str, float | int], ...]:
    return tuple((key, getattr(msg, key)) for key in SAMPLING_KEYS if msg.HasField(key))


async def fetch_model_info(channel: grpc.aio.Channel, timeout_s: float) -> ModelInfo:
    """The model info of the prefill replica behind `channel`; raises grpc.aio.AioRpcError when it
    does not answer within `timeout_s` (down, still loading its model, or too old to serve it)."""
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    return model_info_from_proto(
        await stub.GetModelInfo(prefill_pb2.GetModelInfoRequest(), timeout=timeout_s)
    )


def tokenize_request_to_proto(request: TokenizeInput, request_id: str) -> prefill_pb2.TokenizeRequest:
    return prefill_pb2.TokenizeRequest(
        request_id=request_id,
        prompt=request.prompt,
        messages=messages_to_proto(request.messages),
        add_special_tokens=request.add_special_tokens,
        template=template_to_proto(request.template),
        return_token_strs=request.return_token_strs,
    )


def tokenize_input_from_proto(msg: prefill_pb2.TokenizeRequest) -> TokenizeInput:
    return TokenizeInput(
        prompt=msg.prompt if msg.HasField("prompt") else None,
        messages=messages_from_proto(msg.messages),
        add_special_tokens=msg.add_special_tokens,
        template=template_from_proto(msg.template),
        return_token_strs=msg.return_token_strs,
    )


def tokenize_output_to_proto(output: TokenizeOutput) -> prefill_pb2.TokenizeResult:
    return prefill_pb2.TokenizeResult(token_ids=output.token_ids, token_strs=output.token_strs or ())


def tokenize_output_from_proto(msg: prefill_pb2.TokenizeResult, return_token_strs: bool) -> TokenizeOutput:
    """`return_token_strs`: the request's (an empty repeated field cannot say whether they were asked)."""
    return TokenizeOutput(list(msg.token_ids), list(msg.token_strs) if return_token_strs else None)


def public_tokenize_input_from_proto(msg: gateway_pb2.GatewayServiceTokenizeRequest) -> TokenizeInput:
    """The gateway's public request as the HTTP API's /tokenize body reads
    (`epd.gateway.tokenize_api.parse_tokenize_request`): add_special_tokens unset takes vLLM's
    default, true for a prompt and false for messages (whose template writes its own)."""
    prompt = msg.prompt if msg.HasField("prompt") else None
    add_special_tokens = msg.add_special_tokens if msg.HasField("add_special_tokens") else prompt is not None
    return TokenizeInput(
        prompt=prompt,
        messages=messages_from_proto(msg.messages),
        add_special_tokens=add_special_tokens,
        template=template_from_proto(msg.template),
        return_token_strs=msg.return_token_strs,
    )


def tokenize_answer_to_proto(answer: TokenizeAnswer) -> gateway_pb2.GatewayServiceTokenizeResponse:
    return gateway_pb2.GatewayServiceTokenizeResponse(
        token_ids=answer.token_ids,
        num_tokens=len(answer.token_ids),
        max_model_len=answer.max_model_len,
        token_strs=answer.token_strs or (),
    )
