"""The gateway's /openapi.json is built once per served model id, not per request (a
build is milliseconds of the gateway's loop; fuzzers and API tools fetch it often)."""

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson

from pdserve.gateway import app, openapi


def test_the_document_is_built_once_per_model_id(monkeypatch):
    built: list[str] = []
    real = openapi.spec

    def counting(model_id: str = "") -> dict[str, Any]:
        built.append(model_id)
        return real(model_id)

    monkeypatch.setattr(openapi, "spec", counting)
    openapi.spec_json.cache_clear()
    try:

        async def get(model_id: str) -> bytes:
            request: Any = SimpleNamespace(app={app.SERVICE: SimpleNamespace(model_id=model_id)})
            response = await app.openapi(request)
            assert response.content_type == "application/json"
            assert isinstance(response.body, bytes)
            return response.body

        first, again, other = (asyncio.run(get(m)) for m in ("m1", "m1", "m2"))
        assert built == ["m1", "m2"]  # once per model id
        assert first == again and orjson.loads(first) == real("m1")
        assert orjson.loads(other)["info"]["description"].endswith("serving m2")
    finally:
        openapi.spec_json.cache_clear()  # the other tests' documents are their own
