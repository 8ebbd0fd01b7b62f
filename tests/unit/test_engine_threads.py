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
