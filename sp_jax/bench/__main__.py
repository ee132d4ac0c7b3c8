"""``python -m sp_jax.bench [--quick] [--out DIR]``.

Simulates 8 CPU devices (and keeps XLA:CPU's CSE from merging recompute's backward
re-gather) before JAX starts its backend; flags already in ``XLA_FLAGS`` are kept.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags  # noqa: E402

apply_xla_flags(cpu_simulation_flags(8))

# `python -m sp_jax.bench` imports the sp_jax package (and so jax) before this file runs;
# the backend is not initialised yet, so the platform can still be chosen here.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

from sp_jax.bench.run import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
