"""The dashboard's tenants panel in a real browser (test_dashboard.py's chromium and fixtures), with
real traffic from two tenants: today's usage against each tenant's and each key's limits, the
requests refused over a limit and the requests shed; and no panel on a gateway without API keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from test_dashboard import CHROMEDRIVER, CHROMIUM, NONE, TOKEN, cells, driver, endpoint_rows, page

from support import model_config

__all__ = ["driver", "page"]  # (the fixtures, shared with test_dashboard.py)

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="the browser tests need Debian's chromium and chromium-driver (/usr/bin/chromium, "
    "/usr/bin/chromedriver); `make test` installs them when it runs as root with apt-get",
)

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ALPHA = "sk-alpha-0123456789"
BETA = "sk-beta-0123456789"
FIELDS = ("priority", "limits", "minute-requests", "requests", "errors", "refused", "shed")


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {
                        "name": "alpha",
                        "models": ["chat"],
                        "priority": 2,
                        "limits": {"requests_per_minute": 20, "budget": 1.0},
                    },
                    {"name": "beta", "models": ["*"]},
                ],
                "keys": [
                    {"name": "alpha-app", "tenant": "alpha", "key": ALPHA},
                    {"name": "beta-app", "tenant": "beta", "key": BETA, "limits": {"requests_per_minute": 3}},
                ],
            }
        )
    )
    return path


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **extra}


async def send(http: aiohttp.ClientSession, url: str, key: str) -> tuple[int, str | None]:
    async with http.post(
        url + "/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"}
    ) as r:
        body = await r.json()
        return r.status, body["error"]["code"] if r.status >= 400 else None


def row(tenant: str, key: str | None = None) -> str:
    if key is None:
        return f"#tenants tr[data-row='tenant'][data-tenant='{tenant}']"
    return f"#tenants tr[data-row='key'][data-tenant='{tenant}'][data-key='{key}']"


def shown(css: str, *fields: str) -> Any:
    def read(d: WebDriver) -> dict[str, str]:
        return cells(d.find_element(By.CSS_SELECTOR, css), *fields)

    return read


async def test_the_tenants_panel_shows_usage_against_limits_refusals_and_shedding(
    sim_workers, gateways, http, page, tmp_path
):
    workers = await sim_workers(1, decode_ms_per_token=20.0)
    endpoints = [{"name": "w0", "url": workers[0].url, "cost_per_1k_tokens": 2.0}]
    gateway = await gateways(
        # one request at a time, no queue: a second one at once is shed (429 overloaded)
        [model_config("chat", workers, endpoints=endpoints, circuit_breakers={"max_requests": 1})],
        auth={
            "enabled": True,
            "keys_file": str(keys_file(tmp_path)),
            "runtime_keys_file": str(tmp_path / "runtime-keys.json"),
        },
        admin={"token": TOKEN},
    )
    body = {"name": "alpha-ci", "tenant": "alpha", "limits": {"tokens_per_minute": 50000}}
    async with http.post(gateway.url + "/admin/keys", json=body, headers=ADMIN) as response:
        assert response.status == 201
        alpha_ci = (await response.json())["key"]

    dashboard = await page(gateway)
    section = await dashboard.element("#tenants-section")
    assert not await dashboard.run(section.is_displayed)  # nothing shown before the token
    await dashboard.type("#token", TOKEN)
    await dashboard.click("#token-save")
    await dashboard.until(lambda d: section.is_displayed(), "the tenants panel, with the token")
    await dashboard.until(
        lambda d: (
            shown(row("alpha"), "minute-requests", "requests", "shed")(d)
            == {"minute-requests": "0 / 20", "requests": "0", "shed": "0"}
        ),
        "alpha, idle",
    )

    # alpha's stream holds the one slot: beta's request meanwhile is shed
    async with http.post(
        gateway.url + "/v1/chat/completions", json=chat(stream=True, max_tokens=30),
        headers={"Authorization": f"Bearer {ALPHA}"},
    ) as stream:  # fmt: skip
        assert stream.status == 200
        await stream.content.readuntil(b"\n\n")
        assert await send(http, gateway.url, BETA) == (429, "overloaded")
        await stream.read()
    for key in (ALPHA, ALPHA, alpha_ci, alpha_ci):
        assert await send(http, gateway.url, key) == (200, None)
    # beta-app may begin 3 a minute: the shed one counted, 2 more, then refused
    assert [await send(http, gateway.url, BETA) for _ in range(4)] == [
        (200, None), (200, None), (429, "rate_limit_exceeded"), (429, "rate_limit_exceeded")
    ]  # fmt: skip

    expected = {
        row("alpha"): {
            "priority": "2", "limits": "20 req/min, $1.00/day", "minute-requests": "5 / 20", "requests": "5",
            "errors": "0", "refused": "0", "shed": "0",
        },
        row("alpha", "alpha-app"): {
            "priority": "2", "limits": NONE, "minute-requests": "3", "requests": "3", "errors": "0",
            "refused": "0", "shed": NONE,
        },
        row("alpha", "alpha-ci"): {
            "priority": "2", "limits": "50000 tok/min", "minute-requests": "2", "requests": "2",
            "errors": "0", "refused": "0", "shed": NONE,
        },
        row("beta"): {
            "priority": "0", "limits": NONE, "minute-requests": "3", "requests": "3", "errors": "1",
            "refused": "2 (requests 2)", "shed": "1",
        },
        row("beta", "beta-app"): {
            "priority": "0", "limits": "3 req/min", "minute-requests": "3 / 3", "requests": "3",
            "errors": "1", "refused": "2", "shed": NONE,
        },
    }  # fmt: skip
    for css, fields in expected.items():
        await dashboard.until(lambda d, c=css, f=fields: shown(c, *FIELDS)(d) == f, f"{css}: {fields}")
    keys = await dashboard.run(
        lambda: [
            r.get_attribute("data-key")
            for r in dashboard.driver.find_elements(By.CSS_SELECTOR, "#tenants tbody tr")
        ]
    )
    assert keys == [None, "alpha-app", "alpha-ci", None, "beta-app"]  # each tenant, then its keys
    source = await dashboard.text(row("alpha", "alpha-ci") + " td[data-field='name']")
    assert source == "↳ alpha-ci runtime"

    # the numbers are the gateway's: tokens and cost as /admin/usage has them
    async with http.get(gateway.url + "/admin/usage", headers=ADMIN) as response:
        usage = {t["tenant"]: t for t in (await response.json())["tenants"]}
    alpha = await dashboard.run(shown(row("alpha"), "tokens", "cost", "minute-tokens"), dashboard.driver)
    assert alpha["tokens"] == alpha["minute-tokens"] == str(usage["alpha"]["tokens"]) != "0"
    assert 0.01 < usage["alpha"]["cost"] < 1 and alpha["cost"] == f"${usage['alpha']['cost']:.4f} / $1.00"
    full = await dashboard.element(row("beta", "beta-app") + " td[data-field='minute-requests']")
    assert await dashboard.run(full.get_attribute, "data-share") == "1.0000"
    assert "bad" in await dashboard.run(
        lambda: full.find_element(By.CSS_SELECTOR, ".meter").get_attribute("class")
    )  # at its limit: red
    status = await dashboard.text("#tenants-status")
    assert "(UTC), this worker; last minute: the " in status
    await dashboard.screenshot("tenants")

    # a key revoked is still shown with today's usage, as no longer listed
    async with http.delete(gateway.url + "/admin/keys/alpha-ci", headers=ADMIN) as response:
        assert response.status == 200
    await dashboard.shows(row("alpha", "alpha-ci") + " td[data-field='name']", "no longer listed")


async def test_without_api_keys_there_is_no_tenants_panel(sim_workers, gateways, page):
    gateway = await gateways([model_config("chat", await sim_workers(1))])
    dashboard = await page(gateway)
    await dashboard.until(endpoint_rows("chat"), "the endpoints of chat")
    section = await dashboard.element("#tenants-section")
    assert not await dashboard.run(section.is_displayed)
