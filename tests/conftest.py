"""Test setup: 8 simulated CPU devices, configured before JAX initialises its backend; the
marker for tests that compile for a GPU without one."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags  # noqa: E402

# 8 host devices; cse_barrier_expander off so XLA:CPU keeps recompute's backward
# re-all-gather separate from the forward one (XLA:GPU keeps it without this flag).
# The suite's shapes are tiny and compiling dominates its time: LLVM's optimisation of
# the CPU code is not worth it here (a quarter of the suite's time; HLO passes, and so
# every collective, buffer and schedule the tests check, are unaffected). Subprocesses
# the tests start inherit XLA_FLAGS.
apply_xla_flags([*cpu_simulation_flags(8), "--xla_backend_optimization_level=0"])

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated CPU devices, got {jax.devices()}"

from sp_jax.analysis import cuda_plugin_available  # noqa: E402

HAS_CUDA_PLUGIN = cuda_plugin_available()
requires_cuda_plugin = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN,
    reason="deviceless GPU compiles need the CUDA PJRT plugin: pip install -e '.[gpu-aot]'",
)
"""Marks a test that compiles for a GPU mesh without a GPU (``compile_for_gpu``,
``gpu_mesh``): skipped where the plugin is missing (``make test`` installs it)."""


def make_mesh(data: int, tensor: int, axis_type: AxisType = AxisType.Explicit):
    """A (data, tensor) mesh over the first data*tensor simulated devices."""
    return jax.make_mesh(
        (data, tensor),
        ("data", "tensor"),
        axis_types=(axis_type, axis_type),
        devices=jax.devices()[: data * tensor],
    )


@pytest.fixture(scope="session")
def mesh_2x4():
    return make_mesh(2, 4)


@pytest.fixture(scope="session")
def mesh_2x4_auto():
    return make_mesh(2, 4, AxisType.Auto)


@pytest.fixture(scope="session")
def mesh_8x1():
    return make_mesh(8, 1)


# The slowest test files (measured, `pytest --durations`), longest first: with
# `--dist loadfile --no-loadscope-reorder` (make test) xdist hands files to its workers
# in collection order, so starting with these keeps one long file from running alone at
# the end. Every other file follows in its usual order.
SLOWEST_FIRST = ("test_benchmarks.py", "test_context.py", "test_gpt.py", "test_train_gpt.py",
                 "test_multiprocess.py", "test_plan.py", "test_fsdp.py", "test_properties.py",
                 "test_faults.py", "test_gpu_check.py", "test_analysis.py",
                 "test_collective_matmul.py", "test_checkpoint.py",
                 "test_checkpoint_faults.py", "test_hf.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
