"""compose/: the docker-compose stack and its Dockerfile, checked by reading them (no Docker engine here).

Each check is a function `check_*(...) -> list[str]` of problems. The real files must give none,
and a broken copy of the parsed file must give the problem the check exists for (the mutation
tests at the end), so no check passes vacuously.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from epd.cli import configs
from epd.cli.main import build_parser
from epd.cli.serve import stack_commands
from epd.decode_svc.config import DEFAULT_PORT as DECODE_PORT
from epd.decode_svc.kv_pull import KvPuller
from epd.encoder_svc.config import DEFAULT_PORT as ENCODER_PORT
from epd.gateway.config import DEFAULT_PORT as GATEWAY_PORT
from epd.prefill_svc.config import DEFAULT_PORT as PREFILL_PORT
from epd.stages.errors import InvalidRequest

COMPOSE_DIR = Path(__file__).resolve().parents[3] / "compose"
STAGES = ("encoder", "prefill", "decode")
ROLE_PORTS = {
    "gateway": GATEWAY_PORT,
    "encoder": ENCODER_PORT,
    "prefill": PREFILL_PORT,
    "decode": DECODE_PORT,
}
MODEL_ENV = ("EPD_MODEL", "EPD_DEVICE", "EPD_DTYPE", "EPD_NUM_THREADS")
KEY_ENV = {"EPD_API_KEY": "test-key"}  # compose refuses to start without it
_VAR = re.compile(r"\$\{(\w+)(?:(:?)([-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's `${VAR}`, `${VAR-default}`, `${VAR:-default}`, `${VAR:?error}` and `$$`, applied
    to every string; a required variable that is unset raises ValueError with its message."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, colon, op, text = m.groups()
        if name in env and not (colon and env[name] == ""):
            return env[name]
        if op == "?":
            raise ValueError(f"required variable {name} is missing a value: {text}")
        return text or ""

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def merge(base, override):
    """Compose's merge of override files: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    return override


def load(*names: str, env: dict[str, str] | None = None) -> dict:
    doc: dict = {}
    for name in names:
        doc = merge(doc, yaml.safe_load((COMPOSE_DIR / name).read_text()))
    return interpolate(doc, {**KEY_ENV, **(env or {})})


def as_argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def parse_epd(argv: list[str]) -> argparse.Namespace:
    """The real `epd` parser (the image's ENTRYPOINT is `epd`); SystemExit becomes ValueError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise ValueError(f"`epd {' '.join(argv)}` is not a valid command: {err.getvalue().strip()}") from None


def serve_configs(services: dict) -> tuple[dict, list[str]]:
    """service name -> the typed config `epd serve ROLE` builds from its command, plus problems."""
    builders = {
        "encoder": configs.encoder_config,
        "prefill": configs.prefill_config,
        "decode": configs.decode_config,
        "gateway": configs.gateway_config,
    }
    out, problems = {}, []
    for name, svc in services.items():
        try:
            args = parse_epd(as_argv(svc.get("command", [])))
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if args.command != "serve" or args.role is None:
            problems.append(f"{name}: command is not `epd serve ROLE`")
            continue
        if args.role != name:
            problems.append(f"{name}: runs `epd serve {args.role}`; the service name must be its role")
            continue
        out[name] = builders[args.role](args)
    return out, problems


# ---- checks ---------------------------------------------------------------------------------------


def check_commands(doc: dict) -> list[str]:
    services = doc["services"]
    cfgs, problems = serve_configs(services)
    if set(services) != set(ROLE_PORTS):
        problems.append(f"services are {sorted(services)}, expected one per role {sorted(ROLE_PORTS)}")
    for name, cfg in cfgs.items():
        if cfg.server.host != "0.0.0.0":
            problems.append(f"{name}: binds {cfg.server.host}; containers must bind 0.0.0.0")
        if cfg.server.port != ROLE_PORTS[name]:
            problems.append(f"{name}: port {cfg.server.port}, expected the default {ROLE_PORTS[name]}")
        svc = services[name]
        container_ports = {str(p) for p in svc.get("expose", [])}
        container_ports |= {str(p).rsplit(":", 1)[-1] for p in svc.get("ports", [])}
        if str(cfg.server.port) not in container_ports:
            problems.append(f"{name}: port {cfg.server.port} is neither exposed nor published")
    return problems


def check_addresses(doc: dict) -> list[str]:
    """The gateway points at the right services, decoders may pull from the address prefill gives."""
    cfgs, problems = serve_configs(doc["services"])
    if problems or not {"gateway", "prefill", "decode"} <= set(cfgs):
        return problems or ["gateway, prefill and decode are all needed"]
    gw = cfgs["gateway"]
    for role, addresses in (
        ("encoder", gw.encoder_addresses),
        ("prefill", gw.prefill_addresses),
        ("decode", gw.decode_addresses),
    ):
        for address in addresses:
            host, _, port = address.rpartition(":")
            if host not in cfgs or host != role:
                problems.append(f"gateway --{role} {address}: {host!r} is not the {role} service")
            elif int(port) != cfgs[host].server.port:
                problems.append(f"gateway --{role} {address}: {host} listens on {cfgs[host].server.port}")
    advertised = cfgs["prefill"].advertise_address
    if advertised != f"prefill:{cfgs['prefill'].server.port}":
        problems.append(
            f"prefill advertises {advertised!r}; decoders reach it at prefill:{cfgs['prefill'].server.port}"
        )
    puller = KvPuller(cfgs["decode"].allow_kv_from, 1, 1.0)
    for address, should_pass in (
        (advertised, True),
        ("attacker.example:50052", False),
        ("prefill:22", False),
    ):
        try:
            puller.check_allowed(address)
            allowed = True
        except InvalidRequest:
            allowed = False
        if allowed != should_pass:
            problems.append(
                f"decode --allow-kv-from {','.join(cfgs['decode'].allow_kv_from)} "
                f"{'refuses' if should_pass else 'admits'} {address}"
            )
    return problems


def check_healthchecks(doc: dict) -> list[str]:
    problems = []
    for name, svc in doc["services"].items():
        hc = svc.get("healthcheck") or {}
        test = hc.get("test")
        if not test or hc.get("disable"):
            problems.append(f"{name}: no healthcheck")
            continue
        argv = as_argv(test)
        if argv[0] == "CMD-SHELL":
            argv = shlex.split(argv[1])
        elif argv[0] == "CMD":
            argv = argv[1:]
        else:
            problems.append(f"{name}: healthcheck test must start with CMD or CMD-SHELL")
            continue
        if argv[:1] != ["epd"]:
            problems.append(f"{name}: healthcheck runs {argv[:1]}, not `epd health`")
            continue
        try:
            args = parse_epd(argv[1:])
        except ValueError as exc:
            problems.append(f"{name}: healthcheck: {exc}")
            continue
        port = ROLE_PORTS.get(name)
        if args.command != "health" or args.address not in (f"localhost:{port}", f"127.0.0.1:{port}"):
            problems.append(f"{name}: healthcheck must be `epd health localhost:{port}`, is {argv}")
    return problems


def check_start_order(doc: dict) -> list[str]:
    services = doc["services"]
    problems = []
    deps = services.get("gateway", {}).get("depends_on") or {}
    for stage in STAGES:
        if not isinstance(deps, dict) or (deps.get(stage) or {}).get("condition") != "service_healthy":
            problems.append(f"gateway must depend on {stage} with condition service_healthy")
    for name, svc in services.items():
        d = svc.get("depends_on") or {}
        for dep in d if isinstance(d, list) else []:
            problems.append(f"{name}: depends_on {dep} without condition service_healthy")
        for dep, spec in d.items() if isinstance(d, dict) else []:
            if (spec or {}).get("condition") != "service_healthy":
                problems.append(f"{name}: depends_on {dep} without condition service_healthy")
    return problems


def check_model_cache(doc: dict) -> list[str]:
    """Every stage mounts the same named volume at the directory EPD_CACHE_DIR names."""
    problems, volumes = [], set()
    for stage in STAGES:
        svc = doc["services"].get(stage, {})
        cache_dir = (svc.get("environment") or {}).get("EPD_CACHE_DIR")
        if not cache_dir:
            problems.append(f"{stage}: EPD_CACHE_DIR is not set")
            continue
        mounts = [str(v).split(":")[:2] for v in svc.get("volumes", [])]
        names = [src for src, dst in (m for m in mounts if len(m) == 2) if dst == cache_dir]
        if not names:
            problems.append(f"{stage}: nothing is mounted at EPD_CACHE_DIR={cache_dir}")
        volumes.update(names)
    declared = set(doc.get("volumes") or {})
    if len(volumes) != 1 or not volumes <= declared:
        problems.append(
            f"stages must share one declared named volume for the model cache, mount {sorted(volumes)}"
            f" (declared: {sorted(declared)})"
        )
    return problems


def check_env_driven(raw: dict) -> list[str]:
    """On the file before interpolation: model settings come from `${VAR:-default}`, and the
    gateway's API key from `${EPD_API_KEY:?message}`, so compose stops when it is unset."""
    problems = []
    for stage in STAGES:
        env = raw["services"].get(stage, {}).get("environment") or {}
        for var in MODEL_ENV:
            if not re.fullmatch(rf"\$\{{{var}:-[^}}]+\}}", str(env.get(var, ""))):
                problems.append(f"{stage}: {var} must be `${{{var}:-default}}`, is {env.get(var)!r}")
    gateway = raw["services"].get("gateway", {})
    key = (gateway.get("environment") or {}).get("EPD_API_KEY")
    if not re.fullmatch(r"\$\{EPD_API_KEY:\?[^}]+\}", str(key)):
        problems.append(f"gateway: EPD_API_KEY must be `${{EPD_API_KEY:?message}}`, is {key!r}")
    if "--no-api-key" in as_argv(gateway.get("command", [])):
        problems.append("gateway: runs with --no-api-key")
    return problems


def check_gpu(doc: dict) -> list[str]:
    """With the GPU override: each model stage reserves an NVIDIA GPU and runs on cuda."""
    problems = []
    for name, svc in doc["services"].items():
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get(
            "devices"
        ) or []
        has_gpu = any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
        if name in STAGES and not has_gpu:
            problems.append(f"{name}: no nvidia GPU reservation")
        if name in STAGES and not str((svc.get("environment") or {}).get("EPD_DEVICE")).startswith("cuda"):
            problems.append(f"{name}: reserves a GPU but EPD_DEVICE is not cuda")
        if name not in STAGES and has_gpu:
            problems.append(f"{name}: loads no model and should reserve no GPU")
    return problems


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def check_dockerfile(text: str) -> list[str]:
    ins = dockerfile_instructions(text)
    problems = []
    froms = [v for k, v in ins if k == "FROM"]
    if froms[-1:] != ["python:3.11-slim"]:
        problems.append(f"FROM must be python:3.11-slim, is {froms}")
    entry = [v for k, v in ins if k == "ENTRYPOINT"]
    if not entry or json.loads(entry[-1]) != ["epd"]:
        problems.append(f'ENTRYPOINT must be ["epd"] (compose commands are its arguments), is {entry}')
    users = [v for k, v in ins if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"the image must run as a non-root USER, has {users}")
    runs = " ; ".join(v for k, v in ins if k == "RUN")
    if not re.search(r"pip install (\S+ )*-r requirements/ci\.txt", runs):
        problems.append("requirements/ci.txt is not installed")
    if not re.search(r"pip install (\S+ )*-e \.", runs):
        problems.append("the repository is not installed with `pip install -e .`")
    if (
        "TORCH_INDEX_URL" not in [v.split("=")[0] for k, v in ins if k == "ARG"]
        or '--index-url "${TORCH_INDEX_URL}"' not in runs
    ):
        problems.append("no TORCH_INDEX_URL build arg for a CPU (or other) torch index")
    return problems


def all_problems(raw: dict) -> list[str]:
    doc = interpolate(raw, KEY_ENV)
    return (
        check_commands(doc)
        + check_addresses(doc)
        + check_healthchecks(doc)
        + check_start_order(doc)
        + check_model_cache(doc)
        + check_env_driven(raw)
    )


# ---- the real files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())


def test_compose_file_has_no_problems(raw):
    assert all_problems(raw) == []


def test_gpu_override_reserves_gpus_for_model_stages_only():
    doc = load("docker-compose.yml", "docker-compose.gpu.yml")
    assert check_gpu(doc) == []
    # The override changes devices and environment only: the stack itself stays valid.
    assert (
        all_problems(
            merge(
                yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text()),
                yaml.safe_load((COMPOSE_DIR / "docker-compose.gpu.yml").read_text()),
            )
        )
        == []
    )
    assert check_gpu(load("docker-compose.yml")) != []  # CPU by default


def test_environment_overrides_reach_the_services():
    doc = load(
        "docker-compose.yml",
        env={"EPD_MODEL": "Qwen/Qwen2-VL-2B-Instruct", "EPD_GATEWAY_PORT": "6000", "EPD_HTTP_PORT": "6001"},
    )
    assert doc["services"]["prefill"]["environment"]["EPD_MODEL"] == "Qwen/Qwen2-VL-2B-Instruct"
    assert doc["services"]["gateway"]["ports"] == ["6000:50050", "6001:8000"]
    assert load("docker-compose.yml")["services"]["decode"]["environment"]["EPD_MODEL"] == "default"
    assert load("docker-compose.yml")["services"]["gateway"]["environment"]["EPD_API_KEY"] == "test-key"
    with pytest.raises(ValueError, match="EPD_API_KEY is missing a value: set EPD_API_KEY"):
        load("docker-compose.yml", env={"EPD_API_KEY": ""})


def test_dockerfile_is_valid_and_compose_builds_it(raw):
    assert check_dockerfile((COMPOSE_DIR / "Dockerfile").read_text()) == []
    for name, svc in raw["services"].items():
        build = svc["build"]
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == (
            COMPOSE_DIR / "Dockerfile"
        ), name


def test_compose_runs_the_same_topology_as_epd_serve(raw):
    """`epd serve` (loopback processes) and compose: same roles, same ports, same wiring."""
    args = parse_epd(["serve"])
    loopback = {role: parse_epd(cmd[3:]) for role, cmd in stack_commands(args).items()}
    composed = {
        name: parse_epd(as_argv(svc["command"]))
        for name, svc in interpolate(raw, KEY_ENV)["services"].items()
    }
    assert {r: a.port for r, a in loopback.items()} == {r: a.port for r, a in composed.items()}

    def gateway_targets(a):  # role -> ports the gateway calls
        return {role: [int(x.rsplit(":", 1)[1]) for x in getattr(a, role)] for role in STAGES}

    assert gateway_targets(loopback["gateway"]) == gateway_targets(composed["gateway"])


# ---- every check can fail -------------------------------------------------------------------------


def _set(path: str, value):
    def mutate(doc):
        *keys, last = path.split(".")
        node = doc
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()

MUTATIONS = [
    ("unknown flag", _set("services.encoder.command.2", "--hots"), "not a valid command"),
    (
        "wrong role",
        _set("services.prefill.command", ["serve", "decode", "--host", "0.0.0.0", "--port", "50052"]),
        "service name must be its role",
    ),
    ("loopback bind", _set("services.prefill.command.3", "127.0.0.1"), "must bind 0.0.0.0"),
    ("port moved", _set("services.encoder.command.5", "50061"), "expected the default 50051"),
    ("stage missing", _set("services.decode", _DELETE), "one per role"),
    (
        "gateway -> wrong host",
        _set("services.gateway.command.7", "prefill:50051"),
        "is not the encoder service",
    ),
    ("gateway -> wrong port", _set("services.gateway.command.11", "decode:50052"), "decode listens on 50053"),
    ("advertise loopback", _set("services.prefill.command.7", "127.0.0.1:50052"), "prefill advertises"),
    (
        "allow-list refuses prefill",
        _set("services.decode.command.7", "prefill-old:*"),
        "refuses prefill:50052",
    ),
    ("allow-list admits any port", _set("services.decode.command.7", "prefill:*"), "admits prefill:22"),
    ("allow-list any host", _set("services.decode.command.7", "*:50052"), "no any-host wildcard"),
    ("no healthcheck", _set("services.decode.healthcheck", _DELETE), "decode: no healthcheck"),
    (
        "healthcheck wrong port",
        _set("services.encoder.healthcheck.test.3", "localhost:50052"),
        "epd health localhost:50051",
    ),
    ("healthcheck not epd", _set("services.prefill.healthcheck.test", ["CMD", "true"]), "not `epd health`"),
    (
        "started, not healthy",
        _set("services.gateway.depends_on.prefill.condition", "service_started"),
        "depend on prefill with condition service_healthy",
    ),
    ("cache not mounted", _set("services.prefill.volumes", []), "prefill: nothing is mounted"),
    (
        "two caches",
        _set("services.decode.volumes", ["other-cache:/cache"]),
        "share one declared named volume",
    ),
    (
        "cache dir unset",
        _set("services.encoder.environment.EPD_CACHE_DIR", _DELETE),
        "EPD_CACHE_DIR is not set",
    ),
    ("hard-coded model", _set("services.encoder.environment.EPD_MODEL", "default"), "EPD_MODEL must be"),
    (
        "optional key",
        _set("services.gateway.environment.EPD_API_KEY", "${EPD_API_KEY:-}"),
        "EPD_API_KEY must be",
    ),
    (
        "key opt-out",
        lambda d: d["services"]["gateway"]["command"].append("--no-api-key"),
        "with --no-api-key",
    ),
]


@pytest.mark.parametrize("mutate, problem", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_checks_catch_a_broken_compose_file(raw, mutate, problem):
    broken = copy.deepcopy(raw)
    mutate(broken)
    problems = all_problems(broken)
    assert any(problem in p for p in problems), problems


def test_gpu_check_catches_a_missing_reservation_and_a_cpu_device():
    doc = load("docker-compose.yml", "docker-compose.gpu.yml")
    broken = copy.deepcopy(doc)
    del broken["services"]["decode"]["deploy"]
    broken["services"]["encoder"]["environment"]["EPD_DEVICE"] = "cpu"
    broken["services"]["gateway"]["deploy"] = doc["services"]["prefill"]["deploy"]
    assert check_gpu(broken) == [
        "encoder: reserves a GPU but EPD_DEVICE is not cuda",
        "decode: no nvidia GPU reservation",
        "gateway: loads no model and should reserve no GPU",
    ]


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("FROM python:3.11-slim", "FROM python:3.11", "FROM must be python:3.11-slim"),
        ('ENTRYPOINT ["epd"]', 'ENTRYPOINT ["python"]', "ENTRYPOINT must be"),
        ("USER epd", "USER root", "non-root USER"),
        ("pip install -r requirements/ci.txt", "pip install torch", "requirements/ci.txt is not installed"),
        ("pip install --no-deps -e .", "pip install --no-deps .", "pip install -e ."),
        ('--index-url "${TORCH_INDEX_URL}"', "", "TORCH_INDEX_URL"),
    ],
)
def test_dockerfile_check_catches_a_broken_dockerfile(old, new, problem):
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    assert old in text
    problems = check_dockerfile(text.replace(old, new))
    assert any(problem in p for p in problems), problems
