"""HTTP handlers: parse once, ask the engine for slots and delays, render each protocol's shape.

Errors are raised as `Rejected` and rendered at the edge by the route's protocol wrapper, in the
envelopes modelyard's own errors use (`serving.errors`): OpenAI's `{"error": {"message", "type",
"param", "code"}}` or OIP/KServe's `{"error": "..."}`. Anything else (no route, a method the route
does not take, a body over the limit, a bug) is left to aiohttp, as it was.

With a tokenizer (`config.tokenizer`), a prompt's tokens are its token ids, as vLLM computes them
(balancing/tokens.py); without one, or for a prompt it cannot tokenize so, whitespace-separated
words. With `kv_events_port`, the cache's changes are published as vLLM's KV-cache events.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from modelyard.balancing.tokens import PromptTokens
from modelyard.errors import ModelyardError
from modelyard.protocols import oip
from modelyard.serving.errors import error_response
from modelyard.simworker.config import SimWorkerConfig
from modelyard.simworker.engine import Running, SimEngine
from modelyard.simworker.kv_publisher import STATS_OFF, KvPublisher
from modelyard.simworker.latency import Tokens
from modelyard.simworker.metrics import CONTENT_TYPE, create_registry, render
from modelyard.simworker.repository import REPOSITORY, install_repository, only_loaded_models
from modelyard.simworker.tensors import oip_outputs, scale_nested
from modelyard.simworker.text import (
    chat_prompt,
    completion_prompts,
    embed,
    embedding_inputs,
    generate_words,
    tokenize,
)
from modelyard.types import Protocol

ENGINE = web.AppKey("modelyard_sim_engine", SimEngine)
_REGISTRY = web.AppKey("modelyard_sim_registry", CollectorRegistry)
TRACEPARENTS_KEPT = 32
# The W3C traceparent of the last requests that sent one, newest last, in /sim/stats: what a
# tracing gateway propagated is observable from outside (tests, a demo without a collector).
_TRACEPARENTS = web.AppKey("modelyard_sim_traceparents", deque[str])
_TOKENS = web.AppKey("modelyard_sim_prompt_tokens", PromptTokens)  # only with config.tokenizer
PUBLISHER = web.AppKey("modelyard_sim_kv_publisher", KvPublisher)  # only with config.kv_events_port

_DEFAULT_MAX_TOKENS = 16
_MAX_TOKENS_LIMIT = 1 << 17
_MAX_EMBEDDING_DIM = 65536
SERVER_NAME = "modelyard-sim"
SERVER_VERSION = "0.1.0"
_CREATED = int(time.time())

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Rejected(ModelyardError):
    """A request the simulated server refuses: its status and message (and OpenAI's type, code)."""

    def __init__(
        self, status: int, message: str, *, error_type: str = "invalid_request_error", code: str = "invalid"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.code = code


def _simulated_failure() -> Rejected:
    return Rejected(500, "simulated failure (fail_rate)", error_type="server_error", code="simulated_failure")


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _answering_in(protocol: Protocol) -> Callable[[Handler], Handler]:
    """A route whose refusals answer in `protocol`'s envelope (chosen by the route, not its path:
    `/sim/...` answers as OIP does)."""

    def wrap(handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except Rejected as exc:
                return error_response(protocol, exc)

        return wrapped

    return wrap


_openai_api = _answering_in(Protocol.OPENAI)
_oip_api = _answering_in(Protocol.OIP)


async def _json_body(request: web.Request) -> dict[str, object]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Rejected(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise Rejected(400, "the JSON body must be an object", code="invalid_json")
    return body


def _fits_context(engine: SimEngine, prompt_tokens: int, max_tokens: int) -> None:
    """400 for a request over `max_model_len`, in vLLM's words and with OpenAI's error code."""
    limit = engine.config.max_model_len
    if limit is not None and prompt_tokens + max_tokens > limit:
        raise Rejected(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
        )


def _model(body: dict[str, object], engine: SimEngine) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else engine.config.models[0]


def _max_tokens(body: dict[str, object]) -> int:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return _DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_TOKENS_LIMIT:
        raise Rejected(
            400, f"max_tokens must be an integer in 0..{_MAX_TOKENS_LIMIT}", code="invalid_max_tokens"
        )
    return value


def _prompt_tokens(app: web.Application, fields: Mapping[str, object], text: str) -> Tokens:
    """The token ids of the prompt in `fields` (a request body, or {"prompt": one of its
    prompts}) with a tokenizer, else (or when it cannot say) the words of `text`. Raises
    Rejected for a token id outside the vocabulary, as vLLM does."""
    tokens = app.get(_TOKENS)
    if tokens is not None:
        ids = tokens.ids(fields)
        if ids is not None:
            if ids is fields.get("prompt"):  # the client's own ids
                size = tokens.tokenizer.get_vocab_size(with_added_tokens=True)
                if not all(0 <= i < size for i in ids):
                    raise Rejected(400, "a token id is out of vocabulary", code="invalid_prompt")
            return ids
    return tokenize(text)


def _prompts_tokens(app: web.Application, prompt: object, texts: list[str]) -> list[Tokens]:
    """Each prompt's tokens, for a completions `prompt` (or embeddings `input`) whose prompts,
    already checked, read `texts`: each one tokenized on its own, as vLLM does."""
    sent: list[object] = [prompt]  # a string, or token ids
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        sent = prompt
    return [_prompt_tokens(app, {"prompt": one}, text) for one, text in zip(sent, texts, strict=True)]


def _include_usage(body: dict[str, object]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _pieces(words: list[str]) -> list[str]:
    """Stream pieces that concatenate to the non-streamed text."""
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def _event(chunk: object) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _stream(
    request: web.Request,
    engine: SimEngine,
    prompts: list[Tokens],
    max_tokens: int,
    step_chunks: Callable[[int], Iterable[object]],
    end_chunks: Callable[[Running], Iterable[object]],
) -> web.StreamResponse:
    """Server-sent events: the chunks of each decode step as soon as it is done, then [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async with engine.admit(prompts, max_tokens) as run:
            for step in range(max_tokens):
                await run.step()
                await response.write(b"".join(map(_event, step_chunks(step))))
        await response.write(b"".join(map(_event, end_chunks(run))) + b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the slot is already released
    return response


# OpenAI ------------------------------------------------------------------------------------------


@_openai_api
async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.count("chat_completions")
    body = await _json_body(request)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise Rejected(400, "'messages' must be a list of messages", code="invalid_messages")
    try:
        prompt = chat_prompt(messages)
    except ValueError as exc:
        raise Rejected(400, str(exc), code="invalid_messages") from None
    max_tokens = _max_tokens(body)
    model = _model(body, engine)
    if engine.should_fail():
        raise _simulated_failure()
    tokens = _prompt_tokens(request.app, body, prompt)
    _fits_context(engine, len(tokens), max_tokens)
    words = generate_words(prompt, max_tokens, engine.config.answer_variant)
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    if body.get("stream"):
        include_usage = _include_usage(body)
        chunk_base = {**base, "object": "chat.completion.chunk"}
        if include_usage:
            chunk_base["usage"] = None
        pieces = _pieces(words)

        def step_chunks(step: int) -> list[object]:
            delta = {"role": "assistant", "content": pieces[0]} if step == 0 else {"content": pieces[step]}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            return [{**chunk_base, "choices": [choice]}]

        def end_chunks(run: Running) -> list[object]:
            delta = {"role": "assistant", "content": ""} if max_tokens == 0 else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "length"}
            chunks: list[object] = [{**chunk_base, "choices": [choice]}]
            if include_usage:
                usage = _usage(len(tokens), max_tokens, run.cached_tokens)
                chunks.append({**chunk_base, "choices": [], "usage": usage})
            return chunks

        return await _stream(request, engine, [tokens], max_tokens, step_chunks, end_chunks)

    async with engine.admit([tokens], max_tokens) as run:
        await run.steps(max_tokens)
    message = {"role": "assistant", "content": " ".join(words)}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
    return _json({**base, "choices": [choice], "usage": _usage(len(tokens), max_tokens, run.cached_tokens)})


@_openai_api
async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.count("completions")
    body = await _json_body(request)
    try:
        prompts = completion_prompts(body.get("prompt"))
    except ValueError as exc:
        raise Rejected(400, str(exc), code="invalid_prompt") from None
    max_tokens = _max_tokens(body)
    model = _model(body, engine)
    token_lists = _prompts_tokens(request.app, body.get("prompt"), prompts)
    if engine.should_fail():
        raise _simulated_failure()
    for token_list in token_lists:  # (each prompt of a batch is a request of its own to vLLM)
        _fits_context(engine, len(token_list), max_tokens)
    prompt_tokens = sum(map(len, token_lists))
    completion_tokens = max_tokens * len(prompts)
    words = [generate_words(p, max_tokens, engine.config.answer_variant) for p in prompts]
    base = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    if body.get("stream"):
        include_usage = _include_usage(body)
        if include_usage:
            base["usage"] = None
        pieces = [_pieces(w) for w in words]

        def step_chunks(step: int) -> list[object]:
            return [
                {**base, "choices": [{"index": i, "text": p[step], "logprobs": None, "finish_reason": None}]}
                for i, p in enumerate(pieces)
            ]

        def end_chunks(run: Running) -> list[object]:
            chunks: list[object] = [
                {**base, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": "length"}]}
                for i in range(len(prompts))
            ]
            if include_usage:
                usage = _usage(prompt_tokens, completion_tokens, run.cached_tokens)
                chunks.append({**base, "choices": [], "usage": usage})
            return chunks

        return await _stream(request, engine, token_lists, max_tokens, step_chunks, end_chunks)

    async with engine.admit(token_lists, max_tokens) as run:
        await run.steps(max_tokens)
    choices = [
        {"index": i, "text": " ".join(w), "logprobs": None, "finish_reason": "length"}
        for i, w in enumerate(words)
    ]
    usage = _usage(prompt_tokens, completion_tokens, run.cached_tokens)
    return _json({**base, "choices": choices, "usage": usage})


@_openai_api
async def _embeddings(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.count("embeddings")
    body = await _json_body(request)
    try:
        inputs = embedding_inputs(body.get("input"))
    except ValueError as exc:
        raise Rejected(400, str(exc).replace("prompt", "input"), code="invalid_input") from None
    dim = body.get("dimensions")
    if dim is None:
        dim = engine.config.embedding_dim
    elif isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= _MAX_EMBEDDING_DIM:
        raise Rejected(
            400, f"dimensions must be an integer in 1..{_MAX_EMBEDDING_DIM}", code="invalid_dimensions"
        )
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise Rejected(400, "encoding_format must be 'float' or 'base64'", code="invalid_encoding_format")
    model = _model(body, engine)
    token_lists = _prompts_tokens(request.app, body.get("input"), inputs)
    if engine.should_fail():
        raise _simulated_failure()
    async with engine.admit(token_lists, 0, use_cache=False):
        pass
    data = []
    for i, text in enumerate(inputs):
        vector = embed(text, dim)
        value: object = vector
        if encoding == "base64":
            value = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(map(len, token_lists))
    return _json(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _list_models(request: web.Request) -> web.StreamResponse:
    repository = request.app.get(REPOSITORY)
    models = request.app[ENGINE].config.models if repository is None else sorted(repository.loaded)
    return _json({"object": "list", "data": [_model_card(m) for m in models]})


def _model_card(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": _CREATED, "owned_by": SERVER_NAME}


async def _model_v1(request: web.Request) -> web.StreamResponse:
    """`GET /v1/models/{model}`: OpenAI's model object and KServe v1's readiness in one body."""
    model = request.match_info["model"]
    return _json({**_model_card(model), "name": model, "ready": True})


# KServe v1 ---------------------------------------------------------------------------------------


@_oip_api
async def _kserve_predict(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.count("kserve_predict")
    body = await _json_body(request)
    instances = body.get("instances", body.get("inputs"))
    if not isinstance(instances, list):
        raise Rejected(400, "'instances' must be a list")
    try:
        predictions = scale_nested(instances, engine.config.oip_scale)
    except ValueError as exc:
        raise Rejected(400, str(exc)) from None
    if engine.should_fail():
        raise _simulated_failure()
    async with engine.admit([], 0) as run:
        await run.steps(1)
    return _json({"predictions": predictions})


# Open Inference Protocol v2 ----------------------------------------------------------------------


async def _v2_live(request: web.Request) -> web.StreamResponse:
    return _json({"live": True})


async def _v2_ready(request: web.Request) -> web.StreamResponse:
    return _json({"ready": True})


async def _v2_server(request: web.Request) -> web.StreamResponse:
    return _json({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data"]})


async def _v2_model(request: web.Request) -> web.StreamResponse:
    return _json(oip_model_metadata(request.match_info["model"], request.match_info.get("version")))


async def _v2_model_ready(request: web.Request) -> web.StreamResponse:
    return _json({"name": request.match_info["model"], "ready": True})


@_oip_api
async def _v2_infer(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    engine.count("oip_infer")
    try:
        body = oip.read_infer_request(await request.read(), request.headers)
    except ModelyardError as exc:
        raise Rejected(exc.status, exc.message) from None
    response = await oip_answer(engine, request.match_info["model"], request.match_info.get("version"), body)
    try:
        payload, header_length = oip.write_infer_response(response, body)
    except ValueError as exc:
        raise Rejected(400, str(exc)) from None
    if header_length is None:
        return web.Response(body=payload, content_type="application/json")
    headers = {oip.BINARY_HEADER: str(header_length), "Content-Type": oip.BINARY_CONTENT_TYPE}
    return web.Response(body=payload, headers=headers)


async def oip_answer(
    engine: SimEngine, model: str, version: str | None, body: dict[str, object]
) -> dict[str, object]:
    """The OIP v2 answer to an infer request's JSON (over REST or gRPC): its inputs times
    `oip_scale`, after one decode step. Raises Rejected."""
    try:
        outputs = oip_outputs(body, engine.config.oip_scale)
    except ValueError as exc:
        raise Rejected(400, str(exc)) from None
    if engine.should_fail():
        raise _simulated_failure()
    async with engine.admit([], 0) as run:
        await run.steps(1)
    response: dict[str, object] = {"model_name": model}
    if version is not None:
        response["model_version"] = version
    if "id" in body:
        response["id"] = body["id"]
    response["outputs"] = outputs
    return response


def oip_model_metadata(model: str, version: str | None) -> dict[str, object]:
    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [-1]}
    return {
        "name": model,
        "versions": [version or "1"],
        "platform": SERVER_NAME,
        "inputs": [tensor],
        "outputs": [tensor],
    }


# Operations --------------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.StreamResponse:
    return _json({"status": "ok"})


async def _metrics(request: web.Request) -> web.StreamResponse:
    return web.Response(body=render(request.app[_REGISTRY]), headers={"Content-Type": CONTENT_TYPE})


async def _sim_stats(request: web.Request) -> web.StreamResponse:
    seen = request.app[_TRACEPARENTS]
    publisher = request.app.get(PUBLISHER)
    kv = publisher.stats() if publisher is not None else STATS_OFF
    return _json({**request.app[ENGINE].snapshot(), **kv, "traceparents": [*seen]})


@web.middleware
async def _remember_traceparent(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    traceparent = request.headers.get("traceparent")
    if traceparent is not None:
        request.app[_TRACEPARENTS].append(traceparent)
    return await handler(request)


async def _sim_config(request: web.Request) -> web.StreamResponse:
    return _json(request.app[ENGINE].config.model_dump(mode="json"))


@_oip_api
async def _sim_config_update(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _json_body(request)
    try:
        config = engine.update_config(body)
    except ValueError as exc:
        raise Rejected(400, str(exc)) from None
    return _json(config.model_dump(mode="json"))


# The chaos controls of `POST /sim/kv-events`: switches, and counts of batches.
_KV_SWITCHES = ("pause", "clear")
_KV_COUNTS = ("drop", "lose", "garbage")


@_oip_api
async def _sim_kv_events(request: web.Request) -> web.StreamResponse:
    """Chaos for the gateway's subscriber: `{"pause": bool}`, `{"drop": N}`, `{"lose": N}`,
    `{"garbage": N}`, `{"clear": true}` (kv_publisher.py says what each does), several at once."""
    publisher = request.app.get(PUBLISHER)
    if publisher is None:
        raise Rejected(409, "KV-cache events are off: start the worker with kv_events_port")
    body = await _json_body(request)
    unknown = sorted(set(body) - {*_KV_SWITCHES, *_KV_COUNTS})
    if unknown or not body:
        known = ", ".join((*_KV_SWITCHES, *_KV_COUNTS))
        raise Rejected(400, f"expected some of {known}; got {', '.join(unknown) or 'none'}")
    switches: dict[str, bool] = {}
    counts: dict[str, int] = {}
    for name, value in body.items():
        if name in _KV_SWITCHES:
            if not isinstance(value, bool):
                raise Rejected(400, f"{name} must be true or false")
            switches[name] = value
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Rejected(400, f"{name} must be an integer >= 0")
        else:
            counts[name] = value
    publisher.control(
        pause=switches.get("pause"),
        drop=counts.get("drop"),
        lose=counts.get("lose"),
        garbage=counts.get("garbage"),
    )
    if switches.get("clear"):
        request.app[ENGINE].clear_cache()
    return _json(publisher.state())


def _install_kv_publisher(app: web.Application, engine: SimEngine, config: SimWorkerConfig) -> None:
    """Bound with the server (on_startup), closed with it (on_cleanup)."""
    assert config.kv_events_port is not None
    publisher = KvPublisher(
        config.host, config.kv_events_port, config.kv_replay_port, config.kv_buffer_steps, config.kv_topic
    )
    app[PUBLISHER] = publisher
    engine.kv_events = publisher.publish

    async def start(_app: web.Application) -> None:
        await publisher.start()

    async def close(_app: web.Application) -> None:
        await publisher.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)


def create_sim_app(config: SimWorkerConfig) -> web.Application:
    """A fresh simulated server: its own engine, counters, cache and metrics registry. Loads the
    tokenizer, if any (raises TokenizerError naming the file)."""
    gate = [only_loaded_models] if config.repository_mode else []
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[_remember_traceparent, *gate])
    engine = SimEngine(config)
    app[ENGINE] = engine
    if config.tokenizer is not None:
        app[_TOKENS] = PromptTokens.load(config.tokenizer, config.chat_template)
    if config.kv_events_port is not None:
        _install_kv_publisher(app, engine, config)
    app[_TRACEPARENTS] = deque(maxlen=TRACEPARENTS_KEPT)
    repository = install_repository(app, config) if config.repository_mode else None
    app[_REGISTRY] = create_registry(engine, repository)
    v2_model = "/v2/models/{model}"
    v2_version = "/v2/models/{model}/versions/{version}"
    app.router.add_routes(
        [
            web.post("/v1/chat/completions", _chat_completions),
            web.post("/v1/completions", _completions),
            web.post("/v1/embeddings", _embeddings),
            web.get("/v1/models", _list_models),
            web.get("/v1/models/{model}", _model_v1),
            web.post("/v1/models/{model}:predict", _kserve_predict),
            web.get("/v2/health/live", _v2_live),
            web.get("/v2/health/ready", _v2_ready),
            web.get("/v2", _v2_server),
            web.get(v2_model, _v2_model),
            web.get(v2_version, _v2_model),
            web.get(v2_model + "/ready", _v2_model_ready),
            web.get(v2_version + "/ready", _v2_model_ready),
            web.post(v2_model + "/infer", _v2_infer),
            web.post(v2_version + "/infer", _v2_infer),
            web.get("/health", _health),
            web.get("/metrics", _metrics),
            web.get("/sim/stats", _sim_stats),
            web.get("/sim/config", _sim_config),
            web.put("/sim/config", _sim_config_update),
            web.post("/sim/kv-events", _sim_kv_events),
        ]
    )
    return app
