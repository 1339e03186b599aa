"""A local OTLP/HTTP trace receiver for measuring a traced gateway: accepts `POST /v1/traces`
(protobuf), decodes each ExportTraceServiceRequest, counts the spans, and prints the count every
`--every` seconds and when stopped (Ctrl-C / SIGTERM). Nothing is stored.

    .venv/bin/python benchmarks/otlp_sink.py --port 4318 &
    MODELYARD_TELEMETRY__OTLP_ENDPOINT=http://127.0.0.1:4318 .venv/bin/modelyard serve -c CONFIG
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_ANSWER = ExportTraceServiceResponse().SerializeToString()


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between counts printed")
    args = parser.parse_args()
    spans = exports = 0

    async def traces(request: web.Request) -> web.Response:
        nonlocal spans, exports
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        exports += 1
        spans += sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
        return web.Response(body=_ANSWER, content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"OTLP sink on http://{args.host}:{args.port}/v1/traces", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), args.every)
        except TimeoutError:
            print(f"{spans} spans in {exports} exports", flush=True)
    print(f"{spans} spans in {exports} exports", flush=True)
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
