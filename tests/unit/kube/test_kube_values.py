"""`modelyard deploy render`'s values: defaults written out in deploy/values.yaml, errors with paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from modelyard.errors import ConfigError
from modelyard.kube.render import render
from modelyard.kube.values import DeployValues, load_values

DEPLOY = Path(__file__).parents[3] / "deploy"


def test_deploy_values_yaml_is_the_defaults_written_out():
    assert load_values([DEPLOY / "values.yaml"]) == DeployValues()
    # and nothing in it is a field the model does not have (the model would refuse it anyway)
    assert set(yaml.safe_load((DEPLOY / "values.yaml").read_text())) == set(DeployValues.model_fields)


def test_later_files_merge_over_earlier_ones(tmp_path):
    first = tmp_path / "a.yaml"
    first.write_text("gateway: {replicas: 3, autoscaling: {max_replicas: 20}}\n")
    second = tmp_path / "b.yaml"
    second.write_text("gateway: {autoscaling: {min_replicas: 4}}\nservers: []\n")
    values = load_values([first, second])
    assert values.gateway.replicas == 3
    assert (values.gateway.autoscaling.min_replicas, values.gateway.autoscaling.max_replicas) == (4, 20)
    assert values.servers == []


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "values.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        render(load_values([path]), source=str(path))
    assert caught.value.source == str(path)
    return caught.value.problems


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "gateway: {autoscaling: {min_replicas: 5, max_replicas: 2}}",
            "gateway.autoscaling: max_replicas 2 is below min_replicas 5",
        ),
        ("servers: [{name: Bad_Name}]", "servers[0].name: String should match pattern"),
        (
            "servers: [{name: s, resources: {limits: {cpu: '1'}}}]",
            "servers[0]: resources.limits.memory is needed: the agent offers part of it for models",
        ),
        ("servers: [{name: s, capabilities: [GPU!]}]", "servers[0]: capability 'GPU!' is not a DNS label"),
        ("servers: [{name: a}, {name: a}]", "(top level): server names must be unique: a"),
        ("redis: {deploy: false}", "redis: deploy is false: give url, the Redis the gateways share"),
        ("redis: {url: 'redis://r:6379/0'}", "redis: set either deploy: true or url"),
        ("scheduler: {enabled: false}", "(top level): servers need the scheduler"),
        (
            "gateway: {resources: {limits: {cpu: lots}}}",
            "gateway.resources.limits: cpu: 'lots' is not a quantity",
        ),
        (
            "gateway: {resources: {requests: {cpu: '3'}, limits: {cpu: '2'}}}",
            "gateway.resources: cpu: the request 3 is above the limit 2",
        ),
        (
            "servers: [{name: g, resources: {requests: {nvidia.com/gpu: 1}, limits: {memory: 1Gi}}}]",
            "servers[0].resources: nvidia.com/gpu: requests must equal limits (got 1, limit None)",
        ),
        (
            "gateway: {resources: {limits: {gpu: 1}}}",
            "gateway.resources.limits: 'gpu' is not a resource name",
        ),
        ("servers: [{name: modelyard-scheduler}]", "(top level): server names modelyard-scheduler: taken"),
        (
            "servers: [{name: s, model_memory: 3Gi, resources: {limits: {memory: 2Gi}}}]",
            "servers[0]: model_memory 3Gi is above resources.limits.memory 2Gi",
        ),
        (
            "gateway: {autoscaling: {min_replicas: 1}}",
            "gateway: min_available 1 would block every node drain with 1 gateway(s)",
        ),
        ("gateway: {admin_token: {key: 'bad key!'}}", "gateway.admin_token.key: String should match"),
        ("telemetry: {otlp_endpoint: 'ftp://x'}", "telemetry.otlp_endpoint: expected an http://"),
        ("gateway: {sevice_type: LoadBalancer}", "gateway.sevice_type: unknown field"),
        (
            "gateway: {admin_token: {value: short}}",
            "gateway.admin_token.value: String should have at least 16",
        ),
        # the gateway's own config is checked as `modelyard serve` would, its path under gateway.config
        (
            "gateway: {config: {listen: {port: 70000}}}",
            "gateway.config.listen.port: Input should be less than",
        ),
        ("gateway: {config: {models: [{name: m}]}}", "gateway.config.models[0].endpoints: Field required"),
        (
            "gateway: {config: {listen: {host: 127.0.0.1}}}",
            "gateway.config.listen.host: a pod listens on 0.0.0.0",
        ),
        (
            "gateway: {config: {listen: {workers: 4}}}",
            "gateway.config.listen.workers: placement.scheduler (placed models) works with one worker only",
        ),
        # TLS and tokens (issue 28): plain text only when the values say insecure: true
        ("tls: {enabled: false}", "(top level): tls.enabled is false: tokens, models and requests"),
        (
            "tokens: {scheduler: {enabled: false}}",
            "(top level): tokens.scheduler.enabled is false: anyone reaching the scheduler could place",
        ),
        ("insecure: true", "(top level): insecure: true, but TLS and every credential are on"),
        ("tls: {issuer: {kind: Cluster}}", "tls.issuer.kind: expected one of 'Issuer' or 'ClusterIssuer'"),
        ("tls: {issuer: {name: My_CA}}", "tls.issuer.name: String should match pattern"),
        ("tls: {gateway: {dns_names: ['bad name']}}", "tls.gateway.dns_names: 'bad name' is not a DNS name"),
        (
            "tls: {existing_secrets: {servers: {nope: x}}}",
            "(top level): tls.existing_secrets.servers: no server",
        ),
        ("tls: {existing_secrets: {gateway: Bad}}", "tls.existing_secrets.gateway: String should match"),
        (
            "tokens: {scheduler: {read_value: 0123456789abcdefXY}}",
            "tokens.scheduler: read_value and write_value go together",
        ),
        (
            "tokens: {scheduler: {read_value: 0123456789abcdefXY, write_value: 0123456789abcdefXY}}",
            "tokens.scheduler: read_value and write_value must differ",
        ),
        (
            "tokens: {agents: {enabled: true, values: {other: j-0123456789abcdef01}}}",
            "(top level): tokens.agents.values: one token for each server",
        ),
        ("tokens: {scheduler: {secret_name: Tokens}}", "tokens.scheduler.secret_name: String should match"),
        (
            "gateway: {api_keys: {enabled: true, secret_name: ''}}",
            "gateway.api_keys.secret_name: expected a Secret's name (lowercase letters, digits",
        ),
        (
            "gateway: {api_keys: {secret_name: Team_Keys}}",
            "gateway.api_keys.secret_name: expected a Secret's name",
        ),
        ("gateway: {api_keys: {key: 'keys/a.yaml'}}", "gateway.api_keys.key: expected a Secret's key"),
        ("gateway: {api_keys: {key: ..data}}", "gateway.api_keys.key: expected a Secret's key"),
        ("gateway: {api_keys: {enabled: yes please}}", "gateway.api_keys.enabled: "),
        (
            "tokens: {agents: {values: {mlserver: j-0123456789abcdef01}}}",
            "tokens.agents: values are given but enabled is false",
        ),
        (
            "tokens: {scheduler: {enabled: false, read_value: r-0123456789abcdef,"
            " write_value: w-0123456789abcdef}}\ninsecure: true",
            "tokens.scheduler: read_value and write_value are given but enabled is false",
        ),
    ],
)
def test_a_mistake_names_the_file_and_the_field_path(tmp_path, text, expected):
    found = problems(tmp_path, text)
    assert any(p.startswith(expected) for p in found), found


def test_resources_take_kubernetes_names_and_plain_numbers(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(
        "servers: [{name: s, resources: {requests: {cpu: 2, memory: 1Gi, ephemeral-storage: 10Gi, "
        "nvidia.com/gpu: 1}, limits: {cpu: 2, memory: 1Gi, nvidia.com/gpu: '1', hugepages-2Mi: 64Mi}}}]"
    )
    (server,) = load_values([path]).servers
    assert server.resources.requests.amounts() == {
        "cpu": "2",
        "memory": "1Gi",
        "ephemeral-storage": "10Gi",
        "nvidia.com/gpu": "1",
    }
    assert server.model_memory_bytes() == 3 * 1024**3 // 4  # 3/4 of the limit by default


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tokens: {scheduler: {read_value: 'has space 0123456789', write_value: w-0123456789abcdef}}",
         "tokens.scheduler.read_value: String should match pattern"),
        ("tokens: {agents: {enabled: true, values: {mlserver: 'short one'}}}",
         "tokens.agents.values: mlserver: a token is 16 or more printable ASCII characters"),
        ("gateway: {admin_token: {value: 'short one'}}", "gateway.admin_token.value: String should have"),
    ],
)  # fmt: skip
def test_a_bad_token_is_named_by_its_field_never_shown(tmp_path, text, expected):
    found = problems(tmp_path, text)
    assert any(p.startswith(expected) for p in found), found
    assert not [p for p in found if "has space" in p or "short one" in p], found
