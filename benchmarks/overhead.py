"""Gateway overhead: what the modelyard gateway adds over hitting a backend directly, next to nginx
and vLLM's Rust router.

Targets, same zero-latency backends (nginx returning a fixed chat.completion), same load (wrk):
  direct       one backend, no proxy in between
  nginx        nginx round robin over the 3 backends (keep-alive upstream pool, HTTP/1.1)
  vllm-router  vLLM's router (`pip install vllm-router`), round robin over the 3 backends; in the
               default targets when the command is found (--vllm-router)
  modelyard    `modelyard serve -c <generated yaml>` round robin over the 3 backends, the default
               config (`listen.workers: auto`: one process per CPU; `--variant` for others)

With --tls, TLS beside plain text in the same run (a trustme CA, the backends also listening over
TLS; vLLM's router has no TLS of its own):
  direct-tls        wrk to one backend over TLS
  nginx-tls-up      nginx, plain from wrk, TLS to the backends (proxy_ssl_verify, session reuse)
  nginx-tls         nginx, TLS from wrk and to the backends
  modelyard-tls-up  the gateway, plain from wrk, TLS to the backends (upstream.tls.ca_file)
  modelyard-tls     the gateway, TLS from wrk (listen.tls) and to the backends

For each proxy the table also shows the CPU it used per request (its whole process tree, from /proc).

Run by hand, never from the test suite:  .venv/bin/python benchmarks/overhead.py
See benchmarks/README.md for how to read the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.markup import escape

from common import (
    CHAT_PATH,
    INSTALL_HINT,
    WRK_SCRIPT,
    Child,
    WrkResult,
    backends_conf,
    free_ports,
    median,
    nginx_version,
    nproc,
    post_chat,
    process_tree_cpu,
    proxy_conf,
    require_binaries,
    run_wrk,
    start_nginx,
    wait_for_chat,
    wait_for_port,
    wrk_version,
)

ROOT = Path(__file__).resolve().parent.parent
PLAIN_TARGETS = ("direct", "nginx", "vllm-router", "modelyard")
# Every target, in the tables' order: each TLS one after the plain one it is measured against.
TARGETS = (
    "direct", "direct-tls", "nginx", "nginx-tls-up", "nginx-tls", "vllm-router",
    "modelyard", "modelyard-tls-up", "modelyard-tls",
)  # fmt: skip
TLS_OF = {
    "direct": ("direct-tls",),
    "nginx": ("nginx-tls-up", "nginx-tls"),
    "modelyard": ("modelyard-tls-up", "modelyard-tls"),
}
WARMUP_S = 2.0


def _csv_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive integers separated by commas, e.g. 1,64")
    return values


def _csv_targets(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [v for v in values if v not in TARGETS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"choose from {','.join(TARGETS)}; got {text!r}")
    return [t for t in TARGETS if t in values]  # fixed order: direct first, it is the baseline


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per (target, concurrency); medians shown")
    parser.add_argument(
        "--concurrency", type=_csv_ints, default=[1, 64], help="wrk connections, comma-separated (1,64)"
    )
    parser.add_argument(
        "--targets",
        type=_csv_targets,
        default=None,
        help="any of " + ",".join(TARGETS) + " (default: direct,nginx,vllm-router,modelyard, "
        "vllm-router when found)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="add the TLS targets of the plain ones chosen (direct-tls; nginx-tls-up, nginx-tls; "
        "modelyard-tls-up, modelyard-tls): TLS's cost against plain text in the same run",
    )
    parser.add_argument(
        "--vllm-router",
        default="vllm-router",
        metavar="CMD",
        help="vLLM's router executable (pip install vllm-router; default: vllm-router on PATH)",
    )
    parser.add_argument(
        "--gateway-cmd",
        help="command that starts the gateway; {config} is replaced by the generated YAML path "
        "(appended as `-c PATH` when absent). Default: .venv/bin/modelyard serve -c {config} "
        "--log-level warning (uvloop is used when installed in that environment)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="one more gateway as a target named NAME, started by CMD as --gateway-cmd says "
        "(repeatable): before/after or setting against setting in one run, e.g. "
        "--variant 'aiohttp=env MODELYARD_LISTEN__LEAN=false .venv/bin/modelyard serve -c {config}'",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start each proxy anew (and warm it up) before each of its runs: at one connection, "
        "where a process happens to run against wrk and nginx moves latency as much as its code",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="send `Authorization: Bearer KEY` with every request, to every target (the others ignore "
        "it): for variants with auth.enabled, e.g. --variant 'auth=env MODELYARD_AUTH__ENABLED=true "
        "MODELYARD_AUTH__KEYS_FILE=benchmarks/bench-keys.yaml .venv/bin/modelyard serve -c {config}'",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write raw results (every run) here")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (configs, logs)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.repeat < 1:
        parser.error("--duration must be > 0 and --repeat >= 1")
    if args.targets is None:
        found = shutil.which(args.vllm_router) is not None
        args.targets = [t for t in PLAIN_TARGETS if t != "vllm-router" or found]
    if args.tls:
        wanted = {*args.targets, *(tls for t in args.targets for tls in TLS_OF.get(t, ()))}
        args.targets = [t for t in TARGETS if t in wanted]
    variants: dict[str, str] = {}
    for text in args.variant:
        name, sep, command = text.partition("=")
        if not sep or not name or not command.strip() or name in TARGETS or name in variants:
            taken = ", ".join(TARGETS)
            parser.error(f"--variant {text!r}: expected NAME=CMD with a new name (not one of {taken})")
        variants[name] = command
    args.variants = variants
    args.targets = [*args.targets, *variants]
    return args


# --- the gateway ----------------------------------------------------------------------------


def gateway_argv(gateway_cmd: str | None, config: Path) -> list[str]:
    if gateway_cmd is None:
        exe = ROOT / ".venv" / "bin" / "modelyard"
        if not exe.exists():
            exe = Path(sys.executable).parent / "modelyard"
        return [str(exe), "serve", "-c", str(config), "--log-level", "warning"]
    argv = shlex.split(gateway_cmd)
    if any("{config}" in part for part in argv):
        return [part.replace("{config}", str(config)) for part in argv]
    return [*argv, "-c", str(config)]


def gateway_yaml(
    port: int, backend_ports: list[int], tls: Tls | None = None, listen_tls: bool = False
) -> str:
    """The gateway's config; with `tls`, https:// backends verified with its CA (upstream.tls) and,
    with `listen_tls`, HTTPS to its clients (listen.tls)."""
    scheme = "https" if tls is not None else "http"
    endpoints = "\n".join(f"      - url: {scheme}://127.0.0.1:{p}" for p in backend_ports)
    listen = upstream = ""
    if tls is not None:
        upstream = f"upstream:\n  tls: {{ca_file: {tls.ca}}}\n"
        if listen_tls:
            listen = f"  tls: {{cert_file: {tls.cert}, key_file: {tls.key}}}\n"
    return f"""\
listen:
  host: 127.0.0.1
  port: {port}
{listen}{upstream}models:
  - name: bench
    strategy: round_robin
    health_check: {{interval: 60s}}
    endpoints:
{endpoints}
"""


# --- TLS --------------------------------------------------------------------------------------


class Tls:
    """A CA and a server certificate for 127.0.0.1 and localhost (trustme, ECDSA P-256 keys), as
    PEM files in `folder`."""

    def __init__(self, folder: Path) -> None:
        try:
            import trustme
        except ImportError:
            raise RuntimeError("--tls needs trustme (in the dev environment: uv sync)") from None
        folder.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA(organization_name="modelyard benchmark", key_type=trustme.KeyType.ECDSA)
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        self.ca, self.cert, self.key = folder / "ca.pem", folder / "server.pem", folder / "server.key"
        ca.cert_pem.write_to_path(str(self.ca))
        self.cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        self.key.write_bytes(leaf.private_key_pem.bytes())
        self.key_type = "ECDSA P-256"


def _sub_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(f"generated nginx config changed: {old!r} not found once")
    return text.replace(old, new)


def tls_backends_conf(tmp: Path, ports: list[int], tls_ports: list[int], tls: Tls) -> str:
    """The backends, also listening over TLS on `tls_ports` (the same answers)."""
    conf = backends_conf(tmp, ports + tls_ports)
    for port in tls_ports:
        conf = _sub_once(
            conf,
            f"listen 127.0.0.1:{port} backlog=4096;",
            f"listen 127.0.0.1:{port} ssl backlog=4096;\n"
            f"        ssl_certificate {tls.cert};\n        ssl_certificate_key {tls.key};",
        )
    return conf


def tls_proxy_conf(tmp: Path, port: int, tls_ports: list[int], tls: Tls, listen_tls: bool) -> str:
    """nginx to the backends over TLS (verified with the CA, sessions reused, connections kept
    alive as in proxy_conf), and with `listen_tls` serving TLS itself."""
    conf = proxy_conf(tmp, port, tls_ports)
    conf = _sub_once(
        conf,
        "proxy_pass http://backends;",
        "proxy_pass https://backends;\n"
        f"            proxy_ssl_trusted_certificate {tls.ca};\n"
        "            proxy_ssl_verify on;\n"
        "            proxy_ssl_name localhost;\n"
        "            proxy_ssl_session_reuse on;",
    )
    if listen_tls:
        conf = _sub_once(
            conf,
            f"listen 127.0.0.1:{port} backlog=4096;",
            f"listen 127.0.0.1:{port} ssl backlog=4096;\n"
            f"        ssl_certificate {tls.cert};\n        ssl_certificate_key {tls.key};",
        )
    return conf


def _interpreter_of(exe: str) -> str | None:
    """The Python behind a console script (its shebang), or the exe itself when it is a Python."""
    path = shutil.which(exe) or exe
    if Path(path).name.startswith("python"):
        return path
    try:
        with open(path, "rb") as f:
            first = f.readline().decode(errors="replace").strip()
    except OSError:
        return None
    if first.startswith("#!") and "python" in first:
        return first[2:].strip().split()[0]
    return None


def gateway_versions(argv: list[str]) -> str:
    python = _interpreter_of(argv[0])
    if python is None:
        return "unknown (not a Python entry point)"
    probe = (
        "import platform, importlib.metadata as m\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except Exception: return 'absent'\n"
        "print(f\"modelyard {v('modelyard')}, python {platform.python_version()}, "
        "uvloop {v('uvloop')}, aiohttp {v('aiohttp')}\")"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False, timeout=30)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def loaded_event_loop(pid: int) -> str:
    """Which loop the running gateway really has: uvloop's extension mapped in it (or a child) or not."""
    pids, seen = [pid], []
    while pids:
        current = pids.pop()
        seen.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            pids.extend(int(c) for c in children.read_text().split())
    for p in seen:
        try:
            if "/uvloop/loop." in Path(f"/proc/{p}/maps").read_text():
                return "uvloop"
        except OSError:
            continue
    return "asyncio (uvloop not loaded)"


# --- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    children: list[Child] = []
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        tls = Tls(tmp / "tls") if any("-tls" in t for t in args.targets) else None
        # One call for every port: a later call could hand out one already given, not yet bound.
        gateways = 1 + len(args.variants)
        ports = free_ports(5 + gateways + (7 if tls is not None else 0))
        backend_ports, proxy_port, router_port = ports[:3], ports[3], ports[4]
        gateway_ports, tls_ports = ports[5 : 5 + gateways], ports[5 + gateways :]
        # TLS: the backends' own TLS ports, then nginx's and the gateway's, each to TLS backends
        # and from plain or TLS clients.
        tls_backend_ports = tls_ports[:3]
        if tls is None:
            conf = backends_conf(tmp / "backends", backend_ports)
        else:
            conf = tls_backends_conf(tmp / "backends", backend_ports, tls_backend_ports, tls)
            # This process's own requests (the sanity checks) trust the benchmark's CA; wrk verifies nothing.
            context = ssl.create_default_context(cafile=str(tls.ca))
            urllib.request.install_opener(
                urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
            )
        backends = start_nginx("backends (nginx)", tmp / "backends", conf)
        children.append(backends)
        for port in backend_ports + tls_backend_ports:
            wait_for_port(port, backends)

        urls = {"direct": f"http://127.0.0.1:{backend_ports[0]}{CHAT_PATH}"}
        meta: dict[str, Any] = {}
        if tls is not None:
            urls["direct-tls"] = f"https://127.0.0.1:{tls_backend_ports[0]}{CHAT_PATH}"
            meta["tls_certificates"] = (
                f"trustme CA ({tls.key_type}), a certificate for 127.0.0.1 and localhost"
            )
        # How each proxy under test starts, ready to serve (`--fresh` starts it again before each
        # run); `running` holds the process now serving, whose tree's CPU is the proxy's.
        starters: dict[str, Callable[[], Child]] = {}

        def started(child: Child) -> Child:
            children.append(child)
            return child

        if "nginx" in args.targets:
            urls["nginx"] = f"http://127.0.0.1:{proxy_port}{CHAT_PATH}"

            def start_proxy() -> Child:
                conf = proxy_conf(tmp / "proxy", proxy_port, backend_ports)
                proxy = started(start_nginx("proxy (nginx)", tmp / "proxy", conf))
                wait_for_port(proxy_port, proxy)
                return proxy

            starters["nginx"] = start_proxy
        for name, port, listen_tls in (("nginx-tls-up", 3, False), ("nginx-tls", 4, True)):
            if name not in args.targets or tls is None:
                continue
            scheme = "https" if listen_tls else "http"
            urls[name] = f"{scheme}://127.0.0.1:{tls_ports[port]}{CHAT_PATH}"

            def start_tls_proxy(
                name: str = name, port: int = tls_ports[port], listen_tls: bool = listen_tls, tls: Tls = tls
            ) -> Child:
                conf = tls_proxy_conf(tmp / name, port, tls_backend_ports, tls, listen_tls)
                proxy = started(start_nginx(f"proxy ({name})", tmp / name, conf))
                wait_for_port(port, proxy)
                return proxy

            starters[name] = start_tls_proxy
        if "vllm-router" in args.targets:
            urls["vllm-router"] = f"http://127.0.0.1:{router_port}{CHAT_PATH}"
            router_argv = [
                args.vllm_router,
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--worker-urls",
                *(f"http://127.0.0.1:{p}" for p in backend_ports),
                "--policy",
                "round_robin",
                "--log-level",
                "warning",
            ]

            def start_router() -> Child:
                router = started(Child("vllm-router", router_argv, tmp / "vllm-router.log"))
                wait_for_chat(urls["vllm-router"], router)
                return router

            starters["vllm-router"] = start_router
        commands = {"modelyard": args.gateway_cmd, **args.variants}
        gateways_run = [
            (name, command, port, gateway_yaml(port, backend_ports), "http")
            for (name, command), port in zip(commands.items(), gateway_ports, strict=True)
        ]
        if tls is not None:
            for name, port, listen_tls in (("modelyard-tls-up", 5, False), ("modelyard-tls", 6, True)):
                text = gateway_yaml(tls_ports[port], tls_backend_ports, tls, listen_tls)
                scheme = "https" if listen_tls else "http"
                gateways_run.append((name, args.gateway_cmd, tls_ports[port], text, scheme))
        for name, command, port, text, scheme in gateways_run:
            if name not in args.targets:
                continue
            config = tmp / f"gateway-{name}.yaml"
            config.write_text(text)
            argv = gateway_argv(command, config)
            urls[name] = f"{scheme}://127.0.0.1:{port}{CHAT_PATH}"
            if name == "modelyard":
                meta["gateway_argv"] = argv
                meta["gateway_versions"] = gateway_versions(argv)
            elif name in args.variants:
                meta.setdefault("variant_argv", {})[name] = argv

            def start_gateway(name: str = name, argv: list[str] = argv) -> Child:
                gateway = started(Child(f"gateway {name}", argv, tmp / f"gateway-{name}.log"))
                status, body = wait_for_chat(urls[name], gateway, headers=auth)
                if not 200 <= status < 300:
                    say(f"[red]{name}: first request answered {status}:[/red] {escape(repr(body[:300]))}")
                    say(f"gateway log tail:\n{escape(gateway.log_tail())}")
                return gateway

            starters[name] = start_gateway
        running = {target: start() for target, start in starters.items()}
        if "modelyard" in running:
            meta["gateway_event_loop"] = loaded_event_loop(running["modelyard"].proc.pid)

        # One request per target before loading it: the answer must be the backend's chat.completion.
        for target in args.targets:
            try:
                status, body = post_chat(urls[target], headers=auth)
            except OSError as error:
                status, body = 0, repr(error).encode()
            ok = 200 <= status < 300 and b'"chat.completion"' in body
            meta.setdefault("sanity", {})[target] = {
                "status": status,
                "body": body[:300].decode(errors="replace"),
            }
            if not ok:
                say(
                    f"[yellow]{target}: sanity request answered {status}:[/yellow] {escape(repr(body[:300]))}"
                )

        script = tmp / "chat.lua"
        script.write_text(WRK_SCRIPT + "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in auth.items()))
        for target in args.targets:
            say(f"warm-up {target} ({WARMUP_S:g}s, {max(args.concurrency)} connections)")
            run_wrk(target, urls[target], script, max(args.concurrency), WARMUP_S)

        # Rounds interleave the targets, so drift (other load, thermal) hits them alike.
        runs: list[WrkResult] = []
        total = args.repeat * len(args.concurrency) * len(args.targets)
        for round_ in range(args.repeat):
            for conns in args.concurrency:
                for target in args.targets:
                    if args.fresh and target in running:  # a new process, warmed up, for each run
                        running[target].stop()
                        running[target] = starters[target]()
                        run_wrk(target, urls[target], script, conns, WARMUP_S)
                    pid = running[target].proc.pid if target in running else None
                    cpu = process_tree_cpu(pid) if pid else None
                    result = run_wrk(target, urls[target], script, conns, args.duration)
                    if cpu is not None:
                        result.cpu_s = process_tree_cpu(pid) - cpu
                    result.repeat = round_
                    runs.append(result)
                    say(
                        f"[{len(runs)}/{total}] {target:<11} c={conns:<3} {result.requests_per_s:>9.0f} req/s"
                        f"  p50 {result.p50_ms:.3f} ms  p99 {result.p99_ms:.3f} ms  errors {result.errors}"
                        + (f"  (wrk exit {result.returncode})" if result.returncode else "")
                    )
        for name, child in running.items():
            if not child.alive():
                code = child.proc.returncode
                say(f"[red]{name} exited during the run ({code}):[/red]\n{escape(child.log_tail())}")
        if "modelyard" in running:
            meta["gateway_log_tail"] = running["modelyard"].log_tail(50)
        return {"urls": urls, "runs": runs, **meta}
    finally:
        for child in reversed(children):
            child.stop()


def _cpu_ms(runs: list[WrkResult]) -> float | None:
    """The median proxy CPU milliseconds per request over the runs that measured it; None if none."""
    per_request = [1000 * r.cpu_s / r.requests for r in runs if r.cpu_s is not None and r.requests]
    return median(per_request) if per_request else None


def summarize(runs: list[WrkResult], targets: list[str], concurrency: list[int]) -> list[dict[str, Any]]:
    rows = []
    for conns in concurrency:
        group = {t: [r for r in runs if r.target == t and r.connections == conns] for t in targets}
        med = {
            t: {
                "rps": median([r.requests_per_s for r in rs]),
                "p50": median([r.p50_ms for r in rs]),
                "p99": median([r.p99_ms for r in rs]),
                "non_2xx": sum(r.non_2xx_3xx for r in rs),
                "socket": sum(sum(r.socket_errors.values()) for r in rs),
                "cpu_ms": _cpu_ms(rs),
                "runs": len(rs),
            }
            for t, rs in group.items()
        }
        for target in targets:
            m = med[target]
            direct = med.get("direct")
            nginx = med.get("nginx")
            router = med.get("vllm-router")
            rows.append(
                {
                    "concurrency": conns,
                    "target": target,
                    "requests_per_s": m["rps"],
                    "p50_ms": m["p50"],
                    "p99_ms": m["p99"],
                    "added_p50_ms": m["p50"] - direct["p50"] if direct else None,
                    "rps_vs_nginx": m["rps"] / nginx["rps"] if nginx and nginx["rps"] else None,
                    "rps_vs_vllm_router": m["rps"] / router["rps"] if router and router["rps"] else None,
                    "cpu_ms_per_request": m["cpu_ms"],
                    "non_2xx": m["non_2xx"],
                    "socket_errors": m["socket"],
                    "runs": m["runs"],
                }
            )
    return rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|" + "|".join("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths)) + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def report_lines(rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any]) -> list[str]:
    header = [
        "target", "req/s", "p50 ms", "p99 ms", "added p50 vs direct ms", "req/s ÷ nginx",
        "req/s ÷ vllm-router", "CPU ms/req", "errors",
    ]  # fmt: skip
    lines: list[str] = []
    for conns in args.concurrency:
        cells = []
        for row in (r for r in rows if r["concurrency"] == conns):
            errors = row["non_2xx"] + row["socket_errors"]
            cells.append(
                [
                    row["target"],
                    f"{row['requests_per_s']:,.0f}",
                    f"{row['p50_ms']:.3f}",
                    f"{row['p99_ms']:.3f}",
                    "—" if row["added_p50_ms"] is None else f"{row['added_p50_ms']:+.3f}",
                    "—" if row["rps_vs_nginx"] is None else f"{row['rps_vs_nginx']:.2f}",
                    "—" if row["rps_vs_vllm_router"] is None else f"{row['rps_vs_vllm_router']:.2f}",
                    "—" if row["cpu_ms_per_request"] is None else f"{row['cpu_ms_per_request']:.3f}",
                    f"{errors} ({row['non_2xx']} non-2xx, {row['socket_errors']} socket)" if errors else "0",
                ]
            )
        lines += [f"{conns} connection(s): wrk -t1 -c{conns}, median of {args.repeat} run(s)", ""]
        lines += [markdown_table(header, cells), ""]
    return lines + tls_lines(rows, args) + footer(info)


def plain_of(target: str) -> str:
    """The plain target a TLS one is measured against ("" for a plain one)."""
    return next((plain for plain, tls in TLS_OF.items() if target in tls), "")


def tls_lines(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Each TLS target against its plain one, in the same run: req/s as a share of the plain
    target's, and what TLS adds to the p50 and to the proxy's CPU per request."""
    header = [
        "connections",
        "target",
        "req/s",
        "÷ plain",
        "p50 ms",
        "added p50 ms",
        "CPU ms/req",
        "added CPU ms/req",
    ]
    cells = []
    for conns in args.concurrency:
        by = {r["target"]: r for r in rows if r["concurrency"] == conns}
        for target, row in by.items():
            plain = by.get(plain_of(target))
            if plain is None:
                continue
            cpu, plain_cpu = row["cpu_ms_per_request"], plain["cpu_ms_per_request"]
            cells.append(
                [
                    str(conns),
                    f"{target} (vs {plain['target']})",
                    f"{row['requests_per_s']:,.0f}",
                    f"{row['requests_per_s'] / plain['requests_per_s']:.2f}"
                    if plain["requests_per_s"]
                    else "—",
                    f"{row['p50_ms']:.3f}",
                    f"{row['p50_ms'] - plain['p50_ms']:+.3f}",
                    "—" if cpu is None else f"{cpu:.3f}",
                    "—" if cpu is None or plain_cpu is None else f"{cpu - plain_cpu:+.3f}",
                ]
            )
    if not cells:
        return []
    return ["TLS against plain text, same proxy, same run (medians):", "", markdown_table(header, cells), ""]


def footer(info: dict[str, Any]) -> list[str]:
    lines = [
        f"command: {info['command']}",
        f"date: {info['date']}",
        f"nproc: {info['nproc']}  (load average at start: {info['loadavg_start']})",
        f"versions: nginx {info['nginx']}, wrk {info['wrk']}, python {info['python']} ({info['platform']})",
    ]
    if "gateway_versions" in info:
        lines.append(
            f"gateway: {info['gateway_versions']}; event loop: {info.get('gateway_event_loop', '?')}"
        )
        lines.append(f"gateway command: {shlex.join(info['gateway_argv'])}")
    for name, argv in info.get("variant_argv", {}).items():
        lines.append(f"{name} command: {shlex.join(argv)}")
    if "tls_certificates" in info:
        lines.append(
            f"TLS: {info['tls_certificates']}; -tls-up: TLS to the backends, -tls: from wrk too; "
            "connections kept alive throughout (nginx: proxy_ssl_verify, proxy_ssl_session_reuse)"
        )
    lines.append(
        f"load: wrk 1 thread, {info['duration_s']:g}s per run, "
        + (
            f"each proxy started anew before each run and warmed up for {WARMUP_S:g}s (--fresh)"
            if info.get("fresh")
            else f"{WARMUP_S:g}s warm-up per target"
        )
        + " (not reported); backends: 3 zero-latency nginx servers (1 worker)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    err = Console(stderr=True, highlight=False)

    missing = require_binaries("nginx", "wrk")
    hints = [INSTALL_HINT] if missing else []
    if "vllm-router" in args.targets and shutil.which(args.vllm_router) is None:
        missing.append(args.vllm_router)
        hints.append("pip install vllm-router")
    if missing:
        print(f"missing: {', '.join(missing)}. Install with:\n  " + "\n  ".join(hints), file=sys.stderr)
        return 2

    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop nginx and the gateway.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info: dict[str, Any] = {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "nproc": nproc(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "nginx": nginx_version(),
        "wrk": wrk_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "duration_s": args.duration,
        "repeat": args.repeat,
        "concurrency": args.concurrency,
        "targets": args.targets,
        "warmup_s": WARMUP_S,
        "fresh": args.fresh,
    }
    tmp = Path(tempfile.mkdtemp(prefix="modelyard-bench-"))
    failed = True
    try:
        result = run(args, tmp, err.print)
        failed = False
    except RuntimeError as error:
        err.print(f"[red]error:[/red] {escape(str(error))}")
        return 1
    finally:
        if args.keep_tmp or failed:
            err.print(f"configs and logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    runs: list[WrkResult] = result.pop("runs")
    shown = ("gateway_", "variant_", "tls_")  # what the footer names: versions, commands, certificates
    info.update({k: v for k, v in result.items() if k.startswith(shown) and k != "gateway_log_tail"})
    rows = summarize(runs, args.targets, args.concurrency)
    print()
    print("\n".join(report_lines(rows, args, info)), flush=True)

    bad = [r for r in runs if r.errors or r.returncode]
    if bad:
        first = bad[0]
        err.print(
            f"\n{len(bad)} run(s) had errors; first: {first.target} c={first.connections}:", markup=False
        )
        err.print(first.raw, markup=False)
        if "gateway_log_tail" in result and any(r.target == "modelyard" for r in bad):
            err.print(f"gateway log tail:\n{result['gateway_log_tail']}", markup=False)

    if args.json:
        payload = {
            "info": info,
            "summary": rows,
            "runs": [r.to_json() for r in runs],
            **{k: v for k, v in result.items() if k not in info},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        err.print(f"raw results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
