"""compose/: the docker-compose stack and its Dockerfile, read as compose and the real `epd`
would read them (no Docker engine here). `check_*` return problems: the real files give none,
and each mutation at the end must give the problem its check exists for."""

from __future__ import annotations

import copy
import json
import re
import shlex
from fnmatch import fnmatch

import pytest
import yaml

from tests.unit.deploy.epd_commands import (
    BUILDERS,
    ROOT,
    STAGES,
    api_key_problems,
    internal_secret_problems,
    kv_source_problems,
    parse_epd,
    serve_config,
    stop_bound_s,
)

COMPOSE = ROOT / "compose"
KEY = "key-from-the-shell"
SECRET = "internal-secret"
"""The compose secret holding the stages' internal secret."""
_VAR = re.compile(r"\$\{(\w+)(?:(:?)([-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's `${VAR}`, `${VAR-default}`, `${VAR:-default}`, `${VAR:?error}` and `$$`."""
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
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def raw(*names: str) -> dict:
    doc: dict = {}
    for name in names or ("docker-compose.yml",):
        doc = merge(doc, yaml.safe_load((COMPOSE / name).read_text()))
    return doc


def as_argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def env_of(svc: dict) -> dict[str, str]:
    return {k: str(v) for k, v in (svc.get("environment") or {}).items()}


def duration_s(text: str) -> float:
    """A compose duration ("70s", "1m10s", "1h"; Docker's default stop_grace_period is 10s)."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(text))
    assert parts and any(parts.groups()), f"not a compose duration: {text!r}"
    hours, minutes, seconds = (float(g or 0) for g in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def check_stack(doc: dict) -> list[str]:
    """Commands, ports, health checks, wiring, start order, model cache, API key."""
    services, problems, cfgs = doc["services"], [], {}
    for name, svc in services.items():
        try:
            role, cfg = serve_config(as_argv(svc.get("command", [])), env_of(svc))
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if role != name:
            problems.append(f"{name}: runs `epd serve {role}`; the service name must be its role")
            continue
        cfgs[name] = cfg
        port = cfg.server.port
        if cfg.server.host != "0.0.0.0":
            problems.append(f"{name}: binds {cfg.server.host}; containers must bind 0.0.0.0")
        inside = {str(p) for p in svc.get("expose", [])} | {
            str(p).rsplit(":", 1)[-1] for p in svc.get("ports", [])
        }
        if str(port) not in inside:
            problems.append(f"{name}: port {port} is neither exposed nor published")
        test = as_argv((svc.get("healthcheck") or {}).get("test") or ["NONE"])
        argv = shlex.split(test[1]) if test[0] == "CMD-SHELL" else test[1:] if test[0] == "CMD" else []
        try:
            ok = argv[:1] == ["epd"] and vars(parse_epd(argv[1:])).get("address") in (
                f"localhost:{port}",
                f"127.0.0.1:{port}",
            )
        except ValueError:
            ok = False
        if not ok:
            problems.append(f"{name}: healthcheck must run `epd health localhost:{port}`, is {test}")
        need_s = stop_bound_s(role, cfg.server.grace_s, cfg.server.close_timeout_s)
        if (given_s := duration_s(svc.get("stop_grace_period", "10s"))) < need_s:
            problems.append(f"{name}: stop_grace_period is {given_s:g} s; its stop may take {need_s:g} s")
    problems += [f"no service runs `epd serve {r}`" for r in BUILDERS if r not in cfgs]
    if problems:
        return problems
    gateway = services["gateway"]
    for role in STAGES:
        for address in getattr(cfgs["gateway"], f"{role}_addresses"):
            host, _, port = address.removeprefix("dns:///").rpartition(":")
            if host != role or int(port) != cfgs[role].server.port:
                problems.append(
                    f"gateway --{role} {address}: {role} listens at {role}:{cfgs[role].server.port}"
                )
            elif not address.startswith("dns:///"):  # else gRPC balances the replicas: one to the router
                problems.append(
                    f"gateway --{role} {address}: write dns:///{address}, so that the gateway routes "
                    "each replica behind the name"
                )
        if ((gateway.get("depends_on") or {}).get(role) or {}).get("condition") != "service_healthy":
            problems.append(f"gateway must depend on {role} with condition service_healthy")
    advertised = cfgs["prefill"].advertise_address
    if advertised != f"prefill:{cfgs['prefill'].server.port}":
        problems.append(
            f"prefill advertises {advertised!r}; decoders reach it at prefill:{cfgs['prefill'].server.port}"
        )
    problems += kv_source_problems(cfgs["decode"].allow_kv_from, advertised)
    volumes = set()
    for role in STAGES:
        cache_dir = env_of(services[role]).get("EPD_CACHE_DIR")
        mounts = [str(v).split(":")[:2] for v in services[role].get("volumes", [])]
        names = [m[0] for m in mounts if len(m) == 2 and m[1] == cache_dir]
        if not cache_dir or not names:
            problems.append(f"{role}: no volume mounted at EPD_CACHE_DIR={cache_dir}")
        volumes.update(names)
    if len(volumes) > 1 or not volumes <= set(doc.get("volumes") or {}):
        problems.append(
            f"stages must share one declared named volume for the model cache, mount {sorted(volumes)}"
        )
    declared = doc.get("secrets") or {}
    mounted = {
        role: f"/run/secrets/{SECRET}"
        for role in cfgs
        if SECRET in services[role].get("secrets", []) and SECRET in declared
    }
    problems += internal_secret_problems(cfgs, mounted)
    return problems + api_key_problems(cfgs["gateway"], KEY) + check_supervision(doc)


def replicas_of(svc: dict) -> int:
    """`deploy.replicas` as compose reads it (a string after interpolation; 1 when absent)."""
    return int((svc.get("deploy") or {}).get("replicas", 1))


def check_supervision(doc: dict) -> list[str]:
    """Every service is restarted when it exits; replica counts are >= 1; prefill, which advertises
    its service name to the decoders, runs once under that name."""
    problems = []
    for name, svc in doc["services"].items():
        if svc.get("restart") not in ("unless-stopped", "always"):
            problems.append(
                f"{name}: restart is {svc.get('restart')!r}; a container that exits must be restarted"
            )
        if replicas_of(svc) < 1:
            problems.append(f"{name}: {replicas_of(svc)} replicas; at least 1")
    prefill = doc["services"]["prefill"]
    argv = as_argv(prefill.get("command", []))
    advertised = argv[argv.index("--advertise-address") + 1] if "--advertise-address" in argv else ""
    if replicas_of(prefill) > 1 and advertised.rpartition(":")[0] == "prefill":
        problems.append(f"prefill: {replicas_of(prefill)} replicas would all advertise {advertised}")
    return problems


def check_gpu(doc: dict) -> list[str]:
    problems = []
    for name, svc in doc["services"].items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        has_gpu = any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
        if name in STAGES and not has_gpu:
            problems.append(f"{name}: no nvidia GPU reservation")
        if name in STAGES and not env_of(svc).get("EPD_DEVICE", "").startswith("cuda"):
            problems.append(f"{name}: reserves a GPU but EPD_DEVICE is not cuda")
        if name not in STAGES and has_gpu:
            problems.append(f"{name}: loads no model and should reserve no GPU")
    return problems


def check_image(doc: dict, dockerfile: str) -> list[str]:
    """Compose builds compose/Dockerfile from files that exist in its context, passes only build
    args the Dockerfile declares, and the image runs `epd` as a non-root user."""
    problems = []
    joined = re.sub(r"\\\n", " ", dockerfile)
    ins = [
        ln.strip().split(None, 1)
        for ln in joined.splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    ins = [(k.upper(), v) for k, v in ins]
    declared = {v.split("=")[0] for k, v in ins if k == "ARG"}
    context = (COMPOSE / doc["services"]["gateway"]["build"]["context"]).resolve()
    for name, svc in doc["services"].items():
        build = svc["build"]
        if (COMPOSE / build["context"] / build["dockerfile"]).resolve() != COMPOSE / "Dockerfile":
            problems.append(f"{name}: does not build compose/Dockerfile")
        problems += [
            f"{name}: build arg {a} is not an ARG of the Dockerfile"
            for a in build.get("args", {})
            if a not in declared
        ]
    ignored = [
        p.strip()
        for p in (COMPOSE / "Dockerfile.dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    for k, v in ins:
        if k == "COPY" and not v.startswith("--from"):
            for src in shlex.split(v)[:-1]:
                if src != "." and (not (context / src).exists() or any(fnmatch(src, p) for p in ignored)):
                    problems.append(f"COPY {src}: not in the build context")
    if [json.loads(v) if v.startswith("[") else v for k, v in ins if k == "ENTRYPOINT"][-1:] != [["epd"]]:
        problems.append('ENTRYPOINT must be ["epd"]: compose commands are its arguments')
    users = [v for k, v in ins if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"the image must run as a non-root USER, has {users}")
    runs = " ; ".join(v for k, v in ins if k == "RUN")
    if not re.search(r"pip install (\S+ )*(-e )?\.(\s|$)", runs):
        problems.append("the repository itself is not pip-installed (no `epd` command)")
    if not re.search(r"apt-get install (\S+ )*libtcmalloc-minimal4(\s|;|$)", runs):
        problems.append(
            "no libtcmalloc-minimal4: the services' --allocator auto falls back to glibc's malloc"
        )
    return problems


SECRET_FILES = (
    "compose/.env",
    "compose/secrets/internal-secret",
    "compose/certs/service.key",
    "compose/certs/service.pem",
    "compose/certs/ca.pem",
)
"""What compose/README.md has an operator create beside the compose files (build context paths)."""


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` (relative to the context) out, as moby's patternmatcher does:
    the last pattern matching the path or one of its parent directories wins, `!` re-includes,
    `**` spans directories, `*` and `?` do not."""

    def regex(pattern: str) -> re.Pattern:
        out = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
            out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        return re.compile(out + "$")

    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(regex(pattern.lstrip("!")).match(p) for p in prefixes):
            ignored = not negated
    return ignored


def check_secrets_stay_out(dockerignore: str) -> list[str]:
    """`COPY . .` copies the whole context: the key, secret and TLS key compose/README.md has you
    create in compose/ must be ignored, or every image built after them carries them."""
    patterns = [p.strip() for p in dockerignore.splitlines() if p.strip() and not p.strip().startswith("#")]
    return [
        f"{path} would be copied into the image" for path in SECRET_FILES if not dockerignored(path, patterns)
    ]


def test_the_secrets_compose_has_you_create_never_reach_the_image():
    dockerignore = (COMPOSE / "Dockerfile.dockerignore").read_text()
    assert check_secrets_stay_out(dockerignore) == []
    assert dockerignored("compose/README.md", ["compose/secrets"]) is False
    assert check_secrets_stay_out(dockerignore.replace("compose/secrets", "compose/secret")) == [
        "compose/secrets/internal-secret would be copied into the image"
    ]
    assert check_secrets_stay_out(dockerignore + "!compose/certs/ca.pem\n") == [
        "compose/certs/ca.pem would be copied into the image"
    ]


def test_the_stack_the_gpu_overlay_and_the_image_have_no_problems():
    env = {"EPD_API_KEY": KEY}
    assert check_stack(interpolate(raw(), env)) == []
    gpu = interpolate(raw("docker-compose.yml", "docker-compose.gpu.yml"), env)
    assert check_stack(gpu) == [] and check_gpu(gpu) == []
    assert set(check_gpu(interpolate(raw(), env))) >= {f"{s}: no nvidia GPU reservation" for s in STAGES}
    assert check_image(interpolate(raw(), env), (COMPOSE / "Dockerfile").read_text()) == []


def check_tls(doc: dict) -> list[str]:
    """mTLS between the services: every one serves TLS with a mounted certificate, the stages
    require client certificates, the gateway and decode verify the stages they call, and the
    health checks speak TLS presenting the container's own certificate: the gateway's too, though
    its port does not require one, so that it still passes once --tls-client-ca is added as the
    file advises."""
    problems, declared = [], doc.get("secrets") or {}
    for name, svc in doc["services"].items():
        _, cfg = serve_config(as_argv(svc["command"]), env_of(svc))
        tls, mounted = (
            cfg.server.security,
            {f"/run/secrets/{s}" for s in svc.get("secrets", []) if s in declared},
        )
        paths = {"--tls-cert": tls.tls_cert, "--tls-key": tls.tls_key, "--tls-ca": tls.tls_ca}
        if name != "gateway":
            paths["--tls-client-ca"] = tls.tls_client_ca
        problems += [
            f"{name}: {flag} {path or '(none)'} is not a mounted secret"
            for flag, path in paths.items()
            if path not in mounted
        ]
        probe = vars(parse_epd(as_argv(svc["healthcheck"]["test"])[2:]))
        if not probe.get("tls_ca") or (probe.get("tls_cert"), probe.get("tls_key")) != (
            tls.tls_cert,
            tls.tls_key,
        ):
            problems.append(f"{name}: its healthcheck does not speak mTLS")
    return problems


def test_the_tls_overlay_secures_every_service():
    env = {"EPD_API_KEY": KEY}
    doc = interpolate(raw("docker-compose.yml", "docker-compose.tls.yml"), env)
    assert check_stack(doc) == [] and check_tls(doc) == []
    assert (
        check_stack(
            interpolate(raw("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.tls.yml"), env)
        )
        == []
    )
    assert len(check_tls(interpolate(raw(), env))) >= 4  # the base file: plaintext
    doc["services"]["prefill"]["healthcheck"]["test"] = ["CMD", "epd", "health", "localhost:50052"]
    assert check_tls(doc) == ["prefill: its healthcheck does not speak mTLS"]
    # The gateway's port takes clients without certificates, but its healthcheck must present one:
    # with --tls-client-ca added (the file's advice), one without would fail its handshake.
    doc["services"]["gateway"]["healthcheck"]["test"] = [
        "CMD",
        "epd",
        "health",
        "localhost:50050",
        "--tls-ca",
        "/run/secrets/tls-ca",
    ]
    assert check_tls(doc) == [
        "prefill: its healthcheck does not speak mTLS",
        "gateway: its healthcheck does not speak mTLS",
    ]


def test_the_advice_to_require_client_certificates_keeps_the_healthcheck_trusted():
    """The gateway's healthcheck presents service.pem: a --tls-client-ca bundle must hold ca.pem."""
    for text in ((COMPOSE / "docker-compose.tls.yml").read_text(), (COMPOSE / "README.md").read_text()):
        assert "--tls-client-ca" in text and "cat clients-ca.pem certs/ca.pem > certs/client-ca.pem" in text


@pytest.mark.parametrize("env", [{}, {"EPD_API_KEY": ""}])
def test_compose_refuses_to_start_without_an_api_key(env):
    with pytest.raises(ValueError, match="EPD_API_KEY is missing a value"):
        interpolate(raw(), env)


def test_shell_settings_reach_epd_in_every_service():
    env = {
        "EPD_API_KEY": KEY,
        "EPD_MODEL": "/models/m",
        "EPD_DEVICE": "cuda:1",
        "EPD_DTYPE": "bfloat16",
        "EPD_NUM_THREADS": "3",
        "EPD_GATEWAY_PORT": "6000",
        "EPD_HTTP_PORT": "6001",
    }
    services = interpolate(raw(), env)["services"]
    for role in STAGES:
        _, cfg = serve_config(as_argv(services[role]["command"]), env_of(services[role]))
        assert (cfg.model.model, cfg.model.device, cfg.model.dtype, cfg.model.num_threads) == (
            "/models/m",
            "cuda:1",
            "bfloat16",
            3,
        ), role
    _, gw = serve_config(as_argv(services["gateway"]["command"]), env_of(services["gateway"]))
    published = dict(str(p).split(":") for p in services["gateway"]["ports"])
    # The model services share the host's cores: passive OpenMP waits, as `epd serve`'s stack.
    assert {env_of(services[role]).get("OMP_WAIT_POLICY") for role in STAGES} == {"PASSIVE"}
    chosen = interpolate(raw(), {**env, "EPD_OMP_WAIT_POLICY": "ACTIVE"})["services"]
    assert {env_of(chosen[role]).get("OMP_WAIT_POLICY") for role in STAGES} == {"ACTIVE"}
    assert published == {"6000": str(gw.server.port), "6001": str(gw.http.port)}


def test_replica_counts_come_from_the_shell_as_epd_serves_flags():
    """EPD_ENCODERS / EPD_DECODES are `epd serve --encoders / --decodes` for compose; every replica
    is reached through its service's name (check_stack: the gateway's addresses are the names)."""
    default = interpolate(raw(), {"EPD_API_KEY": KEY})["services"]
    assert {name: replicas_of(svc) for name, svc in default.items()} == {
        "encoder": 1,
        "prefill": 1,
        "decode": 1,
        "gateway": 1,
    }
    env = {"EPD_API_KEY": KEY, "EPD_ENCODERS": "3", "EPD_DECODES": "2"}
    for files in (("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")):
        doc = interpolate(raw(*files), env)
        assert [replicas_of(doc["services"][s]) for s in STAGES] == [3, 1, 2], files
        assert check_stack(doc) == []


def _cmd(service: str, old: str, new: str | None):
    """Replace (None: remove) one argument of a service's command."""

    def mutate(doc):
        cmd = doc["services"][service]["command"]
        i = cmd.index(old)
        cmd[i : i + 1] = [] if new is None else [new]

    return mutate


def _set(service: str, *path: str, value=None):
    def mutate(doc):
        node = doc["services"][service]
        for k in path[:-1]:
            node = node[k]
        node.pop(path[-1]) if value is None else node.__setitem__(path[-1], value)

    return mutate


MUTATIONS = [
    ("unknown flag", _cmd("encoder", "--host", "--hots"), "not a valid command"),
    (
        "wrong role",
        _set("encoder", "command", value=["serve", "decode", "--host", "0.0.0.0", "--port", "50051"]),
        "service name must be its role",
    ),
    ("stage missing", lambda d: d["services"].pop("decode"), "no service runs `epd serve decode`"),
    ("loopback bind", _cmd("prefill", "0.0.0.0", "127.0.0.1"), "must bind 0.0.0.0"),
    ("port not exposed", _cmd("encoder", "50051", "50061"), "port 50061 is neither exposed"),
    (
        "gateway -> wrong host",
        _cmd("gateway", "dns:///encoder:50051", "dns:///prefill:50051"),
        "encoder listens at",
    ),
    (
        "gateway -> wrong port",
        _cmd("gateway", "dns:///decode:50053", "dns:///decode:50052"),
        "decode listens at",
    ),
    (
        "gateway -> one replica per name",
        _cmd("gateway", "dns:///encoder:50051", "encoder:50051"),
        "write dns:///encoder:50051",
    ),
    ("advertise loopback", _cmd("prefill", "prefill:50052", "127.0.0.1:50052"), "prefill advertises"),
    ("allow-list refuses prefill", _cmd("decode", "prefill:50052", "prefill-old:*"), "refuses prefill:50052"),
    ("allow-list admits any port", _cmd("decode", "prefill:50052", "prefill:*"), "admits prefill:22"),
    ("no healthcheck", _set("decode", "healthcheck"), "decode: healthcheck must run"),
    (
        "healthcheck wrong port",
        lambda d: d["services"]["encoder"]["healthcheck"]["test"].__setitem__(3, "localhost:50052"),
        "epd health localhost:50051",
    ),
    (
        "started, not healthy",
        _set("gateway", "depends_on", "prefill", "condition", value="service_started"),
        "depend on prefill with condition service_healthy",
    ),
    ("cache not mounted", _set("prefill", "volumes", value=[]), "prefill: no volume mounted"),
    (
        "two caches",
        _set("decode", "volumes", value=["other-cache:/cache"]),
        "share one declared named volume",
    ),
    (
        "key inlined",
        _set("gateway", "environment", "EPD_API_KEY", value="hunter2"),
        "does not take its API key",
    ),
    (
        "key opt-out",
        lambda d: d["services"]["gateway"]["command"].append("--no-api-key"),
        "and --no-api-key are set",
    ),
    ("no key at all", _set("gateway", "environment", "EPD_API_KEY"), "refusing to serve"),
    (
        "secret flag dropped",
        lambda d: d["services"]["prefill"].__setitem__("command", d["services"]["prefill"]["command"][:-2]),
        "prefill: no --internal-secret-file",
    ),
    (
        "secret not mounted",
        _set("decode", "secrets"),
        "decode: --internal-secret-file /run/secrets/internal-secret is not",
    ),
    ("secret undeclared", lambda d: d.pop("secrets"), "gateway: --internal-secret-file"),
    (
        "stop grace of the drain only",
        _set("decode", "stop_grace_period", value="35s"),
        "decode: stop_grace_period is 35 s; its stop may take 67 s",
    ),  # fmt: skip
    ("no stop grace (10 s)", _set("prefill", "stop_grace_period"), "prefill: stop_grace_period is 10 s"),
    (
        "a longer close, the same stop grace",
        lambda d: d["services"]["prefill"]["command"].extend(["--close-timeout-s", "60"]),
        "prefill: stop_grace_period is 70 s; its stop may take 95 s",
    ),
    ("not restarted", _set("decode", "restart", value="no"), "decode: restart is 'no'"),
    ("restart dropped", _set("gateway", "restart"), "gateway: restart is None"),
    ("no replicas", _set("encoder", "deploy", "replicas", value="0"), "encoder: 0 replicas"),
    (
        "prefill replicas",
        _set("prefill", "deploy", "replicas", value="2"),
        "prefill: 2 replicas would all advertise prefill:50052",
    ),
]


@pytest.mark.parametrize("mutate, problem", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_check_stack_catches_a_broken_compose_file(mutate, problem):
    doc = interpolate(raw(), {"EPD_API_KEY": KEY})
    mutate(doc)
    problems = check_stack(doc)
    assert any(problem in p for p in problems), problems


def test_check_gpu_catches_a_missing_reservation_a_cpu_device_and_a_gpu_gateway():
    doc = interpolate(raw("docker-compose.yml", "docker-compose.gpu.yml"), {"EPD_API_KEY": KEY})
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
        (
            "COPY requirements/ci.txt requirements/ci.txt",
            "COPY requirements/gone.txt x",
            "COPY requirements/gone",
        ),
        ("COPY requirements/ci.txt requirements/ci.txt", "COPY .venv .venv", "COPY .venv: not in the build"),
        ('ENTRYPOINT ["epd"]', 'ENTRYPOINT ["python"]', "ENTRYPOINT must be"),
        ("USER epd", "USER root", "non-root USER"),
        ("ARG TORCH_INDEX_URL", "ARG TORCH_URL", "build arg TORCH_INDEX_URL is not an ARG"),
        (
            re.compile(r"pip install --no-deps (-e )?\."),
            "pip install --no-deps epd-wheel",
            "not pip-installed",
        ),
        ("libtcmalloc-minimal4", "libjemalloc2", "no libtcmalloc-minimal4"),
    ],
    ids=["missing file", "ignored path", "entrypoint", "root", "build arg", "not installed", "no tcmalloc"],
)
def test_check_image_catches_a_broken_dockerfile(old, new, problem):
    text = (COMPOSE / "Dockerfile").read_text()
    broken = old.sub(new, text) if isinstance(old, re.Pattern) else text.replace(old, new)
    assert broken != text, f"the Dockerfile no longer has {old!r}: update this mutation"
    problems = check_image(interpolate(raw(), {"EPD_API_KEY": KEY}), broken)
    assert any(problem in p for p in problems), problems


def test_every_setting_of_the_compose_files_is_in_the_readme_with_its_default():
    """A `${VAR:-default}` of any compose file is a setting the operator may change: README.md here
    names it, and where its configuration table has the variable's row, that row gives the
    default (EPD_HTTP_PORT, EPD_TLS_DIR and the secret's file were in the files only)."""
    readme = (COMPOSE / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", readme, re.M)}
    problems: set[str] = set()
    for path in sorted(COMPOSE.glob("docker-compose*.yml")):
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        for name, _colon, kind, default in _VAR.findall(text):
            if name not in readme:
                problems.add(f"{path.name}: {name} is not in compose/README.md")
            elif kind == "-" and default and name in rows and f"`{default}`" not in rows[name]:
                problems.add(
                    f"{path.name}: {name} defaults to {default}, the README's table says {rows[name]}"
                )
    assert not problems, "\n".join(sorted(problems))
