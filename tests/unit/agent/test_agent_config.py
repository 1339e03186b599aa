"""AgentConfig validation and Kubernetes-style memory quantities."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from modelyard.agent import AgentConfig
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
