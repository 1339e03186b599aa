"""`listen.workers` > 1: the gateway as N processes on one port (serving/workers.py runs them), which
share in-flight counts, the leader's health verdicts and resource scrapes, admin changes and /metrics
(siblings.py). listen.grpc_port is shared the same way: each worker's OIP gRPC server binds the
port the parent reserved and answers through its own gateway."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from modelyard.config import AUTO_WORKERS, GatewayConfig
from modelyard.errors import ConfigError
from modelyard.gateway.access_log import install_handler
from modelyard.gateway.server import start_gateway
from modelyard.gateway.siblings import METRICS_DIR, SHARED_FILE, Layout, Siblings, worker_exited
from modelyard.gateway.worker_log import LOG_FILE
from modelyard.graph import load_config_graphs
from modelyard.security.tls import ServerTls
from modelyard.serving import run, serve_until_signal
from modelyard.serving.workers import ParentLink, SharedInts, reserve_port, supervise, watch_parent
from modelyard.state.siblings import LOG_RING_BYTES, RINGS_FILE, create_rings, rings_size
from modelyard.upstream.pool import check_upstream_tls

log = logging.getLogger("modelyard.gateway")

SHM = Path("/dev/shm")
SHM_MARGIN = 16 << 20  # for prometheus-client's files, which grow with the metrics' series
STOP_GRACE = 5.0  # seconds past drain_seconds + shutdown_timeout before workers still running are killed


def worker_count(config: GatewayConfig) -> int:
    """listen.workers; auto: one per CPU this process may run on (its affinity), at most
    AUTO_WORKERS; one where workers cannot serve: off Linux (SO_REUSEPORT spreads connections over
    the processes on Linux only) and with placement.scheduler (placed models: one process for now)."""
    workers = config.listen.workers
    if workers != "auto":
        return workers
    if not sys.platform.startswith("linux") or config.placement.scheduler:
        return 1
    # The CPUs this process may run on: a container's or taskset's share.
    return max(1, min(AUTO_WORKERS, len(os.sched_getaffinity(0))))


def worker_share(config: GatewayConfig, count: int) -> GatewayConfig:
    """One worker's part of the limits on what the workers send on, so that `count` workers keep
    about what the config says between them: upstream.max_connections (per server), and each
    model's circuit_breakers.max_pending_requests and retry_budget.min_retry_concurrency, divided
    and rounded up (a limit of 0, none or nothing, stays 0). The kernel spreads connections over
    the workers, so each sees about 1/count of the load these limits are for. The limits on a
    process's own resources (listen.max_connections, admin.max_log_streams) hold per worker."""

    def part(limit: int) -> int:
        return -(-limit // count)

    upstream = config.upstream.model_copy(update={"max_connections": part(config.upstream.max_connections)})
    models = [
        model.model_copy(
            update={
                "circuit_breakers": model.circuit_breakers.model_copy(
                    update={"max_pending_requests": part(model.circuit_breakers.max_pending_requests)}
                ),
                "retry_budget": model.retry_budget.model_copy(
                    update={"min_retry_concurrency": part(model.retry_budget.min_retry_concurrency)}
                ),
            }
        )
        for model in config.models
    ]
    return config.model_copy(update={"upstream": upstream, "models": models})


def check_workers(config: GatewayConfig, source: str, count: int) -> None:
    """What the workers cannot share yet: refused with a config error, before anything starts."""
    if config.placement.scheduler:
        problem = "listen.workers: placement.scheduler (placed models) works with one worker only for now"
        raise ConfigError(source, [f"{problem} (got {count} workers)"])


def serve_workers(
    config: GatewayConfig,
    source: str,
    count: int,
    announce: Callable[[str, int | None], None],
    log_level: str,
) -> int:
    """Run the gateway as `count` worker processes until SIGINT/SIGTERM; returns the exit status.
    `announce(url, grpc_port)` runs once every worker serves (grpc_port: None when gRPC is off).
    The HTTP port and listen.grpc_port are both reserved here, so that port 0 becomes one port that
    every worker binds (SO_REUSEPORT) and a port in use is refused before any worker starts."""
    check_workers(config, source, count)
    # Bad certificate files: one line here, not a traceback from each worker.
    if config.listen.tls is not None:
        ServerTls(config.listen.tls)
    check_upstream_tls(config)
    run_dir = Path(tempfile.mkdtemp(prefix="modelyard-", dir=_run_parent(count, _state_rings(config))))
    reserved: list[socket.socket] = []
    layout = Layout(config, count)
    shared = None
    try:
        shared = create_run_files(run_dir, config, count)
        ints = shared.ints
        # Read by prometheus-client when each spawned worker imports it.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(run_dir / METRICS_DIR)
        reserved.append(reserve_port(config.listen.host, config.listen.port))
        ports: dict[str, int | None] = {"port": reserved[0].getsockname()[1]}
        if config.listen.grpc_port is not None:
            reserved.append(_reserve_grpc_port(config.listen.host, config.listen.grpc_port))
            ports["grpc_port"] = reserved[1].getsockname()[1]
        listen = config.listen.model_copy(update=ports)
        config = config.model_copy(update={"listen": listen})
        return supervise(
            _worker,
            (config, source, str(run_dir), count, log_level),
            count,
            lambda urls: announce(urls[0], listen.grpc_port),
            stop_timeout=config.listen.drain_seconds + config.listen.shutdown_timeout + STOP_GRACE,
            on_exit=lambda index: worker_exited(ints, layout, index),
            heartbeat_timeout=config.listen.worker_heartbeat_timeout,
        )
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if shared is not None:
            shared.close()
        for sock in reserved:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def create_run_files(run_dir: Path, config: GatewayConfig, count: int) -> SharedInts:
    """The files in `run_dir` that the `count` workers of a gateway with `config` share: their
    metrics folder, their shared counters (returned, open) and their rings."""
    (run_dir / METRICS_DIR).mkdir()
    shared = SharedInts(run_dir / SHARED_FILE, Layout(config, count).size, create=True)
    try:
        if _state_rings(config):
            create_rings(run_dir / RINGS_FILE, count)
        create_rings(run_dir / LOG_FILE, count, LOG_RING_BYTES)  # each worker's routing-log records
    except BaseException:
        shared.close()
        raise
    return shared


def _state_rings(config: GatewayConfig) -> bool:
    """Whether the workers share their routing state through rings (with Redis: through Redis)."""
    return config.state.backend == "memory"


def _run_parent(count: int, state_rings: bool, shm: Path = SHM) -> Path | None:
    """Where the workers' shared files go: `shm` (tmpfs: they never touch a disk) when it has room
    for the rings with a margin for the metrics files, else the temporary folder (None; a
    container's /dev/shm is 64 MiB unless set)."""
    if not shm.is_dir():
        return None
    needed = rings_size(count, LOG_RING_BYTES) + (rings_size(count) if state_rings else 0) + SHM_MARGIN
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return None
    if free < needed:
        log.warning(
            "%s has %d MiB free, less than the %d MiB %d workers share: their files go to %s",
            shm, free >> 20, needed >> 20, count, tempfile.gettempdir(),
        )  # fmt: skip
        return None
    return shm


def _reserve_grpc_port(host: str, port: int) -> socket.socket:
    try:
        return reserve_port(host, port)
    except OSError as error:  # one line that says which of the two ports it is
        raise OSError(error.errno, f"listen.grpc_port {port} (OIP gRPC): {error.strerror or error}") from None


def _worker(
    index: int, parent: ParentLink, config: GatewayConfig, source: str, run_dir: str, count: int, level: str
) -> None:
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s"
    )
    output = install_handler() if config.logging.access_log else None  # a JSON line carries its worker
    graphs = load_config_graphs(config, source)

    async def serve() -> None:
        siblings = Siblings(config, index, count, Path(run_dir))
        gateway = await start_gateway(worker_share(config, count), graphs=graphs, siblings=siblings)
        # Without its parent nobody would stop it: drain as on SIGTERM.
        watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))
        parent.start_heartbeat()  # a timer of this loop, never on the request path
        parent.serving(gateway.url)

        await serve_until_signal([gateway.server], gateway.stop)

    try:
        run(serve())
    finally:
        if output is not None:
            output.stop()
