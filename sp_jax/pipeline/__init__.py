"""Pipeline parallelism on a stage mesh axis, in one SPMD program, outside the model:
schedules as tables (:mod:`~sp_jax.pipeline.schedule`: GPipe, circular, 1F1B), the tick
loops that run them (:mod:`~sp_jax.pipeline.runner`), and the GPT wrapped for them
(:mod:`~sp_jax.pipeline.gpt`: :class:`PipelinedGPT`, what ``GPT(config,
parallel=ParallelConfig(pipeline_axis=...))`` builds; its stage program in
:mod:`~sp_jax.pipeline.gpt_stages`). Other models plug in with a :class:`StageProgram`."""

from sp_jax.pipeline.gpt import PipelinedGPT
from sp_jax.pipeline.runner import StageProgram, gpipe, one_f_one_b
from sp_jax.pipeline.schedule import PipelineSchedule, bubble_formula, pipeline_schedule

__all__ = ["PipelineSchedule", "PipelinedGPT", "StageProgram", "bubble_formula", "gpipe",
           "one_f_one_b", "pipeline_schedule"]
