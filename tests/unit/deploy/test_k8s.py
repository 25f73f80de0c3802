"""deploy/k8s/: the Kubernetes manifests, checked by parsing them (no cluster here).

Each check is a function `check_*(objects) -> list[str]` of problems. The real manifests must
give none, and a broken copy must give the problem the check exists for (the mutation tests at
the end), so no check passes vacuously.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
from pathlib import Path

import pytest
import yaml

from epd.cli import configs
from epd.cli.main import build_parser
from epd.decode_svc.config import DEFAULT_PORT as DECODE_PORT
from epd.decode_svc.kv_pull import KvPuller
from epd.encoder_svc.config import DEFAULT_PORT as ENCODER_PORT
from epd.gateway.config import DEFAULT_PORT as GATEWAY_PORT
from epd.prefill_svc.config import DEFAULT_PORT as PREFILL_PORT
from epd.stages.errors import InvalidRequest

K8S_DIR = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
STAGES = ("encoder", "prefill", "decode")
ROLE_PORTS = {
    "gateway": GATEWAY_PORT,
    "encoder": ENCODER_PORT,
    "prefill": PREFILL_PORT,
    "decode": DECODE_PORT,
}
COMPONENT = "app.kubernetes.io/component"
# What the kubelet would put in env vars taken from the downward API, for expanding $(VAR) in args.
FIELD_SAMPLES = {"status.podIP": "10.244.3.17", "metadata.name": "pod-0", "metadata.namespace": "epd"}
BUILDERS = {
    "encoder": configs.encoder_config,
    "prefill": configs.prefill_config,
    "decode": configs.decode_config,
    "gateway": configs.gateway_config,
}


def load_objects() -> list[dict]:
    kust = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((K8S_DIR / f).read_text()) if d]


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o.get("kind") == kind]


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def container_env(c: dict) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        env[e["name"]] = e.get("value", FIELD_SAMPLES.get(ref, ""))
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args: defined variables only; $$ escapes."""
    return re.sub(
        r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg
    )


def serve_config(dep: dict):
    """The typed config `epd serve ROLE` builds from the container's args (ENTRYPOINT is `epd`)."""
    c = container(dep)
    argv = [expand(str(a), container_env(c)) for a in c.get("command", []) + c.get("args", [])]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args: argparse.Namespace = build_parser().parse_args(argv)
    except SystemExit:
        raise ValueError(f"`epd {' '.join(argv)}` is not a valid command: {err.getvalue().strip()}") from None
    if args.command != "serve" or args.role not in BUILDERS:
        raise ValueError(f"`epd {' '.join(argv)}` is not `epd serve ROLE`")
    return args.role, BUILDERS[args.role](args)


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def deployments_by_role(objs: list[dict]) -> tuple[dict[str, dict], list[str]]:
    out, problems = {}, []
    for dep in of_kind(objs, "Deployment"):
        name = dep["metadata"]["name"]
        try:
            role, _ = serve_config(dep)
        except ValueError as exc:
            problems.append(f"Deployment {name}: {exc}")
            continue
        if role in out:
            problems.append(f"Deployments {out[role]['metadata']['name']} and {name} both run {role}")
        out[role] = dep
    for role in ROLE_PORTS:
        if role not in out:
            problems.append(f"no Deployment runs `epd serve {role}`")
    return out, problems


def grpc_port(dep: dict) -> int | None:
    ports = [p for p in container(dep).get("ports", []) if p.get("name") == "grpc"]
    return ports[0]["containerPort"] if ports else None


# ---- checks ---------------------------------------------------------------------------------------


def check_deployments(objs: list[dict]) -> list[str]:
    """One Deployment per role, its own replica count and pod labels, a real command, probes, resources."""
    deps, problems = deployments_by_role(objs)
    all_deps = of_kind(objs, "Deployment")
    for role, dep in deps.items():
        name, spec = dep["metadata"]["name"], dep["spec"]
        labels = spec["template"]["metadata"].get("labels", {})
        if not isinstance(spec.get("replicas"), int) or spec["replicas"] < 1:
            problems.append(f"{name}: replicas must be set (a positive integer), is {spec.get('replicas')!r}")
        if labels.get(COMPONENT) != role:
            problems.append(f"{name}: pods must carry {COMPONENT}: {role}")
        overlap = [
            d["metadata"]["name"]
            for d in all_deps
            if d is not dep
            and selects(spec["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        ]
        if not selects(spec["selector"]["matchLabels"], labels) or overlap:
            problems.append(f"{name}: its selector must match its own pods only (also matches {overlap})")
        _, cfg = serve_config(dep)
        port = grpc_port(dep)
        if cfg.server.host != "0.0.0.0":
            problems.append(f"{name}: binds {cfg.server.host}; pods must bind 0.0.0.0")
        if cfg.server.port != ROLE_PORTS[role] or port != cfg.server.port:
            problems.append(
                f"{name}: serves on {cfg.server.port}, container port `grpc` is {port}, "
                f"default is {ROLE_PORTS[role]}"
            )
        c = container(dep)
        for kind in ("readinessProbe", "livenessProbe"):
            probe_port = (c.get(kind) or {}).get("grpc", {}).get("port")
            if probe_port != port:
                problems.append(f"{name}: {kind} must be a grpc probe on port {port}, is {c.get(kind)}")
        requests = (c.get("resources") or {}).get("requests") or {}
        if not {"cpu", "memory"} <= set(requests):
            problems.append(f"{name}: resources.requests needs cpu and memory, has {requests}")
        if "memory" not in ((c.get("resources") or {}).get("limits") or {}):
            problems.append(f"{name}: resources.limits needs memory")
    return problems


def check_services(objs: list[dict]) -> list[str]:
    """Each role has a Service on its port; each stage also a headless Service over its pods alone."""
    deps, problems = deployments_by_role(objs)
    for role, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        svcs = [s for s in of_kind(objs, "Service") if selects(s["spec"].get("selector", {}), labels)]
        for s in svcs:
            others = [
                d["metadata"]["name"]
                for d in of_kind(objs, "Deployment")
                if d is not dep
                and selects(s["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
            ]
            if others:
                problems.append(f"Service {s['metadata']['name']} also selects the pods of {others}")
            container_ports = {
                cp.get("name"): cp["containerPort"] for cp in dep["spec"]["template"]["spec"]["containers"][0]["ports"]
            }
            for p in s["spec"]["ports"]:
                if p.get("name") == "http":  # the gateway's HTTP API: a named container port
                    if p.get("targetPort") != "http" or container_ports.get("http") != p["port"]:
                        problems.append(f"Service {s['metadata']['name']}: http port {p} does not reach "
                                        f"{role}'s container port named http")
                    continue
                if p.get("targetPort") not in ("grpc", grpc_port(dep)) or p["port"] != grpc_port(dep):
                    problems.append(
                        f"Service {s['metadata']['name']}: port {p} does not reach {role}'s "
                        f"container port {grpc_port(dep)}"
                    )
        normal = [s for s in svcs if s["spec"].get("clusterIP") != "None"]
        headless = [s for s in svcs if s["spec"].get("clusterIP") == "None"]
        if not normal:
            problems.append(f"{role}: no ClusterIP Service")
        if role in STAGES and [s["metadata"]["name"] for s in headless] != [f"{role}-headless"]:
            problems.append(
                f"{role}: needs one headless Service {role}-headless (clusterIP: None), "
                f"has {[s['metadata']['name'] for s in headless]}"
            )
    return problems


def check_addresses(objs: list[dict]) -> list[str]:
    """Gateway -> headless Services of the right stage and port; decode may pull from prefill pods."""
    deps, problems = deployments_by_role(objs)
    if problems:
        return problems
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    gw = serve_config(deps["gateway"])[1]
    for role, addresses in (
        ("encoder", gw.encoder_addresses),
        ("prefill", gw.prefill_addresses),
        ("decode", gw.decode_addresses),
    ):
        for address in addresses:
            host, _, port = address.removeprefix("dns:///").rpartition(":")
            svc = services.get(host)
            if (
                svc is None
                or svc["spec"].get("clusterIP") != "None"
                or svc["spec"]["selector"].get(COMPONENT) != role
            ):
                problems.append(f"gateway --{role} {address}: not the headless Service of {role}")
            elif int(port) != svc["spec"]["ports"][0]["port"]:
                problems.append(
                    f"gateway --{role} {address}: {host} serves port {svc['spec']['ports'][0]['port']}"
                )
    prefill_dep = deps["prefill"]
    advertised = serve_config(prefill_dep)[1].advertise_address
    own = f"{FIELD_SAMPLES['status.podIP']}:{grpc_port(prefill_dep)}"
    if advertised != own:
        problems.append(
            f"prefill advertises {advertised!r}; each pod must advertise its own IP ($(POD_IP) "
            f"from status.podIP) and port, here {own!r}"
        )
    puller = KvPuller(serve_config(deps["decode"])[1].allow_kv_from, 1, 1.0)
    for address, should_pass in ((own, True), (f"{FIELD_SAMPLES['status.podIP']}:22", False)):
        try:
            puller.check_allowed(address)
            allowed = True
        except InvalidRequest:
            allowed = False
        if allowed != should_pass:
            problems.append(
                f"decode --allow-kv-from {','.join(puller.allowed_sources)} "
                f"{'refuses' if should_pass else 'admits'} {address}"
            )
    return problems


def check_model_cache(objs: list[dict]) -> list[str]:
    """Stages take epd-config and mount a volume at its EPD_CACHE_DIR."""
    deps, problems = deployments_by_role(objs)
    config = {c["metadata"]["name"]: c["data"] for c in of_kind(objs, "ConfigMap")}
    for role in STAGES:
        if role not in deps:
            continue
        c = container(deps[role])
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            env.update(config.get(src.get("configMapRef", {}).get("name"), {}))
        cache_dir = env.get("EPD_CACHE_DIR")
        if not cache_dir or not {"EPD_MODEL", "EPD_DEVICE", "EPD_DTYPE", "EPD_NUM_THREADS"} <= set(env):
            problems.append(f"{role}: envFrom must give EPD_MODEL/DEVICE/DTYPE/NUM_THREADS and EPD_CACHE_DIR")
            continue
        mounted = [m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == cache_dir]
        volumes = [v["name"] for v in deps[role]["spec"]["template"]["spec"].get("volumes", [])]
        if not mounted or mounted[0] not in volumes:
            problems.append(f"{role}: no volume mounted at EPD_CACHE_DIR={cache_dir}")
    return problems


def check_api_key(objs: list[dict]) -> list[str]:
    """The gateway takes EPD_API_KEY (epd's default of --api-key) from a required Secret key, so
    it cannot run open; no key or opt-out in its args (args are visible in the pod spec)."""
    deps, problems = deployments_by_role(objs)
    if "gateway" not in deps:
        return problems
    c = container(deps["gateway"])
    env = {e["name"]: e for e in c.get("env", [])}
    ref = (env.get("EPD_API_KEY", {}).get("valueFrom") or {}).get("secretKeyRef") or {}
    if not ref.get("name") or not ref.get("key") or ref.get("optional"):
        problems.append(
            f"gateway: EPD_API_KEY must come from a required secretKeyRef, is {env.get('EPD_API_KEY')}"
        )
    if {"--api-key", "--no-api-key"} & set(c.get("args", [])):
        problems.append("gateway: --api-key/--no-api-key in args; the key comes from the Secret")
    return problems


def check_decode_egress(objs: list[dict]) -> list[str]:
    """Decode admits any private address on the prefill port, so a NetworkPolicy must keep that
    port to prefill pods."""
    port = ROLE_PORTS["prefill"]
    decode_labels = {"app.kubernetes.io/name": "epd", COMPONENT: "decode"}
    policies = [
        p
        for p in of_kind(objs, "NetworkPolicy")
        if selects(p["spec"]["podSelector"].get("matchLabels", {}), decode_labels)
        and "Egress" in p["spec"].get("policyTypes", [])
    ]
    if not policies:
        return ["no NetworkPolicy limits decode's egress"]
    problems = []
    for p in policies:
        for rule in p["spec"].get("egress", []):
            ports = [x.get("port") for x in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("to", [])
            prefill_labels = {**decode_labels, COMPONENT: "prefill"}
            if not peers or not all(
                selects(x.get("podSelector", {}).get("matchLabels", {}), prefill_labels)
                and not x.get("ipBlock")
                and not x.get("namespaceSelector")
                for x in peers
            ):
                problems.append(
                    f"NetworkPolicy {p['metadata']['name']}: decode may reach port {port} "
                    f"beyond prefill pods: {rule}"
                )
    return problems


def all_problems(objs: list[dict]) -> list[str]:
    return (
        check_deployments(objs)
        + check_services(objs)
        + check_addresses(objs)
        + check_model_cache(objs)
        + check_api_key(objs)
        + check_decode_egress(objs)
    )


# ---- the real manifests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return load_objects()


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(on_disk)
    assert {o["kind"] for o in load_objects()} == {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "NetworkPolicy",
    }


def test_manifests_have_no_problems(objs):
    assert all_problems(objs) == []


def test_stages_scale_independently(objs):
    deps, _ = deployments_by_role(objs)
    assert {role: d["spec"]["replicas"] for role, d in deps.items()} == {
        "gateway": 1,
        "encoder": 2,
        "prefill": 1,
        "decode": 2,
    }


# ---- every check can fail -------------------------------------------------------------------------


def _find(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _dep(name):
    return lambda objs: _find(objs, "Deployment", name)


def _mutate_container(name, fn):
    return lambda objs: fn(container(_find(objs, "Deployment", name)))


def _drop(kind, name):
    def mutate(objs):
        objs.remove(_find(objs, kind, name))

    return mutate


MUTATIONS = [
    ("no replicas", lambda o: _dep("decode")(o)["spec"].pop("replicas"), "decode: replicas must be set"),
    ("stage missing", _drop("Deployment", "prefill"), "no Deployment runs `epd serve prefill`"),
    (
        "two deployments of a role",
        lambda o: container(_dep("decode")(o)).update(args=container(_dep("encoder")(o))["args"]),
        "both run encoder",
    ),
    (
        "selector too wide",
        lambda o: _dep("encoder")(o)["spec"]["selector"]["matchLabels"].pop(COMPONENT),
        "selector must match its own pods only",
    ),
    (
        "bad flag",
        _mutate_container("encoder", lambda c: c["args"].append("--no-such-flag")),
        "not a valid command",
    ),
    (
        "loopback bind",
        _mutate_container("decode", lambda c: c["args"].__setitem__(3, "127.0.0.1")),
        "pods must bind 0.0.0.0",
    ),
    (
        "port mismatch",
        _mutate_container("prefill", lambda c: c["ports"][0].update(containerPort=50099)),
        "container port `grpc` is 50099",
    ),
    (
        "no readiness probe",
        _mutate_container("encoder", lambda c: c.pop("readinessProbe")),
        "readinessProbe must be a grpc probe",
    ),
    (
        "probe wrong port",
        _mutate_container("decode", lambda c: c["readinessProbe"]["grpc"].update(port=50052)),
        "decode: readinessProbe must be a grpc probe on port 50053",
    ),
    (
        "no requests",
        _mutate_container("prefill", lambda c: c["resources"].pop("requests")),
        "resources.requests needs cpu and memory",
    ),
    ("no headless", _drop("Service", "decode-headless"), "needs one headless Service decode-headless"),
    (
        "service selects all pods",
        lambda o: _find(o, "Service", "encoder-headless")["spec"]["selector"].pop(COMPONENT),
        "also selects the pods of",
    ),
    (
        "service wrong port",
        lambda o: _find(o, "Service", "prefill")["spec"]["ports"][0].update(port=50053),
        "does not reach prefill's container port",
    ),
    (
        "gateway -> wrong stage",
        _mutate_container(
            "gateway",
            lambda c: c["args"].__setitem__(c["args"].index("--encoder") + 1, "dns:///decode-headless:50053"),
        ),
        "not the headless Service of encoder",
    ),
    (
        "gateway -> ClusterIP",
        _mutate_container(
            "gateway", lambda c: c["args"].__setitem__(c["args"].index("--decode") + 1, "decode:50053")
        ),
        "not the headless Service of decode",
    ),
    (
        "gateway -> wrong port",
        _mutate_container(
            "gateway",
            lambda c: c["args"].__setitem__(
                c["args"].index("--prefill") + 1, "dns:///prefill-headless:50051"
            ),
        ),
        "prefill-headless serves port 50052",
    ),
    (
        "advertise a Service",
        _mutate_container(
            "prefill",
            lambda c: c["args"].__setitem__(c["args"].index("--advertise-address") + 1, "prefill:50052"),
        ),
        "each pod must advertise its own IP",
    ),
    (
        "POD_IP not defined",
        _mutate_container("prefill", lambda c: c.pop("env")),
        "each pod must advertise its own IP",
    ),
    (
        "allow-list refuses prefill",
        _mutate_container(
            "decode", lambda c: c["args"].__setitem__(c["args"].index("--allow-kv-from") + 1, "prefill:*")
        ),
        "refuses 10.244.3.17:50052",
    ),
    (
        "allow-list admits any port",
        _mutate_container(
            "decode", lambda c: c["args"].__setitem__(c["args"].index("--allow-kv-from") + 1, "10.0.0.0/8:*")
        ),
        "admits 10.244.3.17:22",
    ),
    ("no api key", _mutate_container("gateway", lambda c: c.pop("env")), "EPD_API_KEY must come from"),
    (
        "optional api key",
        _mutate_container(
            "gateway", lambda c: c["env"][0]["valueFrom"]["secretKeyRef"].update(optional=True)
        ),
        "EPD_API_KEY must come from",
    ),
    (
        "opt-out",
        _mutate_container("gateway", lambda c: c["args"].append("--no-api-key")),
        "key comes from the Secret",
    ),
    (
        "cache not mounted",
        _mutate_container("encoder", lambda c: c.pop("volumeMounts")),
        "encoder: no volume mounted at EPD_CACHE_DIR",
    ),
    ("no config", _mutate_container("decode", lambda c: c.pop("envFrom")), "decode: envFrom must give"),
    ("no egress policy", _drop("NetworkPolicy", "decode-egress"), "no NetworkPolicy limits decode's egress"),
    (
        "egress open",
        lambda o: _find(o, "NetworkPolicy", "decode-egress")["spec"]["egress"][0].pop("to"),
        "decode may reach port 50052 beyond prefill pods",
    ),
]


@pytest.mark.parametrize("mutate, problem", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_checks_catch_broken_manifests(objs, mutate, problem):
    broken = copy.deepcopy(objs)
    mutate(broken)
    try:
        problems = all_problems(broken)
    except ValueError as exc:  # serve_config on an unparsable command, outside deployments_by_role
        problems = [str(exc)]
    assert any(problem in p for p in problems), problems
