"""`modelyard key create | list | revoke | usage`: a gateway's API keys and their tenants' usage,
through its admin API (README: API keys and tenants), for people (tables) and scripts (`-o json`:
the API's JSON unchanged).

A problem prints one line and exits 1: the gateway unreachable, the admin token refused, an error
the gateway answers (its message, e.g. an unknown tenant's).

Credentials: the gateway's admin token comes from --admin-token (MODELYARD_ADMIN_TOKEN) or
--admin-token-file (MODELYARD_ADMIN_TOKEN_FILE), a flag before a variable; an https gateway is
verified with --ca-file (MODELYARD_GATEWAY_CA), else the system's CAs. No admin token is ever
printed. The key `key create` makes is printed once, as the gateway shows it once: alone on stdout
(`KEY=$(modelyard key create ...)`), or in the whole answer with -o json.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import orjson
import typer
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table

from modelyard.cli.model import ApiAccess, Output, OutputOption, from_variable
from modelyard.cli.problems import print_error
from modelyard.errors import ModelyardError, Unauthorized
from modelyard.tenancy import PERIODS
from modelyard.upstream.admin_client import DEFAULT_GATEWAY, AdminClient

key_app = typer.Typer(no_args_is_help=True, help="API keys of a gateway's tenants, and their usage.")
# Piped into grep or a file, tables keep one row per line (as `modelyard model list` does).
out = Console(highlight=False, width=None if sys.stdout.isatty() else 400)
T = TypeVar("T")

GATEWAY_ENV = "MODELYARD_GATEWAY"
TOKEN_ENV = "MODELYARD_ADMIN_TOKEN"
TOKEN_FILE_ENV = "MODELYARD_ADMIN_TOKEN_FILE"
CA_ENV = "MODELYARD_GATEWAY_CA"
NONE = "\u2013"  # an en dash where there is nothing to show


def _gateway_address(ctx: typer.Context, address: str) -> str:
    """--gateway's URL (`host:port` or `http(s)://host:port`); a bad one is one line naming where it
    came from (the flag or the variable), then exit 1."""
    text = address.strip()
    url = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = urlsplit(""), None
    if parts.scheme not in ("http", "https") or not parts.hostname or (port is None and "://" not in text):
        where = f"environment: {GATEWAY_ENV}" if from_variable(ctx, "gateway") else "command line: --gateway"
        print_error(f"{where}: expected host:port or http(s)://host:port for the gateway (got {address!r})")
        raise typer.Exit(1)
    return url.rstrip("/")


GatewayOption = Annotated[
    str,
    typer.Option(
        "--gateway",
        envvar=GATEWAY_ENV,
        callback=_gateway_address,
        help="The gateway: host:port or URL.",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--admin-token",
        envvar=TOKEN_ENV,
        show_default=False,
        help="The gateway's admin.token (when it sets one).",
    ),
]
TokenFileOption = Annotated[
    str | None,
    typer.Option(
        "--admin-token-file", envvar=TOKEN_FILE_ENV, help="A file holding the admin token (its first line)."
    ),
]
CaFileOption = Annotated[
    str | None,
    typer.Option("--ca-file", envvar=CA_ENV, help="CAs to verify an https gateway with (PEM)."),
]


class Access(ApiAccess):
    """How to reach the gateway's admin API: its URL, the admin token, the CA file."""

    PARAMS = ("admin_token", "admin_token_file")
    FLAGS = ("--admin-token", "--admin-token-file")
    VARIABLES = (TOKEN_ENV, TOKEN_FILE_ENV)

    def client(self) -> AdminClient:
        token, tls = self.credentials()
        return AdminClient(self.url, token=token, tls=tls)


def _call(access: Access, work: Callable[[AdminClient], Awaitable[T]]) -> T:
    """Run `work` against the gateway; a modelyard error prints one line and exits 1."""

    async def run() -> T:
        async with access.client() as gateway:
            return await work(gateway)

    try:
        return asyncio.run(run())
    except Unauthorized as exc:
        print_error(f"{exc.message} (give the admin token: --admin-token, {TOKEN_ENV} or --admin-token-file)")
        raise typer.Exit(1) from None
    except ModelyardError as exc:
        print_error(exc.message)
        raise typer.Exit(1) from None


def _print_json(data: object) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    sys.stdout.flush()


def _print_table(renderable: RenderableType) -> None:
    """A table without the padding rich leaves at the end of each line."""
    with out.capture() as captured:
        out.print(renderable)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    sys.stdout.flush()


# --- key create ----------------------------------------------------------------------------------


@key_app.command("create", short_help="Make a key for a tenant; it is printed this once.")
def create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option("--tenant", help="One of the keys file's tenants.")],
    name: Annotated[str, typer.Option("--name", help="How lists, logs and usage name the key.")],
    models: Annotated[
        list[str] | None,
        typer.Option("--model", help="A model the key may use (repeatable; default: its tenant's)."),
    ] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            "--priority", help="-100 to 100, higher served first under overload (default: its tenant's)."
        ),
    ] = None,
    requests_per_minute: Annotated[
        int | None, typer.Option("--requests-per-minute", help="Requests begun in any 60 s.")
    ] = None,
    tokens_per_minute: Annotated[
        int | None, typer.Option("--tokens-per-minute", help="Prompt + completion tokens in any 60 s.")
    ] = None,
    max_concurrent_requests: Annotated[
        int | None, typer.Option("--max-concurrent-requests", help="Requests in flight at once.")
    ] = None,
    budget: Annotated[
        float | None, typer.Option("--budget", help="USD per --budget-period, at the endpoints' cost.")
    ] = None,
    budget_period: Annotated[
        str | None, typer.Option("--budget-period", help=f"{', '.join(PERIODS)} (default day).")
    ] = None,
    output: OutputOption = Output.table,
    gateway: GatewayOption = DEFAULT_GATEWAY,
    admin_token: TokenOption = None,
    admin_token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """Make a key for a tenant (the gateway needs auth.runtime_keys_file, or state.backend redis).
    The key is printed this once, alone on stdout; -o json prints the whole answer, key included.
    Its limits apply within its tenant's."""
    access = Access(ctx, gateway, admin_token, admin_token_file, ca_file)
    if budget_period is not None and budget is None:
        print_error("--budget-period needs --budget")
        raise typer.Exit(1)
    limits = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "max_concurrent_requests": max_concurrent_requests,
        "budget": budget,
        "budget_period": budget_period,
    }
    body: dict[str, Any] = {"name": name, "tenant": tenant}
    if models:
        body["models"] = models
    if priority is not None:
        body["priority"] = priority
    given = {field: value for field, value in limits.items() if value is not None}
    if given:
        body["limits"] = given
    made = _call(access, lambda client: client.create_key(body))
    if output is Output.json:
        _print_json(made)
        return
    _note(
        f"key {made.get('name')} of tenant {made.get('tenant')} created; this is the only time it is "
        "shown: keep it now"
    )
    sys.stdout.write(f"{made.get('key')}\n")
    sys.stdout.flush()


def _note(line: str) -> None:
    """A line for the person at the terminal, on stderr (stdout holds what a script reads)."""
    Console(stderr=True, highlight=False).print(escape(line), soft_wrap=True)


# --- key list ------------------------------------------------------------------------------------


@key_app.command("list", short_help="Every key, with its tenant and limits; never a key itself.")
def list_keys(
    ctx: typer.Context,
    output: OutputOption = Output.table,
    gateway: GatewayOption = DEFAULT_GATEWAY,
    admin_token: TokenOption = None,
    admin_token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """Every key: the keys file's and those made at runtime; never a key itself. -o json prints the
    API's answer (with the tenants and their limits)."""
    answer = _call(Access(ctx, gateway, admin_token, admin_token_file, ca_file), lambda c: c.keys())
    if output is Output.json:
        _print_json(answer)
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "TENANT", "SOURCE", "MODELS", "PRIORITY", "LIMITS", "CREATED"):
        table.add_column(column)
    for key in answer.get("keys") or []:
        table.add_row(
            *(
                escape(text)
                for text in (
                    str(key.get("name")),
                    str(key.get("tenant")),
                    str(key.get("source") or NONE),
                    _models(key.get("models")),
                    "tenant's" if key.get("priority") is None else str(key["priority"]),
                    _limits_text(key.get("limits")),
                    _created(key.get("created")),
                )
            )
        )
    _print_table(table)


def _models(models: object) -> str:
    if models is None:
        return "tenant's"
    if isinstance(models, list):
        return ", ".join(map(str, models)) or NONE
    return str(models)


def _limits_text(limits: object) -> str:
    """`60 req/min, 20000 tok/min, 4 concurrent, $25/day`; an en dash for none."""
    if not isinstance(limits, dict) or not limits:
        return NONE
    parts = []
    if limits.get("requests_per_minute") is not None:
        parts.append(f"{limits['requests_per_minute']} req/min")
    if limits.get("tokens_per_minute") is not None:
        parts.append(f"{limits['tokens_per_minute']} tok/min")
    if limits.get("max_concurrent_requests") is not None:
        parts.append(f"{limits['max_concurrent_requests']} concurrent")
    if limits.get("budget") is not None:
        parts.append(f"${limits['budget']:g}/{limits.get('budget_period') or 'day'}")
    return ", ".join(parts) or NONE


def _created(created: object) -> str:
    if not isinstance(created, int | float) or isinstance(created, bool):
        return NONE  # the keys file's keys
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(created))


# --- key revoke ----------------------------------------------------------------------------------


@key_app.command("revoke", short_help="Revoke a key made at runtime.")
def revoke(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The key's name (as key list shows it).")],
    output: OutputOption = Output.table,
    gateway: GatewayOption = DEFAULT_GATEWAY,
    admin_token: TokenOption = None,
    admin_token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """Revoke a key made at runtime: every gateway sharing its store refuses it within
    auth.key_refresh_interval. A key of the keys file is revoked by removing it from the file."""
    answer = _call(Access(ctx, gateway, admin_token, admin_token_file, ca_file), lambda c: c.revoke_key(name))
    if output is Output.json:
        _print_json(answer)
    else:
        out.print(escape(f"{name}: revoked"))


# --- key usage -----------------------------------------------------------------------------------


@key_app.command("usage", short_help="A day's usage by tenant and key.")
def usage(
    ctx: typer.Context,
    day: Annotated[str | None, typer.Option("--day", help="A UTC day, YYYY-MM-DD (default: today).")] = None,
    output: OutputOption = Output.table,
    gateway: GatewayOption = DEFAULT_GATEWAY,
    admin_token: TokenOption = None,
    admin_token_file: TokenFileOption = None,
    ca_file: CaFileOption = None,
) -> None:
    """A UTC day's usage by tenant, and by key within it: requests, tokens, errors, requests refused
    over a limit, cost (USD at the endpoints' cost_per_1k_tokens)."""
    answer = _call(Access(ctx, gateway, admin_token, admin_token_file, ca_file), lambda c: c.usage(day))
    if output is Output.json:
        _print_json(answer)
        return
    tenants = answer.get("tenants") or []
    if not tenants:
        out.print(escape(f"no usage on {answer.get('day')} ({answer.get('scope')})"))
        return
    table = Table(box=None, pad_edge=False, caption=escape(f"{answer.get('day')}, {answer.get('scope')}"))
    table.add_column("TENANT")
    table.add_column("KEY")
    for column in ("REQUESTS", "TOKENS", "ERRORS", "REFUSED", "COST"):
        table.add_column(column, justify="right")
    for tenant in tenants:
        table.add_row(escape(str(tenant.get("tenant"))), "(all)", *_counts(tenant))
        for key in tenant.get("keys") or []:
            table.add_row("", escape(str(key.get("key"))), *_counts(key))
    _print_table(table)


def _counts(row: dict[str, Any]) -> list[str]:
    cost = row.get("cost")
    return [
        *(str(row.get(field, 0)) for field in ("requests", "tokens", "errors", "refused")),
        f"${cost:.6f}" if isinstance(cost, int | float) else NONE,
    ]
