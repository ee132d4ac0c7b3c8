"""The small MLP example trains and matches its unsharded twin (subprocess run)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_mlp_matches_unsharded():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, "examples/train_mlp.py", "--steps", "6", "--recompute-allgather"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    m = re.search(r"loss (\S+) -> (\S+); max \|SP - unsharded\| over 6 steps: (\S+)", out.stdout)
    assert m, out.stdout
    first, last, diff = (float(v) for v in m.groups())
    assert last < first
    assert diff < 1e-5
    assert "mesh: {'data': 2, 'tensor': 4}" in out.stdout
