"""Pipeline parallelism on a stage mesh axis, in one SPMD program, outside the model:
schedules as action tables (:mod:`~sp_jax.pipeline.schedule`: GPipe, circular, 1F1B, or
any table of forward, backward-input and backward-weight actions), the one interpreter
that runs them (:mod:`~sp_jax.pipeline.interpreter`, over the stage axis's ``shard_map``
of :mod:`~sp_jax.pipeline.spmd`), and the GPT wrapped for them
(:mod:`~sp_jax.pipeline.gpt`: :class:`PipelinedGPT`, what ``GPT(config,
parallel=ParallelConfig(pipeline_axis=...))`` builds; its stage program in
:mod:`~sp_jax.pipeline.gpt_stages`, which layer each stage runs where, per kind of
layer, in :mod:`~sp_jax.pipeline.placement`). Other models plug in with a :class:`StageProgram`."""

from sp_jax.pipeline.gpt import PipelinedGPT
from sp_jax.pipeline.interpreter import StageProgram, gpipe, one_f_one_b, run_schedule
from sp_jax.pipeline.schedule import (
    PipelineSchedule,
    bubble_formula,
    defer_weights,
    pipeline_schedule,
)

__all__ = ["PipelineSchedule", "PipelinedGPT", "StageProgram", "bubble_formula",
           "defer_weights", "gpipe", "one_f_one_b", "pipeline_schedule", "run_schedule"]
