"""The dashboard in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver, against gateways and sim workers on free ports.

Selenium blocks, and the servers run on this test's event loop, so every browser call runs in a
thread (`Page`) while the loop keeps serving the page. Screenshots are kept as test artefacts in
$MODELYARD_ARTEFACTS (default: .artefacts/dashboard/ in the repository), their paths printed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
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

from modelyard.gateway import RunningGateway
from support import model_config, wait_until

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
