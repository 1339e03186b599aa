"""`modelyard graph deploy`: the objects KServe's raw deployment mode makes for an InferenceGraph."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from modelyard.errors import ConfigError
from modelyard.kube.graph import graph_manifests, resolve_services

SPEC = {
    "nodes": {
        "root": {"routerType": "Sequence", "steps": [{"serviceUrl": "http://a.example/v1/models/a:predict"}]}
    }
}


def manifests(spec=SPEC, metadata=None, **options):
    return graph_manifests("my-graph", spec, metadata or {"namespace": "ml"}, image="img:1", **options)


def test_deployment_service_and_hpa_as_kserve_makes_them():
    deployment, service, hpa = manifests(
        metadata={"namespace": "ml", "labels": {"team": "a"}, "annotations": {"x": "y"}}
    )
    for doc in (deployment, service, hpa):
        assert doc["metadata"] == {
            "name": "my-graph",
            "namespace": "ml",
            "labels": {"team": "a", "serving.kserve.io/inferencegraph": "my-graph"},
            "annotations": {"x": "y"},
        }
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    assert deployment["spec"]["selector"]["matchLabels"] == {"app": "isvc.my-graph"}
    assert service["spec"]["selector"] == {"app": "isvc.my-graph"}
    assert service["spec"]["ports"] == [
        {"name": "my-graph", "port": 80, "targetPort": 8080, "protocol": "TCP"}
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "my-graph"
    assert container["command"] == ["modelyard", "graph", "serve"]
    assert container["args"][0] == "--graph-json" and json.loads(container["args"][1]) == SPEC
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8080, "scheme": "HTTP"}
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "100Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    assert container["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 1
    assert hpa["spec"]["metrics"][0]["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 80},
    }


def test_the_specs_scaling_resources_affinity_and_propagated_headers_carry_over():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}  # fmt: skip
    tolerations = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    spec = {
        **SPEC,
        "nodeSelector": {"pool": "routers"},
        "tolerations": tolerations,
        "serviceAccountName": "graph-router",
        "minReplicas": 2,
        "maxReplicas": 6,
        "scaleMetric": "memory",
        "scaleTarget": 60,
        "resources": {"limits": {"cpu": "2", "memory": "2Gi"}},
        "affinity": affinity,
    }
    deployment, _service, hpa = manifests(
        spec, propagate_headers=["Authorization", "x-team-.*"], otlp_endpoint="http://collector:4318"
    )
    pod = deployment["spec"]["template"]["spec"]
    assert pod["affinity"] == affinity
    assert pod["nodeSelector"] == {"pool": "routers"} and pod["tolerations"] == tolerations
    assert pod["serviceAccountName"] == "graph-router"
    assert pod["containers"][0]["resources"] == {"limits": {"cpu": "2", "memory": "2Gi"}}
    assert pod["containers"][0]["env"] == [
        {"name": "PROPAGATE_HEADERS", "value": "Authorization,x-team-.*"},
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://collector:4318"},
    ]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "memory"
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 60
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)


def test_a_knative_only_scale_metric_is_refused_with_its_path():
    with pytest.raises(
        ConfigError, match=r"spec\.scaleMetric: raw deployment scales on cpu or memory, got 'rps'"
    ):
        manifests({**SPEC, "scaleMetric": "rps"})


def test_service_names_resolve_as_kserves_controller_does():
    steps = [
        {"serviceName": "a"},
        {"serviceName": "b"},
        {"serviceName": "c", "serviceUrl": "http://kept"},
        {"nodeName": "n"},
    ]
    spec = {"nodes": {"root": {"routerType": "Sequence", "steps": steps}}}
    resolved, guessed = resolve_services(spec, "ml", {"b": "http://b.other/v2/models/b/infer"}, protocol="v2")
    steps = resolved["nodes"]["root"]["steps"]
    assert steps[0]["serviceUrl"] == "http://a-predictor.ml.svc.cluster.local/v2/models/a/infer"
    assert steps[1]["serviceUrl"] == "http://b.other/v2/models/b/infer"
    assert steps[2]["serviceUrl"] == "http://kept" and "serviceUrl" not in steps[3]
    assert guessed == ["a"]
    assert "serviceUrl" not in spec["nodes"]["root"]["steps"][0]  # the caller's spec is left as it was
    resolved, _ = resolve_services(spec, "ml", {})
    assert resolved["nodes"]["root"]["steps"][0]["serviceUrl"].endswith("/v1/models/a:predict")


def test_a_min_replicas_below_one_is_one_as_in_kserves_raw_mode():
    *_, hpa = manifests({**SPEC, "minReplicas": -1})
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 1)
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)
