"""A serving process builds its command line without the tools' parsers (bench, compare,
plan import aiohttp's client, numpy and the planner: ~0.4 s of CPU at each of the hundreds
of process starts of `pdserve up` and the tests); every other command line, `--help`
included, still sees every command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import SERVING, build_parser, command_of

PROBE = """
import sys
from pdserve.cli import build_parser
args = build_parser(sys.argv[1:]).parse_args(sys.argv[1:])
tools = [m for m in ("pdserve.loadgen.bench", "pdserve.planner.cli") if m in sys.modules]
print(args.command, tools)
"""


SERVING_ARGV = [["prefill", "--node-id", "p"], ["--log-level", "INFO", "gateway"]]


@pytest.mark.parametrize("argv", SERVING_ARGV)
def test_a_serving_process_imports_no_tool(argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    assert out.split()[0] in SERVING and out.strip().endswith("[]"), out


def test_a_node_without_a_metrics_port_imports_no_aiohttp():
    """aiohttp (~0.12 s of CPU to import) serves a node's --metrics-port only: imported when
    that server starts, not at every node process's start."""
    code = (
        "import sys\n"
        "from pdserve import launch\n"
        "import pdserve.decode_node.server, pdserve.prefill_node.server\n"
        "import pdserve.colocated_node.server, pdserve.common.node_metrics\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    assert out.strip() == "[]", out


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["--log-level", "INFO", "up", "--prefill", "2"], "up"),
        (["decode"], "decode"),
        (["--help"], None),
        ([], None),
        (["bench", "--url", "x"], "bench"),
        (["--log-format=json", "plan"], "plan"),
    ],
)
def test_the_command_is_read_past_the_global_flags(argv, command):
    assert command_of(argv) == command


def test_help_and_the_tools_still_see_every_command():
    for argv in (None, ["bench"], ["--help"], ["nosuch"]):
        parser = build_parser(argv)
        subs = next(a for a in parser._actions if a.dest == "command")
        assert {"bench", "compare", "plan", "prefill", "up"} <= set(subs.choices), argv
    argv = ["bench", "--url", "http://x"]
    assert build_parser(argv).parse_args(argv).url == ["http://x"]  # repeatable: gateways


def test_up_s_help_gives_the_dtype_it_defaults_to(monkeypatch):
    """`pdserve up` runs --dtype auto unless told (what this machine runs best); its help
    said float32, the default of the single-process commands."""
    monkeypatch.delenv("PDSERVE_DTYPE", raising=False)
    parser = build_parser(["up"])
    subs = next(a for a in parser._actions if a.dest == "command")
    up = subs.choices["up"]
    [dtype] = [a for a in up._actions if a.dest == "dtype"]
    assert up.get_default("dtype") == "auto" and "(default: auto;" in (dtype.help or "")


def test_a_pdserve_process_exits_without_collecting_what_the_os_frees(tmp_path):
    """At exit the interpreter's last collections walked every object still alive: ~0.45 s
    of CPU at each torch node's stop. `main` has them frozen first, by an exit handler (one
    registered before it still runs, after it)."""
    code = (
        "import atexit, gc, sys\n"
        "from pdserve.cli import main\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
        "main(['keygen', sys.argv[1]])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "k")], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    assert "frozen True" in out, out
