"""OIP v2 over gRPC: what the gateway's gRPC listener adds, against REST through the gateway and REST
straight to the backend.

One sim-worker with every cost at zero (it never sleeps) serves OIP over REST and gRPC
(`--grpc-port`); a gateway (`modelyard serve`, round_robin, `listen.grpc_port` set) routes model
`echo` to its REST port only and model `relay` to the same worker with its `grpc_url` too. Five
ways to send the same OIP v2 inference (one FP32 input of `--elements` values):
  rest-direct    POST /v2/models/echo/infer to the sim-worker (JSON)
  rest-gateway   the same through the gateway
  grpc-direct    ModelInfer on the sim-worker's gRPC port (raw_input_contents, as tritonclient sends)
  grpc-gateway   the same on the gateway's gRPC port, model echo: turned into the REST call above
  grpc-relay     the same, model relay: relayed to the sim-worker's gRPC port as it came
The added p50 is against the direct way of the same protocol.
Each (way, concurrency) pair runs `--seconds` or `--requests`, whichever ends first, in rounds that
interleave the ways; the table shows medians over `--repeat` rounds. The client runs in this process
(asyncio, aiohttp and grpc.aio), beside the gateway and the sim-worker on the same cores.

    .venv/bin/python benchmarks/oip_grpc.py
    .venv/bin/python benchmarks/oip_grpc.py --concurrency 1,16 --seconds 5 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import grpc
import orjson

from common import Child, free_ports, median, nproc, wait_for_port
from modelyard.bench.report import percentile
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2 as pb
from modelyard.rpc.oip_v2 import grpc_predict_v2_pb2_grpc as pb_grpc

MODYARD = str(Path(sys.executable).parent / "modelyard")
WAYS = ("rest-direct", "rest-gateway", "grpc-direct", "grpc-gateway", "grpc-relay")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16", help="requests in flight, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="at most this long per run")
    parser.add_argument("--requests", type=int, default=50_000, help="at most this many requests per run")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians shown")
    parser.add_argument("--elements", type=int, default=16, help="FP32 values in the input tensor")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


Send = Callable[[], Awaitable[None]]


def rest_sender(session: aiohttp.ClientSession, url: str, body: bytes) -> Send:
    async def send() -> None:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"{url}: {response.status}")

    return send


def grpc_sender(stub: pb_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest) -> Send:
    async def send() -> None:
        await stub.ModelInfer(request)

    return send


async def load(send: Send, concurrency: int, seconds: float, requests: int) -> tuple[float, list[float]]:
    """`concurrency` loops sending one request after another until the time or the count is spent;
    (requests per second, each request's latency in seconds)."""
    latencies: list[float] = []
    left = requests
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            started = time.perf_counter()
            await send()
            latencies.append(time.perf_counter() - started)

    began = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - began), latencies


async def measure(
    args: argparse.Namespace, sim_port: int, sim_grpc_port: int, http_port: int, grpc_port: int
) -> dict:
    values = [float(i) for i in range(args.elements)]
    body = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [1, args.elements], "datatype": "FP32", "data": values}]}
    )

    def request(model: str) -> pb.ModelInferRequest:
        return pb.ModelInferRequest(
            model_name=model,
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, args.elements])
            ],
            raw_input_contents=[struct.pack(f"<{args.elements}f", *values)],
        )

    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{sim_grpc_port}") as direct,
    ):
        gateway = pb_grpc.GRPCInferenceServiceStub(channel)
        senders = {
            "rest-direct": rest_sender(session, f"http://127.0.0.1:{sim_port}/v2/models/echo/infer", body),
            "rest-gateway": rest_sender(session, f"http://127.0.0.1:{http_port}/v2/models/echo/infer", body),
            "grpc-direct": grpc_sender(pb_grpc.GRPCInferenceServiceStub(direct), request("echo")),
            "grpc-gateway": grpc_sender(gateway, request("echo")),
            "grpc-relay": grpc_sender(gateway, request("relay")),
        }
        for send in senders.values():  # warm-up: connections, the gateway's pools
            await load(send, max(args.concurrency), 1.0, 2000)
        for round_ in range(args.repeat):
            for concurrency in args.concurrency:
                for way, send in senders.items():
                    rps, latencies = await load(send, concurrency, args.seconds, args.requests)
                    p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
                    results.setdefault((way, concurrency), []).append((rps, p50, p99))
                    print(
                        f"[round {round_ + 1}] {way:<13} c={concurrency:<3} {rps:>8.0f} req/s"
                        f"  p50 {p50:.3f} ms  p99 {p99:.3f} ms",
                        flush=True,
                    )
    return results


def main() -> int:
    args = parse_args()
    command = shlex.join(sys.orig_argv)
    with tempfile.TemporaryDirectory(prefix="modelyard-oip-grpc-") as tmp_dir:
        tmp = Path(tmp_dir)
        sim_port, sim_grpc_port, http_port, grpc_port = free_ports(4)
        children = []
        try:
            sim = Child(
                "sim-worker",
                [
                    MODYARD,
                    "sim-worker",
                    "--port",
                    str(sim_port),
                    "--grpc-port",
                    str(sim_grpc_port),
                    "--model",
                    "echo",
                    "--prefill-ms-per-token",
                    "0",
                    "--decode-ms-per-token",
                    "0",
                ],
                tmp / "sim.log",
            )
            children.append(sim)
            wait_for_port(sim_port, sim)
            wait_for_port(sim_grpc_port, sim)
            config = tmp / "gateway.yaml"
            config.write_text(
                f"listen: {{host: 127.0.0.1, port: {http_port}, grpc_port: {grpc_port}, drain_seconds: 0}}\n"
                "models:\n"
                "  - name: echo\n"
                "    strategy: round_robin\n"
                "    health_check: {interval: 60s, path: /v2/health/ready}\n"
                f"    endpoints: [{{url: 'http://127.0.0.1:{sim_port}'}}]\n"
                "  - name: relay\n"
                "    strategy: round_robin\n"
                "    health_check: {interval: 60s, path: /v2/health/ready}\n"
                f"    endpoints: [{{url: 'http://127.0.0.1:{sim_port}', grpc_url: 'grpc://127.0.0.1:{sim_grpc_port}'}}]\n"
            )
            gateway = Child(
                "gateway",
                [MODYARD, "serve", "-c", str(config), "--workers", "1", "--log-level", "warning"],
                tmp / "gw.log",
            )
            children.append(gateway)
            wait_for_port(http_port, gateway)
            wait_for_port(grpc_port, gateway)
            results = asyncio.run(measure(args, sim_port, sim_grpc_port, http_port, grpc_port))
        finally:
            for child in reversed(children):
                child.stop()

    print()
    print("| way | concurrency | req/s | p50 ms | p99 ms | added p50 vs direct ms |")
    print("|--|--:|--:|--:|--:|--:|")
    for concurrency in args.concurrency:
        for way in WAYS:
            direct_way = "grpc-direct" if way.startswith("grpc") else "rest-direct"
            direct = median([p50 for _, p50, _ in results[(direct_way, concurrency)]])
            runs = results[(way, concurrency)]
            rps = median([r for r, _, _ in runs])
            p50 = median([p for _, p, _ in runs])
            p99 = median([p for _, _, p in runs])
            print(f"| {way} | {concurrency} | {rps:,.0f} | {p50:.3f} | {p99:.3f} | {p50 - direct:+.3f} |")
    print()
    print(f"command: {command}")
    date = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"date: {date}, nproc {nproc()}, {args.elements} FP32 values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
