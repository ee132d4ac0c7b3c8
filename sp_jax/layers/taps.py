"""Weight-gradient taps on the layers: the state through which a stage's backward hands
out what its weight gradients need, for a pipeline to compute them later
(:mod:`sp_jax.ops.deferred`; zero-bubble schedules).

A layer whose ops can defer their weight gradients (the linear layers, the grouped-query
projection, the experts) names the parameters those gradients are of
(``weight_grad_covers()``). :func:`enable_weight_grad_taps` gives every such layer of a
module a :class:`WeightGradTap` variable, ``wgrad_tap``, holding a
:class:`~sp_jax.ops.deferred.TapSlot` (no arrays): it is part of the module's state, so it
travels with the parameters through ``nnx.split`` / ``nnx.merge``, stacks and scans; the
layers run as before until :func:`~sp_jax.ops.deferred.backward_input` /
:func:`~sp_jax.ops.deferred.backward_weight` put a pass's taps in its place. Without the
call (the default) a module holds no tap and nothing changes.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from sp_jax.ops.deferred import TapSlot, backward_input, backward_weight

__all__ = ["WeightGradTap", "backward_input", "backward_weight", "enable_weight_grad_taps",
           "layer_taps"]


class WeightGradTap(nnx.Variable):
    """A layer's weight-gradient tap (:mod:`sp_jax.ops.deferred`): a
    :class:`~sp_jax.ops.deferred.TapSlot` between passes; not a parameter (no optimizer,
    no checkpoint holds it)."""


def enable_weight_grad_taps(module: nnx.Module) -> nnx.Module:
    """Gives every layer of ``module`` (itself included) that can defer its weight
    gradients a :class:`WeightGradTap` (``wgrad_tap``); returns ``module``. A stage's
    parameters for :func:`~sp_jax.ops.deferred.backward_input` are then its state with
    the taps: ``nnx.state(module, (nnx.Param, WeightGradTap))`` (or its pure dict)."""
    for _, layer in nnx.iter_modules(module):
        covers = getattr(layer, "weight_grad_covers", None)
        if covers is not None:
            layer.wgrad_tap = WeightGradTap(TapSlot(tuple(covers())))
    return module


def layer_taps(layer: nnx.Module) -> Any:
    """The value of ``layer``'s weight-gradient tap, or None without one."""
    tap = getattr(layer, "wgrad_tap", None)
    return None if tap is None else tap.get_value()
