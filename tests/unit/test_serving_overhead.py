"""`benchmarks/serving_overhead.py` sets the engine's own step against the ITL a served
stream sees; the reference must decode at the contexts the stream decodes at."""

from __future__ import annotations

import argparse

from benchmarks.serving_overhead import engine_step_cmd


def test_the_engine_reference_decodes_at_the_served_stream_s_contexts():
    args = argparse.Namespace(dtype="float32", quantization="none", threads=2, prompt=256,
                              output=128)  # fmt: skip
    cmd = engine_step_cmd(args)
    context = int(cmd[cmd.index("--decode-context") + 1])
    steps = int(cmd[cmd.index("--steps") + 1])
    warmup = 3  # benchmarks/engine.py's steps before the timed ones
    # the timed steps' mean context: the served stream's, prompt + half the output (it was
    # prompt + output + 3: the reference ~67 tokens deeper, slower, less overhead read)
    mean = context + warmup + (steps - 1) / 2
    assert abs(mean - (args.prompt + args.output / 2)) <= warmup
