"""Keeps a local cluster's processes running (`pdserve up`), as a supervisor of a fault-tolerant
service should: a child that dies is started again and the others keep serving.

Rules, per child:
- exit code 0 is a clean exit (a node that drained after SIGTERM): not a failure, not
  restarted; EXIT_REFUSED (78) is a node the cluster refused (its numerics): not restarted;
- any other exit (a crash, SIGKILL) is restarted after a backoff that doubles from
  `backoff` up to `max_backoff`, and resets once the child has served `stable_after` seconds
  (from when `is_ready` first saw it serve: a model load is not a stable run);
- `give_up_after` failures in a row, each within `stable_after` seconds of serving, mean the
  child cannot run here (a bad flag, a port taken): it is not started again, and the rest keep
  serving. When the gateway gives up, or every node that prefills or every node that decodes
  does (no request can be served then: the gateways would answer 503 for good), or nothing
  is left running, the cluster stops.
- a node that served and then stops being listed by any gateway that answers, for
  `hung_after` seconds while its process runs, is hung (a frozen event loop, a step stuck in
  native code, SIGSTOP: the gateways dropped it and it never registers again): it is killed
  and restarted as a failure. A gateway is judged by its exit only: a loaded gateway's
  /health may answer late, and killing it would end every stream it carries.

`step(now)` is the whole policy, driven by a clock passed in; `run` polls it.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.common.errors import EXIT_REFUSED

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    command: list[str]
    essential: bool = False  # the cluster cannot serve without one of these (the gateways)
    serves: tuple[str, ...] = ()  # a node's phases: ("prefill",), ("decode",) or both
    proc: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0  # fast failures in a row
    restart_at: float | None = None  # when to start it again after a failure
    ready_at: float | None = None  # when it was first seen serving (stable_after runs from)
    seen_at: float = 0.0  # when it was last seen serving, or could not be judged
    hung_at: float | None = None  # killed as hung: when it was last seen serving
    state: str = "new"  # new | running | waiting | exited | gave_up
    restarts: int = 0


@dataclass
class Supervisor:
    children: list[Child]
    spawn: Callable[[Child], subprocess.Popen]
    backoff: float = 0.5
    max_backoff: float = 30.0
    stable_after: float = 30.0
    give_up_after: int = 5
    events: list[str] = field(default_factory=list)
    # whether a child serves (a node registered): a model load is no stable run, and a node
    # that crashed after each 45 s load was restarted forever; None: from its start. It
    # answers None when it cannot tell (no gateway answered): that is no evidence of a hang
    is_ready: Callable[[Child], bool | None] | None = None
    hung_after: float = 0.0  # 0: a node is never judged hung

    def start(self, now: float) -> None:
        for child in self.children:
            self._launch(child, now)

    def _launch(self, child: Child, now: float) -> None:
        child.started = now  # a spawn that fails counts as a fast failure (backoff, give-up)
        child.ready_at = now if self.is_ready is None else None
        child.hung_at = None
        child.proc = self.spawn(child)
        child.state, child.restart_at = "running", None

    def step(self, now: float) -> bool:
        """Look after every child once; False when the cluster has to stop."""
        for child in self.children:
            if child.state == "running":
                assert child.proc is not None
                code = child.proc.poll()
                if code is not None:
                    self._exited(child, code, now)
                elif self.is_ready is not None:
                    self._watch(child, self.is_ready(child), now)
            elif child.state == "waiting" and child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    self._say(f"restarting {child.name} (restart {child.restarts})")
                    try:
                        self._launch(child, now)
                    except (OSError, subprocess.SubprocessError) as exc:  # EAGAIN, ENOMEM:
                        self._say(f"{child.name} could not start: {exc}")  # a failure,
                        self._exited(child, -1, now)  # not the end of the whole cluster
        essential = [c for c in self.children if c.essential]
        if essential and all(c.state in ("gave_up", "exited") for c in essential):
            return False  # no gateway left: nothing can reach the nodes
        for phase in ("prefill", "decode"):
            able = [c for c in self.children if phase in c.serves]
            gone = [c.state for c in able if c.state in ("gave_up", "exited")]
            if able and len(gone) == len(able) and "gave_up" in gone:  # not a chosen end
                self._say(f"no node left that can {phase}: the cluster cannot serve")
                return False
        return any(c.state in ("running", "waiting") for c in self.children)

    def _watch(self, child: Child, serving: bool | None, now: float) -> None:
        if serving or serving is None:  # None: no gateway to ask (one restarting): the
            # count starts over once they answer, not from before the outage
            if serving:
                child.ready_at = now if child.ready_at is None else child.ready_at
            child.seen_at = now
            return
        if child.ready_at is None or not child.serves or self.hung_after <= 0:
            return  # still loading, a gateway, or off
        if now - child.seen_at >= self.hung_after and child.hung_at is None:
            self._say(f"{child.name} runs but no gateway has listed it for "
                      f"{now - child.seen_at:.0f} s: hung; killing it")  # fmt: skip
            assert child.proc is not None
            child.hung_at = child.seen_at  # its run ended there: a fast failure if short
            child.proc.kill()  # its exit (SIGKILL) is read at a next step

    def _exited(self, child: Child, code: int, now: float) -> None:
        if code == 0:
            child.state = "exited"
            self._say(f"{child.name} exited cleanly; not restarting it")
            return
        if code == EXIT_REFUSED:  # the cluster refused it: the same again at every start
            child.state = "gave_up"
            self._say(f"{child.name} was refused by the cluster (exit code {code}); "
                      "not restarting it")  # fmt: skip
            return
        end = now if child.hung_at is None else child.hung_at
        ran = end - child.ready_at if child.ready_at is not None else 0.0  # never served
        child.failures = child.failures + 1 if ran < self.stable_after else 1
        if child.failures >= self.give_up_after:
            child.state = "gave_up"
            self._say(
                f"{child.name} failed {child.failures} times in a row (exit code {code}); "
                "giving up on it"
            )
            return
        delay = min(self.max_backoff, self.backoff * 2 ** (child.failures - 1))
        child.state, child.restart_at = "waiting", now + delay
        self._say(f"{child.name} exited with code {code}; restarting it in {delay:.1f} s")

    def _say(self, event: str) -> None:
        self.events.append(event)
        log.warning("%s", event)
        print(f"pdserve up: {event}", flush=True)

    def running(self) -> Sequence[subprocess.Popen]:
        return [c.proc for c in self.children if c.proc is not None and c.state == "running"]

    def run(self, should_stop: Callable[[], bool], interval: float = 0.2) -> int:
        """Supervise until asked to stop (0) or the cluster cannot go on (1)."""
        while not should_stop():
            if not self.step(time.monotonic()):
                return 1
            time.sleep(interval)
        return 0
