"""The rendered manifests' roles, run as their pods would run them, reach each other over TLS with
the credentials the manifests mount (issue 28 item 3: `modelyard deploy render` wires
certificates and tokens from Secrets, mutual TLS on by default).

Played here on loopback: each Secret is made as cert-manager (the Certificates the render asks
for, signed by one CA) or the README's `kubectl create secret` would make it; each pod's
projected volume is written out as the kubelet would, keys to the paths its items name; the
scheduler, the agent and the gateway are the real processes started with the rendered command,
args and config. What a cluster does and a machine does not is stood in for, and only that: the
ports (free ones instead of 9004, 9005, 9999 and 8000), the mounted paths (a folder per pod), cluster
DNS (a name is reached at 127.0.0.1 and verified as the name the manifests use: --scheduler-name,
tls.server_name), the downward API ($(POD_NAME), $(POD_INDEX), the labels file), MLServer (a
sim-worker over the same model repository) and Redis (the gateway's memory state).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certificates import Pki
from fake_agent_scheduler import OIP_BODY, model_source
from modelyard.kube.render import render
from modelyard.kube.values import load_values
from support import free_ports, run_modelyard, wait_until

ROOT = Path(__file__).parents[2]
READ, WRITE, ADMIN = "r-3c9e1f7a5b2d8c4e6f0a", "w-8d2b6f4a0c9e7b5d3f1a", "admin-6e4c2a0f8d6b4c2a"
JOIN = "j-1f3e5d7c9b0a2c4e6f8d"
USAGES = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH, "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}


def issue(pki: Pki, spec: dict[str, Any]) -> dict[str, bytes]:
    """What cert-manager's CA issuer writes for a Certificate `spec`: its DNS names, IP addresses
    and URIs as SANs, its usages, signed by `pki`'s CA; the Secret's keys."""
    ca_key = serialization.load_pem_private_key(pki.ca.private_key_pem.bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in spec.get("dnsNames", [])]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in spec.get("ipAddresses", [])]
    names += [x509.UniformResourceIdentifier(u) for u in spec.get("uris", [])]
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec["secretName"])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([USAGES[u] for u in spec["usages"] if u in USAGES]), critical=False
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return {
        "tls.crt": certificate.public_bytes(serialization.Encoding.PEM),
        "tls.key": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        "ca.crt": pki.ca.cert_pem.bytes(),
    }


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


class Cluster:
    """The Secrets of a namespace and the kubelet's writing of them into pods' volumes."""

    def __init__(self, root: Path, docs: list[dict[str, Any]]) -> None:
        self.root = root
        self.docs = docs
        self.secrets: dict[str, dict[str, bytes]] = {}
        self.pki = Pki(root, "modelyard-ca")  # the CA the namespace's Issuer signs with
        for doc in docs:
            if doc["kind"] == "Certificate" and not doc["spec"].get("isCA"):
                self.secrets[doc["spec"]["secretName"]] = issue(self.pki, doc["spec"])
            if doc["kind"] == "Secret":  # rendered from values, for trying out
                self.secrets[doc["metadata"]["name"]] = {k: v.encode() for k, v in doc["stringData"].items()}

    def create_secret(self, name: str, **data: str) -> None:
        """kubectl create secret generic NAME --from-literal=KEY=VALUE ..."""
        self.secrets[name] = {key: value.encode() for key, value in data.items()}

    def mount(self, pod: dict[str, Any], name: str) -> dict[str, str]:
        """Write the container's Secret volumes under a folder of its own, as the kubelet does
        (a key the Secret lacks fails, as the pod would not start); the mount paths -> folders.
        Again after a Secret changed: the kubelet's update of the volumes in place."""
        where = self.root / "pods" / f"{pod['metadata']['name']}-{name}"
        volumes = {v["name"]: v for v in pod["spec"]["template"]["spec"].get("volumes", [])}
        paths = {}
        for mount in container(pod, name).get("volumeMounts", []):
            sources = volumes.get(mount["name"], {}).get("projected", {}).get("sources", [])
            if not sources:
                continue
            folder = where / mount["mountPath"].strip("/")
            files = {}
            for source in sources:
                secret = self.secrets[source["secret"]["name"]]
                for item in source["secret"]["items"]:
                    files[item["path"]] = secret[item["key"]]
            atomic_write(folder, files)
            paths[mount["mountPath"]] = str(folder)
        return paths


def atomic_write(folder: Path, files: dict[str, bytes]) -> None:
    """A volume's files as the kubelet's AtomicWriter writes them, first and on every update: into
    a new `..TIMESTAMP` folder, then the `..data` link swapped to it by a rename; each top-level
    name is a link through `..data` (`tls` -> `..data/tls`), made once."""
    folder.mkdir(parents=True, exist_ok=True)
    old = [p for p in folder.iterdir() if p.name.startswith("..") and not p.is_symlink()]
    stamp = folder / f"..{time.time_ns()}"
    for relative, data in files.items():
        path = stamp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o440)
    (folder / "..data_tmp").symlink_to(stamp.name)
    os.rename(folder / "..data_tmp", folder / "..data")
    for top in {relative.split("/", 1)[0] for relative in files}:
        if not (folder / top).is_symlink():
            (folder / top).symlink_to(f"..data/{top}")
    for path in old:
        shutil.rmtree(path)


def local(text: str, mounts: dict[str, str]) -> str:
    for mount, folder in mounts.items():
        text = text.replace(mount, folder)
    return text


def replace(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag VALUE` given `value`."""
    index = args.index(flag)
    return [*args[: index + 1], value, *args[index + 2 :]]


class Role:
    """A started role: its process and the file its output goes to (a pipe could fill and block it)."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process, self.log = process, log

    def said(self) -> str:
        return self.log.read_text()[-4000:]


@pytest.fixture
async def roles(tmp_path: Path) -> AsyncIterator[Any]:
    """`await roles(name, args, env)`: `modelyard ARGS` as the container's command runs it, from this
    checkout; killed at the end (their drains, 10 s and more, are not what is tested here)."""
    started: list[Role] = []

    async def start(name: str, args: list[str], env: dict[str, str] | None = None) -> Role:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "modelyard", *args,
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )  # fmt: skip
        started.append(Role(process, log))
        return started[-1]

    yield start
    for role in started:
        if role.process.returncode is None:
            role.process.kill()
        await role.process.wait()


async def answering(http: aiohttp.ClientSession, url: str, context: ssl.SSLContext, role: Role) -> None:
    """Until `url` answers 200 over TLS verified with `context`; fails with what the role said."""

    async def up() -> bool:
        if role.process.returncode is not None:
            return True
        try:
            async with http.get(url, ssl=context) as response:
                return response.status == 200
        except aiohttp.ClientConnectionError:
            return False

    try:
        await wait_until(up, attempts=600, interval=0.05)
    except AssertionError:
        raise AssertionError(f"{url} did not answer 200 in 30 s; the process said:\n{role.said()}") from None
    assert role.process.returncode is None, f"exited {role.process.returncode}:\n{role.said()}"


VARIANTS = {
    "mutual TLS": "",  # the defaults
    "join tokens": f"tokens: {{agents: {{enabled: true, values: {{mlserver: {JOIN}}}}}}}",
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
async def test_the_rendered_roles_serve_a_placed_model_over_tls_with_the_mounted_credentials(
    variant, sim_workers, http, tmp_path, roles
):
    values = tmp_path / "values.yaml"
    values.write_text(VARIANTS[variant])
    docs = render(load_values([ROOT / "deploy" / "values.yaml", values]))
    cluster = Cluster(tmp_path, docs)
    # what the README has a user create (no token in the values)
    cluster.create_secret("modelyard-admin", token=ADMIN)
    tokens = f"read {READ}\nwrite {WRITE}\n"
    cluster.create_secret("modelyard-scheduler-tokens", tokens=tokens, read=READ, write=WRITE)
    trust = cluster.pki.client_context()  # a client given the CA (the Secret's ca.crt)
    rest, agents, data_plane, gateway_port = free_ports(4)

    # the scheduler, as its StatefulSet runs it
    pod = find(docs, "StatefulSet", "modelyard-scheduler")
    mounts = cluster.mount(pod, "scheduler")
    args = [local(a, mounts) for a in container(pod, "scheduler")["args"]]
    assert args[args.index("--host") + 1] == "0.0.0.0"  # reachable: it starts only with TLS and credentials
    args = replace(args, "--port", str(rest))
    args = replace(args, "--agent-port", str(agents))
    args = replace(args, "--db", str(tmp_path / "scheduler.db"))
    scheduler = await roles("scheduler", args)
    await answering(
        http, f"https://127.0.0.1:{rest}/readyz", trust, scheduler
    )  # its certificate names 127.0.0.1
    # no token, no placing; /metrics (Prometheus) with the read token
    async with http.get(f"https://127.0.0.1:{rest}/v1/models", ssl=trust) as response:
        assert response.status == 401
    read = {"Authorization": f"Bearer {READ}"}
    async with http.get(f"https://127.0.0.1:{rest}/metrics", ssl=trust, headers=read) as response:
        assert response.status == 200

    # the MLServer pod: the agent beside a server over the shared models volume
    pod = find(docs, "StatefulSet", "mlserver")
    models = tmp_path / "models"
    models.mkdir()
    (worker,) = await sim_workers(1, repository=str(models))
    podinfo = tmp_path / "podinfo"  # the downward API's labels file
    podinfo.mkdir()
    labels = pod["spec"]["template"]["metadata"]["labels"]
    (podinfo / "labels").write_text("\n".join(f'{k}="{v}"' for k, v in labels.items()))
    mounts = cluster.mount(pod, "agent") | {"/mnt/models": str(models), "/etc/podinfo": str(podinfo)}
    host = "mlserver-0"  # $(POD_NAME), and $(POD_INDEX) is 0
    args = [
        local(a, mounts).replace("$(POD_NAME)", host).replace("$(POD_INDEX)", "0")
        for a in container(pod, "agent")["args"]
    ]
    scheduler_host, _ = args[args.index("--scheduler") + 1].rsplit(":", 1)
    args = [*replace(args, "--scheduler", f"127.0.0.1:{agents}"), "--scheduler-name", scheduler_host]
    args = replace(args, "--inference-url", worker.url)
    args = replace(args, "--port", str(data_plane))
    advertised = args[args.index("--advertise-url") + 1]
    assert advertised == f"https://{host}.mlserver.modelyard.svc:9999"
    args = replace(args, "--advertise-url", f"https://127.0.0.1:{data_plane}")
    agent = await roles("agent", args)
    name = advertised.removeprefix("https://").rsplit(":", 1)[0]  # cluster DNS's name for the pod
    to_agent = cluster.pki.client_context()
    to_agent.check_hostname = False  # the name is checked by the gateway below, as rendered
    await answering(http, f"https://127.0.0.1:{data_plane}/agent/readyz", to_agent, agent)  # subscribed

    # the gateway, as its Deployment runs it
    pod = find(docs, "Deployment", "modelyard-gateway")
    mounts = cluster.mount(pod, "gateway")
    config = yaml.safe_load(
        local(find(docs, "ConfigMap", "modelyard-gateway")["data"]["gateway.yaml"], mounts)
    )
    assert config["placement"]["scheduler"] == f"https://{scheduler_host}:9004"
    config["placement"]["scheduler"] = f"https://127.0.0.1:{rest}"
    config["placement"]["tls"]["server_name"] = scheduler_host
    config["upstream"]["tls"]["server_name"] = name  # the agent's wildcard certificate is verified
    config["listen"]["port"] = gateway_port
    config["state"] = {"backend": "memory"}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
    (token,) = container(pod, "gateway")["env"]
    secret = token["valueFrom"]["secretKeyRef"]
    env = {token["name"]: cluster.secrets[secret["name"]][secret["key"]].decode()}
    gateway = await roles("gateway", ["serve", "--config", str(tmp_path / "gateway.yaml")], env)
    url = f"https://127.0.0.1:{gateway_port}"
    await answering(http, f"{url}/readyz", trust, gateway)

    # place a model as the README does, through a port-forward: modelyard model apply, the write token
    source = model_source(models / ".sources", "iris")
    (tmp_path / "iris.yaml").write_text(
        yaml.safe_dump(
            {"name": "iris", "storage_uri": str(source), "memory": 100, "requirements": ["sklearn"]}
        )
    )
    (tmp_path / "write-token").write_text(WRITE)
    applied = await asyncio.to_thread(
        run_modelyard, "model", "apply", "-f", str(tmp_path / "iris.yaml"),
        "--scheduler", f"https://127.0.0.1:{rest}", "--token-file", str(tmp_path / "write-token"),
        "--ca-file", str(cluster.pki.ca_file),
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr

    async def served() -> bool:
        async with http.post(f"{url}/v2/models/iris/infer", json=OIP_BODY, ssl=trust) as response:
            return response.status == 200

    try:
        await wait_until(served, attempts=600, interval=0.05)
    except AssertionError:
        raise AssertionError(
            f"iris not served through the gateway in 30 s\ngateway:\n{gateway.said()}\nagent:\n{agent.said()}"
        ) from None
    # it went through the agent's data plane (TLS), which the agent counted
    async with http.get(f"https://127.0.0.1:{data_plane}/metrics", ssl=to_agent) as response:
        metrics = (await response.text()).splitlines()
    assert [
        line
        for line in metrics
        if line.startswith("modelyard_agent_requests_total{")
        and 'model="iris"' in line
        and 'code="200"' in line
    ]


def keys_yaml(*keys: str) -> str:
    """A keys file (README: "API keys and tenants") of one tenant holding `keys`."""
    return yaml.safe_dump(
        {
            "tenants": [{"name": "team-a", "models": ["m"]}],
            "keys": [{"name": f"key-{i}", "tenant": "team-a", "key": key} for i, key in enumerate(keys)],
        }
    )


async def test_api_keys_follow_their_secret_without_a_restart(sim_workers, http, tmp_path, roles):
    """gateway.api_keys: the gateway, started with the rendered config and the Secret's key where
    its projected volume puts it, takes the keys; a key removed from the Secret and one added take
    effect once the kubelet has updated the volume, with no restart."""
    (worker,) = await sim_workers(1)
    first, second = "sk-team-a-first-0123", "sk-team-a-second-456"
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "scheduler": {"enabled": False},
                "servers": [],
                "gateway": {
                    "api_keys": {"enabled": True},
                    "config": {"models": [{"name": "m", "endpoints": [{"url": worker.url}]}]},
                },
            }
        )
    )
    docs = render(load_values([ROOT / "deploy" / "values.yaml", values]))
    cluster = Cluster(tmp_path, docs)
    cluster.create_secret("modelyard-admin", token=ADMIN)
    # kubectl create secret generic modelyard-api-keys --from-file=keys.yaml=my-keys.yaml
    cluster.create_secret("modelyard-api-keys", **{"keys.yaml": keys_yaml(first)})
    pod = find(docs, "Deployment", "modelyard-gateway")
    mounts = cluster.mount(pod, "gateway")
    config = yaml.safe_load(
        local(find(docs, "ConfigMap", "modelyard-gateway")["data"]["gateway.yaml"], mounts)
    )
    assert config["auth"]["enabled"] is True
    (port,) = free_ports(1)
    config["listen"]["port"] = port
    config["state"] = {"backend": "memory"}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
    (token,) = container(pod, "gateway")["env"]
    gateway = await roles(
        "gateway", ["serve", "--config", str(tmp_path / "gateway.yaml")], {token["name"]: ADMIN}
    )
    url, trust = f"https://127.0.0.1:{port}", cluster.pki.client_context()
    await answering(http, f"{url}/readyz", trust, gateway)

    async def status(key: str) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        async with http.get(f"{url}/v1/models", headers=headers, ssl=trust) as response:
            return response.status

    assert (await status(first), await status(second)) == (200, 401)
    # kubectl apply of the Secret with the first key removed and another added; the kubelet
    # updates the volume in place
    cluster.create_secret("modelyard-api-keys", **{"keys.yaml": keys_yaml(second)})
    cluster.mount(pod, "gateway")

    async def swapped() -> bool:
        return (await status(first), await status(second)) == (401, 200)

    await wait_until(swapped, attempts=200, interval=0.05)
    assert gateway.process.returncode is None
