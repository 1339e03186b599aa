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
import math
import random
import statistics
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
    rate: float | None = Field(
        None, gt=0, description="requests (or conversations) per second, open loop, instead"
    )
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
    # Conversations (`turns` > 1 or `agent_share` > 0): each turn's prompt is the whole conversation
    # so far, the server's own answers included; `rate` is then conversations per second.
    turns: float = Field(1.0, ge=1, description="mean turns of a chat conversation (geometric)")
    max_turns: int = Field(30, ge=1, description="the most turns (or agent steps) of one conversation")
    prompt_spread: float = Field(
        0.0,
        ge=0,
        le=3,
        description="lognormal sigma of a message's words around prompt_tokens (0: all equal)",
    )
    output_spread: float = Field(
        0.0, ge=0, le=3, description="lognormal sigma of a turn's max_tokens around output_tokens"
    )
    think_seconds: float = Field(0.0, ge=0, description="mean pause before a conversation's next turn")
    agent_share: float = Field(0.0, ge=0, le=1, description="share of conversations that are agent loops")
    agents: int = Field(2, ge=1, description="distinct agents, each with its own long instructions")
    agent_prompt_tokens: int = Field(1500, ge=0, description="words of an agent's tools and instructions")
    agent_steps: float = Field(5.0, ge=1, description="mean steps of an agent loop (geometric)")
    tool_result_tokens: int = Field(150, ge=1, description="words of each tool result an agent is sent")
    warmup: float = Field(
        0.0,
        ge=0,
        description="seconds from the start whose requests are sent but not counted (an open loop of "
        "conversations takes about a conversation's length to reach its rate)",
    )

    @property
    def conversations(self) -> bool:
        return self.turns > 1 or self.agent_share > 0


@dataclass(frozen=True, slots=True)
class SimShape:
    """The sim-workers `--spawn` starts for a profile (ignored against a real URL)."""

    max_concurrency: int = 8
    prefill_ms_per_token: float = 0.05
    decode_ms_per_token: float = 5.0
    cache_blocks: int = 256
    block_tokens: int = 16
    batch_slowdown: float = 0.0  # the sim-worker's: a decode step's extra cost per other request running


@dataclass(frozen=True, slots=True)
class Profile:
    workload: WorkloadSpec
    sims: SimShape
    load: float | None = None  # with --spawn and no --rate: this share of the workers' capacity


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
# Today's chat and agent traffic (issue 29), open loop: multi-turn chats (3.5 turns on average,
# geometric; messages of 40 words median, lognormal with a long tail; answers of 120 tokens median;
# 3 in 4 behind one of 4 system prompts of 200 words; a second's thought between turns) and, for
# 3 in 10 conversations, agent loops (5 steps on average over one of 2 agents' 1,500 words of tools
# and instructions, a tool result of 150 words each step). Streamed: time to first token and
# inter-token latency are measured. Servers batch 8 requests, a decode step 8% slower per request
# beside it, with prefix caches of 32k tokens. Sent at 70% of the servers' capacity (`--load`).
PROFILES["chat"] = Profile(
    WorkloadSpec(
        concurrency=256, system_prompts=4, system_prompt_tokens=200, shared_prefix_share=0.75,
        prompt_tokens=40, prompt_spread=1.0, output_tokens=120, output_spread=0.6, turns=3.5,
        think_seconds=1.0, agent_share=0.3, agents=2, agent_prompt_tokens=1500, agent_steps=5.0,
        tool_result_tokens=150, stream=True, requests=800, warmup=5.0,
    ),
    SimShape(
        max_concurrency=8, prefill_ms_per_token=0.1, decode_ms_per_token=2.0, cache_blocks=2048,
        batch_slowdown=0.08,
    ),
    load=0.7,
)  # fmt: skip
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
    kind: str  # "repeat" or "fresh"; a conversation's turn: "chat" or "agent"
    # a conversation's earlier turns: (what the user said, what the server answered)
    history: tuple[tuple[str, str], ...] = ()
    max_tokens: int = 0  # 0: the spec's output_tokens

    def body(self, model: str, spec: WorkloadSpec) -> dict[str, object]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for said, answered in self.history:
            messages.append({"role": "user", "content": said})
            messages.append({"role": "assistant", "content": answered})
        messages.append({"role": "user", "content": self.user})
        max_tokens = self.max_tokens or spec.output_tokens
        body: dict[str, object] = {"model": model, "messages": messages, "max_tokens": max_tokens}
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


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat (a user's messages, each sent with the conversation so far) or an agent loop (a
    task, then tool results, over the agent's long instructions); the runner sends its turns one
    after another, each with the answers before it."""

    system: str
    messages: tuple[str, ...]
    max_tokens: tuple[int, ...]
    kind: str  # "chat" or "agent"
    pauses: tuple[float, ...] = ()  # seconds the user thinks before each turn after the first

    def turn(self, index: int, answers: list[str]) -> BenchRequest:
        history = tuple(zip(self.messages[:index], answers[:index], strict=True))
        return BenchRequest(self.system, self.messages[index], self.kind, history, self.max_tokens[index])


def _count(rng: random.Random, mean: float, most: int) -> int:
    """1 + a geometric count: mean `mean`, a long tail (most conversations are short), at most `most`."""
    count = 1
    while count < most and rng.random() > 1.0 / mean:
        count += 1
    return count


def _length(rng: random.Random, median: int, sigma: float) -> int:
    """Lognormal around `median` (chat logs' lengths: most short, a few pasted pages), at most 8x."""
    if not sigma:
        return median
    return max(1, min(8 * median, round(median * math.exp(rng.gauss(0.0, sigma)))))


def iter_conversations(spec: WorkloadSpec) -> Iterator[Conversation]:
    """The workload's conversations, without end, the same for the same spec and seed. Chats have
    `turns` turns on average (geometric, as in ShareGPT-like logs: many one- or two-turn chats, a
    tail of long ones), messages of `prompt_tokens` words (lognormal, `prompt_spread`), one of the
    shared system prompts on `shared_prefix_share` of them; agents loop `agent_steps` times over
    one of `agents` instructions of `agent_prompt_tokens` words, sent a tool result each step."""
    rng = random.Random(spec.seed)
    systems = [f"system {i}: " + _words(rng, spec.system_prompt_tokens) for i in range(spec.system_prompts)]
    agents = [f"agent {i} tools: " + _words(rng, spec.agent_prompt_tokens) for i in range(spec.agents)]
    for n in itertools.count():
        if rng.random() < spec.agent_share:
            steps = _count(rng, spec.agent_steps, spec.max_turns)
            task = f"task {n}: " + _words(rng, _length(rng, spec.prompt_tokens, spec.prompt_spread))
            results = [
                f"tool result {n}.{k}: "
                + _words(rng, _length(rng, spec.tool_result_tokens, spec.prompt_spread))
                for k in range(1, steps)
            ]
            messages, system, kind = (task, *results), rng.choice(agents), "agent"
        else:
            turns = _count(rng, spec.turns, spec.max_turns)
            messages = tuple(
                f"chat {n}.{k}: " + _words(rng, _length(rng, spec.prompt_tokens, spec.prompt_spread))
                for k in range(turns)
            )
            system = rng.choice(systems) if rng.random() < spec.shared_prefix_share else ""
            kind = "chat"
        outputs = tuple(_length(rng, spec.output_tokens, spec.output_spread) for _ in messages)
        think = spec.think_seconds
        pauses = tuple(rng.expovariate(1.0 / think) if think else 0.0 for _ in messages[1:])
        yield Conversation(system, messages, outputs, kind, pauses)


def request_tokens(spec: WorkloadSpec, sample: int = 200) -> tuple[float, float]:
    """The mean prompt and output tokens (words) of the workload's requests, every prompt counted
    whole (a sim-worker answers max_tokens words, which the next turn carries)."""
    prompts = outputs = count = 0
    if not spec.conversations:
        for request in build_requests(spec, sample):
            prompts += len(prompt_tokens(request))
        return prompts / sample, float(spec.output_tokens)
    for conversation in itertools.islice(iter_conversations(spec), sample):
        answers = [" ".join(["x"] * n) for n in conversation.max_tokens]
        for index in range(len(conversation.messages)):
            prompts += len(prompt_tokens(conversation.turn(index, answers)))
            outputs += conversation.max_tokens[index]
            count += 1
    return prompts / count, outputs / count


def capacity(spec: WorkloadSpec, sims: SimShape, workers: int) -> float:
    """Requests per second `workers` sim-workers shaped `sims` serve with every slot busy and
    nothing cached (each prompt prefilled whole; decode slowed by a full batch): the reference
    `--load` is a share of. A router that reuses the cache serves more."""
    prompt, output = request_tokens(spec)
    batch = 1.0 + sims.batch_slowdown * (sims.max_concurrency - 1)
    seconds = (prompt * sims.prefill_ms_per_token + output * sims.decode_ms_per_token * batch) / 1000.0
    return workers * sims.max_concurrency / seconds if seconds > 0 else float("inf")


def mean_turns(spec: WorkloadSpec, sample: int = 500) -> float:
    if not spec.conversations:
        return 1.0
    return statistics.fmean(len(c.messages) for c in itertools.islice(iter_conversations(spec), sample))


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
