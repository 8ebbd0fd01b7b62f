"""Colocated node: one engine runs prefill and decode in one continuous batch (the baseline)."""
