"""The served model as the gateway learns it from prefill (epd/gateway/model_info.py): the view
of several replicas, and the reads over a real in-process PrefillService (the real servicer over a
stand-in stage: no model)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import aiohttp
import grpc
import pytest
from aiohttp import web

from epd.gateway import request_defaults
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.model_info import ReplicaModelInfo, refresh_model_info, watch_model_info
from epd.gateway.pipeline import Pipeline
from epd.gateway.servicer import GatewayServicer
from epd.model_runtime.generation_defaults import GenerationDefaults, generation_defaults
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.servicer import PrefillServicer
from epd.stages.model_info import ModelInfo, common_model_info
from epd.transport.errors import UpstreamError
from epd.transport.model_info import model_info_from_proto, model_info_to_proto
from epd.transport.ports_file import free_port
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, messages_pb2, prefill_pb2_grpc

QWEN = ModelInfo(
    vocab_size=512, context_tokens=32768, max_prompt_tokens=32768, max_new_tokens=4096, model_type="qwen2_vl"
)
BIGGER = ModelInfo(
    vocab_size=1024, context_tokens=8192, max_prompt_tokens=60000, max_new_tokens=2048, model_type="qwen3_vl"
)


def test_max_model_len_is_the_longest_prompt_plus_answer_a_request_may_have():
    assert QWEN.max_model_len == 32768  # the context: the prompt limit plus max_tokens would pass it
    short_prompts = ModelInfo(512, 32768, max_prompt_tokens=1000, max_new_tokens=4096)
    assert short_prompts.max_model_len == 5096  # epd's own limits add up to less than the context
    assert ModelInfo(512, None, 1000, 24).max_model_len == 1024  # no max_position_embeddings


def test_replicas_that_agree_are_one_view_and_those_that_disagree_the_bounds_each_enforces():
    assert common_model_info([]) is None
    assert common_model_info([QWEN, QWEN]) == QWEN
    both = common_model_info([QWEN, BIGGER])
    assert both is not None
    assert both.vocab_size == 1024  # an id outside both vocabularies: both refuse it
    assert (both.context_tokens, both.max_prompt_tokens, both.max_new_tokens) == (8192, 32768, 2048)
    assert both.max_model_len == 8192
    assert both.model_type == "qwen2_vl,qwen3_vl"
    unknown_vocab = ModelInfo(None, 32768, 32768, 4096)
    mixed = common_model_info([QWEN, unknown_vocab])
    # a replica that checks no vocabulary: no early check
    assert mixed is not None and mixed.vocab_size is None


def test_the_view_keeps_a_silent_replicas_last_answer_and_forgets_a_departed_one(caplog):
    known = ReplicaModelInfo()
    assert known.update(["a", "b"], {"a": None, "b": None}) is None
    assert known.update(["a", "b"], {"a": QWEN, "b": None}) == QWEN
    assert known.update(["a", "b"], {"a": None, "b": QWEN}) == QWEN  # a said nothing: its last stays
    assert known.by_address == {"a": QWEN, "b": QWEN}
    with caplog.at_level(logging.WARNING, logger="epd.gateway.model_info"):
        assert known.update(["a", "b"], {"a": None, "b": BIGGER}) == common_model_info([QWEN, BIGGER])
        known.update(["a", "b"], {"a": QWEN, "b": BIGGER})  # the same disagreement: not logged again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and "a: qwen2_vl, vocabulary 512" in warnings[0] and "b: qwen3_vl" in warnings[0]
    )
    assert known.update(["a"], {"a": None}) == QWEN  # b left the pool: forgotten
    assert known.by_address == {"a": QWEN}


def test_model_info_crosses_the_wire_with_unknown_sizes_as_zero():
    assert model_info_from_proto(model_info_to_proto(QWEN)) == QWEN
    unknown = ModelInfo(None, None, 10, 20, "")
    assert model_info_to_proto(unknown).vocab_size == 0
    assert model_info_from_proto(model_info_to_proto(unknown)) == unknown


class _Stage:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def model_info(self) -> ModelInfo:
        return self.info


class _CountingStage(_Stage):
    def __init__(self, info: ModelInfo) -> None:
        super().__init__(info)
        self.asked = 0

    def model_info(self) -> ModelInfo:
        self.asked += 1
        return self.info


async def _prefill_server(info: ModelInfo | None, stage: _Stage | None = None) -> tuple[grpc.aio.Server, str]:
    """The real PrefillServicer: `info` None is a replica still loading its model (no stage yet);
    `stage`: the stand-in it serves, when the test looks at it."""
    servicer = PrefillServicer(PrefillConfig(), KvStore(1 << 20, 60.0))
    servicer.stage = stage or (None if info is None else _Stage(info))  # type: ignore[assignment]
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_the_gateway_reads_every_prefill_replica_and_the_pipeline_checks_with_it():
    """One replica answers, one still loads its model (UNAVAILABLE), one is not there: the view is
    the one answer's, and the pipeline's early vocabulary check uses it. Once the loading replica
    answers with another model, the view is both's bounds."""

    async def scenario():
        ready, ready_address = await _prefill_server(QWEN)
        loading, loading_address = await _prefill_server(None)
        pool = ReplicaPool([ready_address, loading_address, f"127.0.0.1:{free_port()}"])
        stage = RemotePrefillStage(pool, 5.0)
        pipeline = Pipeline(None, stage, None)  # type: ignore[arg-type]
        try:
            assert pipeline.model_info() is None and pipeline.vocab_size is None  # not known yet
            known = ReplicaModelInfo()
            await refresh_model_info(stage, known, timeout_s=1.0)
            assert pipeline.model_info() == QWEN and pipeline.vocab_size == 512
            await loading.stop(None)
            bigger, bigger_address = await _prefill_server(BIGGER)
            pool.set_addresses([ready_address, bigger_address])  # the loading one replaced
            await refresh_model_info(stage, known, timeout_s=1.0)
            assert pipeline.model_info() == common_model_info([QWEN, BIGGER])
            await bigger.stop(None)
        finally:
            await ready.stop(None)
            await pool.close()

    asyncio.run(scenario())


def test_a_replica_that_answered_is_asked_again_only_once_back_in_routing():
    """Prefill's model info does not change while its process lives: a replica that answered is
    not asked again (it was, every --stage-check-interval, idle or not) until the health checks
    find it back in routing (perhaps restarted with other limits), or a call found it unreachable
    and a check SERVING again; one that has not answered yet is asked at each refresh."""

    async def scenario() -> list[int]:
        served = _CountingStage(QWEN)
        server, address = await _prefill_server(QWEN, served)
        pool = ReplicaPool([address])
        stage = RemotePrefillStage(pool, 5.0)
        known = ReplicaModelInfo()
        counts = []
        try:
            await refresh_model_info(stage, known, timeout_s=5.0)
            counts.append(served.asked)
            await refresh_model_info(stage, known, timeout_s=5.0)
            counts.append(served.asked)
            pool.set_serving(address, False)  # a health check: down (a restart) ...
            await refresh_model_info(stage, known, timeout_s=5.0)  # (no answer expected while down)
            pool.set_serving(address, True)  # ... and back
            await refresh_model_info(stage, known, timeout_s=5.0)
            counts.append(served.asked)
            pool.mark_failed(address)  # a call found it unreachable ...
            pool.set_serving(address, True)  # ... and a check SERVING
            await refresh_model_info(stage, known, timeout_s=5.0)
            await refresh_model_info(stage, known, timeout_s=5.0)
            counts.append(served.asked)
        finally:
            await server.stop(None)
            await pool.close()
        return counts

    assert asyncio.run(scenario()) == [1, 1, 2, 3]


def test_a_dns_name_not_found_yet_is_not_asked():
    """A `dns:///` entry the gateway has not looked up yet gets no call (gRPC's own resolver would
    reach the server behind it past the gateway's routing): its model is not known until found."""

    async def scenario():
        server, address = await _prefill_server(QWEN)
        port = address.rsplit(":", 1)[1]
        pool = ReplicaPool([f"dns:///localhost:{port}"])
        stage = RemotePrefillStage(pool, 5.0)
        try:
            await refresh_model_info(stage, ReplicaModelInfo(), timeout_s=1.0)
            assert stage.model_info() is None
        finally:
            await server.stop(None)
            await pool.close()

    asyncio.run(scenario())


def test_the_watch_polls_until_a_replica_answers_and_stops_when_told_not_to_refresh():
    async def scenario():
        pool = ReplicaPool([f"127.0.0.1:{free_port()}"])
        stage = RemotePrefillStage(pool, 5.0)
        watch = asyncio.ensure_future(watch_model_info(stage, interval_s=0))
        try:
            await asyncio.sleep(0.6)
            assert not watch.done() and stage.model_info() is None  # nothing answers: it keeps asking
            server, address = await _prefill_server(QWEN)
            pool.set_addresses([address])
            await asyncio.wait_for(watch, 10)  # interval 0: done once known
            assert stage.model_info() == QWEN
            await server.stop(None)
        finally:
            watch.cancel()
            await pool.close()

    asyncio.run(scenario())


def test_the_default_max_tokens_fits_the_max_tokens_limit_and_max_model_len():
    """A request without max_tokens takes the front door's default (32) fitted to what prefill
    takes: its max_tokens limit, and what max_model_len (a prefill --max-model-len of 20 here)
    leaves after a one-token prompt. The default alone passed a context of 20, so such a request
    was refused whatever its prompt; one the client set is left for prefill to judge."""
    configured = GenerationDefaults()  # max_new_tokens 32
    not_known = Pipeline(None, None, None)  # type: ignore[arg-type]
    assert asyncio.run(not_known.request_defaults(configured)) == GenerationConfig()

    def fitted(info: ModelInfo) -> int:
        pipeline = Pipeline(None, _Stage(info), None)  # type: ignore[arg-type]
        return asyncio.run(pipeline.request_defaults(configured)).max_new_tokens

    assert fitted(QWEN) == 32
    assert fitted(ModelInfo(512, 32768, 32768, max_new_tokens=16)) == 16
    assert fitted(ModelInfo(512, context_tokens=20, max_prompt_tokens=20, max_new_tokens=4096)) == 19
    # prefill refuses
    assert fitted(ModelInfo(512, context_tokens=1, max_prompt_tokens=1, max_new_tokens=4096)) == 1


CREATORS = (("repetition_penalty", 1.3), ("temperature", 0.0), ("top_k", 0), ("max_new_tokens", 12))
"""A model's defaults as prefill reports them, with 0s that are real values (greedy, top_k off)."""


def test_the_models_defaults_cross_the_wire_zeros_and_all():
    info = replace(QWEN, generation_defaults=CREATORS)
    assert model_info_from_proto(model_info_to_proto(info)) == info
    none = replace(QWEN, generation_defaults=())  # the model recommends none
    assert model_info_from_proto(model_info_to_proto(none)) == none
    old = model_info_to_proto(QWEN)
    old.ClearField("generation_defaults")  # a prefill from before them: not known, not none
    assert model_info_from_proto(old).generation_defaults is None
    assert model_info_from_proto(model_info_to_proto(replace(QWEN, generation_defaults=None))) == replace(
        QWEN, generation_defaults=None
    )


def test_replicas_whose_models_defaults_differ_report_none(caplog):
    """Which replica's would be arbitrary: none, and the gateway says so (the view's warning names
    each replica's)."""
    with caplog.at_level(logging.WARNING, logger="epd.gateway.model_info"):
        known = ReplicaModelInfo()
        view = known.update(["a", "b"], {"a": replace(QWEN, generation_defaults=CREATORS), "b": QWEN})
    assert view is not None and view.generation_defaults is None
    [warning] = [r.getMessage() for r in caplog.records]
    assert "a: " in warning and "sampling defaults repetition_penalty=1.3, temperature=0.0" in warning
    assert "b: " in warning and "sampling defaults none" in warning
    same = replace(QWEN, generation_defaults=CREATORS)
    assert common_model_info([same, same]) == same
    other = replace(same, max_new_tokens=1024)  # the same model, other limits: its defaults stand
    both = common_model_info([same, other])
    assert both is not None and both.generation_defaults == CREATORS
    differ = common_model_info([same, replace(QWEN, generation_defaults=())])
    assert differ is not None and differ.generation_defaults is None


@pytest.mark.parametrize(
    "source,override,want",
    [
        ("auto", "", GenerationConfig(repetition_penalty=1.3, max_new_tokens=12)),  # the model's
        ("auto", '{"repetition_penalty": 1.1}', GenerationConfig(repetition_penalty=1.1, max_new_tokens=12)),
        ("vllm", "", GenerationConfig()),  # the model's ignored
        ("vllm", '{"top_p": 0.5}', GenerationConfig(top_p=0.5)),
        ("DIR", "", GenerationConfig(top_k=7)),  # that folder's, not the model's
        ("DIR", '{"top_k": 3}', GenerationConfig(top_k=3)),
    ],
)
def test_the_front_door_resolves_auto_from_prefills_model_info_then_the_override(
    tmp_path, source, override, want
):
    (tmp_path / "generation_config.json").write_text('{"top_k": 7}')
    configured = generation_defaults(str(tmp_path) if source == "DIR" else source, override)
    pipeline = Pipeline(None, _Stage(replace(QWEN, generation_defaults=CREATORS)), None)  # type: ignore[arg-type]
    assert asyncio.run(pipeline.request_defaults(configured)) == want


def test_the_defaults_are_announced_once_they_are_known_and_when_they_change(caplog):
    stage = _Stage(replace(QWEN, generation_defaults=CREATORS))
    pipeline = Pipeline(None, stage, None)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            asyncio.run(pipeline.request_defaults(GenerationDefaults("auto")))
        stage.info = replace(QWEN, generation_defaults=None)  # prefill stopped saying
        asyncio.run(pipeline.request_defaults(GenerationDefaults("auto")))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2, said  # once for the first, once for the change (the second: none)
    assert "repetition_penalty=1.3, max_tokens=12" in said[0]
    assert "prefill does not report its model's sampling defaults" in said[1]


def test_a_replica_removed_before_its_model_info_read_starts_leaves_the_watch_running():
    """The replica list changes between a refresh listing the replicas and its reads starting (a
    reloaded replica file, a name resolved again): the removed one's read answers none. Looking
    its channel up when the read started raised KeyError, which ended the gateway's watch: the
    full suite's early-request test below waited its 30 s for model info no one read any more."""

    async def scenario() -> ModelInfo | None:
        pool = ReplicaPool([f"127.0.0.1:{free_port()}"])
        stage = RemotePrefillStage(pool, 5.0)
        try:
            refresh = asyncio.ensure_future(refresh_model_info(stage, ReplicaModelInfo(), timeout_s=1.0))
            await asyncio.sleep(0)  # the refresh has listed the replica; its read has not started
            pool.set_addresses([f"127.0.0.1:{free_port()}"])
            await asyncio.wait_for(refresh, 30)  # a deadline, not a timing assertion: it returns
            return stage.known_model_info
        finally:
            await pool.close()

    assert asyncio.run(scenario()) is None


def test_an_early_request_waits_for_prefills_model_info_and_is_refused_when_none_comes(monkeypatch):
    """Under auto a request that comes before any prefill replica has answered waits for the
    gateway's reads (a real PrefillService that starts later), never resolved without the model's
    defaults; with none answering it asks once itself, and prefill's error is the request's
    (here UNAVAILABLE: no replica serves; a refusal, such as a missing internal secret, passes on as
    prefill words it: tests/integration/test_internal_auth.py)."""
    monkeypatch.setattr(request_defaults, "MODEL_INFO_WAIT_S", 0.5)

    async def scenario():
        pool = ReplicaPool([f"127.0.0.1:{free_port()}"])
        stage = RemotePrefillStage(pool, 5.0)
        pipeline = Pipeline(None, stage, None)  # type: ignore[arg-type]
        watch = asyncio.ensure_future(watch_model_info(stage, interval_s=0))
        try:
            with pytest.raises(UpstreamError, match="prefill stage unavailable") as refused:
                await pipeline.request_defaults(GenerationDefaults("auto"))
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert (await pipeline.request_defaults(GenerationDefaults("vllm"))) == GenerationConfig()
            monkeypatch.setattr(request_defaults, "MODEL_INFO_WAIT_S", 60.0)
            early = asyncio.ensure_future(pipeline.request_defaults(GenerationDefaults("auto")))
            await asyncio.sleep(0)  # it waits: nothing is known yet
            assert not early.done()
            server, address = await _prefill_server(replace(QWEN, generation_defaults=CREATORS))
            pool.set_addresses([address])
            got = await asyncio.wait_for(early, 30)
            assert (got.repetition_penalty, got.max_new_tokens) == (1.3, 12)
            await server.stop(None)
        finally:
            watch.cancel()
            await pool.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("prefill", [None, object()])
def test_a_pipeline_whose_prefill_cannot_say_knows_no_model(prefill):
    pipeline = Pipeline(None, prefill, None)  # type: ignore[arg-type]
    assert pipeline.model_info() is None and pipeline.vocab_size is None


def test_a_request_template_is_refused_before_the_encode_unless_every_prefill_trusts_them():
    """The gateway learns from prefill whether it renders a request's own `chat_template`
    (--trust-request-chat-template): without it the request is refused before its media costs an
    encode (this pipeline has no encoder to reach)."""
    from epd.gateway.ask_types import AskRequest
    from epd.stages.contracts import MediaInput
    from epd.stages.errors import InvalidRequest
    from epd.stages.messages import VIDEO, ChatTemplateOptions, Message

    trusting = replace(QWEN, trust_request_chat_template=True)
    assert model_info_from_proto(model_info_to_proto(trusting)) == trusting
    assert common_model_info([trusting, QWEN]).trust_request_chat_template is False  # any replica may get it
    assert common_model_info(
        [trusting, replace(BIGGER, trust_request_chat_template=True)]
    ).trust_request_chat_template
    request = AskRequest(
        [Message.user(VIDEO, "what moves?")],
        MediaInput(b"\x00" * 16),
        template=ChatTemplateOptions(chat_template="{{ messages }}"),
    )

    async def ask(info: ModelInfo):
        async for _ in Pipeline(None, _Stage(info), None).ask(request):  # type: ignore[arg-type]
            pass

    with pytest.raises(InvalidRequest, match="not started with --trust-request-chat-template"):
        asyncio.run(ask(QWEN))


def test_a_malformed_request_that_comes_before_the_model_info_is_refused_without_the_wait(monkeypatch):
    """Under auto a request that comes before prefill's model info is read under the server's own
    defaults first: a malformed one gets its 400 (HTTP) or INVALID_ARGUMENT (gRPC Ask) at once, as
    once the info is known, not prefill's error after the wait (here: no replica ever answers)."""
    monkeypatch.setattr(request_defaults, "MODEL_INFO_WAIT_S", 0.5)  # beyond it: prefill's UNAVAILABLE
    config = GatewayConfig(http=HttpApiConfig(port=0), generation=GenerationDefaults("auto"))

    async def scenario() -> tuple[int, str, grpc.StatusCode, str, int]:
        pool = ReplicaPool([f"127.0.0.1:{free_port()}"])  # nothing listens there
        stage = RemotePrefillStage(pool, 5.0)
        waits = []
        wait_model_info = stage.wait_model_info

        async def noted_wait(timeout_s: float):
            waits.append(timeout_s)
            return await wait_model_info(timeout_s)

        monkeypatch.setattr(stage, "wait_model_info", noted_wait)
        pipeline = Pipeline(None, stage, None)  # type: ignore[arg-type]
        runner = web.AppRunner(HttpApi(config, pipeline, GatewayMetrics()).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(config, pipeline), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            body = {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                async with session.post("/v1/chat/completions", json=body) as resp:
                    http_status, http_error = resp.status, (await resp.json())["error"]["message"]
            header = gateway_pb2.AskHeader(
                prompt=messages_pb2.RawPrompt(text="hi"), generation=common_pb2.GenerationParams(n=2)
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(
                    iter([gateway_pb2.AskRequest(header=header)])
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in call:
                        pass
            return http_status, http_error, refused.value.code(), refused.value.details() or "", len(waits)
        finally:
            await server.stop(None)
            await runner.cleanup()
            await pool.close()

    http_status, http_error, code, details, num_waits = asyncio.run(scenario())
    assert http_status == 400 and "temperature" in http_error, http_error
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "generation.n is 2" in details, details
    assert num_waits == 0  # refused before any wait for prefill's model info


def test_an_answer_is_asked_for_again_once_it_is_old_though_the_replica_never_went_down():
    """A process replaced behind the same address between two health checks (a fast restart, a
    rolling update behind one Service address) is never seen down; its answer is asked for again
    once `MODEL_INFO_MAX_AGE_S` old, so other limits or defaults are learnt within that time."""
    from epd.gateway.model_info import MODEL_INFO_MAX_AGE_S

    now = [100.0]
    known = ReplicaModelInfo(clock=lambda: now[0])
    address = "127.0.0.1:1"
    assert known.due({address: 0}) == [address]  # not answered yet
    known.update([address], {address: QWEN}, {address: 0})
    now[0] += MODEL_INFO_MAX_AGE_S - 1
    assert known.due({address: 0}) == []  # fresh, and never down since
    now[0] += 1
    assert known.due({address: 0}) == [address]
    known.update([address], {address: None}, {address: 0})  # no answer: still due
    assert known.due({address: 0}) == [address]
    known.update([address], {address: QWEN}, {address: 0})
    assert known.due({address: 0}) == []
