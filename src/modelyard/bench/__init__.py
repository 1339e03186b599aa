"""`modelyard bench`: a load generator for choosing a routing strategy.

workload  WorkloadSpec (what to send) and the named profiles (`inferflow`, `quick`, `chat`); the
          request list, or the conversations (chats and agent loops) and the capacity they are sent at
runner    sending the requests (or playing the conversations) at a concurrency or a Poisson rate,
          recording each outcome (latency, time to first token, inter-token latency)
spawn     sim-workers and a gateway of our own per strategy (`--spawn N`)
progress  the bars on stderr while it runs: runs done, the run in flight, time left
report    per-run summaries (latency percentiles, TTFT, req/s, backend split, cached share), their
          medians over runs, the table, and the JSON/CSV files
chart     the PNG (`--chart`) of the same summaries: each request's latency, the cached share and
          the backend split per strategy; needs matplotlib (`modelyard[bench]`), imported only when
          a chart is drawn
"""

from modelyard.bench.report import Summary, summarize
from modelyard.bench.runner import Outcome, run_workload
from modelyard.bench.workload import PROFILES, BenchRequest, WorkloadSpec, build_requests, iter_requests

__all__ = [
    "PROFILES",
    "BenchRequest",
    "Outcome",
    "Summary",
    "WorkloadSpec",
    "build_requests",
    "iter_requests",
    "run_workload",
    "summarize",
]
