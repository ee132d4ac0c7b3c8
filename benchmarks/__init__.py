"""Benchmarks of sp_jax's TP+SP transformer block against a GSPMD baseline and the
unsharded block (not part of the installed package).

Run ``make bench``, i.e. ``JAX_PLATFORMS=cpu python -m benchmarks --out .`` from the
repository root (a few minutes on a 2-core CPU; ``--quick`` for a smoke run in seconds).
It simulates 8 CPU devices and compiles for 8 x H100 without a GPU (deviceless, needs the
CUDA PJRT plugin: ``pip install -e '.[gpu-aot]'``; without it the H100 sections are
reported as not measured). In one run it measures:

- activation memory per layer and device (the residuals abstract ``jax.vjp`` keeps)
  against Korthikanti et al.'s formula, at a realistic shape and over ``t`` and ``s``
  (:mod:`benchmarks.memory`);
- the collectives of one block's forward and backward pass in compiled HLO, on 8
  simulated CPU devices and on an 8 x H100 mesh, against Megatron's counts
  (:mod:`benchmarks.collectives`, :mod:`benchmarks.gpu`);
- per-device peak memory, what is live at the peak and the async collectives of a GPT
  forward+backward on 8 x H100 (:mod:`benchmarks.gpu`);
- CPU step time of each variant (:mod:`benchmarks.timing`);

evaluates its targets (:mod:`benchmarks.targets`) and writes ``OUT/BENCHMARKS.md``,
``OUT/docs/bench.json`` and ``OUT/docs/bench_memory_vs_{t,s}.png``
(:mod:`benchmarks.report`). Each measurement returns JSON-serialisable data; the markdown
is rendered from that data alone (:mod:`benchmarks.render`, one module per section) with
the prose of ``benchmarks/templates/*.md``, so ``python -m benchmarks.check_render``
renders ``docs/bench.json`` again and diffs it against ``BENCHMARKS.md``. The first run
on real GPUs (``make gpu-check``) is a tool, ``scripts/gpu_check.py``. The variants are
built in :mod:`benchmarks.variants`; the GSPMD baseline is :mod:`benchmarks.baseline`. The
benchmark uses only public ``sp_jax`` names; the measurement tools a user needs at run
time are in :mod:`sp_jax.analysis`.

This file imports nothing, so that ``python -m benchmarks`` can configure the simulated
devices (:mod:`benchmarks.__main__`) before JAX is imported.
"""
