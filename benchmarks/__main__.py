"""Entry point: ``python -m benchmarks --out DIR [--quick]`` (``make bench``).

Simulates 8 CPU devices (and keeps XLA:CPU's CSE from merging recompute's backward
re-gather) before JAX starts its backend; flags already in ``XLA_FLAGS`` are kept.
``JAX_PLATFORMS`` defaults to ``cpu``: the CUDA plugin is then registered for deviceless
GPU compiles instead of probing for a GPU.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags  # noqa: E402

apply_xla_flags(cpu_simulation_flags(8))

from benchmarks.run import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
