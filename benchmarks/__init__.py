"""Benchmarks: each script prints its figures as one JSON object on its last line."""
