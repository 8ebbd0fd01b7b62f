"""The client's x-request-id as the gateway keeps it: at most REQUEST_ID_CHARS long, since
it rides in every offer and KV header and nodes keep it with their sequences (the echo over
HTTP, bytes that are no UTF-8 replaced: tests/component/test_stream_http.py)."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from pdserve.gateway.app import REQUEST_ID_CHARS, client_request_id


def _request(value: str | None) -> str:
    headers = {} if value is None else {"x-request-id": value}
    return client_request_id(make_mocked_request("POST", "/v1/completions", headers=headers))


def test_the_clients_id_is_kept_whole_when_short_and_cut_when_long():
    assert _request(None) == ""
    assert _request("trace-7") == "trace-7"
    long = "x" * (8 * 1024)  # what aiohttp's header limit lets through
    assert _request(long) == "x" * REQUEST_ID_CHARS
