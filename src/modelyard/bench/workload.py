"""What a bench run sends: a `WorkloadSpec`, and the list of chat requests it makes (seeded).

A request is a *repeat* (with probability `repeat_share`): a whole prompt drawn from a pool of
`pool_size` prompts by Zipf popularity (exponent `zipf_s`: a few are asked again and again), else
a fresh prompt nobody asked before. A prompt is a system prompt (with probability
`shared_prefix_share`, one of `system_prompts` long shared prompts) and a user prompt; a pooled
prompt keeps its system prompt each time it is asked, as the same question from the same app
does. Words come from a fixed vocabulary, so prompts of N words are about N tokens to the
sim-worker (and to any tokenizer, roughly).

`inferflow` reproduces the shape of InferFlow's published experiment: 300 requests at
concurrency 3, half of them repeats of a Zipf-popular pool, many sharing one of 4 long system
prompts, against 3 workers with one request slot each, a prefix cache of about 5 prompts,
prefill 0.8 ms/token and decode 2.5 ms/token. `quick` is the same with 150 requests: a first look
in about a minute.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from modelyard.simworker.latency import PrefixCache, block_hashes
from modelyard.simworker.text import chat_prompt, tokenize

_VOCABULARY = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "glade",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lumen",
    "meadow",
    "nectar",
    "onyx",
    "prairie",
    "quartz",
    "raven",
    "summit",
    "thistle",
    "umber",
    "valley",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
    "atlas",
    "beacon",
    "canyon",
    "dune",
    "estuary",
    "falcon",
    "granite",
    "heron",
    "island",
    "jasper",
    "kelp",
    "lagoon",
    "mesa",
    "north",
    "orchard",
    "pebble",
    "quill",
    "river",
    "sierra",
    "tundra",
    "upland",
    "vista",
    "walnut",
    "yonder",
    "zenith",
    "acorn",
    "birch",
    "coral",
    "dawn",
]


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: int = Field(300, ge=1, description="requests to send (unless duration is set)")
    duration: float | None = Field(None, gt=0, description="send for this many seconds instead")
    concurrency: int = Field(3, ge=1, description="requests in flight at once (closed loop)")
    rate: float | None = Field(None, gt=0, description="requests per second (open loop) instead")
    repeat_share: float = Field(0.5, ge=0, le=1, description="share of user prompts drawn from the pool")
    pool_size: int = Field(40, ge=1, description="prompts in the repeated pool")
    zipf_s: float = Field(1.1, ge=0, description="Zipf exponent of the pool's popularity")
    shared_prefix_share: float = Field(
        0.75, ge=0, le=1, description="share starting with a shared system prompt"
    )
    system_prompts: int = Field(4, ge=1, description="distinct shared system prompts")
    system_prompt_tokens: int = Field(250, ge=0)
    prompt_tokens: int = Field(40, ge=1, description="words in a user prompt")
    output_tokens: int = Field(40, ge=1, description="max_tokens of each request")
    stream: bool = False
    seed: int = 0


@dataclass(frozen=True, slots=True)
class SimShape:
    """The sim-workers `--spawn` starts for a profile (ignored against a real URL)."""

    max_concurrency: int = 8
    prefill_ms_per_token: float = 0.05
    decode_ms_per_token: float = 5.0
    cache_blocks: int = 256
    block_tokens: int = 16


@dataclass(frozen=True, slots=True)
class Profile:
    workload: WorkloadSpec
    sims: SimShape


PROFILES: dict[str, Profile] = {
    # Calibrated to InferFlow's published least_pending run (P95 about 335 ms, mean about 251 ms, 29%
    # of prompt tokens cached; benchmarks/routing_sim.py gives 345 / 247 / 26%): prompts of about
    # 360 tokens (a 120-token system prompt on 3 in 4 of them, 240 tokens of user text), 20 output
    # tokens, a cache of about 5 prompts per worker. An unbounded cache would serve 52% of it.
    "inferflow": Profile(
        WorkloadSpec(system_prompt_tokens=120, prompt_tokens=240, output_tokens=20),
        SimShape(max_concurrency=1, prefill_ms_per_token=0.8, decode_ms_per_token=2.5, cache_blocks=112),
    ),
}
# inferflow's shape with half its requests: a run sends for about 12 s instead of 25 (start-up adds
# about 10 s more on a 2-core machine), so the two default strategies compare in about a minute.
# benchmarks/routing_sim.py: prefix_aware still caches 4 to 11 points more than least_pending on
# every seed at 100 to 300 requests, at the same P95, so the comparison holds.
PROFILES["quick"] = Profile(
    PROFILES["inferflow"].workload.model_copy(update={"requests": 150}), PROFILES["inferflow"].sims
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    system: str  # "" for none
    user: str
    kind: str  # "repeat" or "fresh"

    def body(self, model: str, spec: WorkloadSpec) -> dict[str, object]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.user})
        body: dict[str, object] = {"model": model, "messages": messages, "max_tokens": spec.output_tokens}
        if spec.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(count))


def iter_requests(spec: WorkloadSpec) -> Iterator[BenchRequest]:
    """The workload's requests, one after another without end (a `--duration` run takes as many as
    it sends): the same sequence for the same spec and seed; fresh prompts never repeat."""
    rng = random.Random(spec.seed)
    systems = [f"system {i}: " + _words(rng, spec.system_prompt_tokens) for i in range(spec.system_prompts)]

    def system() -> str:
        return rng.choice(systems) if rng.random() < spec.shared_prefix_share else ""

    pool = [
        BenchRequest(system(), f"pooled {i}: " + _words(rng, spec.prompt_tokens), "repeat")
        for i in range(spec.pool_size)
    ]
    weights = [1.0 / (rank**spec.zipf_s) for rank in range(1, spec.pool_size + 1)]
    for n in itertools.count():
        if rng.random() < spec.repeat_share:
            yield rng.choices(pool, weights=weights)[0]
        else:
            yield BenchRequest(system(), f"fresh {n}: " + _words(rng, spec.prompt_tokens), "fresh")


def build_requests(spec: WorkloadSpec, count: int | None = None) -> list[BenchRequest]:
    """The first `count` (default `spec.requests`) requests of `iter_requests`."""
    return list(itertools.islice(iter_requests(spec), count if count is not None else spec.requests))


def prompt_tokens(request: BenchRequest) -> list[str]:
    """The request's prompt as the sim-worker counts it (a word a token, roles included)."""
    return tokenize(chat_prompt(request.body("", WorkloadSpec())["messages"]))  # type: ignore[arg-type]


def cacheable_share(requests: Iterable[BenchRequest], block_tokens: int = 16) -> float:
    """The share of prompt tokens that repeat an earlier request's prompt prefix (whole blocks of
    `block_tokens`, as the sim-worker and vLLM cache them): what one cache without a size limit
    would serve, so what no router can beat on this workload."""
    cache = PrefixCache(1 << 62)
    cached = total = 0
    for request in requests:
        tokens = prompt_tokens(request)
        hit = cache.match_and_insert(block_hashes(tokens, block_tokens)) * block_tokens
        cached += min(len(tokens), hit)
        total += len(tokens)
    return cached / total if total else 0.0
