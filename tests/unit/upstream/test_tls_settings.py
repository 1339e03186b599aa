"""TLS to upstreams, the parts without a network: which URL carries which settings (TlsUrl, most
specific wins), what a failed handshake is said as (HTTP and gRPC), and the config's checks."""

from __future__ import annotations

import copy
import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError

from certificates import Pki
from modelyard.config import EndpointConfig, ModelConfig, TlsClientConfig, validate_config
from modelyard.gateway.cluster import Cluster
from modelyard.rpc.oip_client import tls_failure
from modelyard.security.tls import ClientTls, TlsError
from modelyard.upstream.http1 import TlsUrl, tls_reason
from modelyard.upstream.pool import UpstreamTls, check_upstream_tls

URL = "https://10.0.0.1:8443"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def test_a_tls_url_equals_only_the_same_url_with_the_same_settings(pki):
    ca = TlsClientConfig(ca_file=str(pki.ca_file))
    client = pki.issue("gateway")
    mtls = TlsClientConfig(ca_file=str(pki.ca_file), cert_file=str(client.cert), key_file=str(client.key))
    one, again, other = TlsUrl(URL, ClientTls(ca)), TlsUrl(URL, ClientTls(ca)), TlsUrl(URL, ClientTls(mtls))
    assert one == again and one != other
    assert one != URL and one != URL  # a plain string is the default's settings: another pool
    assert hash(one) == hash(URL) == hash(other)
    pools = {URL: "default", one: "ca", other: "mtls"}
    assert len(pools) == 3 and pools[again] == "ca" and pools[URL] == "default"
    assert str(one) == URL and type(str(one)) is str
    assert f"{one}/v1" == URL + "/v1"
    assert copy.copy(one) == one and copy.copy(one).tls is one.tls


def test_settings_are_made_once_and_urls_interned(pki):
    tls = UpstreamTls(None)
    ca = TlsClientConfig(ca_file=str(pki.ca_file))
    first = tls.url(URL, ca)
    assert isinstance(first, TlsUrl) and tls.url(URL, ca) is first  # a pool is found by identity
    assert tls.url(URL, TlsClientConfig(ca_file=str(pki.ca_file))) is first  # equal settings
    assert tls.url("grpcs://10.0.0.1:8001", ca).tls is first.tls  # one ClientTls per setting
    assert tls.url("http://10.0.0.1:8000", ca) == "http://10.0.0.1:8000"  # plain text: no TLS
    assert type(tls.url("grpc://10.0.0.1:8001", ca)) is str
    assert type(tls.url(URL, None)) is str  # no settings of its own: the client's default
    assert tls.url("", ca) == ""


def test_the_most_specific_tls_wins_as_a_whole(pki):
    model_tls = TlsClientConfig(ca_file=str(pki.ca_file))
    endpoint_tls = TlsClientConfig(ca_file=str(pki.ca_file), server_name="backend.example")
    config = ModelConfig(
        name="m",
        tls=model_tls,
        endpoints=[
            EndpointConfig(name="a", url="https://10.0.0.1:1"),
            EndpointConfig(
                name="b", url="https://10.0.0.2:1", grpc_url="grpcs://10.0.0.2:2", tls=endpoint_tls
            ),
            EndpointConfig(name="c", url="http://10.0.0.3:1", grpc_url="grpc://10.0.0.3:2"),
        ],
    )
    tls = UpstreamTls(None)
    cluster = Cluster(config, {}, tls_url=tls.url)
    a, b, c = cluster.endpoints
    assert isinstance(a.url, TlsUrl) and a.url.tls.config == model_tls
    assert isinstance(b.url, TlsUrl) and b.url.tls.config == endpoint_tls
    assert isinstance(b.grpc_url, TlsUrl) and b.grpc_url.tls is b.url.tls
    assert (type(c.url), type(c.grpc_url)) == (str, str)
    assert set(cluster._loads) == {"https://10.0.0.1:1", "https://10.0.0.2:1", "http://10.0.0.3:1"}
    # Replaced with the same settings, an endpoint stays itself (its health, its pool).
    cluster.replace_endpoints(config.endpoints)
    assert cluster.endpoints[0] is a and cluster.endpoints[1] is b


def test_what_a_failed_handshake_is_said_as():
    verify = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    verify.verify_message = "unable to get local issuer certificate"
    assert tls_reason(verify) == "certificate verify failed: unable to get local issuer certificate"
    alert = ssl.SSLError(
        1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required (_ssl.c:2580)"
    )
    assert tls_reason(alert) == "tlsv13 alert certificate required"


@pytest.mark.parametrize(
    ("details", "reason"),
    [
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
         "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
         "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK",
         "certificate verify failed: unable to get local issuer certificate"),
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom verification "
         "check failed with error: UNAUTHENTICATED: Hostname Verification Check failed.",
         "Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."),
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused", ""),
        ("Socket closed", ""),
    ],
)  # fmt: skip
def test_what_grpc_says_of_a_failed_handshake(details, reason):
    assert tls_failure(details) == reason


def test_tls_on_an_endpoint_needs_a_url_that_uses_it():
    tls = {"server_name": "backend.example"}
    with pytest.raises(ValidationError, match="nothing uses it"):
        EndpointConfig.model_validate({"url": "http://10.0.0.1:1", "tls": tls})
    EndpointConfig.model_validate({"url": "https://10.0.0.1:1", "tls": tls})
    EndpointConfig.model_validate({"url": "http://10.0.0.1:1", "grpc_url": "grpcs://10.0.0.1:2", "tls": tls})
    with pytest.raises(ValidationError, match="grpcs://"):
        EndpointConfig.model_validate({"url": "http://10.0.0.1:1", "grpc_url": "https://10.0.0.1:2"})


def test_every_upstream_tls_file_can_be_checked_before_workers_start(pki, tmp_path):
    missing = tmp_path / "missing.key"
    client = pki.issue("gateway")
    endpoint = {"url": "https://10.0.0.1:1", "tls": {"cert_file": str(client.cert), "key_file": str(missing)}}
    data = {
        "upstream": {"tls": {"ca_file": str(pki.ca_file)}},
        "models": [{"name": "m", "endpoints": [endpoint]}],
    }
    with pytest.raises(TlsError) as raised:
        check_upstream_tls(validate_config(data, "<test>"))
    assert raised.value.source == str(missing)
    endpoint["tls"]["key_file"] = str(client.key)
    check_upstream_tls(validate_config(data, "<test>"))
