"""ops/k8s/: every manifest valid against the Kubernetes API schema (kubernetes-validate,
offline), and consistent with itself and with pagewire: Services, PodDisruptionBudgets and
autoscalers point at Deployments that exist, probes ask /health on a declared port, and every
container's `pagewire` arguments parse as the command line would parse them (options and
their JSON resolved), so a manifest cannot drift from the flags."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from tests.ops.test_ops_files import OPS

K8S = OPS / "k8s"
VERSION = "1.30.0"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())
            if doc]


def test_there_are_engine_router_and_pd_manifests():
    assert {p.name for p in MANIFESTS} >= {"engine.yaml", "pd.yaml", "router.yaml"}


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else
                         f"{v['kind']}/{v['metadata']['name']}")
def test_each_object_is_valid_kubernetes(name, doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, VERSION, strict=True)


def _by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def _pod_labels() -> list[dict]:
    return [d["spec"]["template"]["metadata"]["labels"] for d in _by_kind("Deployment")]


def _selects(selector: dict) -> bool:
    return any(all(labels.get(k) == v for k, v in selector.items()) for labels in _pod_labels())


def test_services_and_budgets_select_pods_that_exist():
    for service in _by_kind("Service"):
        assert _selects(service["spec"]["selector"]), service["metadata"]["name"]
    for budget in _by_kind("PodDisruptionBudget"):
        assert _selects(budget["spec"]["selector"]["matchLabels"]), budget["metadata"]["name"]
    deployments = {d["metadata"]["name"] for d in _by_kind("Deployment")}
    for hpa in _by_kind("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


def _containers() -> list[dict]:
    return [c for d in _by_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]]


def test_probes_ask_health_on_a_declared_port():
    for c in _containers():
        ports = {p["name"] for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                check = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                assert check["port"] in ports, (c["name"], probe)
                if "httpGet" in c[probe]:
                    assert c[probe]["httpGet"]["path"] == "/health"


def _expand(arg: str, container: dict) -> str:
    """$(VAR) as the kubelet expands it, with a stand-in for values known only at run time."""
    for env in container.get("env", []):
        arg = arg.replace(f"$({env['name']})", "10.0.0.7")
    return arg


def test_pagewire_arguments_parse_and_resolve(monkeypatch):
    from pagewire import cli, options, settings
    from pagewire.config import EngineConfig
    seen = set()
    for c in _containers():
        if c["image"].split(":")[0] != "pagewire-engine" or "command" in c:   # vllm-router
            continue
        args = [_expand(a, c) for a in c["args"]]
        seen.add(args[0])
        if args[0] == "serve":
            parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
            parser.add_argument("model")
            options.add_flags(parser, serve=True)
            parsed = vars(parser.parse_args(args[1:]))
            config = settings.build({k: v for k, v in parsed.items() if k in options.BY_FIELD})
            assert isinstance(config, EngineConfig)
            if config.kv_transfer_config is not None:
                config.kv_transfer_config.check()
                if config.kv_transfer_config.produces:
                    assert config.parallel.curve_keys, "a KV server off loopback needs CURVE keys"
        else:
            with pytest.raises(SystemExit) as done:      # parses, then --help-like exit
                cli.main([*args, "--help"])
            assert done.value.code == 0
    assert seen >= {"serve", "router"}


def test_the_image_recipe_is_there():
    recipe = (OPS / "Dockerfile").read_text()
    assert "torch==2.13.0" in recipe and "pagewire" in recipe
    assert Path(OPS / "README.md").read_text().count("k8s/") >= 3
