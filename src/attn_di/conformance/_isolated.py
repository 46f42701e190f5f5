"""The ``bad_input`` cells in a subprocess: a malformed input may crash a backend (a
segfault in a kernel), and a crash must be a finding, not the end of the run.

One interpreter (``python -m attn_di.conformance._isolated``) runs all of a plan's
``bad_input`` cells one after another, announcing each before it starts; if it dies, the
cell it had announced is a ``CRASH`` and a new interpreter runs the rest. A target whose
class a fresh interpreter cannot import (a class made inside a function) runs them here.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

from attn_di.conformance._case import Case, Outcome
from attn_di.conformance._report import CellResult

if TYPE_CHECKING:
    from attn_di.conformance._runner import ConformancePlan

__all__ = ["IsolatedRun", "main", "run_isolated"]

_START, _RESULT = "attn-di-conform-start ", "attn-di-conform-result "
TIMEOUT_PER_CELL = 120.0
"""Seconds a subprocess may take per cell before it counts as crashed (hung)."""


class IsolatedRun:
    """Cells running in subprocesses, started at once; :meth:`results` waits for them."""

    def __init__(self, plan: ConformancePlan, cases: Sequence[Case]) -> None:
        from attn_di.conformance._target import subprocess_spec

        self.plan = plan
        self.cases = list(cases)
        self.spec = subprocess_spec(plan.driver)
        self._found: dict[str, CellResult] = {}
        self._process: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._remaining = list(self.cases)
        if self.spec is not None and self._remaining:
            self._start()

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env.update(self.plan.driver.subprocess_env())
        request = {
            "target": self.spec,
            "seed": self.plan.seed,
            "cases": [case.id for case in self._remaining],
        }
        self._process = subprocess.Popen(
            [sys.executable, "-m", "attn_di.conformance._isolated"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(request))
        self._process.stdin.close()
        self._lines = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(
            target=_pump, args=(self._process.stdout, self._lines), daemon=True
        ).start()
        self._stderr_done = threading.Thread(
            target=_collect, args=(self._process.stderr, self._stderr), daemon=True
        )
        self._stderr_done.start()

    def results(self) -> dict[str, CellResult]:
        """Every cell's result (waiting for the subprocesses)."""
        from attn_di.conformance._runner import result_from_json, run_in_process

        by_id = {case.id: case for case in self.cases}
        if self.spec is None:
            for case in self._remaining:
                self._found[case.id] = run_in_process(
                    self.plan.driver, case, self.plan.seed, self.plan.rerun(case)
                )
            self._remaining = []
        while self._remaining:
            current: Case | None = None
            started = time.perf_counter()
            deadline = started + TIMEOUT_PER_CELL
            while True:
                try:
                    line = self._lines.get(timeout=max(0.1, deadline - time.perf_counter()))
                except queue.Empty:
                    self._kill()
                    line = None
                    timed_out = True
                else:
                    timed_out = False
                if line is None:
                    break
                if line.startswith(_START):
                    current = by_id[line[len(_START) :].strip()]
                    started = time.perf_counter()
                    deadline = started + TIMEOUT_PER_CELL
                elif line.startswith(_RESULT):
                    data = json.loads(line[len(_RESULT) :])
                    case = by_id[data["id"]]
                    result = result_from_json(case, data)
                    self._found[case.id] = _with_rerun(result, self.plan.rerun(case))
                    self._remaining = [c for c in self._remaining if c.id != case.id]
                    current = None
            code = self._wait()
            if current is None and self._remaining:
                current = self._remaining[0]  # died before announcing a cell: blame the next
            if current is not None:
                self._found[current.id] = CellResult(
                    case=current,
                    outcome=Outcome.CRASH,
                    declared=not self.plan.driver.reasons(current),
                    reason=_death(code, timed_out, self._stderr),
                    rerun=self.plan.rerun(current),
                    seconds=time.perf_counter() - started,
                )
                self._remaining = [c for c in self._remaining if c.id != current.id]
            if self._remaining:
                self._start()
        return self._found

    def _wait(self) -> int | None:
        if self._process is None:
            return None
        try:
            code = self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
            code = self._process.wait()
        self._stderr_done.join(timeout=5)  # the last stderr lines name the cause of a death
        return code

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    def close(self) -> None:
        """Stop a subprocess still running (an interrupted run)."""
        self._kill()


def run_isolated(plan: ConformancePlan, cases: Sequence[Case]) -> dict[str, CellResult]:
    """Run ``cases`` in subprocesses; their results by id."""
    run = IsolatedRun(plan, cases)
    try:
        return run.results()
    finally:
        run.close()


def _with_rerun(result: CellResult, rerun: str) -> CellResult:
    from dataclasses import replace

    return replace(result, rerun=rerun)


def _death(code: int | None, timed_out: bool, stderr: list[str]) -> str:
    if timed_out:
        what = f"the subprocess hung (no answer in {TIMEOUT_PER_CELL:.0f} s) and was killed"
    elif code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = f"the subprocess died of {name}"
    else:
        what = f"the subprocess exited with code {code}"
    tail = "".join(stderr).strip().splitlines()[-1:] if stderr else []
    return what + (f" ({tail[0][:200]})" if tail else "")


def _pump(stream: IO[str] | None, lines: queue.Queue[str | None]) -> None:
    assert stream is not None
    with stream:  # closed at EOF: no unclosed pipe once the subprocess is gone
        for line in stream:
            lines.put(line)
    lines.put(None)


def _collect(stream: IO[str] | None, into: list[str]) -> None:
    assert stream is not None
    with stream:
        for line in stream:
            into.append(line)
            del into[:-20]


def main() -> int:
    """The subprocess: read the request on stdin, run each cell, print each result."""
    import warnings

    from attn_di.conformance._runner import run_in_process
    from attn_di.conformance._target import resolve_driver

    warnings.simplefilter("ignore")
    request = json.loads(sys.stdin.read())
    driver = resolve_driver(request["target"])
    for case_id in request["cases"]:
        print(_START + case_id, flush=True)
        result = run_in_process(driver, Case.from_id(case_id), int(request["seed"]), "")
        print(_RESULT + json.dumps(result.to_json()), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - the subprocess
    sys.exit(main())
