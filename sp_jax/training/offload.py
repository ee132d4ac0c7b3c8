"""Optimizer state and master weights in host memory between steps (ZeRO-Offload's
placement, MaxText's ``optimizer_memory_host_offload`` / ``parameter_memory_host_offload``).

:class:`~sp_jax.training.TrainStep` with ``offload_optimizer=True`` keeps the optimizer
state's arrays in ``pinned_host`` memory (their shardings ``with_memory_kind
("pinned_host")``); the jitted step moves each leaf to device memory where the update
needs it (one ``jax.device_put`` per leaf, :func:`to_device`) and the new state back
(:func:`to_host`), so XLA sees one transfer per array and may schedule each next to its
use. ``offload_params=True`` does the same for the fp32 master weights, the forward and
backward running on a copy in the model's compute dtype (:func:`compute_copy`).

A backend without host memory (no ``pinned_host`` among the device's memory kinds) is
refused with a ``ValueError`` naming it (:func:`require_host_memory`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["HOST", "compute_copy", "elementwise_update", "layered_update", "memory_kinds",
           "on_host", "require_host_memory", "to_device", "to_host"]

HOST = "pinned_host"
"""The memory kind offloaded arrays live in between steps."""


def memory_kinds(device: jax.Device | None = None) -> set[str]:
    """The memory kinds ``device`` (default: the first device) can address, e.g.
    ``{"device", "pinned_host", "unpinned_host"}`` on CPU and GPU backends."""
    device = device if device is not None else jax.devices()[0]
    return {memory.kind for memory in device.addressable_memories()}


def require_host_memory(option: str) -> None:
    """Raises a ``ValueError`` naming the backend and ``option`` when the first device
    has no ``pinned_host`` memory kind (host offload impossible there).

    Args:
      option: the option that needs it, e.g. ``"TrainStep(offload_optimizer=True)"``.
    """
    kinds = memory_kinds()
    if HOST not in kinds:
        device = jax.devices()[0]
        raise ValueError(
            f"{option} keeps arrays in '{HOST}' host memory, but the {device.platform} "
            f"backend ({device.device_kind}) has only the memory kinds {sorted(kinds)}; "
            "train without the offload option on this backend (or run on a GPU or CPU "
            "backend, which have pinned_host memory).")


def _host_sharding(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding.with_memory_kind(HOST)


def on_host(tree: Any) -> Any:
    """``tree``'s arrays moved to ``pinned_host`` memory, keeping their shardings."""
    return jax.tree.map(lambda x: jax.device_put(x, _host_sharding(x)), tree)


def to_device(tree: Any) -> Any:
    """Inside a jitted function: each leaf of ``tree`` moved to device memory (one
    transfer per leaf)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def to_host(tree: Any) -> Any:
    """Inside a jitted function: each leaf of ``tree`` moved to host memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def compute_copy(params: Any, dtype: Any) -> Any:
    """The floating leaves of ``params`` cast to ``dtype`` (None: unchanged), the copy
    the forward and backward of an ``offload_params`` step run on."""
    if dtype is None:
        return params
    return jax.tree.map(
        lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


# Primitives that act element by element (scalars broadcast): an optimizer update built
# only of these on its non-scalar operands gives, on one layer's slice of every stacked
# array, that layer's slice of the whole update (optax.adamw, sgd, lion, schedules: yes;
# clip_by_global_norm: no, its reduce_sum couples the layers).
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos",
    "div", "eq", "exp", "exp2", "floor", "ge", "gt", "integer_pow", "is_finite", "le",
    "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pow",
    "rem", "round", "rsqrt", "select_n", "sign", "sin", "sqrt", "square", "stop_gradient",
    "sub", "tanh", "xor"})
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _elementwise(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        inner = [eqn.params[k] for k in _CALLS if k in eqn.params]
        if inner:
            if not all(_elementwise(getattr(j, "jaxpr", j)) for j in inner):
                return False
            continue
        ranks = [len(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars)]
        if max(ranks, default=0) == 0:
            continue  # scalar bookkeeping (step counts, schedules)
        operands = [len(getattr(v.aval, "shape", ())) for v in eqn.invars]
        if eqn.primitive.name == "broadcast_in_dim" and max(operands, default=0) == 0:
            continue  # a scalar broadcast
        if eqn.primitive.name not in _ELEMENTWISE:
            return False
    return True


def elementwise_update(tx: Any, params: Any, opt_state: Any) -> bool:
    """Whether ``tx.update(grads, opt_state, params)`` acts element by element on the
    parameter-shaped arrays (traced abstractly, nothing computed), so that it can run one
    layer of a scanned stack at a time (:func:`layered_update`)."""
    abstract = functools.partial(
        jax.tree.map, lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype))
    try:
        jaxpr = jax.make_jaxpr(tx.update)(abstract(params), abstract(opt_state),
                                          abstract(params))
    except Exception:  # noqa: BLE001 - an update that does not trace this way: no layering
        return False
    return _elementwise(jaxpr.jaxpr)


def _param_shaped(opt_state: Any, params: Any, stacked: Callable[[tuple], bool]) -> Any:
    """For each leaf of ``opt_state``: "stacked" (it mirrors a stacked parameter, its path
    ending in that parameter's path), "param" (it mirrors another parameter) or "other"
    (scalar bookkeeping such as a step count)."""
    shapes = {path: (jnp.shape(x), stacked(path))
              for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    def kind(path: tuple, x: Any) -> str:
        for i in range(len(path)):
            if path[i:] in shapes and shapes[path[i:]][0] == jnp.shape(x):
                return "stacked" if shapes[path[i:]][1] else "param"
        return "other"

    return jax.tree_util.tree_map_with_path(kind, opt_state)


def layered_update(tx: Any, grads: Any, opt_state: Any, params: Any, *,
                   stacked: Callable[[tuple], bool], keep: jax.Array,
                   offload_optimizer: bool, offload_params: bool) -> tuple:
    """Inside a jitted step: an element-by-element ``tx`` (:func:`elementwise_update`)
    applied one layer at a time to the stacked parameters (a ``lax.scan`` over their
    leading layer axis: only one layer's optimizer state and master weights are brought
    to the device at once, and written back before the next), then once to the others.

    Args:
      grads: the gradients (device memory), like ``params``.
      opt_state, params: the optimizer state and parameters, in host memory where
        ``offload_optimizer`` / ``offload_params`` say.
      stacked: ``stacked(path)``: whether the parameter at ``path`` has the layer axis.
      keep: a boolean scalar; where False the old values are written back.
    Returns:
      ``(new_params, new_opt_state, update_sq, param_sq)``: the new trees (in the memory
      they came from) and the sums of squares of the update and of ``params``.
    """
    kinds = _param_shaped(opt_state, params, stacked)
    param_kinds = jax.tree_util.tree_map_with_path(
        lambda path, _: "stacked" if stacked(path) else "param", params)
    leaves = jax.tree.leaves

    def part(tree: Any, tree_kinds: Any, want: str) -> Any:
        """``tree`` with the leaves of the other kind as empty placeholders."""
        return jax.tree.map(
            lambda k, x: x if k in ("other", want) else jnp.zeros((0,), x.dtype),
            tree_kinds, tree)

    def apply(grads_p, state_p, params_p, opt_on_host, params_on_host):
        state_d = to_device(state_p) if opt_on_host else state_p
        params_d = to_device(params_p) if params_on_host else params_p
        updates, new_state = tx.update(grads_p, state_d, params_d)
        new_params = jax.tree.map(lambda p, u: jnp.asarray(p + u).astype(p.dtype),
                                  params_d, updates)
        select = functools.partial(jax.tree.map, lambda n, o: jnp.where(keep, n, o))
        new_params, new_state = select(new_params, params_d), select(new_state, state_d)
        sq = sum(jnp.sum(jnp.square(u.astype(jnp.float32))) for u in leaves(updates))
        psq = sum(jnp.sum(jnp.square(p.astype(jnp.float32))) for p in leaves(params_d))
        return (to_host(new_params) if params_on_host else new_params,
                to_host(new_state) if opt_on_host else new_state, sq, psq)

    # the non-stacked parameters: one call (also advances the scalar state, e.g. count)
    rest = apply(part(grads, param_kinds, "param"), part(opt_state, kinds, "param"),
                 part(params, param_kinds, "param"), offload_optimizer, offload_params)

    # the stacked ones, one layer per scan step; scalar state read, not carried
    def take(tree, tree_kinds):
        return [x for k, x in zip(leaves(tree_kinds), leaves(tree), strict=True) if k == "stacked"]

    def put(tree, tree_kinds, stacked_leaves, other):
        flat, treedef = jax.tree.flatten(other)
        it = iter(stacked_leaves)
        out = [next(it) if k == "stacked" else x
               for k, x in zip(leaves(tree_kinds), flat, strict=True)]
        return jax.tree.unflatten(treedef, out)

    layer_in = (take(grads, param_kinds), take(opt_state, kinds), take(params, param_kinds))
    if not layer_in[0]:
        return rest
    zeros = (part(grads, param_kinds, "stacked"), part(opt_state, kinds, "stacked"),
             part(params, param_kinds, "stacked"))

    def body(carry, xs):
        g, s, p = (put(tree, k, x, z) for tree, k, x, z in zip(
            (grads, opt_state, params), (param_kinds, kinds, param_kinds), xs, zeros,
            strict=True))
        new_p, new_s, sq, psq = apply(g, s, p, offload_optimizer, offload_params)
        return (carry[0] + sq, carry[1] + psq), (take(new_p, param_kinds),
                                                 take(new_s, kinds))

    (sq, psq), (new_p, new_s) = lax.scan(
        body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), layer_in)
    new_params = put(params, param_kinds, new_p, rest[0])
    new_state = put(opt_state, kinds, new_s, rest[1])
    return new_params, new_state, rest[2] + sq, rest[3] + psq
