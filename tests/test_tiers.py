"""The two tiers of the suite: `make test` runs every test, `make test-fast` (the inner
loop, under 3 minutes on 2 idle cores) those without `pytest.mark.slow`. The tier is
marked in each test file itself (DEVELOPERS.md, Conventions)."""

import json
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# The fast tier's size (409 test ids when the tiers moved into the test files). Before
# raising it, measure `make test-fast` (DEVELOPERS.md): a test belongs there only if it is
# a unit test of a floor or the one end-to-end test of a feature, on small shapes. 510
# with issue 49's seams (each new module's unit tests; four slower cases moved out to keep
# the tier's time: 4:36 before and after on the same machine).
FAST_LIMIT = 515  # + issue 50's harness: one set per mode, its refusals, a wrong model

_COLLECT = textwrap.dedent("""
    import json, sys
    import pytest

    def whole_file_slow(item):
        marks = getattr(getattr(item, "module", None), "pytestmark", [])
        return any(m.name == "slow" for m in (marks if isinstance(marks, list) else [marks]))

    class Record:
        items = []

        def pytest_collection_finish(self, session):
            self.items = [(item.path.name, item.nodeid,
                           item.get_closest_marker("slow") is not None, whole_file_slow(item))
                          for item in session.items]

    record = Record()
    code = pytest.main(["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "-W", "error::pytest.PytestUnknownMarkWarning", sys.argv[1]],
                       plugins=[record])
    with open(sys.argv[2], "w") as f:
        json.dump({"code": int(code), "items": record.items}, f)
""")


def _collect(tmp_path) -> list[tuple[str, str, bool, bool]]:
    """(file, node id, slow, whole file slow) of every test, collected in a fresh process
    (as `make test` does; a misspelled marker is an error, not a silent fast test)."""
    out = tmp_path / "items.json"
    proc = subprocess.run([sys.executable, "-c", _COLLECT, str(TESTS), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["code"] == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [tuple(item) for item in result["items"]]


def test_every_file_keeps_fast_tests_and_the_fast_tier_stays_small(tmp_path):
    """Each test file has tests in the fast tier (its floor's unit tests, its feature's
    end-to-end test) unless it says, with a module-level ``pytestmark``, that all of it is
    slow; the fast tier holds under FAST_LIMIT tests."""
    items = _collect(tmp_path)
    by_file = defaultdict(list)
    for name, node_id, slow, whole_file in items:
        by_file[name].append((node_id, slow, whole_file))
    assert len(by_file) >= 40, sorted(by_file)
    without_fast = [name for name, tests in by_file.items()
                    if all(slow for _, slow, _ in tests)
                    and not all(whole for _, _, whole in tests)]
    assert not without_fast, (
        f"{without_fast}: no test in the fast tier; keep its unit tests fast or mark the "
        "whole file `pytestmark = pytest.mark.slow`")
    fast = [node_id for _, node_id, slow, _ in items if not slow]
    assert 0 < len(fast) < FAST_LIMIT, (len(fast), FAST_LIMIT)
