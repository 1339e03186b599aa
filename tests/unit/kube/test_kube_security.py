"""`modelyard deploy render` wires certificates (cert-manager's) and tokens from Secrets, mutual TLS
to the scheduler on by default (issue 28 item 3). Every file a role is told to read is a key of the
Secret it should come from, mounted where the flag or the config says; every name a client connects
to is in the certificate it will be shown. The processes themselves, run with these files:
tests/integration/test_deploy_tls.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_schemas import validate
from modelyard.config import scheduler_url, validate_config
from modelyard.errors import ConfigError
from modelyard.kube.render import dump, render
from modelyard.kube.values import load_values
from modelyard.security.tokens import any_key, parse_token_lines, role_key
from modelyard.upstream.feed import FeedClient

DEPLOY = Path(__file__).parents[3] / "deploy"
VALUES = {"defaults": ("values.yaml",), "production": ("values-production.yaml",)}
READ, WRITE = "r-5f0c1d2e3a4b5c6d7e8f", "w-9a8b7c6d5e4f3a2b1c0d"


def rendered(*files: str, tmp_path: Path | None = None, extra: str | None = None) -> list[dict[str, Any]]:
    paths = [DEPLOY / f for f in files]
    if extra is not None:
        assert tmp_path is not None
        paths.append(tmp_path / "extra.yaml")
        paths[-1].write_text(extra)
    docs = render(load_values(paths))
    for doc in docs:
        validate(doc, "1.28.0")
    return docs


@pytest.fixture(params=sorted(VALUES))
def manifests(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return rendered(*VALUES[request.param])


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def kinds(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def servers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["kind"] == "StatefulSet" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    ]


def mounted(doc: dict[str, Any], name: str) -> dict[str, tuple[str, str]]:
    """What the kubelet puts in the container's files from Secrets: path -> (Secret, key)."""
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"].get("volumes", [])}
    files = {}
    for mount in container(doc, name).get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})  # none: a volumeClaimTemplate's
        sources = [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
        if "secret" in volume:
            sources.append({"name": volume["secret"]["secretName"], **volume["secret"]})
        for secret in sources:
            assert "items" in secret, "each key named: a missing one stops the pod rather than a file missing"
            for item in secret["items"]:
                files[f"{mount['mountPath']}/{item['path']}"] = (secret["name"], item["key"])
    return files


def flag(args: list[str], name: str) -> str | None:
    """`--name=value` or `--name value` in `args`; None when absent."""
    for index, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}":
            return args[index + 1]
    return None


def gateway_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(
        find(docs, "ConfigMap", "modelyard-gateway")["data"]["gateway.yaml"]
    )
    return config


def secret_of_certificate(docs: list[dict[str, Any]], name: str) -> str:
    secret: str = find(docs, "Certificate", name)["spec"]["secretName"]
    return secret


def names_match(pattern: str, host: str) -> bool:
    """A certificate's DNS name against a host, as TLS clients match them (a wildcard: one label)."""
    if pattern.startswith("*."):
        return "." in host and host.split(".", 1)[1] == pattern[2:]
    return pattern == host


def probes(doc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    found = container(doc, name)
    return [found[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in found]


# --- on by default --------------------------------------------------------------------------------


def test_every_hop_is_tls_and_every_role_has_its_credentials_by_default(manifests):
    scheduler = container(find(manifests, "StatefulSet", "modelyard-scheduler"), "scheduler")["args"]
    for name in ("tls-cert", "tls-key", "tokens-file", "agent-ca"):
        assert flag(scheduler, name), name
    assert flag(scheduler, "host") == "0.0.0.0"  # reachable, and it starts: TLS and credentials given
    config = gateway_config(manifests)
    assert config["listen"]["tls"]["cert_file"] and config["listen"]["tls"]["key_file"]
    assert config["placement"]["scheduler"].startswith("https://")
    assert config["placement"]["tls"]["ca_file"] and config["placement"]["token_file"]
    assert config["upstream"]["tls"]["ca_file"]  # the agents' data planes
    for server in servers(manifests):
        agent = container(server, "agent")["args"]
        for name in ("scheduler-ca", "cert", "key", "tls-cert", "tls-key"):  # mutual TLS, TLS data plane
            assert flag(agent, name), name
        assert flag(agent, "advertise-url").startswith("https://")
        assert flag(agent, "token-file") is None  # a certificate, not a join token
    pods = [d for d in manifests if d["kind"] in ("Deployment", "StatefulSet")]
    every_arg = [
        a for d in pods for c in d["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])
    ]
    assert "--insecure" not in every_arg


def test_probes_speak_https_where_the_port_serves_tls(manifests):
    for probe in probes(find(manifests, "Deployment", "modelyard-gateway"), "gateway"):
        assert probe["scheme"] == "HTTPS" and probe["port"] == "https"
    for probe in probes(find(manifests, "StatefulSet", "modelyard-scheduler"), "scheduler"):
        assert probe["scheme"] == "HTTPS" and probe["port"] == "https"
    for server in servers(manifests):
        for probe in probes(server, "agent"):
            assert probe["scheme"] == "HTTPS"
        for probe in probes(server, "mlserver"):  # MLServer itself: plain HTTP, inside the pod
            assert probe.get("scheme", "HTTP") == "HTTP"
        hook = container(server, "mlserver")["lifecycle"]["preStop"]["exec"]["command"][2]
        assert "https://127.0.0.1:9999/agent/livez" in hook  # the agent's data plane is TLS now
    for name in ("Deployment", "StatefulSet"):
        for doc in kinds(manifests, name).values():
            annotations = doc["spec"]["template"]["metadata"].get("annotations", {})
            if annotations.get("prometheus.io/scrape") == "true":
                assert annotations["prometheus.io/scheme"] == "https"


def test_every_file_a_role_reads_is_the_key_of_the_secret_it_should_be(manifests):
    """The kubelet's view (a projected volume of Secret keys) against each flag and config path."""
    gateway_tls = secret_of_certificate(manifests, "modelyard-gateway")
    scheduler_tls = secret_of_certificate(manifests, "modelyard-scheduler")
    tokens = "modelyard-scheduler-tokens"

    files = mounted(find(manifests, "StatefulSet", "modelyard-scheduler"), "scheduler")
    args = container(find(manifests, "StatefulSet", "modelyard-scheduler"), "scheduler")["args"]
    assert files[flag(args, "tls-cert")] == (scheduler_tls, "tls.crt")
    assert files[flag(args, "tls-key")] == (scheduler_tls, "tls.key")
    assert files[flag(args, "agent-ca")] == (scheduler_tls, "ca.crt")
    assert files[flag(args, "tokens-file")] == (tokens, "tokens")

    files = mounted(find(manifests, "Deployment", "modelyard-gateway"), "gateway")
    config = gateway_config(manifests)
    assert files[config["listen"]["tls"]["cert_file"]] == (gateway_tls, "tls.crt")
    assert files[config["listen"]["tls"]["key_file"]] == (gateway_tls, "tls.key")
    assert files[config["placement"]["tls"]["ca_file"]] == (scheduler_tls, "ca.crt")
    assert files[config["upstream"]["tls"]["ca_file"]] == (scheduler_tls, "ca.crt")
    assert files[config["placement"]["token_file"]] == (tokens, "read")
    assert {key for secret, key in files.values() if secret == tokens} == {"read"}  # not the write token

    for server in servers(manifests):
        name = server["metadata"]["name"]
        own = secret_of_certificate(manifests, f"{name}-agent")
        files = mounted(server, "agent")
        args = container(server, "agent")["args"]
        assert files[flag(args, "cert")] == files[flag(args, "tls-cert")] == (own, "tls.crt")
        assert files[flag(args, "key")] == files[flag(args, "tls-key")] == (own, "tls.key")
        assert files[flag(args, "scheduler-ca")] == (scheduler_tls, "ca.crt")
        assert mounted(server, "mlserver") == {}  # the server container holds no key of ours

    # every Secret a pod mounts: one a Certificate fills, or one the README tells you to create
    made = {d["spec"]["secretName"] for d in manifests if d["kind"] == "Certificate"}
    yours = {"modelyard-admin", tokens}
    for doc in [*kinds(manifests, "Deployment").values(), *kinds(manifests, "StatefulSet").values()]:
        for c in doc["spec"]["template"]["spec"]["containers"]:
            assert {secret for secret, _ in mounted(doc, c["name"]).values()} <= made | yours


def test_each_certificate_names_what_its_clients_connect_to(manifests):
    config = gateway_config(manifests)
    scheduler = find(manifests, "Certificate", "modelyard-scheduler")["spec"]
    feed_host = config["placement"]["scheduler"].removeprefix("https://").rsplit(":", 1)[0]
    assert feed_host in scheduler["dnsNames"]
    assert "server auth" in scheduler["usages"]
    namespace = find(manifests, "StatefulSet", "modelyard-scheduler")["metadata"]["namespace"]
    gateway = find(manifests, "Certificate", "modelyard-gateway")["spec"]
    assert {"modelyard-gateway", f"modelyard-gateway.{namespace}.svc"} <= set(gateway["dnsNames"])
    for server in servers(manifests):
        name = server["metadata"]["name"]
        args = container(server, "agent")["args"]
        assert flag(args, "scheduler").rsplit(":", 1)[0] in scheduler["dnsNames"]
        spec = find(manifests, "Certificate", f"{name}-agent")["spec"]
        # the data plane, as gateways reach pod 0 (and any other) from the feed
        host = flag(args, "advertise-url").removeprefix("https://").replace("$(POD_NAME)", f"{name}-0")
        assert any(names_match(pattern, host.rsplit(":", 1)[0]) for pattern in spec["dnsNames"])
        # and the agent's identity to the scheduler: its server, any replica
        assert spec["uris"] == [f"spiffe://modelyard/server/{name}"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
    for certificate in kinds(manifests, "Certificate").values():
        assert certificate["metadata"]["namespace"] == namespace


def test_by_default_the_namespace_gets_its_own_ca():
    docs = rendered("values.yaml")
    selfsigned, ca_issuer = find(docs, "Issuer", "modelyard-selfsigned"), find(docs, "Issuer", "modelyard-ca")
    assert selfsigned["spec"] == {"selfSigned": {}}
    ca = find(docs, "Certificate", "modelyard-ca")["spec"]
    assert ca["isCA"] is True and ca["issuerRef"]["name"] == "modelyard-selfsigned"
    assert ca["privateKey"]["rotationPolicy"] == "Never"  # renewed, it still verifies what it signed
    assert ca_issuer["spec"] == {"ca": {"secretName": ca["secretName"]}}
    for name, certificate in kinds(docs, "Certificate").items():
        if name != "modelyard-ca":
            issuer = certificate["spec"]["issuerRef"]
            assert issuer == {"name": "modelyard-ca", "kind": "Issuer", "group": "cert-manager.io"}
    # cert-manager objects come before the pods that mount their Secrets (kubectl apply's order)
    order = [d["kind"] for d in docs]
    assert order.index("Certificate") < order.index("StatefulSet")
    # the gateway's and the scheduler's also name localhost for kubectl port-forward
    for name in ("modelyard-gateway", "modelyard-scheduler"):
        spec = find(docs, "Certificate", name)["spec"]
        assert "localhost" in spec["dnsNames"] and spec["ipAddresses"] == ["127.0.0.1"]


def test_a_named_issuer_replaces_the_namespaces_own_ca(tmp_path):
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra="tls: {issuer: {name: corp-ca, kind: ClusterIssuer}, localhost: false,"
        " gateway: {dns_names: [ai.example.com]}}",
    )
    assert not kinds(docs, "Issuer")
    assert set(kinds(docs, "Certificate")) == {"modelyard-gateway", "modelyard-scheduler", "mlserver-agent"}
    for certificate in kinds(docs, "Certificate").values():
        spec = certificate["spec"]
        assert spec["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert "localhost" not in spec["dnsNames"] and "ipAddresses" not in spec
    assert "ai.example.com" in find(docs, "Certificate", "modelyard-gateway")["spec"]["dnsNames"]


def test_existing_secrets_need_no_cert_manager(tmp_path):
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra="tls: {existing_secrets: {gateway: gw-public, scheduler: sched-tls,"
        " servers: {mlserver: ml-tls}}}",
    )
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io")]
    assert set(mounted(find(docs, "Deployment", "modelyard-gateway"), "gateway").values()) >= {
        ("gw-public", "tls.crt"),
        ("sched-tls", "ca.crt"),  # the gateway's own may come from a public CA: trust is the scheduler's
    }
    assert ("sched-tls", "tls.key") in mounted(
        find(docs, "StatefulSet", "modelyard-scheduler"), "scheduler"
    ).values()
    files = mounted(find(docs, "StatefulSet", "mlserver"), "agent")
    assert {("ml-tls", "tls.crt"), ("ml-tls", "tls.key"), ("sched-tls", "ca.crt")} <= set(files.values())
    # one existing, the others issued
    docs = rendered("values.yaml", tmp_path=tmp_path, extra="tls: {existing_secrets: {gateway: gw-public}}")
    assert set(kinds(docs, "Certificate")) == {"modelyard-ca", "modelyard-scheduler", "mlserver-agent"}


# --- tokens ---------------------------------------------------------------------------------------


def test_no_token_is_rendered_unless_the_values_give_one(manifests):
    assert not kinds(manifests, "Secret")
    assert "stringData" not in dump(manifests)
    config = gateway_config(manifests)  # the ConfigMap names the token's file, never a token
    assert "admin" not in config or "token" not in config["admin"]
    assert set(config["placement"]) & {"token", "token_file"} == {"token_file"}


def test_tokens_given_for_trying_out_are_in_their_secret_only(tmp_path):
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra=f"tokens: {{scheduler: {{read_value: {READ}, write_value: {WRITE}}}}}",
    )
    secret = find(docs, "Secret", "modelyard-scheduler-tokens")
    assert secret["stringData"]["read"] == READ and secret["stringData"]["write"] == WRITE
    # the scheduler's own parser reads its file: one token per role
    table = parse_token_lines(secret["stringData"]["tokens"].splitlines(), "tokens", role_key)
    assert (table.lookup(READ), table.lookup(WRITE)) == ("read", "write")
    for doc in docs:
        if doc["kind"] != "Secret":
            assert READ not in yaml.safe_dump(doc) and WRITE not in yaml.safe_dump(doc), doc["kind"]


def test_join_tokens_replace_the_agents_client_certificates(tmp_path):
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra="tokens: {agents: {enabled: true, values: {mlserver: j-0123456789abcdef01}}}",
    )
    scheduler = find(docs, "StatefulSet", "modelyard-scheduler")
    args = container(scheduler, "scheduler")["args"]
    assert flag(args, "agent-ca") is None  # it would require a certificate of every agent
    assert mounted(scheduler, "scheduler")[flag(args, "agent-tokens-file")] == (
        "modelyard-agent-tokens",
        "tokens",
    )
    server = find(docs, "StatefulSet", "mlserver")
    args = container(server, "agent")["args"]
    assert flag(args, "cert") is None and flag(args, "scheduler-ca")  # TLS still, no client certificate
    assert mounted(server, "agent")[flag(args, "token-file")] == ("modelyard-agent-tokens", "server-mlserver")
    data = find(docs, "Secret", "modelyard-agent-tokens")["stringData"]
    assert data["server-mlserver"] == "j-0123456789abcdef01"
    table = parse_token_lines(data["tokens"].splitlines(), "agent-tokens", any_key)
    assert table.lookup("j-0123456789abcdef01") == "mlserver"


# --- API keys ------------------------------------------------------------------------------------


def test_api_keys_are_the_gateways_keys_file_from_their_secret(tmp_path):
    docs = rendered("values.yaml", tmp_path=tmp_path, extra="gateway: {api_keys: {enabled: true}}")
    config = gateway_config(docs)
    assert config["auth"] == {"enabled": True, "keys_file": "/var/run/secrets/modelyard/api-keys.yaml"}
    validate_config(config, "gateway.yaml")  # what `modelyard serve` reads from the ConfigMap
    gateway = find(docs, "Deployment", "modelyard-gateway")
    files = mounted(gateway, "gateway")
    assert files[config["auth"]["keys_file"]] == ("modelyard-api-keys", "keys.yaml")
    # in the projected volume, which the kubelet updates in place: a key added to or removed from
    # the Secret is read again without a restart (no subPath mount, which would never change)
    assert not [m for m in container(gateway, "gateway")["volumeMounts"] if "subPath" in m]
    # never a key in a manifest: you create the Secret
    assert not kinds(docs, "Secret")
    # a Secret and a key of your own
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra="gateway: {api_keys: {enabled: true, secret_name: team-keys, key: tenants.yaml}}",
    )
    config = gateway_config(docs)
    files = mounted(find(docs, "Deployment", "modelyard-gateway"), "gateway")
    assert files[config["auth"]["keys_file"]] == ("team-keys", "tenants.yaml")


def test_the_gateways_own_auth_config_wins_over_the_api_keys_values(tmp_path):
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra="gateway: {api_keys: {enabled: true},"
        " config: {auth: {keys_file: /etc/keys/k.yaml, quota_store_down: refuse}}}",
    )
    auth = gateway_config(docs)["auth"]
    assert auth == {"enabled": True, "keys_file": "/etc/keys/k.yaml", "quota_store_down": "refuse"}
    # with Redis (state.backend, as rendered) keys made at runtime and quotas are shared by gateways
    assert gateway_config(docs)["state"]["backend"] == "redis"


def test_api_keys_off_by_default_render_nothing(tmp_path):
    default = rendered("values.yaml")
    assert "auth" not in gateway_config(default)
    files = mounted(find(default, "Deployment", "modelyard-gateway"), "gateway")
    assert "modelyard-api-keys" not in {secret for secret, _ in files.values()}
    # a Secret's name without enabled changes nothing
    named = rendered(
        "values.yaml", tmp_path=tmp_path, extra="gateway: {api_keys: {secret_name: other, key: k.yaml}}"
    )
    assert named == default


# --- turning pieces off ---------------------------------------------------------------------------


def test_the_gateway_port_may_leave_tls_to_an_ingress(tmp_path):
    docs = rendered("values.yaml", tmp_path=tmp_path, extra="tls: {gateway: {enabled: false}}")
    assert "modelyard-gateway" not in kinds(docs, "Certificate")
    config = gateway_config(docs)
    assert "tls" not in config["listen"]
    assert config["placement"]["scheduler"].startswith("https://")  # the hops inside stay TLS
    gateway = find(docs, "Deployment", "modelyard-gateway")
    assert {p["scheme"] for p in probes(gateway, "gateway")} == {"HTTP"}
    (port,) = find(docs, "Service", "modelyard-gateway")["spec"]["ports"]
    assert (port["name"], port["port"]) == ("http", 80)
    files = mounted(gateway, "gateway")
    assert files[config["placement"]["tls"]["ca_file"]] == ("modelyard-scheduler-tls", "ca.crt")
    assert not [key for _, key in files.values() if key == "tls.key"]


def test_plain_text_is_rendered_only_when_the_values_say_insecure(tmp_path):
    with pytest.raises(ConfigError) as caught:
        rendered("values.yaml", tmp_path=tmp_path, extra="tls: {enabled: false}")
    (problem,) = caught.value.problems
    assert "tls.enabled is false" in problem and "insecure: true" in problem
    docs = rendered("values.yaml", tmp_path=tmp_path, extra="tls: {enabled: false}\ninsecure: true")
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io")]
    scheduler = container(find(docs, "StatefulSet", "modelyard-scheduler"), "scheduler")["args"]
    agent = container(find(docs, "StatefulSet", "mlserver"), "agent")["args"]
    assert "--insecure" in scheduler and "--insecure" in agent
    assert flag(scheduler, "tls-cert") is None and flag(agent, "cert") is None
    assert flag(scheduler, "tokens-file")  # the REST tokens stay
    assert flag(agent, "advertise-url").startswith("http://")
    config = gateway_config(docs)
    assert config["placement"]["scheduler"] == "modelyard-scheduler:9004" and "upstream" not in config
    assert {p["scheme"] for p in probes(find(docs, "StatefulSet", "mlserver"), "agent")} == {"HTTP"}
    # The read token still goes to the scheduler, over plain http as asked: the gateway's feed
    # client, which refuses that by default, is told it may (else the gateway would not start).
    assert config["placement"]["allow_plain_token"] is True
    token = tmp_path / "feed-token"
    token.write_text("a-read-token-of-sixteen\n")
    placement = validate_config(
        {**config, "placement": {**config["placement"], "token_file": str(token)}}, "t"
    )
    FeedClient(
        scheduler_url(placement.placement.scheduler), connect_timeout=1, ping_timeout=1,
        token_file=str(token), allow_plain_token=placement.placement.allow_plain_token,
    )  # fmt: skip


def test_without_the_scheduler_the_gateway_has_only_its_own_certificate(tmp_path):
    docs = rendered("values.yaml", tmp_path=tmp_path, extra="scheduler: {enabled: false}\nservers: []")
    assert set(kinds(docs, "Certificate")) == {"modelyard-ca", "modelyard-gateway"}
    files = mounted(find(docs, "Deployment", "modelyard-gateway"), "gateway")
    assert set(files.values()) == {("modelyard-gateway-tls", "tls.crt"), ("modelyard-gateway-tls", "tls.key")}
    assert "placement" not in gateway_config(docs) and "upstream" not in gateway_config(docs)
