"""AgentConfig validation and Kubernetes-style memory quantities."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from modelyard.agent import AgentConfig
from modelyard.agent.config import check_exposure, exposure
from modelyard.config import TlsClientConfig, TlsServerConfig
from modelyard.errors import ConfigError
from modelyard.placement.manifest import parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000000", 1_000_000),
        ("1Gi", 2**30),
        ("500M", 500_000_000),
        ("100Ki", 102_400),
        ("1.5Gi", 3 * 2**29),
        ("2k", 2000),
        (42, 42),
    ],
)
def test_quantities(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["", "1Zi", "-1", "1 GB", "abc", True])
def test_bad_quantities(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_config_parses_memory_and_capabilities_and_trims_the_url():
    config = AgentConfig(
        scheduler="127.0.0.1:9005",
        server_name="mlserver",
        inference_url="http://127.0.0.1:8080/",
        memory_bytes="1Gi",  # type: ignore[arg-type]
        capabilities="sklearn, xgboost,,",  # type: ignore[arg-type]
    )
    assert config.memory_bytes == 2**30
    assert config.capabilities == ("sklearn", "xgboost")
    assert config.inference_url == "http://127.0.0.1:8080"
    assert (config.load_attempts, config.unload_grace, config.overcommit_percent) == (5, 2.0, 0)


def test_config_errors_name_each_field():
    with pytest.raises(ValidationError) as info:
        AgentConfig(scheduler="nohost", server_name="", inference_url="ftp://x", memory_bytes=-1)
    fields = {e["loc"][0] for e in info.value.errors()}
    assert fields == {"scheduler", "server_name", "inference_url", "memory_bytes"}


@pytest.mark.parametrize(
    ("first", "most"), [("load_backoff", "load_backoff_max"), ("reconnect_backoff", "reconnect_backoff_max")]
)
def test_a_first_backoff_above_its_maximum_is_one_clear_error(first, most):
    # Before: accepted here, then Backoff raised ValueError inside the subscribe loop, which died
    # silently and the agent never subscribed again.
    with pytest.raises(ValidationError, match=f"{first} \\(20s\\) must not exceed {most} \\(10s\\)"):
        AgentConfig(scheduler="h:1", server_name="s", inference_url="http://h:1", **{first: 20.0, most: 10.0})


# --- security: plain text only on loopback, the join token never shown -----------------------

BASE = {"server_name": "s", "inference_url": "http://127.0.0.1:8080"}
TOKEN = "j-3f8a1c6e9b2d7f0a4c5e"


def test_the_reconnect_backoff_is_capped_at_2_seconds_by_default():
    """A scheduler that restarts waits for its agents (its resync); they are back within ~2 s."""
    config = AgentConfig(scheduler="127.0.0.1:9005", **BASE)
    assert (config.reconnect_backoff, config.reconnect_backoff_max) == (0.1, 2.0)


@pytest.mark.parametrize("scheduler", ["127.0.0.1:9005", "localhost:9005", "[::1]:9005", "127.0.0.2:1"])
def test_plain_text_on_loopback_is_allowed(scheduler):
    config = AgentConfig(scheduler=scheduler, **BASE)
    assert exposure(config) == []
    check_exposure(config)


def test_a_data_plane_on_another_address_needs_tls():
    config = AgentConfig(scheduler="127.0.0.1:9005", host="0.0.0.0", **BASE)
    (missing,) = exposure(config)
    assert missing == "its data plane listens on 0.0.0.0 without TLS (--tls-cert, --tls-key)"
    with pytest.raises(ConfigError) as caught:
        check_exposure(config)
    (line,) = caught.value.problems
    assert "0.0.0.0" in line and "--insecure" in line and "\n" not in line
    tls = TlsServerConfig(cert_file="c.pem", key_file="k.pem")
    assert exposure(AgentConfig(scheduler="127.0.0.1:9005", host="0.0.0.0", tls=tls, **BASE)) == []
    assert exposure(AgentConfig(scheduler="127.0.0.1:9005", host="0.0.0.0", port=None, **BASE)) == []


@pytest.mark.parametrize(
    ("settings", "lacks"),
    [
        ({}, "TLS (--scheduler-ca) or a credential"),
        ({"scheduler_token": TOKEN}, "TLS (--scheduler-ca)"),
        ({"scheduler_tls": TlsClientConfig(ca_file="ca.pem")}, "a credential (--cert and --key"),
        ({"scheduler_tls": TlsClientConfig(ca_file="ca.pem"), "scheduler_token": TOKEN}, None),
        ({"scheduler_tls": TlsClientConfig(ca_file="ca.pem"), "scheduler_token_file": "t"}, None),
        ({"scheduler_tls": TlsClientConfig(cert_file="c.pem", key_file="k.pem")}, None),
    ],
)
def test_a_scheduler_elsewhere_needs_tls_and_a_credential(settings, lacks):
    config = AgentConfig(scheduler="scheduler.example:9005", **BASE, **settings)
    if lacks is None:
        assert exposure(config) == []
        return
    (missing,) = exposure(config)
    assert missing.startswith("it reaches the scheduler scheduler.example:9005 without " + lacks)


def test_insecure_lets_it_start_on_any_address():
    config = AgentConfig(scheduler="10.0.0.1:9005", host="0.0.0.0", insecure=True, **BASE)
    assert len(exposure(config)) == 2  # what the agent warns about at start
    check_exposure(config)


def test_the_join_token_is_never_shown():
    config = AgentConfig(scheduler="127.0.0.1:9005", scheduler_token=TOKEN, **BASE)
    assert config.scheduler_token is not None and config.scheduler_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(config) and TOKEN not in str(config)
    assert TOKEN not in config.model_dump_json()
    bad = "j-with a space"
    with pytest.raises(ValidationError) as caught:
        AgentConfig(scheduler="127.0.0.1:9005", scheduler_token=bad, **BASE)
    assert "printable ASCII without spaces" in str(caught.value)
    assert bad not in str(caught.value)  # what a log line or a traceback would show
    with pytest.raises(ValidationError, match="not both"):
        AgentConfig(scheduler="127.0.0.1:9005", scheduler_token=TOKEN, scheduler_token_file="t", **BASE)
    assert AgentConfig(scheduler="127.0.0.1:9005", scheduler_token=" ", **BASE).scheduler_token is None


def test_a_tls_data_plane_advertises_https():
    tls = TlsServerConfig(cert_file="c.pem", key_file="k.pem")
    with pytest.raises(ValidationError, match="expected an https:// URL"):
        AgentConfig(scheduler="127.0.0.1:9005", tls=tls, advertise_url="http://pod:9999", **BASE)
    AgentConfig(scheduler="127.0.0.1:9005", tls=tls, advertise_url="https://pod:9999", **BASE)
