"""HTTP gateway: OpenAI-compatible API, placement of requests on prefill and decode nodes."""
