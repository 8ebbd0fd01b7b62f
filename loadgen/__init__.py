"""Load generator: seeded workloads, SSE client, metrics and reports."""
