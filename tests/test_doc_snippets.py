"""Every code block of the README and docs/ runs as written, in a fresh process, as on a
new user's machine: no conftest, no JAX_PLATFORMS and no device count from the suite (the
snippets simulate their own devices; XLA_FLAGS holds only compile-speed flags), and
nothing scary on stderr.

Which blocks run: every ``python`` block, and every ``bash`` block except the two make
commands (``make test`` is this suite). Blocks that cannot run here are fenced otherwise:
``text`` for output shown, ``sh`` for templates to adapt (a SLURM script, commands for
several hosts), ``console`` for commands that take minutes (the 70B planner run, whose
table ``make bench`` reproduces; tests/test_plan.py runs the same command line on a small
model). Each block runs in a fresh directory holding links to the clone's
``tests/``, ``examples/`` and ``.venv/``, so what it writes (``runs/...``) stays there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _util import script_env, slow_except
from conftest import HAS_CUDA_PLUGIN

from sp_jax._quiet import NOISE

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Blocks that compile for GPUs without one need the CUDA plugin (the gpu-aot extra).
NEEDS_CUDA_PLUGIN = ("sp_jax.plan", "compile_for_gpu", "gpu_mesh")
SCARY = ("Traceback", "cudart_stub", "Could not find cuda drivers", "Jax plugin configuration",
         "gpu_hlo_schedule", "error in the calculation")


def _blocks() -> list[tuple[str, str, str]]:
    """(id, language, code) of every block that runs; the id is ``<file>#<n>``, the n-th
    block of the file that runs, and its line."""
    out = []
    for path in DOCS:
        text, n = path.read_text(), 0
        for m in FENCE.finditer(text):
            language, code = m.group(1), m.group(2)
            line = text.count("\n", 0, m.start()) + 1
            if language == "bash" and all(c.split("#")[0].strip().startswith("make ")
                                          for c in code.splitlines() if c.strip()):
                continue
            if language in ("python", "bash"):
                n += 1
                out.append((f"{path.relative_to(ROOT)}#{n} (line {line})", language, code))
    return out


BLOCKS = _blocks()
IDS = [where.split(" ")[0] for where, _, _ in BLOCKS]


def _user_env() -> dict[str, str]:
    """A user's environment: no JAX_PLATFORMS and no device count of the suite; only its
    compile-speed settings, which change no result: its persistent compilation cache and
    XLA_FLAGS without LLVM optimisation and with XLA:CPU's legacy fusion emitters
    (tests/_util.py)."""
    env = {k: v for k, v in script_env().items() if k != "JAX_PLATFORMS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# code -> where it ran and passed (xdist's loadfile keeps this file in one process): a block
# that repeats one already run (the README's and a guide's copy of one command line) is
# not run twice.
_PASSED: dict[str, str] = {}


@pytest.mark.parametrize("where, language, code", slow_except(BLOCKS, BLOCKS[0]),
                         ids=IDS)
def test_block_runs_as_written(where, language, code, tmp_path):
    if code in _PASSED:
        pytest.skip(f"the same block as {_PASSED[code]}, which ran as written")
    for name in ("tests", "examples", ".venv"):
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    if language == "bash" and ".venv/bin/python" in code and not (ROOT / ".venv").exists():
        pytest.skip("no .venv in this clone (make creates it)")
    if not HAS_CUDA_PLUGIN and any(name in code for name in NEEDS_CUDA_PLUGIN):
        pytest.skip("compiles for GPUs without one: needs the CUDA plugin (gpu-aot extra)")
    script = tmp_path / ("snippet.py" if language == "python" else "snippet.sh")
    script.write_text(code)
    argv = [sys.executable, str(script)] if language == "python" else ["bash", "-e", str(script)]
    run = subprocess.run(argv, cwd=tmp_path, env=_user_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{where} exited {run.returncode}\n{run.stdout[-3000:]}\n" \
                                f"{run.stderr[-3000:]}"
    scary = [line for line in run.stderr.splitlines()
             if any(word in line for word in SCARY) or any(p.fullmatch(line) for p in NOISE)]
    assert not scary, f"{where} printed on stderr:\n" + "\n".join(scary[:20])
    _PASSED[code] = where


def test_every_doc_has_its_blocks_found():
    """The README's snippets are among the blocks run (the fence pattern finds them)."""
    assert sum(where.startswith("README.md") for where, _, _ in BLOCKS) >= 4
