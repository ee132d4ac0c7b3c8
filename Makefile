# `make demo` / `make test` create .venv if it is missing and install sp_jax into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CPU runs: the scripts simulate their devices themselves (sp_jax.xla_flags.cpu_simulation_flags)
CPU_ENV := JAX_PLATFORMS=cpu

.PHONY: demo test test-fast test-combinations slurm-test lint bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,examples,gpu-aot]"
	touch $(STAMP)

# Trains the byte-level GPT (examples/train_gpt.py; under a minute on CPU); examples/train_mlp.py is
# the smaller example: $(CPU_ENV) $(PY) examples/train_mlp.py
demo: $(STAMP)
	$(CPU_ENV) $(PY) examples/train_gpt.py --plot runs/loss.png --log-json runs/demo.jsonl

# Benchmarks sp_jax's TP+SP block against a GSPMD baseline and the unsharded block, and every
# section of BENCHMARKS.md (about an hour on 2 idle CPU cores, half of it the planner's four
# models; 8 simulated devices + deviceless 8 x H100 compiles; benchmarks/, not part of the
# installed package); writes BENCHMARKS.md whole (rendered from the results by
# benchmarks/render/ and the prose of benchmarks/templates/; what the run does not measure
# from docs/bench_recorded.json, each section saying when and how it was measured),
# docs/bench.json and docs/bench_*.png here. `--quick` for a smoke run (16 min on 2 busy
# cores), without the recorded sections.
bench: $(STAMP)
	$(CPU_ENV) $(PY) -m benchmarks --out .

# On 1-8 real GPUs (meant to take under 6 min): times the GPT training step of sp_jax, sp_jax
# with collective matmul, the GSPMD baseline, the unsharded GPT and sp_jax in FP8 (current
# and delayed scaling; tokens/s vs bf16, cuBLASLt FP8 GEMM count); real vs predicted peak
# memory, MFU, a profiler trace; writes runs/gpu-check/gpu_check.{md,json}
# (scripts/gpu_check.py). Not CPU_ENV: it needs the GPUs. Without a GPU only `--quick`
# runs (tiny shapes on simulated CPU devices).
gpu-check: $(STAMP)
	$(PY) -m scripts.gpu_check --out runs/gpu-check

# Measured 2026-12-08 on 2 cores: 63:51 of pytest for 1385 tests (1362 pass, 23 skip without
# torch or SLURM), over the 30-minute budget; 82:06 before a handful of tests that ran
# eagerly (op by op on 8 simulated devices: 40 min of CPU) were compiled. SP_JAX_COMPILE_LOG
# (tests/conftest.py) logs each test's compile count, which finds such tests.
# Three pytest workers on 2 cores, one test file each at a time (module fixtures stay in
# one process), the slowest files first (tests/conftest.py): XLA's compiles are mostly
# single-threaded, and the end-to-end tests wait on their subprocesses and peers. Every
# test process and the scripts it starts compile with XLA:CPU's legacy fusion emitters
# (about twice as fast to compile) and no LLVM optimisation (tests/conftest.py). The whole
# suite from a fresh clone, the install included: about 23 min on 2 idle cores (21:52 of
# pytest, 987 tests of which the 6 SLURM ones skip here; 17:23 with 896 before issues 40
# and 41 added the Gemma, soft-cap, memory-option and offload tests). CI's `.ci/run` then
# runs `make slurm-test` (2:31): 25:07 in all, 41 min of CPU. It is CPU-bound, so its time follows the machine's speed:
# the same machine, slower earlier the same day, took 20:14 (39 min of CPU) for the suite
# before its last speed-ups (the default corpus, the logged schedule, byte-compiled
# sources). JAX's caches are cleared after each test file. The sources are byte-compiled
# first: the suite starts about a hundred Python processes, and where
# PYTHONDONTWRITEBYTECODE is set each would compile sp_jax's sources again (0.5 s each).
# The covering array's cases marked `combinations` are left to `make test-combinations`:
# `make test` runs one combination per feature and mode (tests/combinations/covering.py's
# feature tier).
# TEST_ARGS: more pytest arguments (CI's .ci/run leaves out the covering array's file,
# which `make test-combinations` runs whole right after).
TEST_ARGS ?=
test: $(STAMP)
	$(PY) -m compileall -q sp_jax examples benchmarks
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder -m "not combinations" \
		$(TEST_ARGS) tests

# The fast tier for the inner loop (under 3 min on 2 idle cores: 2:54, 2:53 of pytest, 494
# tests): unit tests of every floor and one end-to-end test per feature
# (tests without `pytest.mark.slow`, marked in each test file; tests/test_tiers.py keeps
# every file in it); one file per worker at a time, as in `test`, so a
# module fixture (a trainer run) is made once, not once per worker.
test-fast: $(STAMP)
	$(PY) -m compileall -q sp_jax examples benchmarks
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder \
		-m "not slow and not combinations" tests

# The whole covering array (tests/combinations/covering.py: every pair of compatible
# features of sp_jax.compat in every mode, and the risky triples), each case through the
# combination harness against the unsharded model (tests/combinations/test_combinations.py,
# both tiers: the cases marked `combinations` and make test's). The cases that passed are
# recorded in tests/combinations/ran.json (SP_JAX_RECORD_COMBINATIONS, tests/conftest.py):
# commit it, tests/compat_coverage.py reads it into `python -m sp_jax.compat`'s table, and
# tests/combinations/test_covering.py fails when the array changed after it was written.
# Its own budget, beside make test's: under 30 min on 2 idle cores (measured 7:11, 64 cases; see
# docs/api.md, "What combines"). Every case is in one file: `--dist load` shares them among
# the three workers (`loadfile` would give the whole file to one).
test-combinations: $(STAMP)
	$(PY) -m compileall -q sp_jax examples benchmarks
	SP_JAX_RECORD_COMBINATIONS=1 $(PY) -m pytest -q -n 3 --dist load \
		tests/combinations/test_combinations.py

# examples/slurm/train.sbatch on a real SLURM cluster: a one-host cluster (munged,
# slurmctld, slurmd; scripts/slurm_cluster.sh) in a temporary directory, tests/test_slurm.py
# against it (SLURM_CONF), and the daemons stopped after, whatever the outcome. As root
# with apt-get it installs slurm-wlm and munge when they are missing; elsewhere without
# them it says what is missing and skips.
slurm-test: $(STAMP)
	@if ! scripts/slurm_cluster.sh check; then \
		echo "make slurm-test: skipped: no SLURM on this machine"; exit 0; fi; \
	dir=$$(mktemp -d /tmp/sp_jax_slurm.XXXXXX); \
	trap 'scripts/slurm_cluster.sh stop "$$dir"; rm -rf "$$dir"' EXIT; \
	scripts/slurm_cluster.sh start "$$dir" && \
	SLURM_CONF="$$dir/slurm.conf" $(PY) -m pytest -q -p no:xdist tests/test_slurm.py

lint: $(STAMP)
	$(PY) -m ruff check sp_jax tests examples benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
