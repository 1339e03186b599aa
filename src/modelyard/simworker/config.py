"""The sim worker's settings, validated once; `PUT /sim/config` swaps in a validated copy."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from modelyard.simworker.latency import CostModel

# The fields `PUT /sim/config` may change while the worker runs.
RUNTIME_FIELDS = frozenset(
    {
        "prefill_ms_per_token",
        "decode_ms_per_token",
        "slowdown",
        "fail_rate",
        "max_concurrency",
        "batch_slowdown",
    }
)


class SimWorkerConfig(BaseModel):
    """Tokens are approximated as whitespace-separated words, unless a tokenizer is given."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(default=9000, ge=0, le=65535, description="0 picks a free port")
    grpc_port: int | None = Field(
        default=None, ge=0, le=65535, description="OIP v2 over gRPC on this port too; 0 picks a free one"
    )
    models: tuple[str, ...] = Field(default=("sim-model",), min_length=1, description="served model names")
    max_concurrency: int = Field(default=8, ge=1, description="slots; excess requests wait in a queue")
    prefill_ms_per_token: float = Field(default=0.05, ge=0, description="cost per uncached prompt token")
    decode_ms_per_token: float = Field(default=5.0, ge=0, description="cost per output token")
    batch_slowdown: float = Field(
        default=0.0,
        ge=0,
        description="a decode step costs this share of decode_ms_per_token more per other request running "
        "(a batching server's steps slow as its batch grows); 0: slots run as if alone",
    )
    slowdown: float = Field(default=1.0, ge=0, description="multiplies prefill and decode costs")
    cache_blocks: int = Field(default=256, ge=0, description="prefix cache capacity in blocks; 0 disables it")
    block_tokens: int = Field(default=16, ge=1, description="tokens per cache block")
    fail_rate: float = Field(default=0.0, ge=0, le=1, description="probability a request answers 500")
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="vLLM's context window: a chat or completion whose prompt tokens and max_tokens "
        "add up to more answers 400 as vLLM does (OpenAI's code context_length_exceeded); none: no limit",
    )
    seed: int = Field(default=0, description="seed of the worker's own random.Random")
    embedding_dim: int = Field(default=16, ge=1, le=65536, description="length of /v1/embeddings vectors")
    oip_scale: float = Field(default=1.0, description="OIP and KServe v1 outputs are inputs times this")
    answer_variant: int = Field(
        default=0, ge=0, description="0: answers depend on the prompt only; another value: other words"
    )
    # Repository mode (simworker/repository.py): models must be loaded before they answer.
    repository: Path | None = Field(default=None, description="model directories; turns repository mode on")
    repository_api: bool = Field(default=False, description="repository mode without a directory")
    memory: int = Field(default=0, ge=0, description="memory for loaded models, bytes; 0 = unlimited")
    model_memory: int = Field(default=0, ge=0, description="bytes per model without its own setting")
    load_delay: float = Field(default=0.0, ge=0, description="seconds a load takes")
    fail_load: tuple[str, ...] = Field(default=(), description="models whose load fails")
    # Real tokens (balancing/tokens.py): what vLLM's KV-cache events carry and the gateway hashes.
    tokenizer: Path | None = Field(
        default=None, description="a tokenizer.json, or a model directory holding one: prompts as token ids"
    )
    chat_template: Path | None = Field(
        default=None, description="a Jinja chat template, in place of the tokenizer directory's"
    )
    # vLLM's KV-cache events (simworker/kv_publisher.py), bound on `host`.
    kv_events_port: int | None = Field(
        default=None, ge=0, le=65535, description="publish KV-cache events (ZMQ PUB) here; 0 picks a port"
    )
    kv_replay_port: int | None = Field(
        default=None, ge=0, le=65535, description="replay buffered events (ZMQ ROUTER) here; 0 picks a port"
    )
    kv_buffer_steps: int = Field(default=10000, ge=1, description="event batches kept for replay")
    kv_topic: str = Field(default="", description="the topic frame of each event message")

    @model_validator(mode="after")
    def _kv_events_need_token_ids(self) -> SimWorkerConfig:
        if self.kv_events_port is not None and self.tokenizer is None:
            raise ValueError("kv_events_port needs a tokenizer: KV-cache events carry the prompts' token ids")
        if self.kv_replay_port is not None and self.kv_events_port is None:
            raise ValueError("kv_replay_port replays the events of kv_events_port, which is not set")
        if self.kv_replay_port and self.kv_replay_port == self.kv_events_port:
            raise ValueError("kv_events_port and kv_replay_port must differ")
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("chat_template needs a tokenizer")
        return self

    @property
    def repository_mode(self) -> bool:
        return self.repository is not None or self.repository_api

    @property
    def costs(self) -> CostModel:
        return CostModel(self.prefill_ms_per_token, self.decode_ms_per_token, self.slowdown)

    def with_runtime_changes(self, changes: Mapping[str, object]) -> SimWorkerConfig:
        """A validated copy with `changes` applied. Raises ValueError naming the bad fields."""
        unknown = sorted(set(changes) - RUNTIME_FIELDS)
        if unknown:
            allowed = ", ".join(sorted(RUNTIME_FIELDS))
            raise ValueError(f"cannot change {', '.join(unknown)} at runtime; allowed: {allowed}")
        try:
            return SimWorkerConfig.model_validate({**self.model_dump(), **changes})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in exc.errors())
            raise ValueError(problems) from None
