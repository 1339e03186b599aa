"""What writing one access log line costs the thread that writes it (the event loop's, in a gateway).

`AccessLog.write` is called `--lines` times in a loop with the line going, as `serve` sends it,
through the writer thread (`thread`), or through a StreamHandler on the calling thread writing
each line to a file (`stream`, as the access log did before it had a thread). It prints the
calling thread's CPU per line and the whole process's.

Run by hand:  .venv/bin/python benchmarks/access_log_write.py
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
import time

from modelyard.config import LoggingConfig
from modelyard.gateway.access_log import LOGGER, AccessLog, AccessOutput
from modelyard.gateway.routing_log import RoutingLog


def measure(mode: str, lines: int) -> str:
    record = RoutingLog().record(
        "m", "default", "*", "w0", "round_robin", 200, 0.0125, None, "7f3c9a1e2b4d6f80000000000000002a"
    )
    logger = logging.getLogger(LOGGER)
    with tempfile.TemporaryFile("w") as out:
        output = handler = None
        if mode == "thread":
            output = AccessOutput(out)
            output.start()
        else:
            handler = logging.StreamHandler(out)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        access = AccessLog(LoggingConfig(access_log=True))
        process, thread = time.process_time(), time.thread_time()
        for _ in range(lines):
            access.write(record, "POST", "/v1/chat/completions", 1, 512, None, 12.5)
        thread = time.thread_time() - thread
        if output is not None:
            output.stop()  # what waits is written: counted in the process's CPU
        process = time.process_time() - process
        if handler is not None:
            logger.removeHandler(handler)
        dropped = output.dropped if output is not None else 0
    return (
        f"{mode:6}  calling thread {thread / lines * 1e6:6.2f} us/line   "
        f"process {process / lines * 1e6:6.2f} us/line   dropped {dropped}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeat):
        for mode in ("stream", "thread"):
            print(measure(mode, args.lines))
    print("command:", shlex.join([sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
