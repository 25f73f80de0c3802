"""deploy/k8s-tls/: the TLS overlay, applied to the base manifests as kustomize would (its JSON
patches appending to args, mounts and volumes of the Deployments their target selects; a strategic
merge of each probe patch) and read as the real `epd` reads its flags: every service serves TLS
from the Secret epd-tls, the stages require client certificates of its CA, the gateway and decode
present their certificate to the stages, decode checks prefill pods' certificates against the name
the certificate carries, every probe is an `epd health` exec probe speaking the same TLS on the
container's own port, and every flag of the base's args is still there. Where kubectl is
installed, its kustomize renders the overlay and must agree."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import pytest
import yaml

from epd.cli.parsers.root import build_parser
from epd.transport.server import LIVENESS_SERVICE
from tests.unit.deploy.epd_commands import serve_config
from tests.unit.deploy.k8s_objects import K8S, container, container_env, expand, load_objects, of_kind, pod

TLS = K8S.parent / "k8s-tls"
SECRET = "epd-tls"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _merge(base: dict, patch: dict) -> dict:
    """Strategic merge of one Deployment patch: the container (by name) takes the patch's
    fields (a null one is deleted), volumeMounts/volumes are merged by name."""
    out = copy.deepcopy(base)
    spec, patch_spec = pod(out)["spec"], patch["spec"]["template"]["spec"]
    for pc in patch_spec.get("containers", []):
        c = next(c for c in spec["containers"] if c["name"] == pc["name"])
        for field, value in pc.items():
            if field == "volumeMounts":
                c[field] = [
                    m for m in c.get(field, []) if m["name"] not in {v["name"] for v in value}
                ] + value
            elif isinstance(value, dict) and isinstance(c.get(field), dict):
                c[field] = {**c[field], **value}
                c[field] = {k: v for k, v in c[field].items() if v is not None}
            else:
                c[field] = value
    if "volumes" in patch_spec:
        names = {v["name"] for v in patch_spec["volumes"]}
        spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] not in names] + patch_spec[
            "volumes"
        ]
    return out


def _json_patch(obj: dict, ops: list[dict]) -> None:
    """The JSON patch (RFC 6902) operations the overlay uses: `add` to the end of a list ("/-")."""
    for op in ops:
        assert op["op"] == "add" and op["path"].endswith("/-"), f"not emulated here: {op}"
        node = obj
        for key in op["path"].split("/")[1:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node.append(copy.deepcopy(op["value"]))


def _selected(target: dict, obj: dict) -> bool:
    """kustomize's patch target: kind, and name as an anchored regular expression."""
    assert set(target) <= {"kind", "name"}, f"not emulated here: {target}"
    return (
        obj["kind"] == target.get("kind", obj["kind"])
        and re.fullmatch(target.get("name", ".*"), obj["metadata"]["name"]) is not None
    )


def tls_objects() -> list[dict]:
    kust = yaml.safe_load((TLS / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../k8s"]
    objs = load_objects()
    for entry in kust["patches"]:
        if "target" in entry:
            matched = [o for o in objs if _selected(entry["target"], o)]
            assert matched, f"patch target {entry['target']} selects nothing"
            for obj in matched:
                _json_patch(obj, yaml.safe_load(entry["patch"]))
            continue
        patch = yaml.safe_load((TLS / entry["path"]).read_text())
        i = next(
            i
            for i, o in enumerate(objs)
            if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]
        )
        objs[i] = _merge(objs[i], patch)
    return objs


def check_tls(objs: list[dict]) -> list[str]:
    problems = []
    for dep in of_kind(objs, "Deployment"):
        name, c = dep["metadata"]["name"], container(dep)
        env = container_env(c, objs)
        role, cfg = serve_config([expand(str(a), env) for a in c.get("args", [])], env)
        sec = cfg.server.security

        def from_secret(path: str, key: str, dep: dict = dep, c: dict = c) -> bool:
            """`path` is file `key` of Secret epd-tls, mounted in the container."""
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in pod(dep)["spec"].get("volumes", [])}
            directory, _, file = path.rpartition("/")
            volume = volumes.get(mounts.get(directory, ""), {})
            return volume.get("secret", {}).get("secretName") == SECRET and file == key

        if not (
            from_secret(sec.tls_cert, "tls.crt")
            and from_secret(sec.tls_key, "tls.key")
            and from_secret(sec.tls_ca, "ca.crt")
        ):
            problems.append(
                f"{name}: --tls-cert/--tls-key/--tls-ca are not tls.crt/tls.key/ca.crt of Secret {SECRET}"
            )
        if role != "gateway" and not from_secret(sec.tls_client_ca, "ca.crt"):
            problems.append(f"{name}: a stage must require client certificates of ca.crt (--tls-client-ca)")
        # decode pulls KV caches at the address each prefill pod advertises: its IP, which no
        # certificate names; decode calls nothing but prefill, so the name is prefill's.
        if role == "decode" and sec.tls_server_name != "prefill-headless":
            problems.append(
                f"{role}: prefill pods are dialled by IP; --tls-server-name must be prefill-headless, "
                f"is {sec.tls_server_name!r}"
            )
        # The gateway checks each pod against the Service name it resolved (and releases a KV cache
        # at a prefill pod's IP against prefill-headless): a --tls-server-name would replace all of
        # those with one name, which only a certificate shared by every stage carries.
        if role == "gateway":
            if sec.tls_server_name:
                problems.append(
                    f"gateway: --tls-server-name {sec.tls_server_name} replaces the check of each "
                    "stage's pods against its own Service name; leave it out"
                )
            for address in (*cfg.encoder_addresses, *cfg.prefill_addresses, *cfg.decode_addresses):
                if not address.startswith("dns:///"):
                    problems.append(
                        f"gateway: {address} is not a dns:/// name: its pods' certificates would "
                        "be checked against the address dialled"
                    )
        port = cfg.server.port
        for kind in PROBES:
            probe = c.get(kind)
            if probe is None:
                continue
            command = probe.get("exec", {}).get("command", [])
            if "grpc" in probe or command[:1] != ["epd"]:
                problems.append(
                    f"{name}: {kind} must be an exec probe running epd health (kubelet's grpc probe "
                    f"speaks no TLS), is {probe}"
                )
                continue
            args = build_parser().parse_args(command[1:])
            if args.command != "health" or args.address != f"localhost:{port}":
                problems.append(f"{name}: {kind} does not check localhost:{port}: {command}")
            # The pod's own certificate on every probe, the gateway's too though its port does not
            # require one: with --tls-client-ca added (the overlay's advice), a probe without one
            # would fail and the kubelet would restart the gateway in a loop.
            elif args.tls_ca != sec.tls_ca or (args.tls_cert, args.tls_key) != (sec.tls_cert, sec.tls_key):
                problems.append(f"{name}: {kind} does not present the TLS its port requires: {command}")
            elif role == "gateway" and kind == "livenessProbe" and args.service != LIVENESS_SERVICE:
                problems.append(
                    f"gateway: livenessProbe must ask --service {LIVENESS_SERVICE} (its own status is "
                    f"NOT_SERVING while a stage is down): {command}"
                )
    return problems


def test_the_tls_overlay_secures_every_service_and_probe():
    objs = tls_objects()
    assert len(of_kind(objs, "Deployment")) == 4
    assert check_tls(objs) == []
    assert "prefill-headless" in (TLS / "kustomization.yaml").read_text()  # the SAN decode checks
    assert check_tls(load_objects()), "the plain manifests must not pass as TLS"


def test_the_overlay_keeps_every_flag_of_the_base_and_adds_only_tls():
    """The overlay appends to the base's args (it does not restate them): a flag changed in
    deploy/k8s holds with TLS too."""
    base = {d["metadata"]["name"]: container(d)["args"] for d in of_kind(load_objects(), "Deployment")}
    for dep in of_kind(tls_objects(), "Deployment"):
        name, args = dep["metadata"]["name"], container(dep)["args"]
        assert args[: len(base[name])] == base[name], name
        added = args[len(base[name]) :]
        assert added and all(flag.startswith("--tls-") for flag in added[::2]), (name, added)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_kustomize_renders_the_overlay_as_the_emulation_does():
    """`kubectl kustomize deploy/k8s-tls` (offline): it accepts the overlay, and its Deployments
    are the ones checked above (lists of named items compared by name)."""
    rendered = subprocess.run(["kubectl", "kustomize", str(TLS)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr

    def by_name(objs) -> dict:
        out = {}
        for dep in of_kind(objs, "Deployment"):
            spec = pod(dep)["spec"]
            c = container(dep)
            out[dep["metadata"]["name"]] = (
                c["args"],
                {k: c.get(k) for k in PROBES},
                sorted(json.dumps(m, sort_keys=True) for m in c.get("volumeMounts", [])),
                sorted(json.dumps(v, sort_keys=True) for v in spec.get("volumes", [])),
            )
        return out

    assert by_name(yaml.safe_load_all(rendered.stdout)) == by_name(tls_objects())


def _patch(name: str, fn):
    def mutate(objs):
        fn(container(next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name)))

    return mutate


@pytest.mark.parametrize(
    "mutate,problem",
    [
        (
            _patch("encoder", lambda c: c["args"].__setitem__(slice(-2, None), [])),
            "require client certificates",
        ),
        (_patch("decode", lambda c: c["args"].__setitem__(slice(-2, None), [])), "--tls-server-name must be"),
        (
            _patch("gateway", lambda c: c["args"].extend(["--tls-server-name", "prefill-headless"])),
            "replaces the check of each stage's pods",
        ),
        (
            _patch("prefill", lambda c: c.__setitem__("readinessProbe", {"grpc": {"port": 50052}})),
            "exec probe",
        ),
        (
            _patch(
                "gateway", lambda c: c["livenessProbe"]["exec"]["command"].__setitem__(2, "localhost:50051")
            ),
            "does not check localhost:50050",
        ),
        (
            _patch("encoder", lambda c: c["startupProbe"]["exec"]["command"].__setitem__(slice(5, None), [])),
            "does not present the TLS",
        ),
        (
            _patch(
                "gateway", lambda c: c["livenessProbe"]["exec"]["command"].__setitem__(slice(5, None), [])
            ),
            "does not present the TLS",
        ),
        (
            _patch(
                "gateway",
                lambda c: c.__setitem__("volumeMounts", [m for m in c["volumeMounts"] if m["name"] != "tls"]),
            ),
            "are not tls.crt",
        ),
    ],
)
def test_check_tls_catches_a_broken_overlay(mutate, problem):
    objs = tls_objects()
    mutate(objs)
    assert any(problem in p for p in check_tls(objs)), check_tls(objs)


def test_the_advice_to_require_client_certificates_keeps_the_probes_trusted():
    """The gateway's probes present tls.crt: a --tls-client-ca bundle must hold ca.crt."""
    for text in ((TLS / "kustomization.yaml").read_text(), (K8S.parent / "README.md").read_text()):
        assert "--tls-client-ca" in text and "client-ca.crt=<(cat clients-ca.pem ca.pem)" in text
