"""The tracer's span shapes with the SDK's in-process exporter: parenting from a client's
traceparent, what goes into outgoing headers, sampling, and graph step spans."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from modelyard.config import TelemetryConfig
from modelyard.graph import GraphDocument, Outcome, RunContext, parse_graph
from modelyard.telemetry import GraphSpans, Tracer, build_tracer, trace_context

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT}-01"
UNSAMPLED = f"00-{TRACE_ID}-{PARENT}-00"


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def tracer_for(exporter: InMemorySpanExporter, **config: object) -> Tracer:
    tracer = build_tracer(TelemetryConfig.model_validate(config), "modelyard-test", exporter=exporter)
    assert tracer is not None
    return tracer


def ids(span: ReadableSpan) -> tuple[str, str]:
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def parent_id(span: ReadableSpan) -> str:
    return f"{span.parent.span_id:016x}" if span.parent is not None else ""


def test_off_without_an_endpoint_and_the_sdks_tracing_is_not_even_imported() -> None:
    # (redis-py imports opentelemetry's API and metrics SDK itself, for its own observability, when
    # they are installed: what we import, the trace SDK and the exporter, stays out.)
    assert build_tracer(TelemetryConfig(), "modelyard-gateway") is None
    code = (
        "import sys\n"
        "from modelyard.config import TelemetryConfig\n"
        "from modelyard.gateway import create_app\n"
        "from modelyard.telemetry import build_tracer\n"
        "assert build_tracer(TelemetryConfig(), 'x') is None\n"
        "ours = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "print(sorted(m for m in sys.modules if m.startswith(ours)))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_a_span_is_a_child_of_the_clients_traceparent_and_names_its_service(exported) -> None:
    tracer = tracer_for(exported)
    span = tracer.start("POST m", [("Traceparent", SAMPLED), ("tracestate", "vendor=1")], "server", {"a": 1})
    assert span.trace_id == TRACE_ID
    span.end()
    (done,) = exported.get_finished_spans()
    assert ids(done)[0] == TRACE_ID and parent_id(done) == PARENT
    assert done.kind == SpanKind.SERVER
    assert done.attributes == {"a": 1}
    assert done.resource.attributes["service.name"] == "modelyard-test"
    assert str(done.context.trace_state.to_header()) == "vendor=1"


def test_a_malformed_traceparent_starts_a_new_trace(exported) -> None:
    tracer = tracer_for(exported)
    tracer.start("x", [("traceparent", "00-nonsense-01")]).end()
    (done,) = exported.get_finished_spans()
    assert done.parent is None
    assert ids(done)[0] != TRACE_ID


def test_inject_replaces_the_callers_context_with_the_childs(exported) -> None:
    tracer = tracer_for(exported)
    request = tracer.start("POST m", [("traceparent", SAMPLED)])
    attempt = request.child("POST w0", "client", {"modelyard.retry": 0})
    sent = attempt.inject([("TraceParent", SAMPLED), ("X-Request-Id", "r1"), ("tracestate", "old=1")])
    attempt.end()
    request.end()
    done_attempt, done_request = exported.get_finished_spans()
    assert sent == [("X-Request-Id", "r1"), ("traceparent", f"00-{TRACE_ID}-{ids(done_attempt)[1]}-01")]
    assert trace_context(sent) == {"traceparent": attempt.traceparent()}
    assert parent_id(done_attempt) == ids(done_request)[1]
    assert done_attempt.kind == SpanKind.CLIENT


def test_fail_sets_error_status_and_type(exported) -> None:
    tracer = tracer_for(exported)
    span = tracer.start("x")
    span.fail("answered 502", "502")
    span.end()
    (done,) = exported.get_finished_spans()
    assert done.status.status_code == StatusCode.ERROR
    assert done.attributes["error.type"] == "502"


def test_sampling_is_parent_based(exported) -> None:
    tracer = tracer_for(exported, sample_ratio=0.0)
    tracer.start("new trace").end()  # ratio 0: not recorded, but still propagates a context
    unsampled = tracer.start("client said no", [("traceparent", UNSAMPLED)])
    assert unsampled.inject([]) == [("traceparent", f"00-{TRACE_ID}-{unsampled.traceparent()[36:52]}-00")]
    unsampled.end()
    tracer.start("client said yes", [("traceparent", SAMPLED)]).end()
    assert [s.name for s in exported.get_finished_spans()] == ["client said yes"]


def test_the_otlp_endpoint_may_be_a_base_or_the_full_traces_url() -> None:
    assert (
        TelemetryConfig(otlp_endpoint="http://collector:4318/").traces_url
        == "http://collector:4318/v1/traces"
    )
    assert TelemetryConfig(otlp_endpoint="https://x/otlp/v1/traces").traces_url == "https://x/otlp/v1/traces"
    assert TelemetryConfig().traces_url is None


async def test_a_graph_step_span_per_step_nested_under_the_step_that_runs_a_node(exported) -> None:
    tracer = tracer_for(exported)
    spec = {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [
                    {"name": "a", "serviceUrl": "http://svc/a"},
                    {"name": "b", "nodeName": "inner"},
                ],
            },
            "inner": {"routerType": "Ensemble", "steps": [{"name": "c", "serviceUrl": "http://svc/c"}]},
        }
    }
    graph, _ = parse_graph(GraphDocument("g", spec, "test"))
    sent: dict[str, list[tuple[str, str]]] = {}

    class Invoker:
        async def call(self, step, body, headers):  # type: ignore[no-untyped-def]
            sent[step.name] = list(headers)
            return Outcome(200, b"{}")

    root = tracer.start("graph g", [("traceparent", SAMPLED)])
    ctx = RunContext(Invoker(), [("x-keep", "1")], __import__("random").Random(0), spans=GraphSpans(root))
    assert (await graph.run(b"{}", ctx)).status == 200
    root.end()

    spans = {s.name: s for s in exported.get_finished_spans()}
    step_a, step_b, step_c = spans["step root/a"], spans["step root/b"], spans["step inner/c"]
    assert parent_id(step_a) == parent_id(step_b) == ids(spans["graph g"])[1]
    assert parent_id(step_c) == ids(step_b)[1]
    assert step_c.attributes == {
        "modelyard.graph.node": "inner",
        "modelyard.graph.step": "c",
        "modelyard.graph.router_type": "Ensemble",
        "modelyard.graph.target": "http://svc/c",
        "http.response.status_code": 200,
    }
    # Each service call carried its step's context, and the propagated headers.
    assert sent["a"] == [("x-keep", "1"), ("traceparent", f"00-{TRACE_ID}-{ids(step_a)[1]}-01")]
    assert sent["c"][-1] == ("traceparent", f"00-{TRACE_ID}-{ids(step_c)[1]}-01")


def test_a_valid_tracestate_is_kept_and_an_invalid_one_dropped_without_a_warning(exported, caplog) -> None:
    tracer = tracer_for(exported)
    valid = "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7,,tenant@vendor=x"
    span = tracer.start("kept", [("traceparent", SAMPLED), ("tracestate", valid)])
    sent = dict(span.inject([]))
    assert sent["tracestate"] == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7,tenant@vendor=x"
    span.end()
    for invalid in ("k=" + "x" * 600, ",,,=,==", ",".join(f"k{i}=v" for i in range(40)), "a=1,a=2", "K=v"):
        span = tracer.start("dropped", [("traceparent", SAMPLED), ("tracestate", invalid)])
        sent = dict(span.inject([]))
        assert sent["traceparent"].split("-")[1] == TRACE_ID and "tracestate" not in sent
        span.end()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_attribute_strings_that_are_not_utf8_are_escaped(exported) -> None:
    tracer = tracer_for(exported)
    span = tracer.start("r\udcff", attributes={"modelyard.request_id": "a\udcffb"})
    span.set("url.path", "/\udc80")
    span.child("c", "client", {"k": "\udcfe"}).end()
    span.end()
    child, parent = exported.get_finished_spans()
    assert parent.name == "r\\udcff" and child.attributes == {"k": "\\udcfe"}
    assert parent.attributes == {"modelyard.request_id": "a\\udcffb", "url.path": "/\\udc80"}
