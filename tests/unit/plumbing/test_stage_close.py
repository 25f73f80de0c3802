"""Closing what the stages started, with the real tiny model: an embedded pipeline stops every
thread it started; a model server's parts close in turn against one deadline
(--close-timeout-s), and `epd ask` closes its pipeline within it.

Waits carry a generous timeout only so that a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.stage import LocalEncodeStage
from epd.gateway.ask_types import AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.stages.model_thread import ModelThread
from tests.unit.plumbing.pipeline_asks import HANG_GUARD_S, _ask


def test_closing_an_embedded_pipeline_stops_every_thread_it_started(tiny_models, videos):
    before = set(threading.enumerate())
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:

        async def ask():
            return [item async for item in pipeline.ask(_ask(videos, max_new_tokens=2))]

        assert isinstance(asyncio.run(ask())[-1], AskSummary)
        started = [t for t in threading.enumerate() if t not in before]
    kinds = {re.sub(r"[-_]\d+$", "", t.name) for t in started}  # model_0, video-decode-1, encode-driver_0
    assert {"model", "video-decode", "encode-driver"} <= kinds, kinds
    for thread in started:
        thread.join(10)
    assert [t.name for t in started if t.is_alive()] == []
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pipeline.prefill.model_thread.run(lambda: None))


def test_stopping_the_encoder_service_closes_its_decode_pool(tiny_models):
    """The encoder service's `HealthyServer.stop` (what `run_service` awaits after the drain)
    closes its stage: no decode worker or request driver it started is left running. Before, the
    pool stayed open until the process ended (`epd serve` leaves by os._exit, without atexit)."""
    from epd.encoder_svc import server
    from epd.stages.server_config import ServerConfig

    config = EncoderConfig(model=ModelConfig(model=str(tiny_models["qwen2_vl"])), server=ServerConfig(port=0))
    before = set(threading.enumerate())

    async def scenario() -> list[threading.Thread]:
        hs = await server.start(config)
        started = [t for t in threading.enumerate() if t not in before and t.name.startswith("video-decode")]
        await hs.stop(0)
        return started

    started = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    assert started, "the service started no decode worker"
    assert [t.name for t in started if t.is_alive()] == []


PART_S = 0.05
"""How long each closed part takes here, at least (a sleep): enough to tell one deadline from two."""
CLOSE_TIMEOUT_S = 3.0
"""The closes' one deadline here (`--close-timeout-s`), far below the default (30 s)."""


@pytest.mark.parametrize("service", ["encoder", "prefill", "decode"])
def test_a_model_servers_parts_close_in_turn_against_one_deadline(tiny_models, monkeypatch, service):
    """After its drain, a model server closes what holds threads in turn, each part given what
    is left of one bound, its config's (`close_in_turn`, at most `close_timeout_s` in all:
    --close-timeout-s): each part's wait is at least PART_S (the time the part before it took)
    below the one before, the first within the config's bound. A part closed with a bound of its
    own (`hs.closers += [part.close]`: its default, or a fresh CLOSE_WAIT_S) gets a wait that does
    not shrink, or none at all, and fails this; so does a close that ignores the config (30 s,
    hard-coded, before). The waits given are recorded, not timed."""
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.stage import LocalPrefillStage
    from epd.stages.server_config import ServerConfig

    server_config = ServerConfig(port=0, close_timeout_s=CLOSE_TIMEOUT_S)

    given: list[tuple[str, float | None]] = []

    def spy(owner: type, method: str, name: str) -> None:
        original = getattr(owner, method)

        def close(self, wait_s=None):
            given.append((name, wait_s))
            time.sleep(PART_S)
            return original(self) if wait_s is None else original(self, wait_s)

        monkeypatch.setattr(owner, method, close)

    spy(ModelThread, "close", "model thread")
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    if service == "encoder":
        from epd.encoder_svc import server as encoder_server

        spy(LocalEncodeStage, "close", "decode pool and drivers")
        start = encoder_server.start(EncoderConfig(model=model, server=server_config))
        parts = ["decode pool and drivers", "model thread"]
    elif service == "prefill":
        from epd.prefill_svc import server as prefill_server

        spy(LocalPrefillStage, "close_tokenizer", "tokenizer threads")
        spy(LocalPrefillStage, "close_compiles", "grammar compiles")
        start = prefill_server.start(PrefillConfig(model=model, server=server_config))
        parts = ["tokenizer threads", "model thread", "grammar compiles"]
    else:
        from epd.decode_svc import server as decode_server
        from epd.decode_svc.config import DecodeConfig
        from epd.model_runtime.structured_output import close_compiler as original_close_compiler

        def close_compiler(adapter, wait_s=None):
            given.append(("grammar compiles", wait_s))
            time.sleep(PART_S)
            original_close_compiler(adapter, wait_s)

        monkeypatch.setattr(decode_server, "close_compiler", close_compiler, raising=False)
        start = decode_server.start(DecodeConfig(model=model, server=server_config))
        parts = ["model thread", "grammar compiles"]

    async def scenario() -> None:
        hs = await start
        await hs.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    assert [name for name, _ in given] == parts
    waits = [wait_s for _, wait_s in given]
    assert all(w is not None for w in waits), f"a part closed with its own default bound: {given}"
    assert waits[0] <= CLOSE_TIMEOUT_S, f"the close ignored its config's bound: {given}"
    for before, after in zip(waits, waits[1:], strict=False):
        assert after <= before - PART_S, f"a part got a bound of its own: {given}"


def test_epd_ask_closes_its_pipeline_within_its_close_timeout(tiny_models, monkeypatch, capsys):
    """`epd ask` (embedded) closes its pipeline once its answer is printed, against one deadline,
    --close-timeout-s: the exit hooks then find no model thread pool or grammar compiler of it
    left, whose waits would each have a deadline of their own (`epd ask` with a pathological
    regex waited for the compile at interpreter exit, `structured_output.EXIT_WAIT_S`, whatever
    the close's deadline). The deadlines given are recorded, not timed."""
    from epd.cli.ask import run_ask
    from epd.cli.parsers.root import build_parser
    from epd.gateway.embedded import EmbeddedPipeline
    from epd.model_runtime import structured_output
    from epd.stages import model_thread

    given: list[float] = []
    original = EmbeddedPipeline.close

    def close(self, wait_s=None):
        given.append(self.close_timeout_s if wait_s is None else wait_s)
        original(self, wait_s)

    monkeypatch.setattr(EmbeddedPipeline, "close", close)
    pools, compilers = set(model_thread._open_pools), set(structured_output._COMPILERS.values())
    model = str(tiny_models["qwen2_vl"])
    flags = ["--max-new-tokens", "2", "--regex", "a+", "--close-timeout-s", str(CLOSE_TIMEOUT_S)]
    code = run_ask(build_parser().parse_args(["ask", "--no-video", "hi?", "--model", model, *flags]))
    assert code == 0, capsys.readouterr().err
    assert given == [CLOSE_TIMEOUT_S]
    assert set(model_thread._open_pools) <= pools, "a model thread pool of epd ask was left to the exit"
    assert set(structured_output._COMPILERS.values()) <= compilers, (
        "a compiler of epd ask was left to the exit"
    )
