"""The dashboard in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver, against gateways and sim workers on free ports.

Selenium blocks, and the servers run on this test's event loop, so every browser call runs in a
thread (`Page`) while the loop keeps serving the page. Screenshots are kept as test artefacts in
$MODELYARD_ARTEFACTS (default: .artefacts/dashboard/ in the repository), their paths printed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from modelyard.cli.demo import demo_config, start_demo_workers
from modelyard.cli.demo_placement import DemoPlacement, start_demo_placement
from modelyard.documents import parse_documents
from modelyard.gateway import RunningGateway, start_gateway
from modelyard.gateway.gateway import GATEWAY
from modelyard.gateway.routing_log import encode_shared
from modelyard.placement.manifest import spec_to_plain, specs_from_manifests
from modelyard.upstream.scheduler_client import SchedulerClient
from raw_http import send as send_raw
from support import model_config, wait_until

MODELS = Path(__file__).parents[2] / "examples" / "placement" / "models.yaml"
NONE = "\u2013"  # the en dash the page shows where there is nothing
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
ARTEFACTS = Path(os.environ.get("MODELYARD_ARTEFACTS") or ROOT / ".artefacts" / "dashboard")
TOKEN = "dashboard-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NEEDS_TOKEN = "This gateway needs the admin token: enter it above."
REDRAWN = (NoSuchElementException, StaleElementReferenceException)

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="the browser tests need Debian's chromium and chromium-driver (/usr/bin/chromium, "
    "/usr/bin/chromedriver); `make test` installs them when it runs as root with apt-get",
)


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    """One headless chromium for the module; each test opens its own gateway (its own origin, so
    its own sessionStorage)."""
    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1700"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for page errors
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield browser
    finally:
        browser.quit()


class Page:
    """The dashboard of one gateway. Browser calls run in a thread; waits are WebDriverWaits."""

    def __init__(self, driver: WebDriver, gateway: RunningGateway, name: str) -> None:
        self.driver = driver
        self.url = gateway.url + "/dashboard"
        self.name = name

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(call, *args)

    async def open(self) -> None:
        await self.run(self.driver.get, self.url)

    async def until(self, condition: Callable[[WebDriver], Any], what: str, within: float = 10) -> Any:
        """What `condition` returns once it is truthy. The page redraws its tables every 2 s: an
        element found just before that is stale, and the condition is tried again."""
        wait = WebDriverWait(self.driver, within, poll_frequency=0.05, ignored_exceptions=REDRAWN)
        try:
            return await self.run(wait.until, condition)
        except TimeoutException:
            shot = await self.screenshot("failed")
            raise AssertionError(f"{what}: not seen within {within:g}s (screenshot {shot})") from None

    async def element(self, css: str) -> WebElement:
        return await self.until(lambda d: d.find_element(By.CSS_SELECTOR, css), f"an element {css}")

    async def text(self, css: str) -> str:
        return str((await self.until(lambda d: (d.find_element(By.CSS_SELECTOR, css).text,), css))[0])

    async def shows(self, css: str, text: str) -> None:
        """Wait until the element `css` shows `text` (in its text)."""
        await self.until(lambda d: text in d.find_element(By.CSS_SELECTOR, css).text, f"{text!r} in {css}")

    async def choose(self, css: str, value: str) -> None:
        """Pick `value` in a select, once the page has filled it with that option."""
        await self.until(
            lambda d: d.find_elements(By.CSS_SELECTOR, f"{css} option[value='{value}']"), f"{value} in {css}"
        )
        select = Select(await self.element(css))
        await self.run(select.select_by_value, value)

    async def type(self, css: str, text: str) -> None:
        field = await self.element(css)
        await self.run(field.clear)
        await self.run(field.send_keys, text)

    async def click(self, css: str) -> None:
        await self.run((await self.element(css)).click)

    async def screenshot(self, step: str) -> Path:
        path = ARTEFACTS / f"{self.name}-{step}.png"
        await self.run(self.driver.save_screenshot, str(path))
        print(f"screenshot: {path}")
        return path


@pytest.fixture
async def page(driver: WebDriver, request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Any]]:
    """`await page(gateway)`: the gateway's dashboard, opened. Afterwards the page must have
    logged no error but the 401s it was meant to meet, and is left for a blank one before the
    gateway stops."""

    async def open_page(gateway: RunningGateway) -> Page:
        opened = Page(driver, gateway, request.node.name.removeprefix("test_"))
        await opened.open()
        return opened

    await asyncio.to_thread(driver.get_log, "browser")  # what an earlier test's page left
    yield open_page
    console = await asyncio.to_thread(driver.get_log, "browser")
    await asyncio.to_thread(driver.get, "about:blank")
    errors = [e["message"] for e in console if e["level"] == "SEVERE" and "status of 401" not in e["message"]]
    assert not errors, errors


def picked(driver: WebDriver, css: str) -> str:
    return str(Select(driver.find_element(By.CSS_SELECTOR, css)).first_selected_option.get_attribute("value"))


def endpoint_rows(model: str) -> Callable[[WebDriver], list[str] | None]:
    def rows(d: WebDriver) -> list[str] | None:
        found = d.find_elements(By.CSS_SELECTOR, f"article[data-model='{model}'] tr[data-endpoint]")
        return [row.text for row in found] or None

    return rows


async def strategies(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    async with http.get(url + "/admin/strategy", headers=headers or {}) as response:
        assert response.status == 200
        return (await response.json())["models"]


# --- the tests ------------------------------------------------------------------------------------


async def test_the_page_lists_each_models_endpoints_and_their_state(sim_workers, gateways, page):
    workers = await sim_workers(2)
    gateway = await gateways(
        [model_config("chat", workers), model_config("echo", workers[:1], strategy="least_pending")]
    )
    dashboard = await page(gateway)
    rows = await dashboard.until(
        lambda d: (r := endpoint_rows("chat")(d)) and len(r) == 2 and r, "the endpoints of chat"
    )
    for name, worker, row in zip(("w0", "w1"), workers, rows, strict=True):
        assert row.startswith(name) and worker.url in row
        assert "healthy" in row and "closed" in row
    await dashboard.shows("article[data-model='echo'] .badge[data-strategy]", "least_pending")
    await dashboard.screenshot("overview")


async def test_switching_the_strategy_in_the_page_switches_the_gateway(sim_workers, gateways, http, page):
    workers = await sim_workers(2)
    gateway = await gateways(
        [model_config("chat", workers), model_config("echo", workers, strategy="kv_aware")]
    )
    dashboard = await page(gateway)
    # The picker shows the chosen model's strategy until another one is picked.
    await dashboard.choose("#strategy-model", "echo")
    await dashboard.until(
        lambda d: picked(d, "#strategy-name") == "kv_aware", "echo's strategy in the picker"
    )
    await dashboard.choose("#strategy-model", "chat")
    await dashboard.until(
        lambda d: picked(d, "#strategy-name") == "round_robin", "chat's strategy in the picker"
    )
    await dashboard.choose("#strategy-name", "least_pending")
    await dashboard.click("#strategy-switch")
    await dashboard.shows("#strategy-result", "Switched chat to least_pending.")
    assert await strategies(http, gateway.url) == {"chat": "least_pending", "echo": "kv_aware"}
    await dashboard.shows("article[data-model='chat'] .badge[data-strategy]", "least_pending")
    await dashboard.screenshot("switched")


async def test_a_request_appears_in_the_live_log_as_it_happens(sim_workers, gateways, http, page):
    gateway = await gateways([model_config("chat", await sim_workers(2), strategy="kv_aware")])
    dashboard = await page(gateway)
    await dashboard.shows("#log-status", "live")
    body = {"model": "chat", "messages": [{"role": "user", "content": "routed while you watch"}]}
    async with http.post(
        gateway.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "seen-live"}
    ) as response:
        assert response.status == 200
        backend = response.headers["X-Modelyard-Backend"]
    row = await dashboard.element("#log tr[data-request-id='seen-live']")  # rows are never redrawn

    def cell(field: str) -> str:
        return str(row.find_element(By.CSS_SELECTOR, f"td[data-field='{field}']").text)

    cells = await dashboard.run(
        lambda: {f: cell(f) for f in ("model", "backend", "strategy", "status", "route", "subset", "cache")}
    )
    assert cells == {
        "model": "chat",
        "backend": backend,
        "strategy": "kv_aware",
        "status": "200",
        "route": "default",
        "subset": "*",
        "cache": "miss",
    }
    await dashboard.screenshot("live-log")


async def test_the_chat_box_streams_the_answer_through_the_gateway(sim_workers, gateways, page):
    gateway = await gateways([model_config("chat", await sim_workers(2, decode_ms_per_token=2.0))])
    dashboard = await page(gateway)
    await dashboard.choose("#chat-model", "chat")
    await dashboard.type("#chat-max-tokens", "24")
    await dashboard.type("#chat-input", "Tell me about routing.")
    await dashboard.click("#chat-send")
    answer = await dashboard.element("#chat-answer")
    await dashboard.until(lambda d: answer.get_attribute("data-state") == "done", "the answer complete")
    chunks = int(await dashboard.run(answer.get_attribute, "data-chunks"))
    assert chunks > 1  # streamed: shown chunk by chunk, not in one piece
    assert len((await dashboard.run(lambda: answer.text)).split()) > 1
    meta = await dashboard.text("#chat-meta")
    assert f"{chunks} chunks streamed from w" in meta and "(round_robin)" in meta
    await dashboard.screenshot("chat")


async def test_with_an_admin_token_the_page_asks_for_it_then_works(sim_workers, gateways, http, page):
    workers = await sim_workers(2)
    gateway = await gateways([model_config("chat", workers)], admin={"token": TOKEN})
    dashboard = await page(gateway)
    banner = await dashboard.element("#auth-message")
    await dashboard.until(lambda d: banner.is_displayed() and banner.text == NEEDS_TOKEN, "the token message")
    await dashboard.shows("#log-status", "needs the admin token")
    await dashboard.shows("#models", "Enter the admin token to see the endpoints.")
    await dashboard.screenshot("token-needed")

    await dashboard.type("#token", TOKEN)
    await dashboard.click("#token-save")
    await dashboard.until(lambda d: not banner.is_displayed(), "the message gone once the token is entered")
    await dashboard.until(endpoint_rows("chat"), "the endpoints, with the token")
    await dashboard.shows("#log-status", "live")
    await dashboard.choose("#strategy-name", "random")
    await dashboard.click("#strategy-switch")
    await dashboard.shows("#strategy-result", "Switched every model to random.")
    assert await strategies(http, gateway.url, AUTH) == {"chat": "random"}
    await dashboard.screenshot("token-entered")


async def test_graphs_run_with_their_trace_and_the_canary_comparison(sim_workers, gateways, http, page):
    primary, canary = await sim_workers(2)
    double = await sim_workers(1, oip_scale=2.0)
    chat = model_config("chat", [primary, canary])
    chat["endpoints"][0]["subset"], chat["endpoints"][1]["subset"] = "v1", "v2"
    chat["routes"] = [{"name": "shadowed", "destinations": [{"subset": "v1"}], "mirror": {"subset": "v2"}}]
    steps = [
        {"name": "first", "serviceName": "double"},
        {"name": "second", "serviceName": "double", "data": "$response", "mapPredictionsToInstances": True},
    ]
    graphs = {"quad": {"nodes": {"root": {"routerType": "Sequence", "steps": steps}}}}
    gateway = await gateways([chat, model_config("double", double)], graphs=graphs)
    body = {"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "compare me"}]}
    for _ in range(3):
        async with http.post(gateway.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200

    async def compared() -> bool:
        async with http.get(gateway.url + "/admin/models/chat/canary") as response:
            summary = (await response.json())["routes"].get("shadowed")
        return summary is not None and summary["compared"] == 3

    await wait_until(compared)

    dashboard = await page(gateway)
    await dashboard.choose("#graph-name", "quad")
    await dashboard.type("#graph-body", '{"instances": [[1, 2]]}')
    await dashboard.click("#graph-run")
    steps_shown = await dashboard.until(
        lambda d: (
            [r.get_attribute("data-step") for r in d.find_elements(By.CSS_SELECTOR, "#graph-trace tbody tr")]
            or None
        ),
        "the graph's trace",
    )
    assert steps_shown == ["first", "second", None]  # and the whole graph's time
    assert (await dashboard.text("#graph-status")).startswith("quad: 200 in")
    assert '"predictions"' in await dashboard.text("#graph-answer")

    await dashboard.choose("#canary-model", "chat")
    await dashboard.shows("#canary tr[data-subset='v2']", "v2 3 0 0.0%")  # requests, errors, rate
    await dashboard.shows("#canary h4[data-route='shadowed']", "route shadowed → mirrors 100% to v2")
    await dashboard.shows("#canary p", "3 answers compared")
    await dashboard.screenshot("graphs-and-canary")


async def test_the_address_with_a_trailing_slash_opens_the_page(sim_workers, gateways, page):
    gateway = await gateways([model_config("chat", await sim_workers(1))])
    dashboard = await page(gateway)
    await dashboard.run(dashboard.driver.get, gateway.url + "/dashboard/")
    await dashboard.until(lambda d: d.current_url == gateway.url + "/dashboard", "the page's own address")
    await dashboard.until(endpoint_rows("chat"), "the endpoints of chat")


async def test_a_refused_log_stream_says_why_and_comes_back_once_there_is_room(
    sim_workers, gateways, http, page
):
    gateway = await gateways([model_config("chat", await sim_workers(1))], admin={"max_log_streams": 1})
    async with http.get(gateway.url + "/admin/log/stream") as held:  # the only stream allowed
        await held.content.readuntil(b"\n\n")
        dashboard = await page(gateway)
        await dashboard.shows("#log-status", "as many as admin.max_log_streams allows; try again")
    # The page tries again after the 503's Retry-After (5 s): by then there is room.
    await dashboard.until(lambda d: d.find_element(By.CSS_SELECTOR, "#log-status").text == "live", "live", 15)
    console = await dashboard.run(dashboard.driver.get_log, "browser")  # the 503s, not the fixture's
    refused = [e["message"] for e in console if e["level"] == "SEVERE"]
    assert refused and all("/admin/log/stream" in m and "503" in m for m in refused), refused


# --- what a new user's first hour found missing (issue 27) ----------------------------------------


def chat_body(model: str, content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def post_chat(
    http: aiohttp.ClientSession, url: str, model: str, request_id: str
) -> aiohttp.ClientResponse:
    async with http.post(
        url + "/v1/chat/completions",
        json=chat_body(model, max_tokens=2),
        headers={"X-Request-Id": request_id},
    ) as response:
        await response.read()
        return response


def raw_chat(model: str, request_id: str, listener: str) -> bytes:
    """A chat request the lean listener reads (Content-Length), or one it hands to aiohttp (chunked)."""
    body = orjson.dumps(chat_body(model))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\n"
    )
    if listener == "lean":
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def cells(row: WebElement, *names: str) -> dict[str, str]:
    return {name: str(row.find_element(By.CSS_SELECTOR, f"td[data-field='{name}']").text) for name in names}


def logged_ids(d: WebDriver) -> list[str]:
    """The request ids of the log's rows, as shown (newest first)."""
    return [
        str(r.get_attribute("data-request-id")) for r in d.find_elements(By.CSS_SELECTOR, "#log tbody tr")
    ]


def chart_values(model: str, chart: str) -> Callable[[WebDriver], list[float] | None]:
    """The points a chart draws, as values (0 at its bottom, 1 at its top), oldest first: every
    5 s step for requests/s, only the steps with answers for errors and P95; None until drawn."""

    def read(d: WebDriver) -> list[float] | None:
        svg = d.find_element(By.CSS_SELECTOR, f"#traffic tr[data-model='{model}'] svg[data-chart='{chart}']")
        heights: list[str] = []
        for shape in svg.find_elements(By.CSS_SELECTOR, "polyline, circle"):  # a lone point: a circle
            if shape.tag_name == "circle":
                heights.append(str(shape.get_attribute("cy")))
            else:
                heights += [point.split(",")[1] for point in str(shape.get_attribute("points")).split()]
        return [round((25 - float(y)) / 24, 3) for y in heights] or None  # CHART_H 26, a pixel's margin

    return read


async def test_a_models_row_counts_its_own_requests_in_flight_not_another_models(
    sim_workers, gateways, http, page
):
    # The demo's two models share their servers: a request of one is not the other's.
    workers = await sim_workers(1, decode_ms_per_token=20.0)
    gateway = await gateways([model_config("chat", workers), model_config("echo", workers)])
    dashboard = await page(gateway)

    def in_flight(model: str) -> Callable[[WebDriver], tuple[str, str] | None]:
        def read(d: WebDriver) -> tuple[str, str] | None:
            row = d.find_element(By.CSS_SELECTOR, f"article[data-model='{model}'] tr[data-endpoint='w0']")
            shown = cells(row, "in-flight", "server-in-flight")
            return shown["in-flight"], shown["server-in-flight"]

        return read

    long = await http.post(
        gateway.url + "/v1/chat/completions", json=chat_body("chat", max_tokens=5000, stream=True)
    )
    try:
        await long.content.readline()  # chat's request runs on the one server
        await dashboard.until(lambda d: in_flight("chat")(d) == ("1", "1"), "chat's request in chat's row")
        assert await dashboard.run(in_flight("echo"), dashboard.driver) == ("0", "1")  # none of echo's
        heads = await dashboard.run(
            lambda: [
                h.text
                for h in dashboard.driver.find_elements(By.CSS_SELECTOR, "article[data-model='echo'] th")
            ]
        )
        assert "in flight" in heads and "server total" in heads
        await dashboard.screenshot("in-flight")
    finally:
        long.close()
    await dashboard.until(lambda d: in_flight("chat")(d) == ("0", "0"), "the request ended")


async def test_refused_requests_show_in_the_live_log_from_either_listener(sim_workers, gateways, page):
    gateway = await gateways([model_config("chat", await sim_workers(1))])
    dashboard = await page(gateway)
    await dashboard.shows("#log-status", "live")
    for listener in ("lean", "aiohttp"):
        reply = await send_raw(gateway.url, raw_chat("nope", f"unknown-{listener}", listener))
        assert reply.status == 404
    for listener in ("lean", "aiohttp"):
        row = await dashboard.element(f"#log tr[data-request-id='unknown-{listener}']")
        shown = await dashboard.run(cells, row, "model", "backend", "status", "route", "strategy")
        assert shown == {
            "model": "nope",
            "backend": "refused (no backend)",
            "status": "404",
            "route": NONE,
            "strategy": NONE,
        }
        assert await dashboard.run(row.get_attribute, "data-refused") == "true"
    await dashboard.screenshot("refused")


@pytest.fixture
async def demo_placement() -> AsyncIterator[tuple[DemoPlacement, RunningGateway]]:
    """The embedded demo with its scheduler, agents and sim-workers, in-process on free ports."""
    placement = await start_demo_placement(port=0, agent_port=0)
    workers = await start_demo_workers()
    gateway = await start_gateway(demo_config(workers, {"listen": {"port": 0}}, placement))
    yield placement, gateway
    await gateway.stop()
    await placement.stop()
    for _name, worker in workers:
        await worker.stop()


async def test_the_placement_panel_shows_each_placed_model_and_why_one_cannot_be_placed(
    demo_placement, http, page
):
    placement, gateway = demo_placement
    specs = specs_from_manifests(parse_documents(MODELS.read_text(), untrusted=False), str(MODELS))
    async with SchedulerClient(placement.url) as scheduler:  # `modelyard model apply -f ...`
        for spec in specs:
            await scheduler.apply(spec_to_plain(spec), spec.name)
        huge = await scheduler.get("chat-huge")
    dashboard = await page(gateway)

    def placed(model: str) -> Callable[[WebDriver], dict[str, str] | None]:
        def read(d: WebDriver) -> dict[str, str] | None:
            row = d.find_element(By.CSS_SELECTOR, f"#placement tr[data-model='{model}']")
            return cells(row, "state", "replicas", "requests", "reason")

        return read

    expected = {
        "chat-small": {"state": "ModelAvailable", "replicas": "2/2", "requests": "routed", "reason": NONE},
        "chat-large": {"state": "ModelAvailable", "replicas": "1/1", "requests": "routed", "reason": NONE},
    }
    for model, shown in expected.items():
        await dashboard.until(lambda d, m=model, s=shown: placed(m)(d) == s, f"{model} placed", within=30)
    row = await dashboard.until(placed("chat-huge"), "chat-huge in the panel")
    assert row["state"] == "ScheduleFailed" and row["replicas"] == "0/1"
    assert row["requests"] == "503, not available"
    assert "no matching server" in row["reason"] and row["reason"] == huge["reason"]
    assert (await dashboard.text("#placement-status")).startswith(f"following {placement.url}")

    # Its requests are refused, and the log says so.
    assert (await post_chat(http, gateway.url, "chat-huge", "huge-1")).status == 503
    logged = await dashboard.element("#log tr[data-request-id='huge-1']")
    shown = await dashboard.run(cells, logged, "model", "status", "backend")
    assert shown == {"model": "chat-huge", "status": "503", "backend": "refused (no backend)"}
    await dashboard.shows("#traffic tr[data-model='chat-huge'] [data-current='errors']", "100.0%")
    await dashboard.screenshot("placement")


async def test_the_charts_show_each_models_requests_errors_and_p95_over_time(
    sim_workers, gateways, http, page
):
    good, failing = await sim_workers(1), await sim_workers(1, fail_rate=1.0)
    gateway = await gateways([model_config("chat", good), model_config("flaky", failing)])
    dashboard = await page(gateway)
    await dashboard.shows("#log-status", "live")
    for i in range(6):
        assert (await post_chat(http, gateway.url, "chat", f"ok-{i}")).status == 200
    for i in range(2):
        assert (await post_chat(http, gateway.url, "flaky", f"failed-{i}")).status >= 500
    assert (await post_chat(http, gateway.url, "nope", "unknown")).status == 404

    def current(model: str, chart: str) -> Callable[[WebDriver], str]:
        css = f"#traffic tr[data-model='{model}'] [data-current='{chart}']"
        return lambda d: str(d.find_element(By.CSS_SELECTOR, css).text)

    await dashboard.until(lambda d: current("chat", "errors")(d) == "0.0%", "chat's errors: none")
    await dashboard.until(lambda d: current("flaky", "errors")(d) == "100.0%", "flaky's errors: all")
    whole = await dashboard.until(
        lambda d: (t := current("", "errors")(d)) not in (NONE, "0.0%") and t, "the gateway's"
    )
    assert 0 < float(whole.rstrip("%")) < 100  # the 404 for no model counts there, and only there
    assert (await dashboard.text("#traffic tr[data-model='chat'] [data-current='rate']")).endswith("/s")
    assert (await dashboard.text("#traffic tr[data-model='chat'] [data-current='p95']")).endswith(" ms")

    # Over the 5 minutes, chat's requests are at the end: the last 5 s step, or the one before when
    # the steps moved on since (this test takes less than 5 s); no point before them.
    rate = await dashboard.until(
        lambda d: (v := chart_values("chat", "rate")(d)) and any(v) and v, "chat's requests charted"
    )
    assert [i - len(rate) for i, value in enumerate(rate) if value > 0] in ([-1], [-2], [-2, -1]), rate
    # The error share has a point only where there were answers: flaky's 2 failures, all errors.
    errors = await dashboard.until(chart_values("flaky", "errors"), "flaky's errors charted")
    assert set(errors[-2:]) <= {1.0} and len(errors) in (1, 2), errors
    models = await dashboard.run(
        lambda: [
            r.get_attribute("data-model")
            for r in dashboard.driver.find_elements(By.CSS_SELECTOR, "#traffic tbody tr")
        ]
    )
    assert models == ["", "chat", "flaky"]  # the gateway, then each model: no row for a name no model has
    await dashboard.screenshot("charts")


async def test_the_log_filter_shows_only_the_records_that_match(sim_workers, gateways, http, page):
    workers = await sim_workers(2)
    gateway = await gateways([model_config("chat", workers), model_config("echo", workers)])
    dashboard = await page(gateway)
    await dashboard.shows("#log-status", "live")
    first = await post_chat(http, gateway.url, "chat", "c1")
    second = await post_chat(http, gateway.url, "chat", "c2")
    assert first.headers["X-Modelyard-Backend"] != second.headers["X-Modelyard-Backend"]  # round robin
    await post_chat(http, gateway.url, "echo", "e1")
    await post_chat(http, gateway.url, "nope", "n1")
    await dashboard.until(lambda d: logged_ids(d) == ["n1", "e1", "c2", "c1"], "every request")

    await dashboard.choose("#log-model", "echo")
    await dashboard.until(lambda d: logged_ids(d) == ["e1"], "echo's only")
    await dashboard.shows("#log-shown", "1 of the last 4 records match")
    await post_chat(http, gateway.url, "chat", "c3")  # a new record is filtered as well
    await post_chat(http, gateway.url, "echo", "e2")
    await dashboard.until(lambda d: logged_ids(d) == ["e2", "e1"], "echo's new one too")

    await dashboard.choose("#log-model", "")
    await dashboard.choose("#log-class", "4")
    await dashboard.until(lambda d: logged_ids(d) == ["n1"], "the 4xx")
    await dashboard.choose("#log-class", "refused")
    await dashboard.until(lambda d: logged_ids(d) == ["n1"], "the refused")
    await dashboard.choose("#log-class", "2")
    await dashboard.until(lambda d: logged_ids(d) == ["e2", "c3", "e1", "c2", "c1"], "the 2xx")

    await dashboard.choose("#log-model", "chat")
    await dashboard.type("#log-text", second.headers["X-Modelyard-Backend"])  # any field: the backend
    await dashboard.until(
        lambda d: "c2" in logged_ids(d) and "c1" not in logged_ids(d), "chat's on c2's backend"
    )
    await dashboard.type("#log-text", "C3")  # the request id, in any case
    await dashboard.until(lambda d: logged_ids(d) == ["c3"], "one request")
    await dashboard.type("#log-text", "no such thing")
    await dashboard.shows("#log-empty", "No record kept matches the filter.")
    await dashboard.screenshot("filtered")


async def test_traffic_from_minutes_ago_is_charted_then_not_as_the_last_minutes(sim_workers, gateways, page):
    gateway = await gateways([model_config("chat", await sim_workers(1))])
    # The gateway's log holds 12 answers from 4 minutes ago and none since, as an idle gateway's does
    # (here: records another worker made then, taken in as the workers' log sharing takes them:
    # the test does not wait 4 minutes). The page opened now replays them.
    then = time.time() - 240
    old = [
        (i, then, "chat", "default", "*", "w0", "round_robin", 200, 2.0, None, f"old-{i}", "", 1, False, "")
        for i in range(12)
    ]
    gateway.app[GATEWAY].metrics.routing_log.adopt(encode_shared(old))
    dashboard = await page(gateway)
    await dashboard.element("#log tr[data-request-id='old-11']")  # the page has the records

    rate = await dashboard.until(
        lambda d: (v := chart_values("chat", "rate")(d)) and any(v) and v, "chat's old requests charted"
    )
    busy = [i - len(rate) + 1 for i, value in enumerate(rate) if value > 0]  # 0: the newest 5 s step
    # 240 s ago is 48 steps before the newest (one more or less as the steps fall), and only there.
    assert len(busy) == 1 and -49 <= busy[0] <= -47, rate
    for model in ("chat", ""):  # the last minute's figures: no request
        assert await dashboard.text(f"#traffic tr[data-model='{model}'] [data-current='rate']") == "0.00/s"
        assert await dashboard.text(f"#traffic tr[data-model='{model}'] [data-current='errors']") == NONE
    await dashboard.screenshot("old-traffic")


WATCH_REDRAWS = """
window.redrawn = new Set();
window.redraws = 0;
new MutationObserver((changes) => {
  window.redraws += 1;
  for (const change of changes) {
    const node = change.target.nodeType === Node.ELEMENT_NODE ? change.target : change.target.parentElement;
    const row = node.closest("tr");
    if (row) window.redrawn.add(row.dataset.model);
  }
}).observe(document.querySelector("#traffic tbody"), { childList: true, subtree: true, characterData: true });
"""


def on_screen(d: WebDriver, model: str) -> bool:
    """Whether the model's row shows, in the window and in the table's scrolled box."""
    return bool(
        d.execute_script(
            "const row = document.querySelector(`#traffic tr[data-model='${arguments[0]}']`);"
            "const box = row.getBoundingClientRect();"
            "const view = row.closest('.scroll').getBoundingClientRect();"
            "return box.bottom > Math.max(0, view.top)"
            " && box.top < Math.min(window.innerHeight, view.bottom);",
            model,
        )
    )


async def test_with_many_models_the_charts_redraw_only_the_rows_on_screen_with_traffic(
    sim_workers, gateways, http, page
):
    workers = await sim_workers(1)
    names = [f"m{i:03d}" for i in range(120)]
    gateway = await gateways([model_config(name, workers) for name in names])
    dashboard = await page(gateway)
    last = names[-1]
    idle = "#traffic tr[data-model='m006'] [data-current='rate']"
    await dashboard.until(lambda d: d.find_element(By.CSS_SELECTOR, idle).text == "0.00/s", "a row drawn")
    assert await dashboard.run(on_screen, dashboard.driver, "m005")
    assert not await dashboard.run(on_screen, dashboard.driver, last)  # below, in the table's box
    await dashboard.run(dashboard.driver.execute_script, WATCH_REDRAWS)
    busy = [*names[:6], last]
    for name in busy:
        assert (await post_chat(http, gateway.url, name, f"to-{name}")).status == 200

    def drawn(model: str) -> Callable[[WebDriver], bool]:
        css = f"#traffic tr[data-model='{model}'] [data-current='rate']"
        return lambda d: d.find_element(By.CSS_SELECTOR, css).text not in (NONE, "0.00/s")

    await dashboard.until(drawn("m005"), "m005's request charted")
    redraws = await dashboard.run(dashboard.driver.execute_script, "return window.redraws")
    await dashboard.until(
        lambda d: d.execute_script("return window.redraws") >= redraws + 2, "two more seconds drawn"
    )
    redrawn = await dashboard.run(dashboard.driver.execute_script, "return [...window.redrawn]")
    # The whole gateway and the models with traffic on screen, every second; not the rows without
    # traffic (drawn once), nor the one with traffic below the window.
    assert sorted(redrawn) == ["", *names[:6]], redrawn
    assert await dashboard.text(f"#traffic tr[data-model='{last}'] [data-current='rate']") == NONE

    # Scrolled to, its row shows its request.
    row = await dashboard.element(f"#traffic tr[data-model='{last}']")
    await dashboard.run(dashboard.driver.execute_script, "arguments[0].scrollIntoView()", row)
    await dashboard.until(drawn(last), f"{last}'s request, once on screen")
    await dashboard.screenshot("many-models")
