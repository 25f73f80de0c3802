"""deploy/k8s/'s base manifests as Kubernetes reads them (no cluster here): the objects kustomize
applies (`load_objects`), a Deployment's pod and container, the environment the kubelet gives the
container (`container_env`) and its $(VAR) expansion of args (`expand`), for test_k8s and the TLS
overlay's test_k8s_tls."""

from __future__ import annotations

import re

import yaml

from tests.unit.deploy.epd_commands import ROOT

K8S = ROOT / "deploy" / "k8s"
POD_IP = "10.244.3.17"  # what the kubelet puts in an env var from fieldRef status.podIP
KEY = "key-from-the-secret"


def load_objects() -> list[dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((K8S / f).read_text()) if d]


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o.get("kind") == kind]


def pod(dep: dict) -> dict:
    return dep["spec"]["template"]


def container(dep: dict) -> dict:
    return pod(dep)["spec"]["containers"][0]


def container_env(c: dict, objs: list[dict]) -> dict[str, str]:
    """envFrom ConfigMaps, then env: downward-API IPs and required Secret keys as the kubelet gives them."""
    maps = {m["metadata"]["name"]: m["data"] for m in of_kind(objs, "ConfigMap")}
    env = {k: str(v) for src in c.get("envFrom", []) for k, v in maps[src["configMapRef"]["name"]].items()}
    for e in c.get("env", []):
        source = e.get("valueFrom") or {}
        secret = source.get("secretKeyRef") or {}
        field = (source.get("fieldRef") or {}).get("fieldPath")
        env[e["name"]] = (
            POD_IP
            if field == "status.podIP"
            else KEY
            if secret and not secret.get("optional")
            else ""
            if source
            else str(e.get("value", ""))
        )
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args: defined variables only; $$ escapes."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)
