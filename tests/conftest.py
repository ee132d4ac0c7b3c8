"""Test setup: 8 simulated CPU devices, configured before JAX initialises its backend; the
marker for tests that compile for a GPU without one."""

import atexit
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# The scripts' persistent compilation cache (tests/_util.py), one for the whole session:
# made here, in the first process (xdist's controller, before it starts the workers, which
# inherit the variable), and removed when that process exits.
if "SP_JAX_TEST_JIT_CACHE" not in os.environ:
    os.environ["SP_JAX_TEST_JIT_CACHE"] = tempfile.mkdtemp(prefix="sp_jax_test_jit_cache_")
    atexit.register(shutil.rmtree, os.environ["SP_JAX_TEST_JIT_CACHE"], ignore_errors=True)
from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags  # noqa: E402

# 8 host devices; cse_barrier_expander off so XLA:CPU keeps recompute's backward
# re-all-gather separate from the forward one (XLA:GPU keeps it without this flag).
# The suite's shapes are tiny and compiling dominates its time: LLVM's optimisation of
# the CPU code is not worth it here (a quarter of the suite's time; HLO passes, and so
# every collective, buffer and schedule the tests check, are unaffected).
#
# XLA:CPU's legacy (non-MLIR) fusion emitters compile the suite's programs about twice
# as fast (measured: a GPT training step 1.7 vs 3.4 s; the pipeline tests 114 vs ~450 s).
# The scripts the tests start get the same compile-speed flags (tests/_util.py).
COMPILE_SPEED_FLAGS = ("--xla_backend_optimization_level=0",
                       "--xla_cpu_use_fusion_emitters=false")
apply_xla_flags([*cpu_simulation_flags(8), *COMPILE_SPEED_FLAGS])

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
TESTS = Path(__file__).resolve().parent
SLOWEST_FIRST = ("test_doc_snippets.py", "test_benchmarks.py", "test_pipeline.py",
                 "test_pipeline_packed.py", "test_pipeline_forward.py",
                 "test_gpt.py", "test_fp8.py", "test_plan.py", "test_train_gpt.py",
                 "test_fsdp.py", "test_moe.py", "test_faults.py", "test_gpu_check.py",
                 "test_context.py", "test_attention.py", "test_collective_matmul.py",
                 "test_blocks.py", "test_hf.py", "test_analysis.py", "test_multiprocess.py",
                 "test_trainer.py", "test_generate.py", "test_generate_sharded.py",
                 "test_pipeline_hlo.py", "test_packed.py", "test_checkpoint.py",
                 "test_fp8_experts.py", "test_grouped_matmul.py", "test_finetune_text.py",
                 "test_layer_windows.py",
                 "test_gemma_features.py", "test_attention_softcap.py",
                 "test_hf_gemma.py", "test_zero1.py",
                 "test_offload_optimizer.py", "test_optimizer_precision.py",
                 "test_offload_activations.py", "test_elastic_mesh.py", "test_presets.py")
# a renamed or removed file stops the run here instead of silently losing its place
if missing := [name for name in SLOWEST_FIRST if not (TESTS / name).is_file()]:
    raise pytest.UsageError(f"tests/conftest.py: SLOWEST_FIRST names no test file: {missing}")


def pytest_collection_modifyitems(config, items):
    """The files of SLOWEST_FIRST first. (The fast tier, `make test-fast`, is marked in the
    test files themselves: each test outside it carries `pytest.mark.slow`.)"""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a file (its module fixtures already torn down): JAX's caches
    of traced and compiled functions cleared and a full garbage collection. A worker
    process runs many files; what the earlier ones leave alive makes every later trace and
    compile slower (measured: tests/test_gpt.py after the quick benchmark run, 85 -> 54 s
    of CPU time, as in a fresh process). A file's tests still share their compiled
    functions, but for the cases of the covering array (`test_combination`, make
    test-combinations: `--dist load` hands one file's cases to every worker), each of
    which builds models of its own."""
    if nextitem is None or nextitem.path != item.path or getattr(
            item, "originalname", "") == "test_combination":
        gc.collect()  # first: a donated array kept in a cycle fails block_until_ready
        for array in jax.live_arrays():  # nothing still running while executables are freed
            array.block_until_ready()
        jax.clear_caches()
        gc.collect()


def pytest_configure(config):
    """`make test-combinations` (SP_JAX_RECORD_COMBINATIONS set): the cases of the
    covering array that passed, recorded by the controlling process
    (tests/combinations/recording.py; xdist's workers report to it)."""
    if not os.environ.get("SP_JAX_RECORD_COMBINATIONS") or hasattr(config, "workerinput"):
        return
    from combinations import recording  # tests/ is on the path (rootdir conftest)

    if (path := recording.target()) is not None:
        config.pluginmanager.register(recording.Recorder(path), "sp_jax_combinations_recorder")


# SP_JAX_COMPILE_LOG=path: each test's count of XLA compiles and their seconds, a JSON line
# a test appended to path (every worker process appends its own). A test with hundreds of
# compiles runs eagerly, op by op (measured: the MTP equality tests, 248 s eager against
# 11 s with their loss and gradients under jit): the log finds them.
_COMPILES = {"count": 0, "seconds": 0.0}


def _count_compile(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["count"] += 1
        _COMPILES["seconds"] += seconds


_COMPILE_LOG = os.environ.get("SP_JAX_COMPILE_LOG")
if _COMPILE_LOG:
    jax.monitoring.register_event_duration_secs_listener(_count_compile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _COMPILE_LOG:
        yield
        return
    count, seconds, start = _COMPILES["count"], _COMPILES["seconds"], time.perf_counter()
    yield
    with open(_COMPILE_LOG, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "compiles": _COMPILES["count"] - count,
                            "compile_s": round(_COMPILES["seconds"] - seconds, 2),
                            "wall_s": round(time.perf_counter() - start, 2)}) + "\n")
