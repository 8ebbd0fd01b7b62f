"""Cross-origin requests (CORS): which web pages' scripts may call the API from a browser.

`--allowed-origins` lists them (`*` any, the default, as vLLM's and SGLang's servers do;
empty: none, and browsers refuse every cross-origin call). Credentials (cookies) are never
allowed: a page that calls with an API key sends it in its own `Authorization` header.

- a preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`) is answered 204
  here, before the API key is checked: a browser sends none with it;
- every other response to an allowed origin carries `Access-Control-Allow-Origin`, set as
  its head leaves (`on_response_prepare`), so SSE streams and errors carry it too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
METHODS = "GET, POST, OPTIONS"
# what a page's script may read of a response: the id a stream resumes by, when to retry
EXPOSED = "x-request-id, Retry-After"
MAX_AGE = "600"  # seconds a browser may cache a preflight's answer


class Cors:
    def __init__(self, allowed_origins: str) -> None:
        # as browsers send it: scheme://host[:port], lower case, no path
        origins = {o.strip().rstrip("/").lower() for o in allowed_origins.split(",") if o.strip()}
        self.any = "*" in origins
        self.origins = origins - {"*"}

    def allows(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for `origin`, or None (not allowed)."""
        if self.any:
            return "*"
        return origin if origin.lower() in self.origins else None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        wanted = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or wanted is None:
            return await handler(request)
        allow = self.allows(origin)
        if allow is None:  # no CORS headers: the browser refuses the call
            return web.Response(status=204)
        headers = {
            "Access-Control-Allow-Origin": allow,
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Max-Age": MAX_AGE,
            "Vary": "Origin",
        }
        asked = request.headers.get("Access-Control-Request-Headers", "")
        if asked and len(asked) <= 4096:  # any (Authorization, Content-Type, Last-Event-ID)
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if "Access-Control-Allow-Origin" in response.headers:
            return  # a preflight's answer: complete already
        if not self.any:  # the answer depends on the Origin: caches must key on it
            response.headers.add("Vary", "Origin")
        origin = request.headers.get("Origin")
        allow = None if origin is None else self.allows(origin)
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
