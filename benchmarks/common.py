"""Helpers for the benchmarks: free ports, child processes, nginx configs, wrk runs and their output.

Nothing here imports modelyard: the benchmarks drive the gateway as a subprocess, like a user would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

INSTALL_HINT = "apt-get install -y nginx wrk"

CHAT_PATH = "/v1/chat/completions"
CHAT_BODY = '{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
# What the zero-latency backend answers: a small, fixed OpenAI chat.completion.
CHAT_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    separators=(",", ":"),
)

WRK_SCRIPT = f"""\
wrk.method = "POST"
wrk.body = '{CHAT_BODY}'
wrk.headers["Content-Type"] = "application/json"
"""


def require_binaries(*names: str) -> list[str]:
    """The names in `names` that are not on PATH."""
    return [name for name in names if shutil.which(name) is None]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports, all held open together while choosing so none repeats."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


# --- child processes --------------------------------------------------------------------------


class Child:
    """A long-running child process (nginx master, gateway) with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = log_path.open("wb")
        # A new session: Ctrl-C in the terminal reaches only this script, which then stops us in order.
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()


def wait_for_port(port: int, child: Child, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:\n{child.log_tail()}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(
        f"{child.name} did not listen on {host}:{port} within {timeout:.0f}s:\n{child.log_tail()}"
    )


def post_chat(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One chat request, as wrk sends it; returns (status, body). Raises OSError when nothing answered."""
    request = urllib.request.Request(
        url,
        data=CHAT_BODY.encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def wait_for_chat(
    url: str, child: Child, timeout: float = 20.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """Poll with the benchmark's own request until it answers 200 (or give up, returning the last answer)."""
    deadline = time.monotonic() + timeout
    last: tuple[int, bytes] = (0, b"no answer")
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}:\n{child.log_tail()}")
        try:
            last = post_chat(url, timeout=2.0, headers=headers)
        except OSError as error:
            last = (0, repr(error).encode())
        else:
            if 200 <= last[0] < 300:
                return last
        time.sleep(0.1)
    return last


# --- nginx --------------------------------------------------------------------------------------


def nginx_version() -> str:
    out = subprocess.run(["nginx", "-v"], capture_output=True, text=True, check=False)
    text = (out.stderr or out.stdout).strip()
    return text.rsplit("/", 1)[-1] if "/" in text else text


def _nginx_temp_paths(tmp: Path) -> str:
    """Every temp path the binary has a module for, inside `tmp` (so nothing under /var/lib/nginx)."""
    built = subprocess.run(["nginx", "-V"], capture_output=True, text=True, check=False).stderr
    lines = [f"client_body_temp_path {tmp}/client_body;", f"proxy_temp_path {tmp}/proxy;"]
    for module in ("fastcgi", "uwsgi", "scgi"):
        if f"--without-http_{module}_module" not in built:
            lines.append(f"{module}_temp_path {tmp}/{module};")
    return "\n    ".join(lines)


def _nginx_conf(tmp: Path, servers: str) -> str:
    return f"""\
daemon off;
master_process on;
worker_processes 1;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    {_nginx_temp_paths(tmp)}
    keepalive_timeout 300s;
    keepalive_requests 100000000;

{servers}
}}
"""


def backends_conf(tmp: Path, ports: list[int]) -> str:
    """Zero-latency OpenAI backends: one server per port answering a fixed chat.completion."""
    assert "'" not in CHAT_COMPLETION and "$" not in CHAT_COMPLETION
    servers = "\n".join(
        f"""\
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        default_type application/json;
        location = {CHAT_PATH} {{
            if ($request_method != POST) {{ return 405; }}
            return 200 '{CHAT_COMPLETION}';
        }}
        location = /health {{ return 200 '{{}}'; }}
        location / {{ return 404 '{{"error":"not found"}}'; }}
    }}"""
        for port in ports
    )
    return _nginx_conf(tmp, servers)


def proxy_conf(tmp: Path, port: int, upstream_ports: list[int], keepalive: int = 64) -> str:
    """nginx as the reference proxy: round robin with a keep-alive pool over HTTP/1.1."""
    members = "\n".join(f"        server 127.0.0.1:{p};" for p in upstream_ports)
    servers = f"""\
    upstream backends {{
{members}
        keepalive {keepalive};
        keepalive_requests 100000000;
        keepalive_timeout 300s;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://backends;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}"""
    return _nginx_conf(tmp, servers)


def start_nginx(name: str, tmp: Path, conf: str) -> Child:
    tmp.mkdir(parents=True, exist_ok=True)
    # Workers drop to an unprivileged user when the master runs as root; let them reach their temp paths.
    tmp.chmod(0o755)
    conf_path = tmp / "nginx.conf"
    conf_path.write_text(conf)
    # -e: the error log before the config is read (else nginx opens its compiled-in default).
    argv = ["nginx", "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(conf_path)]
    check = subprocess.run([*argv, "-t", "-q"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise RuntimeError(f"{name}: nginx -t failed:\n{check.stderr}\n--- {conf_path}:\n{conf}")
    return Child(name, argv, tmp / "stdout.log")


# --- wrk ----------------------------------------------------------------------------------------


@dataclass
class WrkResult:
    target: str
    connections: int
    duration_s: float
    requests: int = 0
    requests_per_s: float = 0.0
    p50_ms: float = float("nan")
    p75_ms: float = float("nan")
    p90_ms: float = float("nan")
    p99_ms: float = float("nan")
    non_2xx_3xx: int = 0
    socket_errors: dict[str, int] = field(default_factory=dict)
    repeat: int = 0
    returncode: int = 0
    raw: str = ""
    cpu_s: float | None = None  # CPU the proxy under test used during the run (its whole process tree)

    @property
    def errors(self) -> int:
        return self.non_2xx_3xx + sum(self.socket_errors.values())

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["errors"] = self.errors
        return data


def wrk_version() -> str:
    out = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    first = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ""
    parts = first.split()
    return parts[1] if len(parts) > 1 else first


_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_DURATION = re.compile(r"^([\d.]+)(us|ms|s|m|h)$")


def _to_ms(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"unexpected wrk duration {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def parse_wrk(output: str, result: WrkResult) -> WrkResult:
    """Fill `result` from wrk's text output (run with --latency)."""
    if m := re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M):
        result.requests_per_s = float(m.group(1))
    if m := re.search(r"^\s*(\d+) requests in ", output, re.M):
        result.requests = int(m.group(1))
    for pct, attr in (("50", "p50_ms"), ("75", "p75_ms"), ("90", "p90_ms"), ("99", "p99_ms")):
        if m := re.search(rf"^\s+{pct}%\s+(\S+)", output, re.M):
            setattr(result, attr, _to_ms(m.group(1)))
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output):
        result.non_2xx_3xx = int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output):
        result.socket_errors = dict(
            zip(("connect", "read", "write", "timeout"), map(int, m.groups()), strict=True)
        )
    return result


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and every process below it (nginx's workers,
    a gateway's children), read from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids, total = [pid], 0.0
    while pids:
        current = pids.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                pids.extend(int(c) for c in children.read_text().split())
            except OSError:
                continue
    return total


def run_wrk(
    target: str, url: str, script: Path, connections: int, duration_s: float, timeout_s: str = "2s"
) -> WrkResult:
    """One bounded wrk run: 1 thread, `connections` keep-alive connections, latency distribution."""
    argv = [
        "wrk",
        "--latency",
        "-t1",
        f"-c{connections}",
        f"-d{duration_s:g}s",
        f"--timeout={timeout_s}",
        "-s",
        str(script),
        url,
    ]
    result = WrkResult(target=target, connections=connections, duration_s=duration_s)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 30, check=False)
    except subprocess.TimeoutExpired as error:
        result.returncode = 124
        result.raw = f"wrk did not finish: {error}"
        return result
    result.returncode = out.returncode
    result.raw = out.stdout + out.stderr
    return parse_wrk(result.raw, result)


def median(values: list[float]) -> float:
    clean = [v for v in values if v == v]  # drop NaN
    return statistics.median(clean) if clean else float("nan")


def nproc() -> int:
    return len(os.sched_getaffinity(0))
