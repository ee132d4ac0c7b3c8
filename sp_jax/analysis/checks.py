"""Deviceless compiles that the tests and the benchmarks share: the FSDP step's temp
memory and backward weight gathers on an 8 x H100 mesh (:func:`fsdp_step_report`), a
scanned stack of blocks with or without activation offload (:func:`scanned_stack_report`),
a GPT's gradients in each form of its layers (:data:`STACK_FORMS`, :func:`gpt_memory_report`,
:func:`per_layer_memory`: the memory options' effect per layer), and the memory planner
against a CPU compile of the same step for a small model (:func:`plan_cpu_check`).

They need the CUDA PJRT plugin for the H100 compiles (:func:`sp_jax.analysis.
cuda_plugin_available`); :func:`plan_cpu_check` also needs 8 (simulated) devices."""

from __future__ import annotations

import dataclasses
from typing import Any

from sp_jax.analysis.plan import ModelShape, PlanOption, plan

__all__ = ["STACK_FORMS", "StepShape", "fsdp_step_report", "gpt_memory_report",
           "offloaded_bytes_per_layer", "per_layer_memory", "plan_cpu_check",
           "scanned_stack_report"]

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class StepShape:
    """A GPT for :func:`fsdp_step_report`: ``layers`` blocks of hidden size ``h`` with
    ``heads`` heads, sequence length ``s``, vocabulary ``vocab``."""

    layers: int
    h: int
    heads: int
    s: int
    vocab: int


def fsdp_step_report(shape: Any, data: int, tensor: int, scan: bool, fsdp: bool
                     ) -> dict[str, Any]:
    """Temp / peak MiB of one training step (forward, backward, AdamW; parameters and
    optimizer state donated; rotary positions, bf16 compute, fp32 master weights,
    ``recompute_allgather``, fp32 weight gradients) on a ``data x tensor`` mesh of H100s,
    and its backward weight gathers (JAX scope ``fsdp_gather`` under ``transpose(...)``):
    their count, how many are async and overlapped, their dtypes. ``shape``: a
    :class:`StepShape` or any object with its fields."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.analysis.hlo import parse_collectives
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import GPT, GPTConfig
    from sp_jax.training.step import train_step_fn

    parallel = ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32, fsdp=fsdp)
    cfg = GPTConfig(vocab_size=shape.vocab, max_seq_len=shape.s, num_layers=shape.layers,
                    num_heads=shape.heads, hidden=shape.h, positions="rotary",
                    dtype=jnp.bfloat16, param_dtype=jnp.float32, scan_layers=scan)
    tx = optax.adamw(1e-4)
    mesh_shape, axes = (data, tensor), ("data", "tensor")
    with jax.set_mesh(gpu_mesh(mesh_shape, axes)):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((1, data, shape.s), jnp.int32,
                                  sharding=Layout.of(parallel).micro_batched_tokens)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    rep = compile_for_gpu(train_step_fn(graphdef, tx), params, rest, opt_state,
                          {"tokens": tokens, "labels": tokens}, key, mesh_shape=mesh_shape,
                          axis_names=axes, donate_argnums=(0, 2))
    gathers = [c for c in parse_collectives(rep.hlo)
               if c.kind == "all-gather" and "fsdp_gather" in c.op_name
               and "transpose(" in c.op_name]
    return {"temp_mib": rep.temp_bytes / MiB, "peak_mib": rep.peak_bytes / MiB,
            "bwd_gathers": len(gathers),
            "bwd_gathers_async": sum(c.is_async for c in gathers),
            "bwd_gathers_overlapped": sum(c.is_async and c.overlapped_ops > 0 for c in gathers),
            "bwd_gather_dtypes": sorted({a[0] for c in gathers for a in c.arrays})}


def plan_cpu_check(model: ModelShape) -> dict[str, Any]:
    """The planner on ``model`` (data 2 x tensor 4, sharded over data) against the
    analytic parameter and optimizer bytes and against the same training step compiled
    for the 8 simulated CPU devices (XLA:CPU temp minus the gradients): ``{"row": the
    plan's row as a dict, "cpu_temp_bytes", "cpu_activation_bytes"}``."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sp_jax.config import ParallelConfig
    from sp_jax.models import GPT
    from sp_jax.training import TrainStep

    option = PlanOption(2, 1, 4, fsdp=True, remat=False)
    (row,) = plan(model, 8, options=[option], progress=False)
    mesh = jax.make_mesh((2, 1, 4), ("data", "context", "tensor"))
    cfg = model.gpt_config()  # the plan's model (GPT blocks: remat off, as the option)
    parallel = ParallelConfig(recompute_allgather=True, fsdp=True,
                              wgrad_dtype=jax.numpy.float32)
    with jax.set_mesh(mesh):
        step = TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)), optax.adamw(1e-4))
        tokens = np.zeros((1, 2, model.seq), np.int32)
        batch = jax.device_put({"tokens": tokens, "labels": tokens},
                               NamedSharding(mesh, P(None, "data", None)))
        temp = step.temp_bytes(batch, jax.random.key(0))
    return {"row": row.as_dict(), "cpu_temp_bytes": temp,
            "cpu_activation_bytes": temp - row.grad_bytes}


def offloaded_bytes_per_layer(*, hidden: int, seq: int, heads: int, tensor: int,
                              batch: int = 1, mlp_hidden: int | None = None,
                              remat: bool = False, itemsize: int = 2) -> dict[str, int]:
    """What one block's rules send to the host per device (LayerNorm, no dropout,
    ``recompute_allgather``), by residual; with ``remat`` only the block's input."""
    f = mlp_hidden or 4 * hidden
    shard = batch * seq // tensor * hidden * itemsize         # [b, s / t, h]
    tp = batch * seq * hidden // tensor * itemsize            # [b, s, h / t]
    stats = 2 * batch * seq // tensor * 4                     # mean, rstd fp32 [b, s / t, 1]
    if remat:
        return {"block input": shard}
    return {
        "norm inputs + statistics (2 norms)": 2 * (shard + stats),
        "column inputs (qkv, MLP up: local shards)": 2 * shard,
        "attention q, k, v, output": 4 * tp,
        "attention log-sum-exp (fp32)": batch * heads // tensor * seq * 4,
        "out-projection input": tp,
        "MLP hidden (down projection's input)": batch * seq * f // tensor * itemsize,
    }


def gpt_memory_report(*, layers: int, hidden: int, seq: int, heads: int, tensor: int,
                      offload: bool, remat: bool = False, scan: bool = True, data: int = 1,
                      data_axis: str | None = "data", stages: int = 1,
                      schedule: str = "gpipe", vocab: int = 256, dtype: Any = None
                      ) -> dict[str, Any]:
    """Deviceless H100 compile of a GPT's loss and gradients (w.r.t. its parameters,
    outputs of the program: not temporaries) in one of the forms a user picks: its
    ``layers`` unrolled or scanned (``scan``), with ``remat``, with or without a data
    axis (``data_axis``: the config's; ``data``: the mesh's data size, one sequence per
    data shard), or on ``stages`` pipeline stages (``stages > 1``: the ``"stage"`` axis
    outermost, ``schedule`` (``"gpipe"`` or ``"1f1b"``) over ``stages`` micro-batches,
    the layers scanned within each stage);
    ``ParallelConfig(offload_activations=offload)``, ``recompute_allgather``, fp32
    parameters, ``dtype`` compute (None: bf16), fp32 weight gradients. Returns
    ``memory_analysis()``'s device temp and peak bytes and its host temp bytes (the
    offloaded residuals), and the HLO."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import GPT, GPTConfig

    dtype = jnp.bfloat16 if dtype is None else dtype
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=seq, num_layers=layers, num_heads=heads,
                    hidden=hidden, dtype=dtype, param_dtype=jnp.float32, remat=remat,
                    scan_layers=scan or stages > 1)
    pipeline = {"pipeline_axis": "stage", "pipeline_microbatches": stages,
                "pipeline_schedule": schedule} if stages > 1 else {}
    parallel = ParallelConfig(data_axis=data_axis, recompute_allgather=True,
                              wgrad_dtype=jnp.float32, offload_activations=offload,
                              **pipeline)
    shape, axes = ((stages, data, tensor), ("stage", "data", "tensor")) if stages > 1 \
        else ((data, tensor), ("data", "tensor"))
    with jax.set_mesh(gpu_mesh(shape, axes)):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
    layout = Layout.of(parallel)
    if stages > 1:
        tokens = jax.ShapeDtypeStruct((stages, data, seq), jnp.int32,
                                      sharding=layout.micro_batched_tokens)

        def grads(params, rest, tokens):
            loss, count, g = nnx.merge(graphdef, params, rest).pipeline_loss_and_grads(
                tokens, tokens, None)
            return loss / count, g
    else:
        tokens = jax.ShapeDtypeStruct((data, seq), jnp.int32, sharding=layout.tokens)

        def grads(params, rest, tokens):
            return jax.value_and_grad(
                lambda p: nnx.merge(graphdef, p, rest).loss(tokens))(params)

    report = compile_for_gpu(grads, params, rest, tokens, mesh_shape=shape, axis_names=axes)
    mem = report.compiled.memory_analysis()
    return {"temp_bytes": report.temp_bytes, "peak_bytes": report.peak_bytes,
            "host_temp_bytes": int(mem.host_temp_size_in_bytes), "hlo": report.hlo}


STACK_FORMS: dict[str, dict[str, Any]] = {
    "unrolled": {"scan": False, "data_axis": None},
    "unrolled, data axis": {"scan": False},
    "scanned": {"scan": True, "data_axis": None},
    "scanned, data axis": {"scan": True},
    "scanned, data 2": {"scan": True, "data": 2},
    "unrolled, remat": {"scan": False, "remat": True},
    "scanned, remat": {"scan": True, "remat": True},
    "2 stages (GPipe)": {"stages": 2},
    "2 stages (1F1B)": {"stages": 2, "schedule": "1f1b"},
}
"""The forms of a GPT's layers a user can pick, as :func:`gpt_memory_report`'s options:
unrolled or scanned, without a data axis (``data_axis=None``) or with one (of size 1,
or 2: one sequence per data shard), with ``remat``, on 2 pipeline stages (GPipe or
1F1B)."""


def per_layer_memory(form: str, *, offload: bool, depths: tuple[int, int] | None = None,
                     **shape: Any) -> dict[str, float]:
    """Per-layer memory of ``form`` (a :data:`STACK_FORMS` key) from two
    :func:`gpt_memory_report` compiles at ``depths`` layers (``shape``: its ``hidden``,
    ``seq``, ``heads``, ``tensor``; None: 2 and 4 layers, per stage with a pipeline, 4
    and 8 for a scanned remat stack):
    ``growth_bytes``, the device temp growth per layer (per layer of a stage with a
    pipeline: the difference over ``(L2 - L1) / stages``), and ``host_bytes``, the host
    temp bytes per layer (the offloaded residuals)."""
    kw = STACK_FORMS[form]
    stages = kw.get("stages", 1)
    # XLA:GPU compiles a layer scan of 1 or 2 steps unlike a longer one (a loop of one
    # step removed, the double-buffered loop's peeled copy): measured, a scanned remat
    # stack with offload_activations grew 0.044 MiB per layer from 2 to 4 layers (h=256,
    # s=1024, tensor 8) with no [layers, ...] value in its temp allocation, and 0 from 4
    # to 8. Scanned remat stacks and stages are measured from 4 layers (per stage: 2).
    if depths is None:
        depths = (4, 8) if kw.get("remat") and kw.get("scan", True) else \
            (2 * stages, 4 * stages)
    runs = [gpt_memory_report(layers=n, offload=offload, **shape, **kw) for n in depths]
    per = (depths[1] - depths[0]) / stages
    return {"growth_bytes": (runs[1]["temp_bytes"] - runs[0]["temp_bytes"]) / per,
            "host_bytes": (runs[1]["host_temp_bytes"] - runs[0]["host_temp_bytes"]) / per}


def scanned_stack_report(*, layers: int, hidden: int, seq: int, heads: int, tensor: int,
                         offload: bool, remat: bool = False, batch: int = 1,
                         recompute: bool = True, dtype: Any = None,
                         data_axis: str | None = None) -> dict[str, Any]:
    """Deviceless H100 compile of ``layers`` scanned blocks' forward and backward
    (gradients of a mean-square loss w.r.t. the parameters and the input; ``lax.scan``
    over the layers as ``GPTConfig(scan_layers=True)`` runs them) on a ``1 x tensor``
    mesh, with ``ParallelConfig(offload_activations=offload)``: ``memory_analysis()``'s
    device temp and peak bytes, its host temp bytes and the HLO. ``dtype``: the compute
    dtype (None: bf16); ``data_axis``: the config's (None: the batch is not split;
    ``"data"``: over the mesh's data axis, of size 1)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import Block, GPTConfig
    from sp_jax.models.blocks import scan_blocks, stack_blocks

    dtype = jnp.bfloat16 if dtype is None else dtype
    cfg = GPTConfig(vocab_size=256, max_seq_len=seq, num_layers=layers, num_heads=heads,
                    hidden=hidden, dtype=dtype, param_dtype=jnp.float32, remat=remat,
                    scan_layers=True)
    parallel = ParallelConfig(data_axis=data_axis, recompute_allgather=recompute,
                              wgrad_dtype=jnp.float32, offload_activations=offload)
    mesh = gpu_mesh((1, tensor), ("data", "tensor"))
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: stack_blocks(
            [Block(cfg, parallel, rngs=nnx.Rngs(i)) for i in range(layers)]))
        graphdef, params = nnx.split(model)
        params = jax.tree.map(
            lambda v, spec: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                 sharding=NamedSharding(mesh, spec)),
            params, nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    x = jax.ShapeDtypeStruct((batch, seq, hidden), dtype, sharding=Layout.of(parallel).sp)

    def loss(p, x):
        y, _ = scan_blocks(nnx.merge(graphdef, p), x, None, remat)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    report = compile_for_gpu(jax.grad(loss, argnums=(0, 1)), params, x, mesh_shape=(1, tensor),
                             axis_names=("data", "tensor"))
    mem = report.compiled.memory_analysis()
    return {"temp_bytes": report.temp_bytes, "peak_bytes": report.peak_bytes,
            "host_temp_bytes": int(mem.host_temp_size_in_bytes), "hlo": report.hlo}
