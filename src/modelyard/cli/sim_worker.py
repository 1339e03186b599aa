"""`modelyard sim-worker`: run one simulated model server until interrupted."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from modelyard.balancing.tokens import TokenizerError
from modelyard.cli.listening import Listener, listen_failure
from modelyard.cli.problems import fail, print_error
from modelyard.cli.tls import TlsCertOption, TlsClientCaOption, TlsKeyOption, tls_server_config
from modelyard.config import TlsServerConfig
from modelyard.errors import ModelyardError
from modelyard.placement.manifest import parse_quantity
from modelyard.serving import run, serve_until_signal
from modelyard.simworker import SimWorker, SimWorkerConfig


def sim_worker(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind; 0 picks a free one.")] = 9000,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            help="Serve OIP v2 over gRPC (inference.GRPCInferenceService) on this port too; 0 picks one."
        ),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            help="Served model name (repeatable; default sim-model). Requests for any name are answered.",
        ),
    ] = None,
    max_concurrency: Annotated[
        int, typer.Option(help="Concurrency slots; a request holds one for its whole prefill and decode.")
    ] = 8,
    prefill_ms_per_token: Annotated[
        float,
        typer.Option(help="Prefill cost in ms per uncached prompt token (a word, or a --tokenizer token)."),
    ] = 0.05,
    decode_ms_per_token: Annotated[
        float, typer.Option(help="Decode cost in ms per output token; streams emit each token after it.")
    ] = 5.0,
    slowdown: Annotated[float, typer.Option(help="Multiplier on prefill and decode costs.")] = 1.0,
    batch_slowdown: Annotated[
        float,
        typer.Option(
            help="A decode step costs this share of --decode-ms-per-token more per other request running "
            "(a batching server slows as its batch grows); 0: slots run as if alone."
        ),
    ] = 0.0,
    cache_blocks: Annotated[
        int, typer.Option(help="Prefix cache capacity in blocks (LRU); 0 disables the cache.")
    ] = 256,
    block_tokens: Annotated[int, typer.Option(help="Tokens per prefix cache block.")] = 16,
    fail_rate: Annotated[
        float, typer.Option(help="Probability (0..1) that a request answers 500 with an error body.")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the worker's random generator (fail_rate).")] = 0,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="vLLM's context window: a chat or completion whose prompt tokens plus max_tokens are more "
            "answers 400 context_length_exceeded, as vLLM does. Default: no limit."
        ),
    ] = None,
    embedding_dim: Annotated[int, typer.Option(help="Length of /v1/embeddings vectors.")] = 16,
    oip_scale: Annotated[
        float, typer.Option(help="OIP v2 and KServe v1 outputs are the inputs times this (1.0 echoes).")
    ] = 1.0,
    answer_variant: Annotated[
        int,
        typer.Option(
            help="0: answers depend on the prompt only; another number answers other words (a canary)."
        ),
    ] = 0,
    repository: Annotated[
        Path | None,
        typer.Option(
            help="Repository mode over this dir of models (<dir>/<name>/model-settings.json): serve the "
            "OIP repository API; only loaded models answer."
        ),
    ] = None,
    repository_api: Annotated[
        bool, typer.Option("--repository-api", help="Repository mode without a dir: any name can be loaded.")
    ] = False,
    memory: Annotated[
        str, typer.Option(help="Repository mode: memory for loaded models (bytes, 1Gi, 500M); 0 = unlimited.")
    ] = "0",
    model_memory: Annotated[
        str, typer.Option(help="Repository mode: memory of a model whose settings do not say.")
    ] = "0",
    load_delay: Annotated[float, typer.Option(help="Repository mode: seconds a load takes.")] = 0.0,
    fail_load: Annotated[
        list[str] | None,
        typer.Option("--fail-load", help="Repository mode: this model's load fails (repeatable)."),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="A tokenizer.json, or a Hugging Face model dir holding one: prompts become token ids "
            "(chats rendered by its chat template), as vLLM tokenizes them."
        ),
    ] = None,
    chat_template: Annotated[
        Path | None, typer.Option(help="A Jinja chat template file, in place of the tokenizer dir's.")
    ] = None,
    kv_events_port: Annotated[
        int | None,
        typer.Option(
            help="Publish vLLM's KV-cache events (ZMQ PUB) on this port; 0 picks one. Needs --tokenizer."
        ),
    ] = None,
    kv_replay_port: Annotated[
        int | None,
        typer.Option(help="Replay buffered KV-cache events (ZMQ ROUTER) on this port; 0 picks one."),
    ] = None,
    kv_buffer_steps: Annotated[int, typer.Option(help="KV-cache event batches kept for replay.")] = 10000,
    kv_topic: Annotated[str, typer.Option(help="The topic frame of each KV-cache event message.")] = "",
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_client_ca: TlsClientCaOption = None,
) -> None:
    """Run a simulated LLM/OIP server: OpenAI, OIP v2, KServe v1, vLLM metrics.

    Latency is vLLM-like: wait for a slot, prefill the prompt tokens that
    the prefix cache misses, then decode one token per step. Tokens are
    approximated as whitespace-separated words, or are token ids with
    --tokenizer. With every cost at 0 it never sleeps. GET /sim/stats shows
    its counters; PUT /sim/config changes the costs, slowdown, fail_rate and
    max_concurrency while it runs. With --kv-events-port it publishes its
    prefix cache's changes as vLLM's KV-cache events (POST /sim/kv-events
    pauses, drops, loses or garbles them, or clears the cache).
    """
    try:
        config = SimWorkerConfig(
            host=host,
            port=port,
            grpc_port=grpc_port,
            models=tuple(model) if model else ("sim-model",),
            max_concurrency=max_concurrency,
            prefill_ms_per_token=prefill_ms_per_token,
            decode_ms_per_token=decode_ms_per_token,
            slowdown=slowdown,
            batch_slowdown=batch_slowdown,
            cache_blocks=cache_blocks,
            block_tokens=block_tokens,
            fail_rate=fail_rate,
            max_model_len=max_model_len,
            seed=seed,
            embedding_dim=embedding_dim,
            oip_scale=oip_scale,
            answer_variant=answer_variant,
            repository=repository,
            repository_api=repository_api,
            memory=_bytes("--memory", memory),
            model_memory=_bytes("--model-memory", model_memory),
            load_delay=load_delay,
            fail_load=tuple(fail_load or ()),
            tokenizer=tokenizer,
            chat_template=chat_template,
            kv_events_port=kv_events_port,
            kv_replay_port=kv_replay_port,
            kv_buffer_steps=kv_buffer_steps,
            kv_topic=kv_topic,
        )
    except ValidationError as exc:
        problems = "; ".join(_problem(e["loc"], e["msg"]) for e in exc.errors())
        typer.echo(f"error: sim-worker options: {problems}", err=True)
        raise typer.Exit(1) from None
    tls = tls_server_config(tls_cert, tls_key, tls_client_ca)
    try:
        run(_serve(config, tls))
    except ModelyardError as exc:  # a certificate or key that cannot be used: one line naming the file
        raise fail(exc) from None
    except TokenizerError as exc:  # (its message names the file)
        print_error(str(exc))
        raise typer.Exit(1) from None
    except OSError as exc:  # typically the port is taken
        listeners = [Listener(host, port, "sim-worker HTTP")]
        if grpc_port is not None:
            listeners.append(Listener(host, grpc_port, "sim-worker OIP gRPC", grpc=True))
        if kv_events_port is not None:
            listeners.append(Listener(host, kv_events_port, "sim-worker KV events"))
        if kv_replay_port is not None:
            listeners.append(Listener(host, kv_replay_port, "sim-worker KV events replay"))
        raise listen_failure(exc, listeners) from None


def _bytes(flag: str, value: str) -> int:
    try:
        return parse_quantity(value)
    except ValueError as exc:
        typer.echo(f"error: sim-worker options: {flag}: {exc}", err=True)
        raise typer.Exit(1) from None


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    """`--flag: message` for a field's error; one about several fields names them as flags."""
    if loc:
        return f"{_flag(loc[0])}: {message}"
    message = message.removeprefix("Value error, ")
    fields = "|".join(SimWorkerConfig.model_fields)
    return re.sub(rf"\b(?:{fields})\b", lambda m: _flag(m[0]), message)


def _flag(field: int | str) -> str:
    name = "model" if field == "models" else str(field)
    return "--" + name.replace("_", "-")


async def _serve(config: SimWorkerConfig, tls: TlsServerConfig | None) -> None:
    worker = SimWorker(config, tls=tls)
    url = await worker.start()
    typer.echo(f"sim-worker listening on {url}" + (f" and {worker.grpc_url}" if worker.grpc_url else ""))
    if worker.kv_events_url is not None:
        replay = f", replay on {worker.kv_replay_url}" if worker.kv_replay_url else ""
        typer.echo(f"sim-worker KV-cache events on {worker.kv_events_url}{replay}")
    await serve_until_signal([worker.server], worker.stop)
