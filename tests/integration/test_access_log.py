"""The access log (logging.access_log): one JSON line per request on `modelyard.access`, built from
the same record as the routing log; upstream error lines carry the request id."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import sys

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import yaml
from grpc import aio
from tritonclient.utils import InferenceServerException

from modelyard.gateway import GATEWAY, RunningGateway
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from otlp_receiver import OtlpReceiver
from raw_http import Client, Reply, read_reply, send
from raw_http import request as raw_request
from support import ONE_SLOT, cancel_while_queued, model_config, wait_until

CHAT = "/v1/chat/completions"
ACCESS = "modelyard.access"


def chat(**extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **extra}


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ACCESS]


async def test_one_json_line_per_request_matching_the_routing_log_and_the_trace(
    sim_workers, gateways, http, caplog
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    receiver = await OtlpReceiver().start()
    try:
        (worker,) = await sim_workers(1)
        gateway = await gateways(
            [model_config("m", [worker])],
            logging={"access_log": True},
            telemetry={"otlp_endpoint": receiver.url},
        )
        async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "acc-1"}) as response:
            assert response.status == 200
            body = await response.read()
            backend = response.headers["X-Modelyard-Backend"]
        tracer = gateway.app[GATEWAY].tracer
        assert tracer is not None and await asyncio.to_thread(tracer.force_flush)
    finally:
        await receiver.stop()

    (line,) = access_lines(caplog)
    entry = orjson.loads(line)
    (record,) = [r for r in gateway.app[GATEWAY].metrics.routing_log.recent() if r.request_id == "acc-1"]
    (span,) = [s for s in receiver.spans if s.kind == "server"]
    assert entry == {
        "ts": entry["ts"],
        "request_id": "acc-1",
        "method": "POST",
        "path": CHAT,
        "model": record.model,
        "route": record.route,
        "subset": record.subset,
        "backend": backend,
        "strategy": record.strategy,
        "attempts": 1,
        "status": 200,
        "duration_ms": record.latency_ms,
        "bytes": len(body),
        "trace_id": span.trace_id,
        "worker": None,
    }
    assert record.backend == backend and record.status == 200
    assert entry["ts"].endswith("+00:00")


async def test_a_stream_is_logged_once_when_it_ends_with_its_bytes(sim_workers, gateways, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], logging={"access_log": True, "format": "text"})
    async with http.post(gateway.url + CHAT, json=chat(stream=True)) as response:
        body = await response.read()
        request_id = response.headers["X-Request-Id"]
    (line,) = access_lines(caplog)
    fields = dict(part.split("=", 1) for part in line.split(" "))
    assert fields["request_id"] == request_id
    assert fields["bytes"] == str(len(body))
    assert (fields["status"], fields["attempts"], fields["worker"]) == ("200", "1", "-")
    assert "trace_id" not in fields  # tracing is off


async def test_an_upstream_failure_is_logged_with_its_request_id(sim_workers, gateways, http, caplog):
    caplog.set_level(logging.INFO)
    workers = await sim_workers(1, decode_ms_per_token=200.0)  # healthy, but slower than a try may be
    route = {
        "name": "impatient",
        "destinations": [{"subset": "default"}],
        "per_try_timeout": "50ms",
        "retries": {"attempts": 0},
    }
    gateway = await gateways([model_config("m", workers, routes=[route])], logging={"access_log": True})
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "err-1"}) as response:
        assert response.status == 504
    (error,) = [r for r in caplog.records if r.name == "modelyard.gateway" and r.levelno >= logging.WARNING]
    assert error.request_id == "err-1"  # type: ignore[attr-defined]
    assert "request err-1 failed after 1 try" in error.getMessage()
    assert "per_try_timeout" in error.getMessage()
    (line,) = access_lines(caplog)
    entry = orjson.loads(line)
    assert (entry["request_id"], entry["status"], entry["backend"], entry["attempts"]) == (
        "err-1",
        504,
        "w0",
        1,
    )


async def test_off_by_default_nothing_is_logged(sim_workers, gateways, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])])
    async with http.post(gateway.url + CHAT, json=chat()) as response:
        assert response.status == 200
    assert access_lines(caplog) == []


async def send_raw(gateway: RunningGateway, request_id: bytes) -> Reply:
    """A chat request whose X-Request-Id is these bytes, as a client may send them (not UTF-8)."""
    head = raw_request("POST", CHAT, orjson.dumps(chat()), X_Request_Id="RID", Connection="close")
    return await send(gateway.url, head.replace(b"X-Request-Id: RID", b"X-Request-Id: " + request_id))


@pytest.mark.parametrize("format", ["json", "text"])
async def test_a_request_id_that_is_not_utf8_is_answered_and_logged(sim_workers, gateways, caplog, format):
    caplog.set_level(logging.INFO)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], logging={"access_log": True, "format": format})
    for request_id in (b"ok-1", b"a\xffb", b"ok-2"):
        assert (await send_raw(gateway, request_id)).status == 200
    lines = access_lines(caplog)
    assert len(lines) == 3
    assert "a\\\\udcffb" in lines[1] if format == "json" else '"a\\\\udcffb"' in lines[1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_failure_is_answered_with_its_status_whatever_the_request_id(sim_workers, gateways, caplog):
    caplog.set_level(logging.INFO)
    workers = await sim_workers(1, decode_ms_per_token=200.0)
    route = {"name": "impatient", "destinations": [{"subset": "default"}], "per_try_timeout": "50ms"}
    route["retries"] = {"attempts": 0}
    gateway = await gateways([model_config("m", workers, routes=[route])], logging={"access_log": True})
    assert (await send_raw(gateway, b"bad-\xfe")).status == 504
    (line,) = access_lines(caplog)
    assert orjson.loads(line)["status"] == 504


async def test_the_duration_is_the_whole_requests_not_its_last_trys(sim_workers, gateways, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    workers = await sim_workers(1, decode_ms_per_token=300.0)  # every try runs out of its 100 ms
    retries = {"attempts": 2, "retry_on": ["gateway-error"], "base_interval": 0, "max_interval": 0}
    route = {
        "name": "r",
        "destinations": [{"subset": "default"}],
        "per_try_timeout": "100ms",
        "retries": retries,
    }
    gateway = await gateways([model_config("m", workers, routes=[route])], logging={"access_log": True})
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "slow"}) as response:
        assert response.status == 504
    (line,) = access_lines(caplog)
    entry = orjson.loads(line)
    assert entry["attempts"] == 3 and entry["duration_ms"] >= 300
    tries = [r for r in gateway.app[GATEWAY].metrics.routing_log.recent() if r.request_id == "slow"]
    # the dashboard's records: one per try, each with its own time, shorter than the whole
    assert len(tries) == 3 and all(100 <= r.latency_ms < entry["duration_ms"] for r in tries)


async def test_a_request_cancelled_while_queued_is_logged_once_as_client_closed(
    sim_workers, gateways, http, caplog
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways(
        [model_config("m", [worker], circuit_breakers=ONE_SLOT)], logging={"access_log": True}
    )
    cluster = gateway.app[GATEWAY].clusters["m"]
    await cancel_while_queued(http, gateway.url, cluster, "q")

    async def logged() -> bool:
        return any(orjson.loads(line)["request_id"] == "q" for line in access_lines(caplog))

    await wait_until(logged)
    assert len(cluster.capacity) == 0
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    (entry,) = [e for e in entries if e["request_id"] == "q"]
    assert (entry["status"], entry["attempts"], entry["backend"]) == (499, 0, "")
    (record,) = [r for r in gateway.app[GATEWAY].metrics.routing_log.recent() if r.request_id == "q"]
    assert record.status == 499


async def test_a_request_cancelled_between_tries_is_logged_once_as_client_closed(
    sim_workers, gateways, http, caplog
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    workers = await sim_workers(1, fail_rate=1.0)
    retries = {"attempts": 1, "retry_on": ["5xx"], "base_interval": "30s", "max_interval": "30s"}
    route = {"name": "r", "destinations": [{"subset": "default"}], "retries": retries}
    gateway = await gateways([model_config("m", workers, routes=[route])], logging={"access_log": True})
    log = gateway.app[GATEWAY].metrics.routing_log
    request = asyncio.create_task(http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "b"}))

    async def tried() -> bool:
        return any(r.request_id == "b" for r in log.recent())

    await wait_until(tried)  # its first try answered 500: it waits out its backoff
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request

    async def logged() -> bool:
        return bool(access_lines(caplog))

    await wait_until(logged)
    (line,) = access_lines(caplog)
    entry = orjson.loads(line)
    assert (entry["request_id"], entry["status"], entry["attempts"]) == ("b", 499, 1)
    assert [r.status for r in log.recent() if r.request_id == "b"] == [500, 499]


async def test_a_graph_request_has_a_line_and_its_steps_carry_its_request_id(
    sim_workers, gateways, http, caplog
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    graph = {
        "nodes": {
            "root": {
                "routerType": "Sequence",
                "steps": [{"name": "first", "serviceName": "m"}, {"name": "second", "serviceName": "m"}],
            }
        }
    }
    gateway = await gateways(
        [model_config("m", [worker], protocol="v2")], graphs={"g": graph}, logging={"access_log": True}
    )
    inputs = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    async with http.post(
        gateway.url + "/v1/graphs/g", json=inputs, headers={"X-Request-Id": "g-1"}
    ) as response:
        assert response.status == 200
        assert response.headers["X-Request-Id"] == "g-1"
        body = await response.read()
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    assert [(e["request_id"], e["model"], e["path"]) for e in entries] == [
        ("g-1", "m", "/v2/models/m/infer"),
        ("g-1", "m", "/v2/models/m/infer"),
        ("g-1", "g", "/v1/graphs/g"),
    ]
    graph_line = entries[-1]
    assert (graph_line["status"], graph_line["backend"], graph_line["bytes"]) == (200, "graph", len(body))
    assert graph_line["duration_ms"] >= max(e["duration_ms"] for e in entries[:2])

    caplog.clear()
    async with http.post(gateway.url + "/v1/graphs/g", json=inputs) as response:  # no id: one is made
        request_id = response.headers["X-Request-Id"]
    assert request_id and {orjson.loads(line)["request_id"] for line in access_lines(caplog)} == {request_id}


async def test_requests_refused_before_routing_have_one_line_each(sim_workers, gateways, http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("m", [worker])], logging={"access_log": True}, limits={"max_body_bytes": 1000}
    )
    refused = [
        (CHAT, orjson.dumps({"model": "nope", "messages": []}), 404),
        (CHAT, b"{bad", 400),
        (CHAT, orjson.dumps(chat(pad="x" * 2000)), 413),
        ("/v2/models/nope/infer", b"{}", 404),
        ("/v1/graphs/nope", b"{}", 404),
    ]
    for path, body, status in refused:
        async with http.post(
            gateway.url + path, data=body, headers={"X-Request-Id": f"r{status}"}
        ) as response:
            assert response.status == status
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "routed"}) as response:
        assert response.status == 200
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    assert [(e["request_id"], e["path"], e["status"], e["model"], e["backend"]) for e in entries] == [
        *[(f"r{status}", path, status, "", "") for path, _, status in refused],
        ("routed", CHAT, 200, "m", "w0"),
    ]


async def test_failed_requests_warn_once_per_endpoint_a_while_each_in_the_access_log(
    sim_workers, gateways, http, caplog
):
    caplog.set_level(logging.INFO)
    workers = await sim_workers(1, decode_ms_per_token=200.0)
    route = {"name": "impatient", "destinations": [{"subset": "default"}], "per_try_timeout": "50ms"}
    route["retries"] = {"attempts": 0}
    gateway = await gateways([model_config("m", workers, routes=[route])], logging={"access_log": True})
    for n in range(3):
        async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": f"f{n}"}) as response:
            assert response.status == 504
    (warning,) = [r for r in caplog.records if r.name == "modelyard.gateway" and r.levelno >= logging.WARNING]
    assert "request f0 failed" in warning.getMessage()
    assert [orjson.loads(line)["request_id"] for line in access_lines(caplog)] == ["f0", "f1", "f2"]


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_writes_access_lines_to_stdout_and_its_other_logs_to_stderr(
    sim_workers, http, tmp_path, workers
):
    (worker,) = await sim_workers(1, decode_ms_per_token=200.0)
    route = {"name": "impatient", "destinations": [{"subset": "default"}], "per_try_timeout": "50ms"}
    route["retries"] = {"attempts": 0}
    config = {
        "listen": {"host": "127.0.0.1", "port": 0, "drain_seconds": 0},
        "models": [model_config("m", [worker], routes=[route])],
        "logging": {"access_log": True},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelyard", "serve", "-c", str(path), "--workers", str(workers),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    try:
        async with asyncio.timeout(60):
            while not (match := re.search(rb"listening on (http://\S+)", await process.stdout.readline())):
                assert process.returncode is None
        url = match.group(1).decode()
        async with http.post(url + CHAT, json=chat(), headers={"X-Request-Id": "timed-out"}) as response:
            assert response.status == 504
        async with http.post(
            url + CHAT, json=chat(model="nope"), headers={"X-Request-Id": "unknown"}
        ) as response:
            assert response.status == 404
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    lines = [orjson.loads(line) for line in stdout.decode().splitlines() if line.startswith("{")]
    # (with two workers, two writer threads: either line may come first)
    assert sorted((e["request_id"], e["status"]) for e in lines) == [("timed-out", 504), ("unknown", 404)]
    # every line names the process that wrote it, the refused one (no routing record) too
    assert all((e["worker"] is None) == (workers == 1) for e in lines), lines
    assert "request timed-out failed" in stderr.decode()  # the warning: on stderr, not stdout
    assert '"request_id"' not in stderr.decode() and "failed after" not in stdout.decode()


async def test_a_graph_request_the_client_gave_up_is_logged_as_client_closed(
    sim_workers, gateways, http, caplog
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1, decode_ms_per_token=30_000.0)  # its one step does not answer in time
    graph = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"name": "only", "serviceName": "m"}]}}}
    gateway = await gateways(
        [model_config("m", [worker], protocol="v2")], graphs={"g": graph}, logging={"access_log": True}
    )
    inputs = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    request = asyncio.create_task(
        http.post(gateway.url + "/v1/graphs/g", json=inputs, headers={"X-Request-Id": "gone"})
    )
    cluster = gateway.app[GATEWAY].clusters["m"]

    async def stepping() -> bool:  # its step's model call is in flight
        return cluster.budget.active == 1

    await wait_until(stepping)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request

    async def logged() -> bool:
        return len(access_lines(caplog)) == 2

    await wait_until(logged)
    entries = sorted((orjson.loads(line) for line in access_lines(caplog)), key=lambda e: e["path"])
    assert [(e["request_id"], e["path"], e["status"]) for e in entries] == [
        ("gone", "/v1/graphs/g", 499),
        ("gone", "/v2/models/m/infer", 499),
    ]


def _head(path: str, framing: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{framing}\r\n".encode()


@pytest.mark.parametrize("listener", ["lean", "aiohttp"])  # a chunked body is aiohttp's to read
async def test_a_request_refused_without_an_id_gets_one_in_its_answer_and_its_line(
    sim_workers, gateways, caplog, listener
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], logging={"access_log": True})
    ids = []
    refused = (
        (orjson.dumps({"model": "nope", "messages": []}), 404, ""),
        (b"{bad", 400, ""),
        (b"{", 400, "mine"),
    )
    for body, status, sent_id in refused:
        framing = f"X-Request-Id: {sent_id}\r\n" if sent_id else ""
        if listener == "lean":
            data = _head(CHAT, framing + f"Content-Length: {len(body)}\r\n") + body
        else:
            chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            data = _head(CHAT, framing + "Transfer-Encoding: chunked\r\n") + chunk
        reply = await send(gateway.url, data)
        assert reply.status == status
        ids.append(reply.headers["x-request-id"])
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    assert [(e["request_id"], e["status"]) for e in entries] == [(ids[0], 404), (ids[1], 400), ("mine", 400)]
    assert ids[2] == "mine" and ids[0] and ids[1] and ids[0] != ids[1]


GRAPH = {"nodes": {"root": {"routerType": "Sequence", "steps": [{"name": "only", "serviceName": "m"}]}}}
PARTIAL_BODIES = {  # the head and the start of a body whose rest never comes
    "lean": _head(CHAT, "Content-Length: 64\r\n") + b'{"model": ',
    "aiohttp": _head(CHAT, "Transfer-Encoding: chunked\r\n") + b'40\r\n{"model": ',
    "graph": _head("/v1/graphs/g", "Content-Length: 64\r\n") + b'{"inputs": ',
}


@pytest.mark.parametrize("listener", list(PARTIAL_BODIES))  # (graphs are aiohttp's)
async def test_a_client_gone_while_its_body_is_read_has_a_499_line(
    sim_workers, gateways, http, caplog, listener
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    gateway = await gateways([model_config("m", [worker])], graphs={"g": GRAPH}, logging={"access_log": True})
    client = await Client.connect(gateway.url)
    pipelined = (
        raw_request("POST", CHAT, orjson.dumps(chat()), X_Request_Id="first") if listener == "lean" else b""
    )
    await client.send(pipelined + PARTIAL_BODIES[listener])
    if pipelined:  # answered, then the client leaves during the next request's body
        assert (await read_reply(client.reader)).status == 200
    client.close()

    async def logged(count: int) -> bool:
        return len(access_lines(caplog)) >= count

    first = 1 if pipelined else 0  # the pipelined request's line comes first
    await wait_until(lambda: logged(first + 1))
    async with http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "after"}) as response:
        assert response.status == 200
    await wait_until(lambda: logged(first + 2))
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    path = "/v1/graphs/g" if listener == "graph" else CHAT
    gone = (path, 499, "", "")
    assert [(e["path"], e["status"], e["model"], e["backend"]) for e in entries] == [
        *([(CHAT, 200, "m", "w0")] if pipelined else []),
        gone,
        (CHAT, 200, "m", "w0"),
    ]
    assert entries[-2]["request_id"] not in ("", "first", "after")


@pytest.mark.parametrize("listener", ["lean", "aiohttp"])
async def test_a_body_still_coming_when_the_gateway_stops_has_no_line(
    sim_workers, gateways, caplog, listener
):
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    gateway = await gateways(
        [model_config("m", [worker])],
        logging={"access_log": True},
        listen={"host": "127.0.0.1", "port": 0, "shutdown_timeout": "100ms"},
    )
    client = await Client.connect(gateway.url)
    if listener == "lean":
        await client.send(PARTIAL_BODIES["lean"])

        async def read() -> bool:  # the lean connection holds the partial request
            return any(c.waiting_bytes for c in gateway.server.lean_connections)

        await wait_until(read)
    else:  # Expect: 100-continue goes to aiohttp, which says Continue as it starts the handler
        await client.send(_head(CHAT, "Content-Length: 64\r\nExpect: 100-continue\r\n"))
        assert (await read_reply(client.reader)).status == 100
        await client.send(b'{"model": ')
    await gateway.stop()  # it closes the connection: the client did not leave
    client.close()
    assert access_lines(caplog) == []


@pytest.fixture
async def grpc_gateway(sim_workers, gateways, caplog) -> RunningGateway:
    """A gateway with OIP over gRPC and the access log on (captured), over one sim worker serving m."""
    caplog.set_level(logging.INFO, logger=ACCESS)
    (worker,) = await sim_workers(1)
    return await gateways(
        [model_config("m", [worker], protocol="v2")],
        logging={"access_log": True},
        listen={"host": "127.0.0.1", "port": 0, "grpc_port": 0},
    )


async def test_grpc_calls_refused_before_routing_have_one_line_each(grpc_gateway, caplog):
    gateway = grpc_gateway
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{gateway.grpc_port}")
    tensor = grpcclient.InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.ones(1, np.float32))
    calls = [
        (client.infer, ("nope", [tensor]), {"model_version": "2", "headers": {"x-request-id": "g1"}}),
        (client.infer, ("m", [tensor]), {"model_version": ".", "headers": {"x-request-id": "g2"}}),
        (client.get_model_metadata, ("nope",), {"headers": {"x-request-id": "g3"}}),
        (client.is_model_ready, ("nope",), {}),
    ]
    try:
        for call, args, kwargs in calls:
            with pytest.raises(InferenceServerException):
                await asyncio.to_thread(call, *args, client_timeout=30.0, **kwargs)
        # a routed call: the attempt loop's line only
        await asyncio.to_thread(
            client.infer, "m", [tensor], headers={"x-request-id": "ok"}, client_timeout=30.0
        )
    finally:
        await asyncio.to_thread(client.close)
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    assert [(e["request_id"], e["method"], e["path"], e["status"], e["model"]) for e in entries[:3]] == [
        ("g1", "POST", "/v2/models/nope/versions/2/infer", 404, ""),
        ("g2", "POST", "/v2/models/m/versions/./infer", 400, ""),
        ("g3", "GET", "/v2/models/nope", 404, ""),
    ]
    ready, routed = entries[3:]
    assert (ready["method"], ready["path"], ready["status"]) == ("GET", "/v2/models/nope/ready", 404)
    assert ready["request_id"] not in ("", "ok")
    assert (routed["request_id"], routed["path"], routed["status"], routed["model"]) == (
        "ok",
        "/v2/models/m/infer",
        200,
        "m",
    )


async def test_a_grpc_calls_request_id_comes_back_as_its_line_has_it(grpc_gateway, caplog):
    """A gRPC answer carries the call's request id in its trailing metadata (as a REST answer does in
    X-Request-Id): the id the gateway made when the call sent none, routed or refused."""
    gateway = grpc_gateway
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(
        name="x", datatype="FP32", shape=[1], contents=pb.InferTensorContents(fp32_contents=[1.0])
    )
    unknown = pb.ModelInferRequest()
    unknown.CopyFrom(request)
    unknown.model_name = "nope"
    async with aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        client = pb_grpc.GRPCInferenceServiceStub(channel)
        routed = client.ModelInfer(request, timeout=30)
        await routed
        routed_id = dict(await routed.trailing_metadata())["x-request-id"]
        with pytest.raises(aio.AioRpcError) as refused:
            await client.ModelInfer(unknown, timeout=30)
        refused_id = dict(refused.value.trailing_metadata())["x-request-id"]
    entries = [orjson.loads(line) for line in access_lines(caplog)]
    assert [(e["request_id"], e["status"]) for e in entries] == [(routed_id, 200), (refused_id, 404)]
    assert routed_id != refused_id and len(routed_id) == 32
