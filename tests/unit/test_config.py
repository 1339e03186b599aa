"""Gateway config: defaults, validation messages and precedence (DESIGN.md habit 5)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from modelyard.cli.telemetry import telemetry_config
from modelyard.config import GatewayConfig, env_overrides, load_config, merged_data, validate_config
from modelyard.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway.yaml"


def write(tmp_path: Path, text: str, name: str = "gateway.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def model(**fields: Any) -> dict[str, Any]:
    return {"name": "m", "endpoints": [{"url": "http://127.0.0.1:9000"}], **fields}


def problems_of(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data, "<test>")
    return info.value.problems


def test_defaults() -> None:
    config = load_config(None, env={})
    assert isinstance(config, GatewayConfig)
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8000)
    assert config.limits.max_body_bytes == 32 * 1024 * 1024
    assert config.state.backend == "memory"
    assert config.models == []
    assert config.admin.token is None


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == load_config(None, env={})


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("http://10.0.0.5:9000", "10.0.0.5:9000"),
        ("http://example.com/", "example.com:80"),
        ("https://api.example.com/v1", "api.example.com:443"),
    ],
)
def test_endpoint_name_defaults_to_host_and_port(url: str, name: str) -> None:
    config = validate_config({"models": [model(endpoints=[{"url": url}])]}, "<test>")
    assert config.models[0].endpoints[0].name == name


def test_explicit_endpoint_name_is_kept_and_url_trailing_slash_dropped() -> None:
    config = validate_config({"models": [model(endpoints=[{"url": "http://h:1/", "name": "gpu-a"}])]}, "<t>")
    endpoint = config.models[0].endpoints[0]
    assert (endpoint.name, endpoint.url) == ("gpu-a", "http://h:1")


def test_endpoints_with_the_same_default_name_are_rejected() -> None:
    problems = problems_of({"models": [model(endpoints=[{"url": "http://h:1"}, {"url": "http://h:1/"}])]})
    assert problems == [
        "models[0].endpoints[1].name: endpoint names must be unique within a model;"
        " 'h:1' is repeated (it defaults to host:port)"
    ]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("250ms", 0.25), ("5s", 5.0), ("1m", 60.0), ("2h", 7200.0), (3, 3.0), (0.5, 0.5), ("1.5", 1.5)],
)
def test_durations(value: Any, seconds: float) -> None:
    config = validate_config({"models": [model(health_check={"interval": value})]}, "<test>")
    assert config.models[0].health_check.interval == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["5 minutes", "-1s", "fast"])
def test_bad_duration_names_field_and_expected_form(value: str) -> None:
    (problem,) = problems_of({"models": [model(health_check={"timeout": value})]})
    assert problem.startswith("models[0].health_check.timeout: expected a duration such as")
    assert repr(value) in problem


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8081",
        "grpc://127.0.0.1",
        "grpc://:8081",
        "grpc://h:8081/v2",
        "grpc://h:99999",
        "grpc://h:0",
        "grpc://h:8081?x=y",
        "grpc://h:8081#f",
        "grpc://u@h:8081",
    ],
)
def test_a_grpc_url_needs_the_grpc_scheme_a_host_and_a_port(url: str) -> None:
    model = {"name": "m", "endpoints": [{"url": "http://127.0.0.1:8080", "grpc_url": url}]}
    (problem,) = problems_of({"models": [model]})
    assert problem.startswith("models[0].endpoints[0].grpc_url: expected grpc://host:port")


def test_a_grpc_url_is_kept() -> None:
    endpoint = {"url": "http://127.0.0.1:8080", "grpc_url": "grpc://[::1]:8081/"}
    config = validate_config({"models": [{"name": "m", "endpoints": [endpoint]}]}, "<test>")
    assert config.models[0].endpoints[0].grpc_url == "grpc://[::1]:8081"


def test_negative_duration_is_rejected() -> None:
    (problem,) = problems_of({"upstream": {"timeout": -1}})
    assert problem.startswith("upstream.timeout: ")


SEVERAL_ERRORS = """\
listen:
  port: 8000
models:
  - name: chat
    strategy: fastest
    endpoints:
      - url: http://127.0.0.1:9000
        weight: -1
        retries: 3
      - url: ftp://example.com
  - name: chat
"""


def test_several_errors_are_reported_together_with_field_paths(tmp_path: Path) -> None:
    path = write(tmp_path, SEVERAL_ERRORS)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    error = info.value
    assert error.source == str(path)
    assert str(error).startswith(f"{path}: ")
    expected_prefixes = [
        "models[0].endpoints[1].url: expected an http:// or https:// URL",
        "models[0].strategy: expected one of 'round_robin', 'random', 'least_pending', 'kv_aware', "
        "'cost_aware', 'resource_aware' or 'prefix_aware' (got 'fastest')",
        "models[0].endpoints[0].weight: ",
        "models[0].endpoints[0].retries: unknown field",
        "models[1].endpoints: Field required",
    ]
    for prefix in expected_prefixes:
        assert any(p.startswith(prefix) for p in error.problems), (prefix, error.problems)
        assert prefix in str(error)
    assert "(got -1)" in next(p for p in error.problems if p.startswith("models[0].endpoints[0].weight"))


def test_duplicate_model_names_are_reported_alongside_other_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, SEVERAL_ERRORS), env={})
    assert any("model names must be unique" in p and "chat" in p for p in info.value.problems)


def test_duplicate_model_names() -> None:
    problems = problems_of({"models": [model(name="chat"), model(name="chat"), model(name="embed")]})
    assert problems == ["models[1].name: model names must be unique; 'chat' is repeated"]


def test_unknown_top_level_field() -> None:
    assert problems_of({"lisen": {"port": 1}}) == ["lisen: unknown field"]


def test_invalid_yaml_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "listen:\n  port: 8000\n host: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    (problem,) = info.value.problems
    assert problem.startswith("line 3, column 2: invalid YAML")
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just text\n", "str"), ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert info.value.problems == [f"expected a mapping at the top level, got {kind}"]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.source == str(path)
    assert info.value.problems == ["cannot read file: No such file or directory"]


def test_env_overrides_nest_on_double_underscore_and_keep_strings() -> None:
    env = {
        "MODELYARD_LISTEN__PORT": "9001",
        "MODELYARD_STATE__BACKEND": "redis",
        "MODELYARD_ADMIN__TOKEN": "0123",
        "MODELYARD_UPSTREAM__TIMEOUT": "2.5",
        "MODELYARD_DEBUG": "1",  # no "__": not a field path
        "OTHER_LISTEN__PORT": "1",
        "PATH": "/usr/bin",
    }
    overrides = env_overrides(env)
    assert overrides["listen"] == {"port": "9001"}
    assert overrides["admin"] == {"token": "0123"}
    config = validate_config(overrides, "<env>")
    assert config.listen.port == 9001  # pydantic reads the number
    assert config.admin.token == "0123"  # a token stays as written (YAML would read 83)
    assert config.upstream.timeout == 2.5


def test_env_lists_and_mappings_are_parsed() -> None:
    overrides = env_overrides({"MODELYARD_LISTEN__HOST": "::1", "MODELYARD_X__Y": '["a", "b"]'})
    assert overrides == {"listen": {"host": "::1"}, "x": {"y": ["a", "b"]}}


def test_env_setting_a_field_and_its_subfield_is_one_clear_error() -> None:
    with pytest.raises(ConfigError) as info:
        env_overrides({"MODELYARD_LISTEN__PORT": "1", "MODELYARD_LISTEN__PORT__X": "2"})
    assert info.value.source == "environment"
    assert "MODELYARD_LISTEN__PORT" in info.value.problems[0]


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "listen:\n  host: 0.0.0.0\n  port: 8001\n")
    env = {"MODELYARD_LISTEN__PORT": "9001"}

    from_file = load_config(path, env={})
    assert (from_file.listen.host, from_file.listen.port) == ("0.0.0.0", 8001)

    from_env = load_config(path, env=env)
    assert (from_env.listen.host, from_env.listen.port) == ("0.0.0.0", 9001)

    from_cli = load_config(path, env=env, overrides={"listen": {"port": 9002}})
    assert (from_cli.listen.host, from_cli.listen.port) == ("0.0.0.0", 9002)
    assert merged_data(path, env=env, overrides={"listen": {"port": 9002}}) == {
        "listen": {"host": "0.0.0.0", "port": 9002}
    }


def test_process_environment_is_read_when_env_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELYARD_LISTEN__PORT", "9003")
    assert load_config(None).listen.port == 9003


def test_a_bad_variable_is_named_not_its_field_path() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"MODELYARD_LISTEN__PORT": "not-a-port"})
    assert info.value.source == "environment"
    assert info.value.problems == ["MODELYARD_LISTEN__PORT: expected an integer (got 'not-a-port')"]


def test_each_problem_names_the_layer_that_set_the_value(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: {host: 0.0.0.0, port: abc}\nmodels: []\n")
    # A variable that sets one key of a mapping leaves the file's other keys the file's.
    env = {"MODELYARD_LISTEN__LEAN": "maybe", "MODELYARD_ADMIN__TOKEN": "t"}
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    assert (info.value.source, info.value.problems) == (
        "environment",
        ["MODELYARD_LISTEN__LEAN: expected true or false (got 'maybe')"],
    )  # the variables' problems first: fixing them shows the file's
    with pytest.raises(ConfigError) as info:
        load_config(path, env={"MODELYARD_ADMIN__TOKEN": "t"})
    assert (info.value.source, info.value.problems) == (
        str(path),
        ["listen.port: expected an integer (got 'abc')"],
    )
    # A flag wins over the variable that set the same field, and is named as the flag.
    with pytest.raises(ConfigError) as info:
        load_config(
            path,
            env={"MODELYARD_LISTEN__PORT": "9000"},
            overrides={"listen": {"port": 70000}},
            flags={"listen.port": "--port"},
        )
    assert (info.value.source, info.value.problems) == (
        "command line",
        ["--port: Input should be less than or equal to 65535 (got 70000)"],
    )


def test_an_override_a_variable_gave_is_named_as_that_variable_with_its_value_once() -> None:
    # serve's --scheduler takes MODELYARD_SCHEDULER when not given (typer's envvar): an override, but
    # the user wrote a variable, and it wins over MODELYARD_PLACEMENT__SCHEDULER.
    problem = "expected host:port or http://host:port for the scheduler (got 'bad::x')"
    overrides = {"placement": {"scheduler": "bad::x"}}
    flags = {"placement.scheduler": "--scheduler"}
    env = {"MODELYARD_PLACEMENT__SCHEDULER": "also::bad"}
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            env=env,
            overrides=overrides,
            flags=flags,
            variables={"placement.scheduler": "MODELYARD_SCHEDULER"},
        )
    assert (info.value.source, info.value.problems) == ("environment", [f"MODELYARD_SCHEDULER: {problem}"])
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env, overrides=overrides, flags=flags)
    assert (info.value.source, info.value.problems) == ("command line", [f"--scheduler: {problem}"])
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    assert (info.value.source, info.value.problems) == (
        "environment",
        [f"MODELYARD_PLACEMENT__SCHEDULER: {problem.replace('bad::x', 'also::bad')}"],
    )


def test_a_variable_holding_a_mapping_or_an_unknown_field_is_named() -> None:
    env = {"MODELYARD_PLACEMENT__MODELS": '{"strategy": "fastest", "health_check": {"interval": "x"}}'}
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    assert info.value.problems == [
        "MODELYARD_PLACEMENT__MODELS.strategy: expected one of 'round_robin', 'random', 'least_pending', "
        "'kv_aware', 'cost_aware', 'resource_aware' or 'prefix_aware' (got 'fastest')",
        "MODELYARD_PLACEMENT__MODELS.health_check.interval: expected a duration such as 5, 0.5, "
        "'250ms', '5s' or '1m' (got 'x')",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"MODELYARD_LISTEN__PORTT": "1", "MODELYARD_NOPE__X": "1"})
    assert info.value.problems == [
        "MODELYARD_LISTEN__PORTT: unknown field",
        "MODELYARD_NOPE__X (nope): unknown field",
    ]


def test_config_is_frozen() -> None:
    config = load_config(None, env={})
    with pytest.raises(ValueError):
        config.listen.port = 1  # type: ignore[misc]


@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/gateway.yaml not present in this checkout")
def test_example_config_loads() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.models, "the example config should route at least one model"
    for m in config.models:
        assert m.endpoints


@pytest.mark.parametrize(
    "endpoint",
    [{"url": "http://[::1:9000"}, {"url": "http://127.0.0.1:9000", "name": [1]}],
)
def test_malformed_endpoints_are_problems_not_crashes(endpoint: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"models": [{"name": "m", "endpoints": [endpoint]}]}, "<test>")
    assert all(p.startswith("models[0].endpoints[0].") for p in info.value.problems)


def test_telemetry_and_logging_are_off_by_default() -> None:
    config = GatewayConfig()
    assert config.telemetry.otlp_endpoint is None
    assert config.logging.access_log is False


def test_bad_telemetry_and_logging_name_their_field_path() -> None:
    problems = problems_of(
        {
            "telemetry": {"otlp_endpoint": "collector:4318", "sample_ratio": 2, "timeout": 0},
            "logging": {"format": "xml", "access_log": "sometimes"},
        }
    )
    assert any(p.startswith("telemetry.otlp_endpoint: expected an http:// or https:// URL") for p in problems)
    assert any(p.startswith("telemetry.sample_ratio:") for p in problems)
    assert any(p.startswith("telemetry.timeout:") for p in problems)
    assert "logging.format: expected one of 'json' or 'text' (got 'xml')" in problems
    assert any(p.startswith("logging.access_log:") for p in problems)


def test_the_otlp_endpoint_comes_from_env_with_modelyards_own_winning(tmp_path: Path) -> None:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}
    assert load_config(None, env=otel).telemetry.otlp_endpoint == "http://otel:4318"
    ours = {**otel, "MODELYARD_TELEMETRY__OTLP_ENDPOINT": "http://ours:4318"}
    assert load_config(None, env=ours).telemetry.otlp_endpoint == "http://ours:4318"
    path = write(tmp_path, "telemetry:\n  otlp_endpoint: http://file:4318\n  service_name: edge\n")
    loaded = load_config(path, env=otel)
    assert (loaded.telemetry.otlp_endpoint, loaded.telemetry.service_name) == ("http://file:4318", "edge")
    assert load_config(path, env=ours).telemetry.otlp_endpoint == "http://ours:4318"
    assert load_config(None, env={"MODELYARD_LOGGING__ACCESS_LOG": "true"}).logging.access_log is True


def test_a_bad_otel_endpoint_is_reported_naming_the_variable() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"})
    assert str(raised.value).startswith("OTEL_EXPORTER_OTLP_ENDPOINT: expected an http:// or https:// URL")
    assert "'collector:4318'" in str(raised.value)
    ours = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318",
        "MODELYARD_TELEMETRY__OTLP_ENDPOINT": "http://a:1",
    }
    assert load_config(None, env=ours).telemetry.otlp_endpoint == "http://a:1"  # not used: not checked


def test_otel_sdk_disabled_turns_tracing_off_however_it_was_turned_on(tmp_path: Path) -> None:
    path = write(tmp_path, "telemetry:\n  otlp_endpoint: http://file:4318\n")
    for env in (
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"},
        {"MODELYARD_TELEMETRY__OTLP_ENDPOINT": "http://ours:4318"},
        {},
    ):
        assert load_config(path, env={**env, "OTEL_SDK_DISABLED": "TRUE"}).telemetry.otlp_endpoint is None
        assert (
            load_config(path, env={**env, "OTEL_SDK_DISABLED": "false"}).telemetry.otlp_endpoint is not None
        )


def test_the_flag_roles_tracing_honours_otel_sdk_disabled_and_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry_config("http://collector:4318", 1.0).otlp_endpoint is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")
    with pytest.raises(typer.Exit):
        telemetry_config("collector:4318", 1.0)  # typer read it from the variable
    assert capsys.readouterr().err.startswith("error: OTEL_EXPORTER_OTLP_ENDPOINT: expected an http://")


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"endpoints": [{"url": "http://a:1", "name": "e\r\nX-Injected: 1"}]}, "models[0].endpoints[0].name"),
        ({"endpoints": [{"url": "http://a:1", "subset": "v1\n"}]}, "models[0].endpoints[0].subset"),
        (
            {"routes": [{"name": "r\x00", "destinations": [{"subset": "default"}]}]},
            "models[0].routes[0].name",
        ),
        (
            {"routes": [{"name": "r", "destinations": [{"subset": "d\x7f"}]}]},
            "models[0].routes[0].destinations[0].subset",
        ),
        (
            {"routes": [{"name": "r", "destinations": [{"subset": "default"}], "mirror": {"subset": "s\r"}}]},
            "models[0].routes[0].mirror.subset",
        ),
    ],
)
def test_names_sent_in_answer_headers_may_not_hold_control_characters(
    change: dict[str, Any], path: str
) -> None:
    model = {"name": "m", "endpoints": [{"url": "http://a:1"}], **change}
    with pytest.raises(ConfigError, match=rf"gw\.yaml: {re.escape(path)}: may not hold control characters"):
        validate_config({"models": [model]}, "gw.yaml")


def test_a_tab_or_non_ascii_in_a_name_is_kept() -> None:
    config = validate_config(
        {"models": [{"name": "m", "endpoints": [{"url": "http://a:1", "name": "é\tx"}]}]}, "x"
    )
    assert config.models[0].endpoints[0].name == "é\tx"
