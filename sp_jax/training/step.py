"""A jitted training step: micro-batch accumulation in fp32, optax update, explicit shardings.

The model is split once into its graph definition, its parameters (``nnx.Param``, the
fp32 master weights) and the rest of its state; the step is a pure function of
``(params, rest, opt_state, batch, key)``, jitted with the in/out shardings of those
arrays (the "pjit" form), parameters and optimizer state donated.

Gradient accumulation runs inside the step as a ``lax.scan`` over the leading
micro-batch dimension of ``batch``, with fp32 accumulators. Losses are normalised by the
total number of target tokens, so ``M`` micro-batches give exactly the gradient of one
batch ``M`` times as large (the analog of Paddle's ``mp_fused_linear_param_grad_add``
accumulation, with ``ParallelConfig(wgrad_dtype=jnp.float32)`` for the per-micro-batch
weight gradients).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.compat import check_mode
from sp_jax.config import ParallelConfig
from sp_jax.layers.cross_entropy import document_labels
from sp_jax.layers.fp8 import Fp8History, update_fp8_histories
from sp_jax.layers.lora import LoRAParam
from sp_jax.layers.moe import RouterBias, update_router_biases
from sp_jax.layout import Layout
from sp_jax.mesh import require_host_memory, restrict_spec, spec_axes
from sp_jax.ops.primitives import reduce_in, to_device, to_host
from sp_jax.training.offload import compute_copy, on_host
from sp_jax.xla_flags import warn_if_gpu_flags_missing

__all__ = ["TrainStep", "accumulate_gradients", "device_bytes", "has_adapters", "lm_loss",
           "manual_data_graphdef", "optimizer_shardings", "train_step_fn", "trained_filter",
           "trained_state"]

LossFn = Callable[[nnx.Module, dict[str, jax.Array], jax.Array], tuple]
"""``(model, micro_batch, key) -> (loss_sum, count)`` or ``(loss_sum, count, metrics)``
(a dict of arrays, averaged over micro-batches into the step's metrics)."""


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array], key: jax.Array,
            ignore_index: int = -100) -> tuple:
    """(sum of per-token losses, number of target tokens) of a language model, and for a
    model with mixture-of-experts layers its metrics (``GPT.loss(...,
    return_metrics=True)``: ``lm_loss``, ``moe_aux_loss``, ``moe_z_loss``,
    ``moe_dropped_fraction``, ``moe_expert_tokens``), and for a model with
    multi-token prediction (``mtp_depth``) ``lm_loss`` and ``mtp_loss``, as a third
    element.

    ``batch`` holds ``tokens`` and ``labels`` ``[batch, seq]``, and for packed rows
    ``segment_ids`` and ``positions`` (:class:`~sp_jax.data.PackedText`; the targets
    across documents are dropped first, :func:`~sp_jax.layers.document_labels`);
    ``model.loss`` returns the mean over target tokens (with the routers' auxiliary
    losses), dropout drawing from ``key``.
    """
    documents = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
    labels = batch["labels"]
    if "segment_ids" in documents:
        labels = document_labels(labels, documents["segment_ids"], ignore_index)
    count = jnp.sum(labels != ignore_index)
    config = getattr(model, "config", None)
    # metrics: the routers' (experts) and the multi-token prediction loss (mtp_depth)
    with_metrics = bool(getattr(config, "num_experts", 0) or getattr(config, "mtp_depth", 0))
    out = model.loss(batch["tokens"], labels, ignore_index=ignore_index,
                     rngs=nnx.Rngs(dropout=key), **documents,
                     **({"return_metrics": True} if with_metrics else {}))
    mean, metrics = out if with_metrics else (out, None)
    total = mean * jnp.maximum(count, 1)
    return (total, count) if metrics is None else (total, count, metrics)


_TRAINED = nnx.All(nnx.Param, nnx.Not(Fp8History), nnx.Not(RouterBias))


def _split_state(params: nnx.State) -> tuple[nnx.State, nnx.State, nnx.State]:
    """``(trained, histories, biases)``: a parameter state split into what the optimizer
    updates, the FP8 amax histories and the routers' selection biases (each an empty
    state when there are none): the two kinds of state the step updates itself from
    their "gradients" (the step's amaxes, the experts' loads)."""
    return nnx.split_state(params, _TRAINED, Fp8History, RouterBias)


def has_adapters(model: nnx.Module) -> bool:
    """Whether ``model`` holds LoRA adapters (:class:`~sp_jax.layers.lora.LoRAParam`)."""
    return any(isinstance(v, LoRAParam) for _, v in nnx.iter_graph(model))


def trained_filter(model: nnx.Module) -> Any:
    """The nnx filter of the state a training step holds as its parameters (and
    differentiates, less the FP8 histories and router biases it updates itself): every
    ``nnx.Param``, or for a model with LoRA adapters the adapters (and router biases):
    its base is frozen, held with the rest of the state (no gradient, no optimizer
    state, not in the step's checkpoints)."""
    if has_adapters(model):
        return nnx.Any(LoRAParam, RouterBias)
    return nnx.Param


def trained_state(params: nnx.State) -> nnx.State:
    """What the optimizer updates of a parameter state (its state is ``tx.init`` of
    this): the parameters less the FP8 amax histories and the routers' selection
    biases."""
    return _split_state(params)[0]


def accumulate_gradients(
    loss_fn: Callable[[Any, Any, jax.Array], tuple],
    params: Any,
    batch: Any,
    key: jax.Array,
    *,
    with_metrics: bool = False,
    maximum: Any = False,
    sums: bool = False,
    unscaled: Any = False,
) -> tuple:
    """Mean loss and gradient over micro-batches, accumulated in fp32.

    Args:
      loss_fn: ``(params, micro_batch, key) -> (loss_sum, count)``, or ``(loss_sum, count,
        metrics)`` with ``metrics`` a dict of arrays.
      params: pytree of parameters.
      batch: pytree whose leaves have a leading micro-batch dimension ``M``.
      key: rng key; micro-batch ``i`` uses ``fold_in(key, i)``.
      with_metrics: also return the loss function's metrics, each averaged over the
        micro-batches (fp32; an empty dict when it returns none).
      maximum: a pytree prefix of ``params`` of bools: the "gradients" of the parts
        marked True are combined over micro-batches by maximum and not normalised (the
        amaxes an FP8 layer returns as the cotangent of its amax history).
      unscaled: a pytree prefix of ``params`` of bools: the "gradients" of the parts
        marked True are summed over the micro-batches and not normalised (the expert
        loads a router returns as the cotangent of its selection bias).
      sums: return ``(loss_sum, count, grads, metrics)`` instead: the sums over the
        micro-batches, not normalised (``metrics`` stacked per micro-batch).
    Returns:
      ``(loss, grads)`` normalised by the total count; ``grads`` in fp32 (with
      ``with_metrics``: ``(loss, grads, metrics)``).
    """
    def split_out(p, micro_batch, k):
        loss, count, *metrics = loss_fn(p, micro_batch, k)
        return loss, (count, metrics[0] if metrics else {})

    grad_fn = jax.value_and_grad(split_out, has_aux=True)
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)
    n = jax.tree.leaves(batch)[0].shape[0]

    def micro_step(carry, xs):
        loss_sum, count, grads = carry
        micro_batch, i = xs
        (loss, (micro_count, metrics)), g = grad_fn(params, micro_batch,
                                                    jax.random.fold_in(key, i))
        grads = jax.tree.map(
            lambda flag, acc, new: jax.tree.map(
                lambda a, b: (jnp.maximum if flag else jnp.add)(a, b.astype(jnp.float32)),
                acc, new),
            maximum, grads, g)
        # each micro-batch's metrics stacked (small), averaged below
        return (loss_sum + loss.astype(jnp.float32), count + micro_count, grads), \
            jax.tree.map(lambda m: m.astype(jnp.float32), metrics)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), zeros)
    (loss_sum, count, grads), metrics = lax.scan(micro_step, init, (batch, jnp.arange(n)))
    if sums:
        return loss_sum, count, grads, metrics
    scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
    loss = loss_sum * scale
    grads = jax.tree.map(
        lambda flag, keep, g: g if flag or keep else jax.tree.map(lambda x: x * scale, g),
        maximum, unscaled, grads)
    if not with_metrics:
        return loss, grads
    return loss, grads, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)


def _pipelined(model: nnx.Module) -> bool:
    """Whether ``model`` trains through its own schedule (a GPT on pipeline stages,
    :class:`sp_jax.pipeline.PipelinedGPT`: it has ``pipeline_loss_and_grads``)."""
    return callable(getattr(model, "pipeline_loss_and_grads", None))


def _pipeline_gradients(model: nnx.Module, params: Any, batch: Any, key: jax.Array,
                        loss_fn: LossFn) -> tuple[jax.Array, Any, dict[str, jax.Array], Any,
                                                  Any]:
    """Mean loss, fp32 gradients, metrics (a mixture of experts' router metrics,
    averaged over the micro-batches as :func:`accumulate_gradients` does), the FP8
    amax histories' "gradients" (the step's amaxes, the maximum over the micro-batches;
    an empty state without them) and the router biases' (the expert loads, summed) of
    a pipelined model's step: its schedule runs the batch's micro-batches
    (``model.pipeline_loss_and_grads``). ``params``: all the model's ``nnx.Param``
    state, histories and biases included."""
    documents = {"segment_ids", "positions"}
    if not isinstance(batch, dict) or not {"tokens", "labels"} <= set(batch) or \
            set(batch) - {"tokens", "labels"} - documents:
        got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(
            "TrainStep: a pipelined model takes batches {'tokens', 'labels'} (and for "
            "packed rows 'segment_ids', 'positions'), each [micro_batches, batch, seq]; "
            f"got {got}.")
    loss_sum, count, pure, metrics = model.pipeline_loss_and_grads(
        batch["tokens"], batch["labels"], key, return_metrics=True,
        **{k: v for k, v in batch.items() if k in documents})
    grads = jax.tree.map(lambda x: x, params)
    # the trained state's gradients (a model with LoRA adapters: theirs; the schedule
    # differentiates every parameter, its frozen base's kernels with zero cotangents)
    nnx.replace_by_pure_dict(grads, _restrict(pure, nnx.to_pure_dict(params)))
    grads, amaxes, loads = _split_state(grads)
    scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
    return loss_sum * scale, jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads), \
        metrics, amaxes, loads


def _restrict(tree: Any, like: Any) -> Any:
    """The entries of nested dict ``tree`` at the keys of ``like`` (a sub-tree of it)."""
    if not isinstance(like, dict):
        return tree
    return {k: _restrict(tree[k], v) for k, v in like.items()}


def _reduce_scatter(g: jax.Array, spec: P, axes: tuple[str, ...], dtype: Any = None
                    ) -> jax.Array:
    """The per-device gradient ``g`` (inside a ``shard_map`` manual over ``axes``) summed
    over ``axes``: reduce-scattered on the dimension ``spec`` (its update layout) splits
    over them, all-reduced where it splits none (a small leaf or a replicated update),
    the collective carrying ``dtype`` (``ParallelConfig.grad_reduce_dtype``; None:
    ``g``'s). ``g`` may still be split over other, explicit axes: the collective then
    runs on each device's block (:func:`~sp_jax.ops.primitives.reduce_in`)."""
    dims = [(d, spec_axes(e, axes)) for d, e in enumerate(spec)]
    dims = [(d, names) for d, names in dims if names]
    if not dims:
        return reduce_in(g, axes, dtype)
    (dim, names), = dims
    return reduce_in(g, names, dtype, scatter_dim=dim)


def _manual_gradients(graphdef: Any, params: Any, rest: Any, batch: Any, key: jax.Array,
                      loss_fn: LossFn, shardings: Any, axes: tuple[str, ...],
                      dtype: Any = None) -> tuple[jax.Array, Any]:
    """Mean loss and fp32 gradients of a ZeRO-1 step whose data ``axes`` are manual:
    each device accumulates the unreduced gradient of its rows over the micro-batches
    (``graphdef``: the model built with ``manual_data_axes``, as a pipeline stage's),
    and one reduce-scatter per parameter per step sums it over the data axes into the
    update layout ``shardings`` (Megatron's distributed optimizer: no all-reduce of a
    full gradient; the parameters' own shardings without ZeRO-1: one all-reduce), the
    collectives carrying ``dtype`` (``grad_reduce_dtype``; None: fp32)."""
    def own_dimension(s):  # a dimension split over the data axes with a tensor axis too
        mixed = [e for e in s.spec if set(spec_axes(e)) & set(axes) and
                 not set(spec_axes(e)) <= set(axes)]  # is all-reduced: resharded after
        return NamedSharding(s.mesh, P()) if mixed else s

    shardings = jax.tree.map(own_dimension, shardings)

    def body(p, r, b, k):
        def local_loss(p, micro_batch, k):
            return loss_fn(nnx.merge(graphdef, p, r), micro_batch, k)

        loss_sum, count, grads, _ = accumulate_gradients(local_loss, p, b, k, sums=True)
        loss_sum, count = lax.psum(loss_sum, axes), lax.psum(count, axes)
        with jax.named_scope("zero1_grad_reduce_scatter"):
            grads = jax.tree.map(lambda g, s: _reduce_scatter(g, s.spec, axes, dtype), grads,
                                 shardings)
        scale = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
        return loss_sum * scale, jax.tree.map(lambda g: g * scale, grads)

    def spec(x):
        return restrict_spec(jax.typeof(x).sharding.spec, axes, x.ndim)

    out = jax.tree.map(lambda x, s: restrict_spec(s.spec, axes, x.ndim), params, shardings)
    specs = jax.tree.map(spec, (params, rest, batch))
    return jax.shard_map(body, in_specs=(*specs, P()), out_specs=(P(), out),
                         axis_names=set(axes), check_vma=False)(params, rest, batch, key)


def _reduce_dtype(model: nnx.Module, parallel: Any, mesh: Any) -> Any:
    """``ParallelConfig.grad_reduce_dtype`` where the step reduces the gradients itself in
    a ``shard_map`` manual over the data axes (:func:`_manual_gradients`): an unpipelined
    model on a ``mesh`` whose data axes hold more than one device; None otherwise (a
    pipeline reduces in its own schedule; GSPMD reduces in the gradients' dtype)."""
    if not isinstance(parallel, ParallelConfig) or parallel.grad_reduce_dtype is None \
            or _pipelined(model) or mesh.empty:
        return None
    if math.prod(mesh.shape.get(a, 1) for a in parallel.data_axes) == 1:
        return None
    return parallel.grad_reduce_dtype


def _check_reduce_dtype(model: nnx.Module, manual: Any) -> None:
    """A ValueError where :func:`_reduce_dtype` applies but the data-manual step does not
    (``manual``: :func:`manual_data_graphdef`'s graph, None there) for a reason other than
    the model's features (those :mod:`sp_jax.compat` refuses: fsdp='full', experts, FP8):
    a model without a ``config``, or a mesh with Auto axes."""
    if manual is None:
        raise ValueError(
            "TrainStep: ParallelConfig(grad_reduce_dtype=...) without a pipeline reduces "
            "the gradients of a sp_jax GPT on an Explicit mesh; got "
            f"{type(model).__name__} on a mesh with Auto axes or without a GPTConfig. Leave "
            "grad_reduce_dtype=None, or build the mesh with Explicit axes.")


def manual_data_graphdef(model: nnx.Module, parallel: ParallelConfig, mesh: Any) -> Any:
    """The graph of ``model`` built with its data axes manual (``manual_data_axes``, as a
    pipeline stage's layers): ``train_step_fn``'s ``manual_graphdef`` for ZeRO-1, as
    :class:`TrainStep` builds it (``mesh``: the step's); None where ZeRO-1 keeps
    the plain gradients (resharded before the update): a pipeline (its own schedule
    reduces once per step), mixture-of-experts or FP8 layers, a model without a
    ``config``, or a mesh with Auto axes."""
    config = getattr(model, "config", None)
    if (config is None or _pipelined(model) or parallel.expert_axis
            or getattr(config, "num_experts", 0) or getattr(config, "fp8", None) is not None
            or any(t != AxisType.Explicit for t in mesh.axis_types)):
        return None
    inner = parallel.replace(data_axis=None, fsdp=False, manual_data_axes=parallel.data_axes)
    training = getattr(model, "training", True)

    def build():
        shell = type(model)(config, parallel=inner, rngs=nnx.Rngs(0))
        if not training:
            shell.eval()
        return shell

    try:
        return nnx.graphdef(nnx.eval_shape(build))
    except TypeError:  # a model class without the GPT's (config, *, parallel, rngs)
        return None


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: getattr(x, "sharding", None), tree)


def _zero1_sharding(x: Any, axes: tuple[str, ...]) -> Any:
    """``x``'s sharding with its largest dimension that no mesh axis splits and that
    divides by their size also split over those of ``axes`` it is not sharded over yet
    (an expert weight, split over the expert axis, over the other data axes); without
    one, its largest dimension whose shards divide by it; ``x``'s own sharding where no
    dimension qualifies (a small leaf of odd size)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    free = tuple(a for a in axes if a not in {n for e in sharding.spec for n in spec_axes(e)})
    size = math.prod(sharding.mesh.shape[a] for a in free)
    if size == 1:
        return sharding
    # a dimension nothing splits, else one split already whose shards split further
    # (a tensor-parallel bias [out / t]): the largest, the first of equal sizes
    dims = [d for d in range(x.ndim) if spec[d] is None and x.shape[d] % size == 0] or [
        d for d in range(x.ndim) if spec[d] is not None and x.shape[d] % (size * math.prod(
            sharding.mesh.shape[a] for a in spec_axes(spec[d]))) == 0]
    if not dims:
        return sharding
    dim = max(dims, key=lambda d: x.shape[d])
    entry = (*spec_axes(spec[dim]), *free)
    entry = entry[0] if len(entry) == 1 else entry
    return NamedSharding(sharding.mesh, P(*spec[:dim], entry, *spec[dim + 1:]))


def optimizer_shardings(params: Any, parallel: ParallelConfig | None) -> Any:
    """The shardings of the parameters' optimizer state: each parameter's own, and with
    ``ParallelConfig(fsdp="optimizer")`` (ZeRO-1) also split over the data axes
    (:attr:`~sp_jax.ParallelConfig.zero1_axes`) on the largest dimension that nothing
    splits yet and that divides by their size, else on the largest one whose shards
    divide by it (a tensor-parallel bias); a leaf with neither (a small one of odd size)
    keeps its own. The update of :class:`TrainStep` runs in this layout.

    Args:
      params: pytree of placed parameters (``jax.Array`` with a ``NamedSharding``).
      parallel: the model's config, or None (the parameters' own shardings).
    """
    axes = parallel.zero1_axes if isinstance(parallel, ParallelConfig) else ()
    if not axes:
        return _shardings(params)
    return jax.tree.map(lambda x: _zero1_sharding(x, axes), params)


def _constrain(tree: Any, shardings: Any) -> Any:
    """``tree`` laid out as ``shardings`` inside a jitted function: ``jax.reshard`` over
    Explicit mesh axes, a sharding constraint over Auto ones."""
    def one(x, s):
        if not isinstance(s, NamedSharding):
            return x
        if all(t == AxisType.Explicit for t in s.mesh.axis_types):
            return jax.reshard(x, s)
        return lax.with_sharding_constraint(x, s)

    return jax.tree.map(one, tree, shardings)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of the arrays in ``tree``: the size of each array's first
    addressable shard (a replicated array counts fully; leaves that are not
    ``jax.Array`` count nothing)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
               if hasattr(x, "addressable_shards"))


def train_step_fn(graphdef: Any, tx: optax.GradientTransformation,
                  loss_fn: LossFn = lm_loss, *, update_shardings: Any = None,
                  param_shardings: Any = None, manual_graphdef: Any = None,
                  manual_axes: tuple[str, ...] = (), reduce_dtype: Any = None,
                  offload_optimizer: bool = False, offload_params: bool = False,
                  compute_dtype: Any = None) -> Callable:
    """The pure training step :class:`TrainStep` jits: ``step(params, rest, opt_state,
    batch, key) -> (params, opt_state, {"loss", "grad_norm", "update_norm", "param_norm",
    "finite", ...})`` (the loss function's own metrics too, e.g. a mixture of experts';
    micro-batch
    gradient accumulation in fp32, then the optimizer update). Also what
    :func:`sp_jax.analysis.plan` compiles.

    A step whose loss, gradient norm or update norm is not finite changes nothing: it
    returns the parameters and optimizer state it was given, and ``finite`` False, so a
    blow-up never reaches the parameters (or a checkpoint of them). ``update_norm /
    param_norm`` (the global L2 norms of the update and of the parameters it was applied
    to) is the update-to-weight ratio a divergence check can bound
    (:class:`sp_jax.training.faults.DivergenceGuard`).

    The FP8 amax histories and the routers' selection biases
    (:class:`~sp_jax.layers.RouterBias`) are not trained: the step rolls the histories
    with its amaxes and moves each bias by its rate from the expert loads of the whole
    step, all micro-batches and data shards (:func:`~sp_jax.layers.update_router_biases`).

    ``update_shardings`` (a tree like the parameters without FP8 histories, e.g. of
    :func:`optimizer_shardings`; ZeRO-1): the gradients and parameters are resharded to
    it before the optimizer's update, which runs there, and the new parameters back to
    ``param_shardings`` (the same tree of their own shardings) after it. With
    ``manual_graphdef`` (the model built with the data ``manual_axes`` manual) the
    gradients are instead accumulated per device and reduce-scattered once per step
    straight into that layout (:func:`_manual_gradients`; without ``update_shardings``:
    all-reduced once per step), the collectives carrying ``reduce_dtype``
    (``ParallelConfig.grad_reduce_dtype``; None: fp32).

    ``offload_optimizer`` / ``offload_params``: the optimizer state / the parameters come
    in (and go out) in host memory (:mod:`sp_jax.training.offload`); each leaf moves to
    the device for the step and back. With ``offload_params`` the forward and backward
    run on the parameters cast to ``compute_dtype`` (None: as they are), the gradients
    (cast back to the parameters' dtype) updating the master weights."""

    def step(params, rest, opt_state, batch, key):
        if offload_params:
            params = to_device(params)
        if offload_optimizer:
            opt_state = to_device(opt_state)
        all_params = params
        params, histories, biases = _split_state(all_params)
        stateful = bool(jax.tree.leaves((histories, biases)))  # state it updates itself
        # the copy the forward and backward see (the master weights themselves without
        # offload_params or with an fp32 compute dtype)
        forward = compute_copy(params, compute_dtype) if offload_params else params
        forward_all = nnx.merge_state(forward, histories, biases) if stateful else forward

        def pure_loss(p, micro_batch, k):
            state = nnx.merge_state(*p) if stateful else p
            return loss_fn(nnx.merge(graphdef, state, rest), micro_batch, k)

        model = nnx.merge(graphdef, forward_all, rest)
        check_mode("train", model, mesh=jax.sharding.get_abstract_mesh(), where="TrainStep",
                   documents=isinstance(batch, dict) and "segment_ids" in batch,
                   custom_loss=loss_fn is not lm_loss, offload=offload_optimizer or offload_params)
        metrics, amaxes, loads = {}, histories, biases
        if _pipelined(model):
            loss, grads, metrics, amaxes, loads = _pipeline_gradients(
                model, forward_all, batch, key, loss_fn)
        elif manual_graphdef is not None and not stateful:  # ZeRO-1, reduced once per step
            loss, grads = _manual_gradients(
                manual_graphdef, forward, rest, batch, key, loss_fn,
                param_shardings if update_shardings is None else update_shardings,
                manual_axes, reduce_dtype)
        elif stateful:  # the histories' "gradients": the amaxes; the biases': the loads
            loss, (grads, amaxes, loads), metrics = accumulate_gradients(
                pure_loss, (forward, histories, biases), batch, key, with_metrics=True,
                maximum=(False, True, False), unscaled=(False, False, True))
        else:
            loss, grads, metrics = accumulate_gradients(pure_loss, forward, batch, key,
                                                        with_metrics=True)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        if update_shardings is not None:  # ZeRO-1: each device updates its shard
            grads = _constrain(grads, update_shardings)
            params = _constrain(params, update_shardings)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if update_shardings is not None:  # the new parameters all-gathered
            new_params = _constrain(new_params, param_shardings)
        if stateful:
            new_params = nnx.merge_state(new_params,
                                         update_fp8_histories(histories, amaxes),
                                         update_router_biases(biases, loads))
        update_norm = optax.tree.norm(updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        out_params, out_opt_state = keep(new_params, all_params), keep(new_opt_state, opt_state)
        if offload_params:
            out_params = to_host(out_params)
        if offload_optimizer:
            out_opt_state = to_host(out_opt_state)
        return out_params, out_opt_state, {
            **metrics, "loss": loss, "grad_norm": grad_norm, "update_norm": update_norm,
            "param_norm": optax.tree.norm(params), "finite": finite}

    return step


@dataclasses.dataclass
class TrainStep:
    """Holds the split model and optimizer state and runs jitted training steps.

    Example::

        step = TrainStep(model, optax.adamw(1e-3))
        for batch in batches:            # leaves [micro_batches, batch, seq]
            metrics = step(batch, key)   # {'loss', 'grad_norm'}
        step.sync_model()                # write the trained parameters back to ``model``

    Create it under ``jax.set_mesh(mesh)``: the parameters are then placed as their
    sharding annotations say, and the optimizer state follows them. Batches may come as
    host arrays (or arrays on one device): :meth:`place` lays them out on the mesh, as
    the call and :meth:`evaluate` do with whatever is not placed there yet.

    With ``ParallelConfig(fsdp="optimizer")`` (ZeRO-1) the parameters keep their layout
    and the optimizer state is sharded over the data axes (:func:`optimizer_shardings`):
    each device accumulates the gradient of its rows over the micro-batches, one
    reduce-scatter per parameter per step sums it over the data axes into that layout
    (for a GPT without experts or FP8 on an Explicit mesh: the model runs with the data
    axes manual, as a pipeline stage does; otherwise, and on a pipeline, the reduced
    gradients are resharded there), the update runs on each device's shard and the new
    parameters are all-gathered.

    Args:
      model: the NNX model (e.g. :class:`sp_jax.models.GPT`) built under the mesh.
      tx: the optax transformation (clipping, schedule, ... included).
      loss_fn: ``(model, micro_batch, key) -> (loss_sum, count)``; default
        :func:`lm_loss`.
      offload_optimizer: keep the optimizer state in ``pinned_host`` memory between
        steps (``opt_state``'s shardings ``with_memory_kind("pinned_host")``); the step
        moves it to the device leaf by leaf for the update and writes it back. The same
        arithmetic: bitwise equal to the step without it.
      offload_params: also keep the parameters (the fp32 master weights) in
        ``pinned_host`` memory; the step runs the forward and backward on a copy in the
        model's compute dtype (``model.config.dtype``; with an fp32 compute dtype
        bitwise the step without offload).

    Raises:
      ValueError: an offload option on a backend without ``pinned_host`` memory.

    On a GPU it warns once per process when ``XLA_FLAGS`` lacks sp_jax's recommended
    overlap flags (:func:`sp_jax.xla_flags.warn_if_gpu_flags_missing`).
    """

    model: nnx.Module
    tx: optax.GradientTransformation
    loss_fn: LossFn = lm_loss
    offload_optimizer: bool = False
    offload_params: bool = False

    def __post_init__(self) -> None:
        check_mode("train", self.model, mesh=jax.sharding.get_mesh(), where="TrainStep",
                   offload=self.offload_optimizer or self.offload_params)  # the model's
        for option in ("offload_optimizer", "offload_params"):
            if getattr(self, option):
                require_host_memory(f"TrainStep({option}=True)")
        warn_if_gpu_flags_missing()  # once per process, on GPU only; no subprocess
        # a model with adapters (LoRA) trains them only: its frozen base is "rest"
        self.graphdef, self.params, self.rest = nnx.split(self.model, trained_filter(self.model),
                                                          ...)
        mesh = self.mesh = jax.sharding.get_mesh()
        if not mesh.empty:
            # Lay the parameters out as their sharding annotations say, whatever their
            # current placement (e.g. weights just loaded from an unsharded model).
            self.params = jax.device_put(self.params, nnx.get_named_sharding(self.params, mesh))
        # no FP8 histories or router biases; with fsdp="optimizer" (ZeRO-1) the moments
        # follow the parameters resharded over the data axes (zeros_like keeps the sharding)
        plain = _split_state(self.params)[0]
        parallel = getattr(self.model, "parallel", None)
        zero1 = not mesh.empty and isinstance(parallel, ParallelConfig) and parallel.zero1_axes
        self._reduce_dtype = _reduce_dtype(self.model, parallel, mesh)
        self._update_shardings, self._manual = None, (None, ())
        if zero1 or self._reduce_dtype is not None:  # the data-manual graph, built once
            self._manual = (manual_data_graphdef(self.model, parallel, mesh), parallel.data_axes)
        if self._reduce_dtype is not None:
            _check_reduce_dtype(self.model, self._manual[0])
        if zero1:
            self._update_shardings = optimizer_shardings(plain, parallel)
            plain = jax.device_put(plain, self._update_shardings)
        self.opt_state = self.tx.init(plain)
        if self.offload_optimizer:
            self.opt_state = on_host(self.opt_state)
        if self.offload_params:
            self.params = on_host(self.params)
        self._step = None
        self._debug = False
        self._eval = None

    def place(self, batch: Any, *, micro_batched: bool = True) -> Any:
        """``batch`` on the step's mesh. Leaves already on the mesh's devices are kept as
        they are; the others (host arrays, arrays on one device) are placed like the
        batches of :class:`~sp_jax.data.ByteCorpus`: token ids ``[micro_batches, batch,
        seq]`` as ``Layout.micro_batched_tokens`` (``[batch, seq]`` as ``Layout.tokens``
        without ``micro_batched``), any other leaf with its batch dimension (the second,
        or the first without ``micro_batched``) over the data axes and the rest
        replicated. The layout is the model's (its ``parallel`` config), else the
        default :class:`~sp_jax.Layout`.

        Raises:
          ValueError: a leaf has no batch dimension, or a batch that does not split over
            the data axes (naming its shape and the fix).
        """
        if self.mesh.empty:
            return batch
        parallel = getattr(self.model, "parallel", None)
        layout = Layout.of(parallel) if isinstance(parallel, ParallelConfig) else Layout()
        lead = 1 if micro_batched else 0
        named = layout.micro_batched_tokens if micro_batched else layout.tokens
        devices = set(self.mesh.devices.flat)
        data = math.prod(self.mesh.shape[a] for a in layout.data_axes)

        def leaf(x: Any) -> Any:
            if isinstance(x, jax.Array) and x.sharding.device_set == devices:
                return x
            x = np.asarray(x)
            if x.ndim <= lead or x.shape[lead] % data:
                raise ValueError(
                    f"TrainStep: a batch leaf of shape {x.shape} needs a batch dimension "
                    f"{lead} divisible by the data-parallel size {data} (leaves "
                    f"[{'micro_batches, ' if micro_batched else ''}batch, ...]); resize it, "
                    "or place it yourself with jax.device_put(x, NamedSharding(mesh, "
                    "spec)).")
            spec = named if x.ndim == len(named) else layout.spec(
                *([None] * lead), "activation_batch", *([None] * (x.ndim - lead - 1)))
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(leaf, batch)

    def _jitted(self, batch: Any) -> Callable:
        """The jitted step, built on first use. It donates the parameters and optimizer
        state, except under ``jax_debug_nans`` / ``jax_debug_infs`` (JAX re-runs a step
        that made a NaN op by op on the same inputs): a change of those builds it again."""
        debug = bool(jax.config.jax_debug_nans or jax.config.jax_debug_infs)
        if self._step is None or self._debug != debug:
            step = train_step_fn(
                self.graphdef, self.tx, self.loss_fn, update_shardings=self._update_shardings,
                param_shardings=_shardings(_split_state(self.params)[0]),
                manual_graphdef=self._manual[0], manual_axes=self._manual[1],
                reduce_dtype=self._reduce_dtype,
                offload_optimizer=self.offload_optimizer, offload_params=self.offload_params,
                compute_dtype=getattr(getattr(self.model, "config", None), "dtype", None))
            # The rest (rng counters, buffers) is small and keeps whatever placement it has.
            param_s, opt_s = _shardings(self.params), _shardings(self.opt_state)
            self._step, self._debug = jax.jit(
                step,
                in_shardings=(param_s, None, opt_s, _shardings(batch), None),
                out_shardings=(param_s, opt_s, None),
                donate_argnums=() if debug else (0, 2),
            ), debug
        return self._step

    def compile(self, batch: Any, key: jax.Array) -> jax.stages.Compiled:
        """The compiled step for ``batch``'s shapes and shardings (for inspection, e.g.
        ``compile(...).memory_analysis()``; the executable is cached by ``jax.jit``)."""
        batch = self.place(batch)
        return self._jitted(batch).lower(self.params, self.rest, self.opt_state, batch,
                                         key).compile()

    def temp_bytes(self, batch: Any, key: jax.Array) -> int | None:
        """XLA's temp buffer size on one device of the compiled step for ``batch``: the
        activations kept for the backward pass, gradients in flight and workspace (from
        ``memory_analysis()``); None where the backend does not report it."""
        try:
            return int(self.compile(batch, key).memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 - memory analysis is optional per backend
            return None

    def evaluate(self, batches: Iterable[Any]) -> float:
        """Mean loss per target token over ``batches`` with the model in eval mode
        (dropout off), at the current parameters.

        Args:
          batches: batches of ``loss_fn``'s form without the micro-batch dimension, e.g.
            ``{"tokens", "labels"}`` ``[batch, seq]`` sharded ``P(data, None)``.
        Returns:
          ``sum(loss_sum) / sum(count)`` over the batches (nan when there are none).
        """
        if self._eval is None:
            graphdef, loss_fn, offloaded = self.graphdef, self.loss_fn, self.offload_params

            @jax.jit
            def eval_loss(params, rest, batch):
                model = nnx.merge(graphdef, to_device(params) if offloaded else params, rest)
                model.eval()
                return loss_fn(model, batch, jax.random.key(0))  # no dropout: key unused

            self._eval = eval_loss
        results = [self._eval(self.params, self.rest,
                              self.place(batch, micro_batched=False))[:2]
                   for batch in batches]
        count = sum(int(n) for _, n in results)
        return sum(float(s) for s, _ in results) / count if count else float("nan")

    def __call__(self, batch: Any, key: jax.Array) -> dict[str, jax.Array]:
        """One optimizer step on ``batch`` (leaves ``[micro_batches, batch, ...]``; placed
        on the mesh by :meth:`place` where they are not yet)."""
        batch = self.place(batch)
        self.params, self.opt_state, metrics = self._jitted(batch)(
            self.params, self.rest, self.opt_state, batch, key)
        return metrics

    def sync_model(self) -> nnx.Module:
        """Writes the current parameters back into ``model`` (in device memory) and
        returns it."""
        params = self.params
        if self.offload_params:
            params = jax.tree.map(
                lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), params)
        nnx.update(self.model, params)
        return self.model
