"""A simulated model server: OpenAI, OIP v2 and KServe v1 APIs over a vLLM-like latency model.

Prefill and decode cost per token, a fixed number of concurrency slots with a queue behind them,
and a prefix cache of chained token blocks; counters in `/sim/stats` and vLLM's `/metrics`. With a
tokenizer, it can publish its cache's changes as vLLM's KV-cache events (ZMQ, kv_publisher.py).
"""

from modelyard.simworker.app import create_sim_app
from modelyard.simworker.config import SimWorkerConfig
from modelyard.simworker.engine import SimStats
from modelyard.simworker.worker import SimWorker

__all__ = ["SimStats", "SimWorker", "SimWorkerConfig", "create_sim_app"]
