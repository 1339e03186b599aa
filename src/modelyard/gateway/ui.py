"""The dashboard at `/dashboard`: plain files beside this module (gateway/dashboard/), no build step.

The page is public and holds no secret. It asks for the admin token, keeps it in the tab's
sessionStorage and sends it on the admin calls it makes; the Content-Security-Policy allows
scripts, styles and connections to this gateway only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from modelyard.errors import NotFound

PAGE = "/dashboard"
ASSETS = {
    "index.html": "text/html",
    "charts.js": "text/javascript",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

Handler = Callable[[web.Request], Awaitable[web.Response]]


def dashboard_handlers() -> tuple[Handler, Handler, Handler]:
    """`GET /dashboard` (the page), `GET /dashboard/{asset}` (its script and style), with the
    files read once, here, and `GET /dashboard/`, which sends the browser to the page."""
    folder = resources.files("modelyard.gateway") / "dashboard"
    files = {name: (folder / name).read_bytes() for name in ASSETS}

    def respond(name: str) -> web.Response:
        return web.Response(body=files[name], content_type=ASSETS[name], charset="utf-8", headers=_HEADERS)

    async def page(request: web.Request) -> web.Response:
        return respond("index.html")

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["asset"]
        if name not in files:
            raise NotFound(f"no dashboard file {name!r}; the files are: {', '.join(ASSETS)}")
        return respond(name)

    async def to_page(request: web.Request) -> web.Response:
        # 307 as Starlette's redirect_slashes answers: not cached for good, the query kept.
        query = request.rel_url.raw_query_string
        location = PAGE + ("?" + query if query else "")
        return web.Response(status=307, headers={"Location": location, "Cache-Control": "no-cache"})

    return page, asset, to_page
