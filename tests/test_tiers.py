"""The tiers of the suite: `make test` runs every test but the covering array's cases
marked `combinations` (`make test-combinations` runs the whole array), `make test-fast`
(the inner loop, under 3 minutes on 2 idle cores) those without `pytest.mark.slow` either.
The tier is marked in each test file itself (DEVELOPERS.md, Conventions)."""

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
# the tier's time: 4:36 before and after on the same machine). 520 with issue 50's
# covering array: its unit tests and the record's (9 tests, 1.5 s in all). 550 with the
# rest of issue 50: the command-line input checks (10 argument-checking unit tests), the
# planner's printed commands parsed by both examples (8), the checkpoint relayout's plan
# (3), the harness's own cases (6: one per mode, the refusals, a wrong model caught).
# 575 with issue 51's first parts: multi-head latent attention against transformers'
# layer on each mesh with a q latent, one model, the latent ring, the cache layout (9;
# six more cases of them slow), DeepSeek routing's NumPy references (4), and the linear
# ops' check_vma forms (8, 4 s in all).
# 590 with the rest of issue 51's merged parts: DeepSeek-V3 / GLM-4.5 readers (4: a
# golden fixture, YaRN, config translation, presets), MTP (5: the NumPy transcription,
# depth 0, the step's metrics, speculative tokens, refusals), a bf16 pipelined eval, the
# cuDNN refusals, the near-tie rule and the offload unroll.
FAST_LIMIT = 590

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
                           item.get_closest_marker("slow") is not None, whole_file_slow(item),
                           item.get_closest_marker("combinations") is not None)
                          for item in session.items]

    record = Record()
    code = pytest.main(["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "-W", "error::pytest.PytestUnknownMarkWarning", sys.argv[1]],
                       plugins=[record])
    with open(sys.argv[2], "w") as f:
        json.dump({"code": int(code), "items": record.items}, f)
""")


def _collect(tmp_path) -> list[tuple[str, str, bool, bool, bool]]:
    """(file, node id, slow, whole file slow, a case of the covering array marked
    `combinations`) of every test, collected in a fresh process (as `make test` does; a
    misspelled marker is an error, not a silent fast test)."""
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
    slow; the fast tier holds under FAST_LIMIT tests. A case marked ``combinations`` (in
    neither make test nor make test-fast) counts as slow, and only the covering array's
    cases (tests/combinations/) carry the marker."""
    items = _collect(tmp_path)
    by_file = defaultdict(list)
    for name, node_id, slow, whole_file, combination in items:
        by_file[name].append((node_id, slow or combination, whole_file))
    assert len(by_file) >= 40, sorted(by_file)
    without_fast = [name for name, tests in by_file.items()
                    if all(slow for _, slow, _ in tests)
                    and not all(whole for _, _, whole in tests)]
    assert not without_fast, (
        f"{without_fast}: no test in the fast tier; keep its unit tests fast or mark the "
        "whole file `pytestmark = pytest.mark.slow`")
    fast = [node_id for _, node_id, slow, _, combination in items
            if not slow and not combination]
    assert 0 < len(fast) < FAST_LIMIT, (len(fast), FAST_LIMIT)
    assert all(node_id.startswith("tests/combinations/")
               for _, node_id, _, _, combination in items if combination)
