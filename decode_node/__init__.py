"""Decode node: receives KV into its paged cache and runs continuous batching."""
