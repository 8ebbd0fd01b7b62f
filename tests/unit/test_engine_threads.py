"""One OpenMP team per process (common/engine/threads.py): a node's engine thread keeps its
torch threads, while the event loop's thread and helper threads run torch single-threaded
and so never open a second team (which makes libgomp stop spinning: a decode step then pays
a futex wake-up per parallel region). Checked in a fresh process, as a node sets it up."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, torch
from pdserve.common.engine import threads
engine = threads.engine_executor(2)
helpers = threads.helper_executor()
engine.submit(lambda: torch.ones(1 << 20).sum()).result()  # the engine's first parallel op
threads.pin_threads(1)  # what the launcher does on the loop's thread
big = torch.ones(1 << 22)
helpers.submit(lambda: big.clone()).result()
print(json.dumps({
    "engine": engine.submit(torch.get_num_threads).result(),
    "loop": torch.get_num_threads(),
    "helper": helpers.submit(torch.get_num_threads).result(),
    "new_helper": [f.result() for f in [helpers.submit(torch.get_num_threads) for _ in range(4)]],
}))
"""


def test_only_the_engine_thread_runs_torch_on_more_than_one_thread():
    cmd = [sys.executable, "-c", SCRIPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"engine": 2, "loop": 1, "helper": 1, "new_helper": [1, 1, 1, 1]}, got


IDLE_SCRIPT = """
import json, os, threading, torch
from pdserve.common.engine import threads
engine = threads.engine_executor(2, idle=True)
engine.submit(lambda: torch.ones(1 << 22).sum()).result()  # opens the engine's team
def policy(tid):  # field 41 of /proc/<pid>/task/<tid>/stat: the scheduling policy
    stat = open(f"/proc/self/task/{tid}/stat").read()
    return int(stat[stat.rindex(")") + 2:].split()[38])
tids = [int(t) for t in os.listdir("/proc/self/task")]
engine_tid = engine.submit(threading.get_native_id).result()
print(json.dumps({
    "engine": policy(engine_tid),
    "main": policy(threading.get_native_id()),
    "idle_threads": sum(policy(t) == os.SCHED_IDLE for t in tids),
}))
"""


def test_an_idle_engine_and_its_openmp_team_are_idle_and_nothing_else_is():
    """--engine-priority idle: the engine thread and the OpenMP workers it creates run under
    SCHED_IDLE; the thread that runs the event loop (first tokens, KV pushes) does not."""
    out = subprocess.run([sys.executable, "-c", IDLE_SCRIPT], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["engine"] == 5 and got["main"] == 0, got  # SCHED_IDLE is 5, SCHED_OTHER 0
    assert got["idle_threads"] >= 2, got  # the engine thread and its OpenMP worker
