"""Benchmarks: sp_jax's TP+SP block against a GSPMD baseline and the unsharded block.

``python -m sp_jax.bench`` (``make bench``) measures, in one run:

- activation memory per layer and device (abstract ``jax.vjp`` residuals) against
  Korthikanti et al.'s formula, at a realistic shape and over ``t`` and ``s``
  (:mod:`sp_jax.bench.memory`);
- the collectives of one block's forward and backward pass in compiled HLO, on 8
  simulated CPU devices and on an 8 x H100 mesh compiled without a GPU
  (:mod:`sp_jax.bench.collectives`, :mod:`sp_jax.bench.gpu`);
- per-device peak memory and async collectives of a GPT forward+backward on 8 x H100;
- CPU step time of each variant (:mod:`sp_jax.bench.timing`);

and writes ``BENCHMARKS.md``, ``docs/bench.json`` and ``docs/bench_memory_vs_{t,s}.png``
(:mod:`sp_jax.bench.report`). The GSPMD baseline is :mod:`sp_jax.bench.baseline`.
"""

from sp_jax.bench.baseline import GspmdBlock, copy_weights
from sp_jax.bench.run import FULL, QUICK, Config, main, run

__all__ = ["Config", "FULL", "GspmdBlock", "QUICK", "copy_weights", "main", "run"]
