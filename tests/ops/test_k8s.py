"""ops/k8s/: every manifest valid against the Kubernetes API schema (kubernetes-validate,
offline), and consistent with itself and with pagewire: Services, PodDisruptionBudgets,
NetworkPolicies and autoscalers point at pods that exist, probes ask /health on a declared
port, and every container's `pagewire` arguments parse as the command line would parse them
(options and their JSON resolved), so a manifest cannot drift from the flags.

A LeaderWorkerSet (tp.yaml) is a CRD kubernetes-validate has no schema for: its two pod
templates are validated as core/v1 PodTemplates, its own fields against LWS v1's
(leaderworkerset_types.go), and its pods' arguments with the variables LWS sets in each
container (the group size, the leader's address, each pod's worker index)."""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import pytest
import yaml

from tests.ops.test_ops_files import OPS

K8S = OPS / "k8s"
VERSION = "1.30.0"
MANIFESTS = sorted(K8S.glob("*.yaml"))


@functools.cache
def documents() -> list[tuple[str, dict]]:
    """Every object of every manifest, parsed once (read only)."""
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())
            if doc]


LWS = "leaderworkerset.x-k8s.io/v1"
# LWS v1's fields (api/leaderworkerset/v1/leaderworkerset_types.go) and its enums
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
            "networkConfig"}
LWS_TEMPLATE = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}
LWS_ENUMS = {"startupPolicy": {"LeaderCreated", "LeaderReady"},
             "restartPolicy": {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}}
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"        # LWS labels each pod of the set


def test_there_are_engine_router_pd_and_tp_manifests():
    assert {p.name for p in MANIFESTS} >= {"engine.yaml", "pd.yaml", "router.yaml", "tp.yaml"}


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else
                         f"{v['kind']}/{v['metadata']['name']}")
def test_each_object_is_valid_kubernetes(name, doc):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    if doc["apiVersion"] != LWS:
        kubernetes_validate.validate(doc, VERSION, strict=True)
        return
    _check_leader_worker_set(doc)
    for role, template in _lws_templates(doc).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{role}"},
                        "template": template}
        kubernetes_validate.validate(pod_template, VERSION, strict=True)


def _check_leader_worker_set(doc: dict) -> None:
    assert doc["kind"] == "LeaderWorkerSet"
    spec, template = doc["spec"], doc["spec"]["leaderWorkerTemplate"]
    assert set(spec) <= LWS_SPEC and set(template) <= LWS_TEMPLATE
    assert "workerTemplate" in template
    for field, allowed in LWS_ENUMS.items():
        assert {**spec, **template}.get(field, next(iter(allowed))) in allowed, field
    assert isinstance(template["size"], int) and template["size"] >= 2   # a leader and a rank


def _lws_templates(doc: dict) -> dict[str, dict]:
    template = doc["spec"]["leaderWorkerTemplate"]
    return {"leader": template.get("leaderTemplate", template["workerTemplate"]),
            "worker": template["workerTemplate"]}


def _by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def _pods() -> list[tuple[dict, dict]]:
    """Every pod template with the variables its controller sets in each container and the
    labels it adds to each pod: none for a Deployment's; for a LeaderWorkerSet's leader and
    (the last rank's) worker, LWS's."""
    pods = [(d["spec"]["template"], {}) for d in _by_kind("Deployment")]
    for lws in _by_kind("LeaderWorkerSet"):
        name, size = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]["size"]
        for role, template in _lws_templates(lws).items():
            index = 0 if role == "leader" else size - 1
            template = {**template, "metadata": {**template["metadata"], "labels": {
                **template["metadata"]["labels"], LWS_NAME_LABEL: name}}}
            pods.append((template, {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index),
                                    "LWS_LEADER_ADDRESS": f"{name}-0.{name}.default"}))
    return pods


def _pod_labels() -> list[dict]:
    return [template["metadata"]["labels"] for template, _ in _pods()]


def _selects(selector: dict) -> bool:
    return any(all(labels.get(k) == v for k, v in selector.items()) for labels in _pod_labels())


def test_services_budgets_and_policies_select_pods_that_exist():
    for service in _by_kind("Service"):
        assert _selects(service["spec"]["selector"]), service["metadata"]["name"]
    for budget in _by_kind("PodDisruptionBudget"):
        assert _selects(budget["spec"]["selector"]["matchLabels"]), budget["metadata"]["name"]
    for policy in _by_kind("NetworkPolicy"):
        selectors = [policy["spec"]["podSelector"]] + [
            peer["podSelector"] for rule in policy["spec"].get("ingress", [])
            for peer in rule.get("from", []) if "podSelector" in peer]
        for selector in selectors:
            assert _selects(selector["matchLabels"]), policy["metadata"]["name"]
    deployments = {d["metadata"]["name"] for d in _by_kind("Deployment")}
    for hpa in _by_kind("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


def _containers() -> list[dict]:
    """Every container, with the variables its controller sets added to its env."""
    return [{**c, "env": [*c.get("env", []), *({"name": k, "value": v} for k, v in set_.items())]}
            for template, set_ in _pods() for c in template["spec"]["containers"]]


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
    """$(VAR) as the kubelet expands it: a variable's value, or a stand-in for values known
    only at run time (a pod's IP)."""
    for env in container.get("env", []):
        arg = arg.replace(f"$({env['name']})", env.get("value", "10.0.0.7"))
    return arg


def test_pagewire_arguments_parse_and_resolve(monkeypatch):
    from pagewire import cli, options, settings
    from pagewire.config import EXTERNAL, EngineConfig, parse_tcp
    seen, leaders, workers = set(), [], []
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
            if config.parallel.executors == EXTERNAL:
                config._check_parallel()       # --listen named, CURVE keys, 2+ ranks
                leaders.append(config.parallel)
        elif args[0] == "executor":
            workers.append(cli.parse_args(args))
        else:
            with pytest.raises(SystemExit) as done:      # parses, then --help-like exit
                cli.main([*args, "--help"])
            assert done.value.code == 0
    assert seen >= {"serve", "router", "executor"}
    # tp.yaml's one LeaderWorkerSet: its last rank attaches to its leader's port and size
    (leader,), (worker,) = leaders, workers
    assert 1 <= worker.rank == leader.tensor_parallel_size - 1
    assert worker.tensor_parallel_size == leader.tensor_parallel_size
    assert parse_tcp(worker.attach)[1] == parse_tcp(leader.listen)[1] and worker.curve_keys


def test_the_image_recipe_is_there():
    recipe = (OPS / "Dockerfile").read_text()
    assert "torch==2.13.0" in recipe and "pagewire" in recipe
    assert Path(OPS / "README.md").read_text().count("k8s/") >= 3
