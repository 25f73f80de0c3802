"""`epd serve --colocate` (epd/cli/serve.py): the front door and its embedded stages in one process,
with the gateway's defaults and the close deadline it is given. The rest of `epd serve` before it
starts anything: tests/unit/cli/test_serve_flags.py, test_stack_ports.py, test_stack_service_flags.py,
test_stack_stage_flags.py, test_stack_gateway_flags.py, test_stack_security.py, test_launcher.py and
tests/unit/runtime/test_model_check.py (the real processes are in
tests/integration/test_lifecycle.py)."""

from __future__ import annotations

from epd.cli import configs
from epd.cli.parsers.root import build_parser
from epd.gateway.config import GatewayConfig, HttpApiConfig


def test_the_colocated_pipeline_closes_within_close_timeout(tiny_models, monkeypatch):
    """`epd serve --colocate --close-timeout-s S`: the embedded pipeline the front door closes
    after its drain (`Pipeline.aclose`) has S as its close's one deadline, not the default. The
    front door itself is not started here: what it is handed is kept and closed."""
    import asyncio

    from epd.cli import serve
    from epd.gateway import server as gateway

    handed = []

    async def main(config, local=None):
        handed.append(local)

    monkeypatch.setattr(gateway, "main", main)
    argv = ["serve", "--colocate", "--model", str(tiny_models["qwen2_vl"]), "--close-timeout-s", "4.5"]
    args = build_parser().parse_args(argv)
    asyncio.run(serve._colocated(configs.colocated_gateway_config(args), configs.colocated_stages(args)))
    [pipeline] = handed
    try:
        assert pipeline.close_timeout_s == 4.5
    finally:
        pipeline.close()


def test_the_colocated_front_door_keeps_the_gateways_defaults():
    config = configs.colocated_gateway_config(build_parser().parse_args(["serve", "--colocate"]))
    assert config.http == HttpApiConfig(port=8000, demo=config.http.demo)
    assert (config.body_timeout_s, config.max_inflight_body_bytes, config.max_requests_per_client) == (
        GatewayConfig.body_timeout_s,
        GatewayConfig.max_inflight_body_bytes,
        GatewayConfig.max_requests_per_client,
    )
