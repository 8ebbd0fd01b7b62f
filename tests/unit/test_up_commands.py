"""`pdserve up`'s child commands: each node's torch thread count, per role."""

from __future__ import annotations

from pdserve import launch
from pdserve.cli import build_parser


def threads_by_node(*argv: str) -> dict[str, int]:
    args = build_parser().parse_args(["up", "--engine", "torch", *argv])
    out = {}
    for cmd in launch.cluster_commands(args)[1:]:  # the gateway first, then the nodes
        out[cmd[cmd.index("--node-id") + 1]] = int(cmd[cmd.index("--num-threads") + 1])
    return out


def test_each_role_takes_its_own_thread_count_or_the_shared_one():
    got = threads_by_node("--prefill", "1", "--decode", "2", "--num-threads", "3",
                          "--decode-threads", "2")  # fmt: skip
    assert got == {"prefill-0": 3, "decode-0": 2, "decode-1": 2}
    got = threads_by_node("--prefill-threads", "2", "--decode-threads", "2")
    assert got == {"prefill-0": 2, "decode-0": 2}  # both phases may take every core


def test_without_any_the_cores_are_shared_out():
    import os

    got = threads_by_node("--prefill", "1", "--decode", "1")
    assert got == {"prefill-0": max(1, (os.cpu_count() or 2) // 2), "decode-0": got["decode-0"]}
    assert got["decode-0"] == got["prefill-0"]
