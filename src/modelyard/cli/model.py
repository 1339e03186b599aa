"""`modelyard model apply | list | status | delete` and `modelyard server list`: the scheduler's REST
API (docs/placement.md) for people (tables) and scripts (`-o json`: the API's JSON unchanged).

A problem prints one line per cause and exits 1: the scheduler unreachable, a manifest that does
not validate (every problem, before anything is sent), an error the scheduler answers.

Credentials: the token comes from --token (MODELYARD_SCHEDULER_TOKEN) or --token-file
(MODELYARD_SCHEDULER_TOKEN_FILE), a flag before a variable; an https scheduler is verified with
--ca-file (MODELYARD_SCHEDULER_CA), else the system's CAs. No token is ever printed.

`model apply` sends each model as its own request, which the scheduler refuses past its
`max_body_bytes` (scheduler.config.MAX_BODY_BYTES). So it reads at most MAX_FILE_BYTES of a file
(counting bytes read: a FIFO's or a pipe's size is unknown), splits the YAML stream at its document
markers without parsing it, and refuses a document over the scheduler's limit before parsing any:
PyYAML takes about 5 seconds and 60 MB for each MB of a long list. A model whose JSON request would
still be over the limit is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
import typer
from rich.console import Console, RenderableType
from rich.markup import escape

from modelyard.cli.placement_views import TERMINATED, applied_line, model_status, models_table, servers_table
from modelyard.config import TlsClientConfig, scheduler_url
from modelyard.documents import DocumentError, parse_documents
from modelyard.errors import (
    Forbidden,
    ModelSpecInvalid,
    ModelyardError,
    NotFound,
    SchedulerUnavailable,
    Unauthorized,
)
from modelyard.placement.manifest import spec_to_plain, specs_from_manifests
from modelyard.placement.spec import ModelSpec
from modelyard.placement.states import ModelState
from modelyard.scheduler.config import MAX_BODY_BYTES
from modelyard.security.tls import ClientTls
from modelyard.security.tokens import read_token
from modelyard.upstream.scheduler_client import DEFAULT_SCHEDULER, SchedulerClient

model_app = typer.Typer(no_args_is_help=True, help="Models placed by the scheduler.")
server_app = typer.Typer(no_args_is_help=True, help="Inference servers registered with the scheduler.")
# Piped into grep or a file, tables keep one row per line (kubectl does the same): rich would
# otherwise wrap them at 80 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 400)
err = Console(stderr=True, highlight=False)
T = TypeVar("T")


class Output(StrEnum):
    table = "table"
    json = "json"


SCHEDULER_ENV = "MODELYARD_SCHEDULER"  # --scheduler's variable (serve's too): named as the variable


def from_variable(ctx: typer.Context, parameter: str) -> bool:
    """Whether the option `parameter` took its value from its environment variable (typer's envvar):
    a problem with it names the variable, not the flag the user never wrote."""
    source = ctx.get_parameter_source(parameter)
    return source is not None and source.name == "ENVIRONMENT"


def _scheduler_address(ctx: typer.Context, address: str) -> str:
    """--scheduler's URL; a bad one is one line naming where it came from (the flag or the variable),
    then exit 1."""
    try:
        return scheduler_url(address)
    except ValueError as exc:
        where = (
            f"environment: {SCHEDULER_ENV}"
            if from_variable(ctx, "scheduler")
            else "command line: --scheduler"
        )
        _error(f"{where}: {exc} (got {address!r})")
        raise typer.Exit(1) from None


SchedulerOption = Annotated[
    str,
    typer.Option(
        "--scheduler",
        envvar=SCHEDULER_ENV,
        callback=_scheduler_address,
        help="The scheduler's REST API: host:port or URL.",
    ),
]
OutputOption = Annotated[Output, typer.Option("-o", "--output", help="table for people, json for scripts.")]
TOKEN_ENV = "MODELYARD_SCHEDULER_TOKEN"
TOKEN_FILE_ENV = "MODELYARD_SCHEDULER_TOKEN_FILE"
CA_ENV = "MODELYARD_SCHEDULER_CA"
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar=TOKEN_ENV,
        show_default=False,
        help="The scheduler's bearer token (role read, or write to apply and delete).",
    ),
]
TokenFileOption = Annotated[
    str | None,
    typer.Option("--token-file", envvar=TOKEN_FILE_ENV, help="A file holding the token (its first line)."),
]
CaFileOption = Annotated[
    str | None,
    typer.Option("--ca-file", envvar=CA_ENV, help="CAs to verify an https scheduler with (PEM)."),
]


class ApiAccess:
    """How to reach an API the CLI calls: its URL, a token (given, or read from a file), the CA file
    to verify https with. PARAMS, FLAGS and VARIABLES name the token's two options (a flag wins over
    a variable; two flags, or two variables, are a mistake)."""

    PARAMS = ("token", "token_file")
    FLAGS = ("--token", "--token-file")
    VARIABLES = (TOKEN_ENV, TOKEN_FILE_ENV)

    def __init__(
        self, ctx: typer.Context, url: str, token: str | None, token_file: str | None, ca: str | None
    ):
        self.url = url
        self._ca = ca
        if token and token_file:
            by_flag = [not from_variable(ctx, name) for name in self.PARAMS]
            if by_flag[0] == by_flag[1]:
                names = self.FLAGS if by_flag[0] else self.VARIABLES
                _error(f"{names[0]} and {names[1]}: give one of them")
                raise typer.Exit(1)
            if by_flag[0]:
                token_file = None
            else:
                token = None
        self._token, self._token_file = token, token_file

    def credentials(self) -> tuple[str | None, ClientTls | None]:
        """The token (TokenFileError names its file, never the token) and the TLS to verify with
        (TlsError names the file)."""
        token = read_token(self._token_file) if self._token_file else self._token
        tls = ClientTls(TlsClientConfig(ca_file=self._ca or "")) if self.url.startswith("https:") else None
        return token, tls


class Access(ApiAccess):
    """The scheduler's (resolved once per command)."""

    def client(self) -> SchedulerClient:
        token, tls = self.credentials()
        return SchedulerClient(self.url, token=token, tls=tls)


def _error(message: str) -> None:
    err.print("[red]error:[/red] " + escape(message), soft_wrap=True)


def _call(access: Access, work: Callable[[SchedulerClient], Awaitable[T]]) -> T:
    """Run `work` against the scheduler (--scheduler's URL, checked as it was parsed); a modelyard
    error prints one line and exits 1."""

    async def run() -> T:
        async with access.client() as scheduler:
            return await work(scheduler)

    try:
        return asyncio.run(run())
    except Unauthorized as exc:
        _error(f"{exc.message} (give a token: --token, {TOKEN_ENV} or --token-file)")
        raise typer.Exit(1) from None
    except Forbidden as exc:
        _error(f"{exc.message} (this needs a token with the role write)")
        raise typer.Exit(1) from None
    except ModelyardError as exc:
        _error(exc.message)
        raise typer.Exit(1) from None


def _print_json(data: object, *, compact: bool = False) -> None:
    """Indented for one answer; `compact` (one object per line, NDJSON) for a stream of them."""
    option = 0 if compact else orjson.OPT_INDENT_2
    sys.stdout.write(orjson.dumps(data, option=option).decode() + "\n")
    sys.stdout.flush()


def _print_table(renderable: RenderableType) -> None:
    """A table without the padding rich leaves at the end of each line."""
    with out.capture() as captured:
        out.print(renderable)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    sys.stdout.flush()


@model_app.command("apply")
def apply(
    files: Annotated[
        list[str],
        typer.Option("-f", "--filename", help="YAML or JSON file of models (repeatable; - = stdin)."),
    ],
    ctx: typer.Context,
    output: OutputOption = Output.table,
    scheduler: SchedulerOption = DEFAULT_SCHEDULER,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """Validate every model in the files (plain specs or Seldon Model resources); send them only when
    all are valid, then print what each became (-o json: each answer, one per line). Each model is
    its own request: one larger than the scheduler takes in a request is refused before any is sent
    (its document unparsed when it is the document that is too large)."""
    access = Access(ctx, scheduler, token, token_file, ca_file)
    specs = _read_specs(files)
    if specs is None:
        raise typer.Exit(1)

    async def send(client: SchedulerClient) -> bool:
        ok = True
        for spec in specs:
            try:
                answer = await client.apply(spec_to_plain(spec), spec.name)
                if output is Output.json:
                    _print_json(answer, compact=True)
                else:
                    out.print(escape(applied_line(answer)))
            except (SchedulerUnavailable, Unauthorized, Forbidden):  # the same for every model: stop
                raise
            except ModelyardError as exc:  # one refused model: the others are still applied
                _error(f"{spec.name}: {exc.message}")
                ok = False
        return ok

    if not _call(access, send):
        raise typer.Exit(1)


def _read_specs(files: list[str]) -> list[ModelSpec] | None:
    """Every spec of every file, or None after printing each problem with its file."""
    specs: list[ModelSpec] = []
    seen: dict[str, str] = {}
    failed = False
    for file in files:
        source = "<stdin>" if file == "-" else file
        try:
            data = _read_bounded(file, source)
            if data is None or not _documents_fit(data, source):
                failed = True
                continue
            found = specs_from_manifests(parse_documents(data.decode(), untrusted=False), source)
        except OSError as exc:
            _error(f"{source}: cannot read file: {exc.strerror or exc}")
            failed = True
            continue
        except UnicodeDecodeError as exc:
            _error(f"{source}: not a text file (byte {exc.start} is not UTF-8)")
            failed = True
            continue
        except DocumentError as exc:
            _error(f"{source}: {exc}")
            failed = True
            continue
        except ModelSpecInvalid as exc:
            for problem in exc.problems:
                _error(f"{source}: {problem}")
            failed = True
            continue
        for spec in found:
            size = len(orjson.dumps(spec_to_plain(spec)))  # the body SchedulerClient.apply sends
            if size > MAX_BODY_BYTES:
                _error(
                    f"{source}: model {spec.name!r}: its request is {_size(size)} of JSON, more than {_LIMIT}"
                )
                failed = True
            if spec.name in seen:
                _error(f"{source}: model {spec.name!r} is also defined in {seen[spec.name]}")
                failed = True
            seen[spec.name] = source
            specs.append(spec)
    return None if failed else specs


_MIB = 1024 * 1024
# The most model apply reads of one file (or stdin): the documents of many models, each sent on its own.
MAX_FILE_BYTES = 16 * MAX_BODY_BYTES


def _size(size: int, *, exact: bool = False) -> str:
    """`7.3 MiB (7654321 bytes)`; `exact`, for a limit: `1 MiB (1048576 bytes)`."""
    return f"{size / _MIB:{'g' if exact else '.1f'}} MiB ({size} bytes)"


_LIMIT = f"the {_size(MAX_BODY_BYTES, exact=True)} the scheduler takes in one request"


def _read_bounded(file: str, source: str) -> bytes | None:
    """At most MAX_FILE_BYTES of the file (`-`: stdin), or None after saying it holds more: counted as
    read, since a FIFO (`-f <(...)`), a pipe or a device has no size to ask for beforehand."""
    if file == "-":
        data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
    else:
        with Path(file).open("rb") as stream:
            data = stream.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        _error(
            f"{source}: more than the {_size(MAX_FILE_BYTES, exact=True)} model apply reads of one file: "
            "split its models into several files (-f takes each)"
        )
        return None
    return data


def _documents_fit(data: bytes, source: str) -> bool:
    """Whether every document of the file fits in one request to the scheduler; False after naming
    each that does not, unparsed."""
    fit = True
    for index, document in enumerate(_documents(data), 1):
        if len(document) > MAX_BODY_BYTES:
            name = _document_name(document)
            named = f" (model {name!r})" if name else ""
            _error(
                f"{source}: document {index}{named}: {_size(len(document))}, more than {_LIMIT}; each "
                "document is sent as its own request, so this model's must be smaller"
            )
            fit = False
    return fit


# A document marker: `---` (a document starts on this line) or `...` (it ends with it), at the start of
# a line and followed by a space or the line's end. YAML forbids both there inside any scalar, so they
# split a stream wherever they are (PyYAML ends a plain or block scalar there, and refuses a quoted one).
_MARKER = re.compile(rb"^(---|\.\.\.)(?=[ \t\r\n]|\Z)", re.M)
_BLANK_LINES = re.compile(rb"(?:[ \t\r]*(?:#[^\n]*)?\n)*")  # blank lines and comment lines


def _documents(data: bytes) -> list[bytes]:
    """The documents of a YAML stream, unparsed, numbered as parse_documents numbers them: those that
    hold only comments, directives (`%YAML 1.2`, before a `---`) or markers are left out, as the
    loader leaves them out. JSON is one value, one document: no line of it starts with `---`."""
    pieces: list[bytes] = []
    start = 0
    for marker in _MARKER.finditer(data):
        if marker.group(1) == b"---":
            pieces.append(data[start : marker.start()])
            start = marker.start()
        else:
            end = data.find(b"\n", marker.end())
            end = len(data) if end < 0 else end + 1
            pieces.append(data[start:end])
            start = end
    pieces.append(data[start:])
    return [piece for piece in pieces if _has_content(piece)]


def _has_content(piece: bytes) -> bool:
    """Whether a piece between markers holds a node: anything beside comments, directives and markers
    (`--- value` holds one)."""
    position = 0
    while position < len(piece):
        match = _BLANK_LINES.match(piece, position)
        position = match.end() if match else position
        end = piece.find(b"\n", position)
        end = len(piece) if end < 0 else end + 1
        line = piece[position:end]
        if _MARKER.match(line):
            line = line[3:]
        elif line.startswith(b"%"):
            line = b""
        text = line.strip()
        if text and not text.startswith(b"#"):
            return True
        position = end
    return False


# A Seldon Model's `metadata:` block, or a plain spec's top-level `name:`, as block YAML writes them.
_METADATA = re.compile(rb"^metadata:[ \t]*(?:#[^\n]*)?\r?\n((?:[ \t][^\n]*\n|[ \t\r]*\n)*)", re.M)
_FIRST_INDENT = re.compile(rb"(?:[ \t\r]*\n)*([ \t]+)")
_PLAIN_NAME = re.compile(rb"^name:[ \t]*([^\r\n]*)", re.M)
_NAME_VALUE = re.compile(rb"(['\"]?)([\w.-]{1,253})\1(?:[ \t]+#.*)?")


def _document_name(document: bytes) -> str | None:
    """The model's name when a regular expression sees it (metadata.name, or name), else None: the
    document is not parsed."""
    metadata = _METADATA.search(document)
    if metadata is not None:
        block = metadata.group(1)
        indent = _FIRST_INDENT.match(block)
        if indent is None:
            return None
        pattern = rb"^" + re.escape(indent.group(1)) + rb"name:[ \t]*([^\r\n]*)"
        found = re.search(pattern, block, re.M)
    else:
        found = _PLAIN_NAME.search(document)
    value = _NAME_VALUE.fullmatch(found.group(1).strip()) if found is not None else None
    return value.group(2).decode() if value is not None else None


@model_app.command("list")
def list_models(
    ctx: typer.Context,
    output: OutputOption = Output.table,
    show_all: Annotated[bool, typer.Option("--all", help="Include terminated models.")] = False,
    scheduler: SchedulerOption = DEFAULT_SCHEDULER,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """The scheduler's models. -o json prints every model, as the API answers."""
    models = _call(Access(ctx, scheduler, token, token_file, ca_file), lambda client: client.list())
    if output is Output.json:
        _print_json({"models": models})
    else:
        _print_table(models_table(models, show_all=show_all))


# What --until may name: the states derive_status and schedule_failed produce.
MODEL_STATES = tuple(
    state.value for state in ModelState if state not in (ModelState.CREATE, ModelState.TERMINATE)
)


@model_app.command("status")
def status(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The model.")],
    watch: Annotated[bool, typer.Option("--watch", help="Poll every second; print again on change.")] = False,
    until: Annotated[
        str | None, typer.Option("--until", help="With --watch: exit 0 once the model is in this state.")
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", help="With --watch: give up (exit 1) after this many seconds.")
    ] = 600.0,
    interval: Annotated[float, typer.Option("--interval", hidden=True)] = 1.0,
    output: OutputOption = Output.table,
    scheduler: SchedulerOption = DEFAULT_SCHEDULER,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """A model's state, with every version and replica."""
    access = Access(ctx, scheduler, token, token_file, ca_file)

    def show(model: dict[str, Any]) -> None:
        if output is Output.json:
            _print_json(model, compact=watch)  # --watch -o json: NDJSON, one line per change
        else:
            _print_table(model_status(model))

    if until is not None:
        if not watch:
            _error("--until needs --watch")
            raise typer.Exit(1)
        if until not in MODEL_STATES:
            _error(f"--until: {until!r} is not a model state; one of: {', '.join(MODEL_STATES)}")
            raise typer.Exit(1)
    if not watch:
        show(_call(access, lambda client: client.get(name)))
        return
    reached = _call(access, lambda client: _watch(client, name, until, timeout, interval, show))
    if not reached:
        _error(f"model {name!r} did not reach {until} within {timeout:g}s" if until else "timed out")
        raise typer.Exit(1)


async def _watch(
    client: SchedulerClient,
    name: str,
    until: str | None,
    seconds: float,
    interval: float,
    show: Callable[[dict[str, Any]], None],
) -> bool:
    """True once the model is in state `until` (a model the scheduler forgot counts as
    ModelTerminated); False when `seconds` pass first."""
    deadline = time.monotonic() + seconds
    last: bytes | None = None
    while True:
        try:
            model = await client.get(name)
        except NotFound:
            if until == TERMINATED:
                return True
            raise
        state = orjson.dumps(model, option=orjson.OPT_SORT_KEYS)
        if state != last:
            show(model)
            last = state
        if until is not None and model.get("state") == until:
            return True
        if time.monotonic() + interval > deadline:
            return False
        await asyncio.sleep(interval)


@model_app.command("delete")
def delete(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The model.")],
    output: OutputOption = Output.table,
    scheduler: SchedulerOption = DEFAULT_SCHEDULER,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """Delete a model: its replicas unload, then the scheduler forgets it."""
    model = _call(Access(ctx, scheduler, token, token_file, ca_file), lambda client: client.delete(name))
    if output is Output.json:
        _print_json(model)
    else:
        out.print(escape(f"{name}: deleted ({model.get('state')})"))


@server_app.command("list")
def list_servers(
    ctx: typer.Context,
    output: OutputOption = Output.table,
    scheduler: SchedulerOption = DEFAULT_SCHEDULER,
    token: TokenOption = None,
    token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """Servers and their replicas: address, memory, capabilities, loaded models."""
    servers = _call(Access(ctx, scheduler, token, token_file, ca_file), lambda client: client.servers())
    if output is Output.json:
        _print_json({"servers": servers})
    else:
        _print_table(servers_table(servers))
