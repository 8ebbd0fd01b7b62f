"""Prefill node: batches prompts, computes KV, sends the first token and the KV."""
