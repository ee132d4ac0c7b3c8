"""What ``make test-combinations`` ran: the cases of the covering array that passed,
recorded in ``tests/combinations/ran.json`` (committed; ``tests/compat_coverage.py``
reads its rows into ``sp_jax.compat``'s table).

``tests/conftest.py`` registers :class:`Recorder` in the controlling pytest process when
``SP_JAX_RECORD_COMBINATIONS`` is set (``1``: ``ran.json``; any other value: that path),
as the make target does. A case is a ``test_combination[{mode}-{combination id}]`` node
(:func:`covering.params`); it is recorded when its call passed and none of its phases
failed; a case that failed, was skipped or did not run is not. The file holds the array's
fingerprint (:func:`covering.fingerprint`): tests/combinations/test_covering.py fails
when the array changed after the file was written.

The file::

    {"fingerprint": "...", "cases": 64, "wall_seconds": 1234,
     "passed": [{"test": "tests/combinations/test_combinations.py::test_combination[train-c07]",
                 "mode": "train", "combination": "c07", "features": [...], "seconds": 12.3},
                ...]}
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from combinations import covering

RAN = Path(__file__).resolve().with_name("ran.json")
"""The committed record."""

ENV = "SP_JAX_RECORD_COMBINATIONS"

_NODE = re.compile(r".*::test_combination\[(?P<case>[^\]]+)\]")


def target() -> Path | None:
    """Where to record, from ``SP_JAX_RECORD_COMBINATIONS`` (unset, empty or ``0``:
    nowhere)."""
    value = os.environ.get(ENV, "")
    if value in ("", "0"):
        return None
    return RAN if value == "1" else Path(value)


def record(passed: dict[str, float], wall_seconds: float) -> dict[str, Any]:
    """The record of a run: ``passed`` maps each passed case's node id to its seconds.
    A ValueError for a node id that is no case of the current array."""
    cases = {covering.case_id(m, c): (m, c) for m, c in covering.cases()}
    order = {key: i for i, key in enumerate(cases)}
    rows = []
    for node, seconds in passed.items():
        match = _NODE.fullmatch(node)
        if match is None or match["case"] not in cases:
            raise ValueError(f"recording: {node!r} is no case of the covering array "
                             f"({len(cases)} cases, ids like {next(iter(cases))!r}).")
        mode, combo = cases[match["case"]]
        rows.append((order[match["case"]], {
            "test": node, "mode": mode, "combination": combo.id,
            "features": list(combo.features), "seconds": round(seconds, 1)}))
    rows = [row for _, row in sorted(rows, key=lambda r: r[0])]
    return {"fingerprint": covering.fingerprint(), "cases": len(cases),
            "wall_seconds": round(wall_seconds), "passed": rows}


def write(path: Path, data: dict[str, Any]) -> None:
    """Writes a record, one case a line (a readable diff)."""
    rows = ",\n".join("  " + json.dumps(r, sort_keys=True) for r in data["passed"])
    head = {k: v for k, v in data.items() if k != "passed"}
    text = json.dumps(head, sort_keys=True)[:-1] + ', "passed": [\n' + rows + "\n]}\n"
    json.loads(text)  # well formed
    path.write_text(text)


def problems(data: dict[str, Any]) -> list[str]:
    """What is wrong with a record against the current array: another fingerprint (the
    array, or a feature's declaration, changed since), or a row whose case is not the
    current array's (its mode, id or features)."""
    if data.get("fingerprint") != covering.fingerprint():
        return [f"recorded for covering array {data.get('fingerprint')!r}, the current one is "
                f"{covering.fingerprint()!r}: run make test-combinations (and commit "
                "tests/combinations/ran.json)"]
    cases = {covering.case_id(m, c): (m, c) for m, c in covering.cases()}
    out = []
    for row in data["passed"]:
        match = _NODE.fullmatch(row["test"])
        case = cases.get(match["case"]) if match else None
        if case is None or (case[0], case[1].id, tuple(case[1].features)) != (
                row["mode"], row["combination"], tuple(row["features"])):
            out.append(f"{row['test']}: not a case of the current array as recorded")
    return out


class Recorder:
    """The pytest plugin: collects each case's reports, writes the record at the end of
    the session (the controlling process: xdist's workers report to it)."""

    def __init__(self, path: Path):
        self.path = path
        self.passed: dict[str, float] = {}
        self.failed: set[str] = set()
        self.start = time.monotonic()

    def pytest_runtest_logreport(self, report) -> None:
        if not _NODE.fullmatch(report.nodeid):
            return
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.when == "call" and report.passed:
            self.passed[report.nodeid] = report.duration

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        passed = {k: v for k, v in self.passed.items() if k not in self.failed}
        data = record(passed, time.monotonic() - self.start)
        write(self.path, data)
        print(f"\nrecording: {len(passed)} of {data['cases']} cases of the covering array "
              f"passed ({len(self.failed)} failed), written to {self.path}")
