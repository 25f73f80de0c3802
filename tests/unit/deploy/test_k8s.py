"""deploy/k8s/: the manifests kustomize applies, read as Kubernetes and the real `epd` would
read them (no cluster here). `check_manifests` returns problems: the real manifests give none,
and each mutation at the end must give the problem its check exists for."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from epd.transport.server import LIVENESS_SERVICE
from tests.unit.deploy.epd_commands import (
    BUILDERS,
    ROOT,
    api_key_problems,
    internal_secret_problems,
    kv_source_problems,
    parse_epd,
    serve_config,
    stop_bound_s,
)
from tests.unit.deploy.k8s_objects import (
    K8S,
    KEY,
    POD_IP,
    container,
    container_env,
    expand,
    load_objects,
    of_kind,
    pod,
)

COMPONENT = "app.kubernetes.io/component"
INTERNAL_SECRET = "epd-internal-secret"
"""The Secret (created out of band, key `secret`) the four Deployments mount."""


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_manifests(objs: list[dict]) -> list[str]:
    problems, deps, cfgs = [], {}, {}
    all_deps = of_kind(objs, "Deployment")
    for dep in all_deps:
        name, c = dep["metadata"]["name"], container(dep)
        env = container_env(c, objs)
        try:
            role, cfg = serve_config(
                [expand(str(a), env) for a in c.get("command", []) + c.get("args", [])], env
            )
        except ValueError as exc:
            problems.append(f"Deployment {name}: {exc}")
            continue
        if role in deps:
            problems.append(f"Deployments {deps[role]['metadata']['name']} and {name} both run {role}")
        deps[role], cfgs[role] = dep, cfg
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        if cfg.server.host != "0.0.0.0":
            problems.append(f"{name}: binds {cfg.server.host}; pods must bind 0.0.0.0")
        if ports.get("grpc") != cfg.server.port or ports.get("http") != getattr(
            getattr(cfg, "http", None), "port", None
        ):
            problems.append(f"{name}: container ports {ports} are not where it serves")
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):  # the last one is optional
            probe = c.get(kind) or ({} if kind != "startupProbe" else {"grpc": {"port": ports.get("grpc")}})
            if probe.get("grpc", {}).get("port") != ports.get("grpc"):
                problems.append(
                    f"{name}: {kind} must be a grpc probe on port {ports.get('grpc')}, is {c.get(kind)}"
                )
            # The gateway's own status is NOT_SERVING while a stage has no replica serving: liveness
            # on it restarted a sound gateway whenever a stage was down or loading.
            elif (
                role == "gateway"
                and kind == "livenessProbe"
                and probe["grpc"].get("service") != LIVENESS_SERVICE
            ):
                problems.append(
                    f"gateway: livenessProbe must ask the service {LIVENESS_SERVICE!r} (SERVING while it "
                    f"runs), not its readiness, is {probe['grpc']}"
                )
        # Supervision, as `epd serve` does it on one host: N replicas, a container that exits is
        # restarted (kubelet's back-off), one that stops answering is killed (livenessProbe above).
        replicas = dep["spec"].get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            problems.append(f"{name}: replicas must be a count >= 1, is {replicas!r}")
        if pod(dep)["spec"].get("restartPolicy", "Always") != "Always":
            problems.append(f"{name}: restartPolicy must be Always, is {pod(dep)['spec']['restartPolicy']!r}")
        labels, selector = pod(dep)["metadata"].get("labels", {}), dep["spec"]["selector"]["matchLabels"]
        if (
            labels.get(COMPONENT) != role
            or not selects(selector, labels)
            or any(selects(selector, pod(d)["metadata"]["labels"]) for d in all_deps if d is not dep)
        ):
            problems.append(
                f"{name}: its pods must carry {COMPONENT}: {role} and its selector match them only"
            )
        if role != "gateway":
            mounted = [
                m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == env.get("EPD_CACHE_DIR")
            ]
            if not mounted or mounted[0] not in [v["name"] for v in pod(dep)["spec"].get("volumes", [])]:
                problems.append(f"{role}: no volume mounted at EPD_CACHE_DIR={env.get('EPD_CACHE_DIR')}")
    problems += [f"no Deployment runs `epd serve {r}`" for r in BUILDERS if r not in deps]
    if problems:
        return problems
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    for name, svc in services.items():
        selected = [
            r
            for r, d in deps.items()
            if selects(svc["spec"].get("selector", {}), pod(d)["metadata"]["labels"])
        ]
        if len(selected) != 1:
            problems.append(f"Service {name} selects the pods of {selected}; exactly one role expected")
            continue
        ports = {p.get("name"): p["containerPort"] for p in container(deps[selected[0]]).get("ports", [])}
        for p in svc["spec"]["ports"]:
            if p.get("targetPort") not in (*ports, *ports.values()):
                problems.append(f"Service {name}: port {p} reaches no container port of {selected[0]}")
    for role in ("encoder", "prefill", "decode"):
        grpc_port = cfgs[role].server.port
        for address in getattr(cfgs["gateway"], f"{role}_addresses"):
            host, _, port = address.removeprefix("dns:///").rpartition(":")
            svc = services.get(host, {}).get("spec", {})
            target = {p["port"]: p.get("targetPort") for p in svc.get("ports", [])}.get(int(port))
            if svc.get("clusterIP") != "None" or not selects(
                svc["selector"], pod(deps[role])["metadata"]["labels"]
            ):
                problems.append(f"gateway --{role} {address}: not a headless Service of {role}")
            elif target not in ("grpc", grpc_port):
                problems.append(
                    f"gateway --{role} {address}: {host} does not forward port {port} to {grpc_port}"
                )
            elif not address.startswith("dns:///"):  # else gRPC balances the pods: one replica to the router
                problems.append(
                    f"gateway --{role} {address}: write dns:///{address}, so that the gateway routes "
                    "each pod behind the name"
                )
    advertised, own = cfgs["prefill"].advertise_address, f"{POD_IP}:{cfgs['prefill'].server.port}"
    if advertised != own:
        problems.append(
            f"prefill advertises {advertised!r}; each pod must advertise its own IP:port ({own!r})"
        )
    problems += kv_source_problems(cfgs["decode"].allow_kv_from, own)
    if of_kind(objs, "Secret"):
        problems.append("a Secret is in the manifests: the API key must be created out of band")
    problems += internal_secret_problems(cfgs, {role: secret_mount(dep) for role, dep in deps.items()})
    return (
        problems
        + api_key_problems(cfgs["gateway"], KEY)
        + check_decode_egress(objs, cfgs["prefill"].server.port)
    )


def secret_mount(dep: dict) -> str:
    """Where the pod's container finds the internal secret: the `secret` key of the Secret
    INTERNAL_SECRET, mounted as a volume (not optional: no Secret, no pod)."""
    volumes = {v["name"]: v.get("secret") or {} for v in pod(dep)["spec"].get("volumes", [])}
    for mount in container(dep).get("volumeMounts", []):
        source = volumes.get(mount["name"], {})
        if source.get("secretName") == INTERNAL_SECRET and not source.get("optional"):
            return f"{mount['mountPath']}/secret"
    return ""


def check_decode_egress(objs: list[dict], port: int) -> list[str]:
    """Decode admits any private address on the prefill port: a NetworkPolicy must keep that
    port to prefill pods."""
    decode = {"app.kubernetes.io/name": "epd", COMPONENT: "decode"}
    prefill = {**decode, COMPONENT: "prefill"}
    policies = [
        p
        for p in of_kind(objs, "NetworkPolicy")
        if "Egress" in p["spec"].get("policyTypes", [])
        and selects(p["spec"]["podSelector"].get("matchLabels", {}), decode)
    ]
    problems = [] if policies else ["no NetworkPolicy limits decode's egress"]
    for p in policies:
        for rule in p["spec"].get("egress", []):
            if rule.get("ports") and port not in [x.get("port") for x in rule["ports"]]:
                continue
            if not rule.get("to") or not all(
                selects(x.get("podSelector", {}).get("matchLabels", {}), prefill)
                and not x.get("ipBlock")
                and not x.get("namespaceSelector")
                for x in rule["to"]
            ):
                problems.append(
                    f"NetworkPolicy {p['metadata']['name']}: decode may reach port {port} beyond prefill"
                )
    return problems


def test_kustomization_applies_every_manifest_and_they_have_no_problems():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    assert check_manifests(load_objects()) == []


def test_the_readme_gives_each_deployments_replica_count():
    """deploy/README.md's table says how many replicas each role runs: the manifests' counts."""
    rows = re.findall(r"^\| (\w+) \| (\d+) \|", (ROOT / "deploy" / "README.md").read_text(), re.M)
    counts = {d["metadata"]["name"]: d["spec"]["replicas"] for d in of_kind(load_objects(), "Deployment")}
    assert {role: int(n) for role, n in rows} == counts


def test_pods_have_the_time_their_stop_takes_and_the_readme_says_how_long():
    """On SIGTERM a service drains its calls in flight for up to --grace-period seconds, then closes
    what it holds within --close-timeout-s (`stop_bound_s`, from the code's constants): the kubelet
    waits that long before its SIGKILL (35 s covered the drain only, not a stuck thread's 30 s
    after it), and deploy/README.md gives that drain (it said 5 s)."""
    objs = load_objects()
    stated = re.search(
        r"drains the calls in flight for up to\s+`--grace-period` seconds \(default (\d+)",
        (ROOT / "deploy" / "README.md").read_text(),
    )
    assert stated, "deploy/README.md no longer says how long a pod drains"
    for dep in of_kind(objs, "Deployment"):
        c = container(dep)
        env = container_env(c, objs)
        args = parse_epd([expand(str(a), env) for a in c.get("command", []) + c.get("args", [])], env)
        assert args.grace_period == float(stated.group(1)), dep["metadata"]["name"]
        need_s = stop_bound_s(args.role, args.grace_period, args.close_timeout_s)
        given_s = pod(dep)["spec"]["terminationGracePeriodSeconds"]
        assert given_s >= need_s, f"{dep['metadata']['name']}: {given_s} s to stop; it may take {need_s} s"


def test_every_stage_reaches_all_its_pods_through_a_headless_service():
    """A ClusterIP Service would pin the gateway's connection to one pod: each stage the gateway
    calls is a headless Service (clusterIP None) selecting that stage's pods."""
    objs = load_objects()
    headless = {
        s["spec"]["selector"][COMPONENT]
        for s in of_kind(objs, "Service")
        if s["spec"].get("clusterIP") == "None"
    }
    assert headless == {"encoder", "prefill", "decode"}
    assert all(d["spec"]["replicas"] >= 1 for d in of_kind(objs, "Deployment"))


def _find(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _c(name, fn):
    return lambda objs: fn(container(_find(objs, "Deployment", name)))


def _arg(name, flag, value):
    return _c(name, lambda c: c["args"].__setitem__(c["args"].index(flag) + 1, value))


def _drop(kind, name):
    return lambda objs: objs.remove(_find(objs, kind, name))


MUTATIONS = [
    ("stage missing", _drop("Deployment", "prefill"), "no Deployment runs `epd serve prefill`"),
    (
        "two deployments of a role",
        lambda o: container(_find(o, "Deployment", "decode")).update(
            args=container(_find(o, "Deployment", "encoder"))["args"]
        ),
        "both run encoder",
    ),
    ("bad flag", _c("encoder", lambda c: c["args"].append("--no-such-flag")), "not a valid command"),
    ("loopback bind", _arg("decode", "--host", "127.0.0.1"), "pods must bind 0.0.0.0"),
    (
        "port mismatch",
        _c("prefill", lambda c: c["ports"][0].update(containerPort=50099)),
        "not where it serves",
    ),
    ("http port mismatch", _arg("gateway", "--http-port", "8080"), "not where it serves"),
    ("no readiness probe", _c("encoder", lambda c: c.pop("readinessProbe")), "readinessProbe must be a grpc"),
    (
        "probe wrong port",
        _c("decode", lambda c: c["startupProbe"]["grpc"].update(port=50052)),
        "decode: startupProbe must be a grpc probe on port 50053",
    ),
    (
        "selector too wide",
        lambda o: _find(o, "Deployment", "encoder")["spec"]["selector"]["matchLabels"].pop(COMPONENT),
        "encoder: its pods must carry",
    ),
    ("cache not mounted", _c("encoder", lambda c: c.pop("volumeMounts")), "encoder: no volume mounted"),
    (
        "service selects all pods",
        lambda o: _find(o, "Service", "encoder")["spec"]["selector"].pop(COMPONENT),
        "Service encoder selects the pods of",
    ),
    (
        "service wrong target",
        lambda o: _find(o, "Service", "gateway")["spec"]["ports"][1].update(targetPort="web"),
        "Service gateway: port",
    ),
    ("no headless", _drop("Service", "decode-headless"), "not a headless Service of decode"),
    (
        "gateway -> wrong stage",
        _arg("gateway", "--encoder", "dns:///decode-headless:50053"),
        "not a headless Service of encoder",
    ),
    ("gateway -> ClusterIP", _arg("gateway", "--decode", "decode:50053"), "not a headless Service of decode"),
    (
        "gateway -> wrong port",
        _arg("gateway", "--prefill", "dns:///prefill-headless:50051"),
        "does not forward port 50051",
    ),
    (
        "gateway -> one replica per name",
        _arg("gateway", "--encoder", "encoder-headless:50051"),
        "write dns:///encoder-headless:50051",
    ),
    (
        "advertise a Service",
        _arg("prefill", "--advertise-address", "prefill:50052"),
        "must advertise its own IP",
    ),
    ("POD_IP not defined", _c("prefill", lambda c: c.pop("env")), "must advertise its own IP"),
    (
        "allow-list refuses prefill",
        _arg("decode", "--allow-kv-from", "prefill:*"),
        "refuses 10.244.3.17:50052",
    ),
    (
        "allow-list admits any port",
        _arg("decode", "--allow-kv-from", "10.0.0.0/8:*"),
        "admits 10.244.3.17:22",
    ),
    ("no api key", _c("gateway", lambda c: c.pop("env")), "refusing to serve"),
    (
        "optional api key",
        _c("gateway", lambda c: c["env"][0]["valueFrom"]["secretKeyRef"].update(optional=True)),
        "refusing to serve",
    ),
    (
        "key inlined",
        _c("gateway", lambda c: c["env"].__setitem__(0, {"name": "EPD_API_KEY", "value": "hunter2"})),
        "does not take its API key",
    ),
    (
        "opt-out",
        _c("gateway", lambda c: c["args"].append("--no-api-key")),
        "both an API key (--api-key or $EPD_API_KEY) and --no-api-key are set",
    ),
    (
        "secret in manifests",
        lambda o: o.append({"kind": "Secret", "metadata": {"name": "epd-api-key"}}),
        "a Secret is in the manifests",
    ),
    (
        "secret flag dropped",
        _c("encoder", lambda c: c.update(args=c["args"][:-2])),
        "encoder: no --internal-secret-file",
    ),
    ("secret not mounted", _c("decode", lambda c: c["volumeMounts"].pop()), "decode: --internal-secret-file"),
    (
        "optional secret",
        lambda o: pod(_find(o, "Deployment", "gateway"))["spec"]["volumes"][0]["secret"].update(
            optional=True
        ),
        "gateway: --internal-secret-file",
    ),
    (
        "no replicas",
        lambda o: _find(o, "Deployment", "encoder")["spec"].pop("replicas"),
        "encoder: replicas must be a count >= 1, is None",
    ),
    (
        "zero replicas",
        lambda o: _find(o, "Deployment", "decode")["spec"].update(replicas=0),
        "decode: replicas must be a count >= 1, is 0",
    ),
    (
        "never restarted",
        lambda o: pod(_find(o, "Deployment", "prefill"))["spec"].update(restartPolicy="Never"),
        "prefill: restartPolicy must be Always",
    ),
    (
        "no liveness probe",
        _c("gateway", lambda c: c.pop("livenessProbe")),
        "gateway: livenessProbe must be a grpc",
    ),
    (
        "liveness on readiness",
        _c("gateway", lambda c: c["livenessProbe"]["grpc"].pop("service")),
        "gateway: livenessProbe must ask the service 'liveness'",
    ),
    ("no egress policy", _drop("NetworkPolicy", "decode-egress"), "no NetworkPolicy limits decode's egress"),
    (
        "egress open",
        lambda o: _find(o, "NetworkPolicy", "decode-egress")["spec"]["egress"][0].pop("to"),
        "decode may reach port 50052 beyond prefill",
    ),
]


@pytest.mark.parametrize("mutate, problem", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_check_manifests_catches_a_broken_manifest(mutate, problem):
    broken = copy.deepcopy(load_objects())
    mutate(broken)
    problems = check_manifests(broken)
    assert any(problem in p for p in problems), problems
