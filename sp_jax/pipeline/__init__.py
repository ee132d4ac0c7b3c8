"""Pipeline parallelism on a stage mesh axis, in one SPMD program: schedules as tables
(:mod:`~sp_jax.pipeline.schedule`: GPipe, circular, 1F1B) and the tick loops that run
them (:mod:`~sp_jax.pipeline.runner`). Models plug in with a :class:`StageProgram`
(:mod:`sp_jax.models.pipelined` for the GPT); ``ParallelConfig(pipeline_axis=...)`` turns
it on."""

from sp_jax.pipeline.runner import StageProgram, gpipe, one_f_one_b
from sp_jax.pipeline.schedule import PipelineSchedule, bubble_formula, pipeline_schedule

__all__ = ["PipelineSchedule", "StageProgram", "bubble_formula", "gpipe", "one_f_one_b",
           "pipeline_schedule"]
