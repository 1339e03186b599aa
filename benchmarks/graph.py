"""Graph overhead: what running a graph adds over calling its services directly.

Three zero-latency services (nginx answering a fixed JSON body, see overhead.py) are the steps of:
  seq  a 3-step Sequence (each step POSTs to one service; `data: $response` chains them)
  ens  a 3-member Ensemble (all three called at once; answers merged)
Each graph is served by the gateway (`modelyard serve`, POST /v1/graphs/{name}) and by the
stand-alone router (`modelyard graph serve --graph-json`, KServe's router contract). wrk sends one
request at a time (concurrency 1). A Sequence's floor is the sum of its direct calls (3 x one
call's p50); an Ensemble's is the max (about one call's p50, the calls overlap). The table shows
each graph's p50 minus that floor, in total and per step; the target is < 1 ms per step.

Run by hand:  .venv/bin/python benchmarks/graph.py
(needs nginx and wrk: apt-get install -y nginx-light wrk)
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from common import (
    CHAT_PATH,
    INSTALL_HINT,
    WRK_SCRIPT,
    Child,
    backends_conf,
    free_ports,
    median,
    nproc,
    require_binaries,
    run_wrk,
    start_nginx,
    wait_for_port,
)

ROOT = Path(__file__).resolve().parent.parent
EXE = ROOT / ".venv" / "bin" / "modelyard"
STEPS = 3


def graphs(ports: list[int]) -> dict[str, dict]:
    urls = [f"http://127.0.0.1:{p}{CHAT_PATH}" for p in ports]
    sequence = [{"name": f"s{i}", "serviceUrl": url, "data": "$response"} for i, url in enumerate(urls)]
    ensemble = [{"name": f"m{i}", "serviceUrl": url} for i, url in enumerate(urls)]
    return {
        "seq": {"nodes": {"root": {"routerType": "Sequence", "steps": sequence}}},
        "ens": {"nodes": {"root": {"routerType": "Ensemble", "steps": ensemble}}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per target; medians shown (default 3)")
    args = parser.parse_args(argv)
    if require_binaries("nginx", "wrk"):
        print(f"missing nginx or wrk: {INSTALL_HINT}", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="modelyard-graph-bench-"))
    backend_ports = free_ports(STEPS)
    gateway_port, router_seq_port, router_ens_port = free_ports(3)
    specs = graphs(backend_ports)
    children: list[Child] = []
    try:
        nginx = start_nginx("backends", tmp / "nginx", backends_conf(tmp / "nginx", backend_ports))
        children.append(nginx)
        wait_for_port(backend_ports[0], nginx)
        config = tmp / "gateway.yaml"
        config.write_text(json.dumps({"listen": {"port": gateway_port}, "graphs": specs}))
        gateway = Child(
            "gateway",
            [str(EXE), "serve", "-c", str(config), "--workers", "1", "--log-level", "warning"],
            tmp / "gw.log",
        )
        children.append(gateway)
        for name, port in (("seq", router_seq_port), ("ens", router_ens_port)):
            argv = [str(EXE), "graph", "serve", "--graph-json", json.dumps(specs[name]), "--port", str(port),
                    "--host", "127.0.0.1", "--drain-seconds", "0"]  # fmt: skip
            children.append(Child(f"router-{name}", argv, tmp / f"router-{name}.log"))
        wait_for_port(gateway_port, gateway)
        for child, port in zip(children[2:], (router_seq_port, router_ens_port), strict=True):
            wait_for_port(port, child)

        script = tmp / "post.lua"
        script.write_text(WRK_SCRIPT)
        targets = {
            "direct (one call)": f"http://127.0.0.1:{backend_ports[0]}{CHAT_PATH}",
            "gateway seq": f"http://127.0.0.1:{gateway_port}/v1/graphs/seq",
            "gateway ens": f"http://127.0.0.1:{gateway_port}/v1/graphs/ens",
            "router seq": f"http://127.0.0.1:{router_seq_port}/",
            "router ens": f"http://127.0.0.1:{router_ens_port}/",
        }
        for url in targets.values():  # warm-up
            run_wrk("warm-up", url, script, 1, 1.0)
        p50: dict[str, list[float]] = {name: [] for name in targets}
        errors: dict[str, int] = dict.fromkeys(targets, 0)
        for _ in range(args.repeat):
            for name, url in targets.items():
                result = run_wrk(name, url, script, 1, args.duration)
                p50[name].append(result.p50_ms)
                errors[name] += result.errors
    finally:
        for child in reversed(children):
            child.stop()

    one = median(p50["direct (one call)"])
    print(f"concurrency 1, wrk, median of {args.repeat} runs of {args.duration:g}s\n")
    print("| target | p50 ms | floor ms | added ms | added per step ms | errors |")
    print("|:--|--:|--:|--:|--:|--:|")
    print(f"| direct (one call) | {one:.3f} | | | | {errors['direct (one call)']} |")
    for name in ("gateway seq", "router seq", "gateway ens", "router ens"):
        value = median(p50[name])
        floor = one * STEPS if name.endswith("seq") else one
        added = value - floor
        print(
            f"| {name} | {value:.3f} | {floor:.3f} | {added:+.3f} | {added / STEPS:+.3f} | {errors[name]} |"
        )
    print(f"\ncommand: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"date: {datetime.now(UTC):%Y-%m-%d %H:%M UTC}, nproc {nproc()}, python {platform.python_version()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
