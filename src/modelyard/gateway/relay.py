"""Relaying an answer to the client: whole, or a server-sent event stream chunk by chunk as it
arrives (never buffered).

A stream that breaks off upstream (the server died, or sent nothing for `stream_idle_timeout`)
cannot change its status any more: it ends with a final SSE event carrying the error in the
protocol's envelope (OpenAI's `data: {"error": {...}}`, as vLLM sends it), then a clean end of the
chunked body, so clients raise an error instead of taking a truncated answer for a whole one.
"""

from __future__ import annotations

import asyncio
import logging
import time

from modelyard.errors import UpstreamError, UpstreamTimeout
from modelyard.gateway.capture import Capture
from modelyard.gateway.exchange import Answer, Attempt, Exchange
from modelyard.gateway.ledger import CLIENT_CLOSED, Ledger, ended_with
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.protocols import error_body, protocol_for_path
from modelyard.protocols.openai import StreamUsage, usage_tokens
from modelyard.serving.reply import Reply, ReplyHeaders, ReplyStream

log = logging.getLogger("modelyard.gateway")


class Relay:
    def __init__(self, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self._ledger = ledger
        self._metrics = metrics

    async def respond(
        self,
        reply: Reply,
        ex: Exchange,
        attempt: Attempt,
        headers: ReplyHeaders,
    ) -> int:
        """Relay the answer and close the exchange, counted with the status it really ended with,
        which it returns (a stream that broke off or went idle ends 502/504 after a 200 was sent;
        a client that left, CLIENT_CLOSED). The shadow comparison's capture gets the answer."""
        upstream = attempt.response
        capture = ex.capture
        code = CLIENT_CLOSED
        try:
            if upstream.content_type == "text/event-stream":
                code = await self._stream(reply, ex, upstream, headers, capture)
            else:
                data = upstream.take() if upstream.complete else await upstream.read()
                if ex.permit is not None:  # (auth.enabled: the tokens the answer reports)
                    ex.usage = usage_tokens(data)
                if capture is not None:
                    capture.add(data)
                reply.whole(upstream.status, headers, data)
                ex.sent_bytes = len(data)
                code = upstream.status
            if capture is not None:
                capture.finish(code, upstream.header("Content-Type"))
        except BaseException as exc:
            code = ended_with(exc)
            raise
        finally:
            self._ledger.close(ex, code)
        return code

    async def _stream(
        self,
        reply: Reply,
        ex: Exchange,
        upstream: Answer,
        headers: ReplyHeaders,
        capture: Capture | None,
    ) -> int:
        """Returns the status the exchange ended with: the upstream's, or 502/504 when the stream
        broke off or went idle after its status was sent."""
        if ex.permit is None:
            return await self._relay_events(reply, ex, upstream, headers, capture, None)
        # auth.enabled: the stream's tokens, from its usage event (whole events relayed); a stream
        # that ended without one (broke off, the client left): its prompt and an event per token
        usage = StreamUsage(ex.permit.strip_usage)
        try:
            return await self._relay_events(reply, ex, upstream, headers, capture, usage)
        finally:
            ex.usage = usage.tokens or (ex.ctx.request.prompt_tokens + usage.events if usage.events else 0)

    async def _relay_events(
        self,
        reply: Reply,
        ex: Exchange,
        upstream: Answer,
        headers: ReplyHeaders,
        capture: Capture | None,
        usage: StreamUsage | None,
    ) -> int:
        model = ex.cluster.name
        response = await reply.stream(upstream.status, headers)
        idle = ex.route.stream_idle_timeout
        chunks = upstream.iter_chunks()
        first = True
        tail = b"\n\n"  # the end of what was sent: is the client between two events?
        error: UpstreamError
        try:
            while True:
                try:
                    async with asyncio.timeout(idle or None):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    if usage is not None:
                        rest = usage.rest()
                        if rest:
                            await response.write(rest)
                            ex.sent_bytes += len(rest)
                    await response.end()
                    return upstream.status
                except TimeoutError:
                    self._metrics.stream_idle_timeouts.labels(model).inc()
                    log.warning(
                        "model %s: request %s: stream idle for %gs, ending it with an error event",
                        model, ex.request_id or "-", idle, extra={"request_id": ex.request_id},
                    )  # fmt: skip
                    error = UpstreamTimeout(f"model {model!r}: the stream sent nothing for {idle:g}s")
                    break
                if usage is not None:
                    chunk = usage.feed(chunk)
                    if not chunk:
                        continue
                if first:
                    self._metrics.ttft.labels(model).observe(time.perf_counter() - ex.started)
                    first = False
                try:
                    await response.write(chunk)
                except ConnectionError:  # the client went away: nothing more to relay
                    return CLIENT_CLOSED
                ex.sent_bytes += len(chunk)
                tail = (tail + chunk)[-2:]
                if capture is not None:
                    capture.add(chunk)
        except UpstreamError as exc:
            log.warning(
                "model %s: request %s: upstream stream broke off: %s",
                model, ex.request_id or "-", exc.message, extra={"request_id": ex.request_id},
            )  # fmt: skip
            error = exc
        await self._end_with_error(ex.path, response, model, error, tail)
        return error.status

    async def _end_with_error(
        self, path: str, response: ReplyStream, model: str, error: UpstreamError, tail: bytes
    ) -> None:
        self._metrics.stream_errors.labels(model, error.code or error.error_type).inc()
        # An event ends at a blank line. A server that died mid-event leaves one open: close it, so
        # the error arrives as an event of its own (the torn one was broken anyway).
        separator = b"" if tail.endswith(b"\n\n") else b"\n" if tail.endswith(b"\n") else b"\n\n"
        event = separator + b"data: " + error_body(protocol_for_path(path), error) + b"\n\n"
        try:
            await response.write(event)
            await response.end()
        except ConnectionError:
            pass  # the client left too
