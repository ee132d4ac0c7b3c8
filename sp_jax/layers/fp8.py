"""The state and options of the FP8 linear layers: the amax history of delayed scaling as
NNX state (the state of a layer's FP8 GEMM, :class:`~sp_jax.layers.gemm.LayerGemm`), and
the per-device FP8 spec of a layer's GEMM object (:class:`~sp_jax.ops.fp8.Fp8Gemm`).

The history is an :class:`Fp8History`, a subclass of ``nnx.Param``: it travels with the
parameters (shardings, checkpoints, the training step's donated state), but it is not
trained. Its "gradient" is the step's amaxes (the cotangent of the FP8 ops,
:func:`sp_jax.ops.fp8.history_amax_cotangent`); :class:`sp_jax.training.TrainStep`
keeps it away from the optimizer, combines the micro-batches' amaxes by maximum and
rolls them in (:func:`sp_jax.ops.fp8.roll_history`). A loop of one's own does the same
with :func:`split_fp8` and :func:`update_fp8_histories`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from sp_jax.config import Fp8Recipe, ParallelConfig
from sp_jax.ops.fp8 import Fp8Spec, roll_history

__all__ = ["WEIGHTS", "Fp8History", "check_fp8_recipe", "fp8_spec", "split_fp8",
           "update_fp8_histories"]


class Fp8History(nnx.Param):
    """The amax history ``[3, amax_history_len]`` (fp32) of one FP8 linear layer under
    delayed scaling: rows input, kernel, output gradient; column 0 the latest step.
    Replicated over the mesh, equal on every process."""


WEIGHTS = nnx.All(nnx.Param, nnx.Not(Fp8History))
"""The filter of the trained parameters: ``nnx.Param`` but the amax histories (what a
Hugging Face checkpoint holds, what an optimizer updates)."""


def check_fp8_recipe(where: str, fp8: Any) -> Fp8Recipe | None:
    """``fp8`` if it is ``None`` or an :class:`~sp_jax.Fp8Recipe`; a TypeError naming
    ``where`` otherwise."""
    if fp8 is not None and not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"{where}: fp8={fp8!r} must be a sp_jax.Fp8Recipe (e.g. "
                        "Fp8Recipe('current') or Fp8Recipe('delayed')) or None.")
    return fp8


def fp8_spec(fp8: Fp8Recipe | None, parallel: ParallelConfig) -> Fp8Spec | None:
    """The :class:`~sp_jax.ops.fp8.Fp8Spec` of a layer: its recipe, and the mesh axes
    an activation's shards span (data, context, tensor: a tensor's amax is the maximum
    over those it varies over)."""
    if fp8 is None:
        return None
    axes = (*parallel.data_axes, *parallel.manual_data_axes, *parallel.context_axes,
            parallel.tensor_axis)
    return Fp8Spec(fp8, tuple(dict.fromkeys(axes)), tuple(parallel.manual_data_axes))


def split_fp8(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(trainable, histories)``: a parameter state split into what the optimizer
    updates and the :class:`Fp8History` leaves (an empty state when there are none)."""
    trainable, histories = nnx.split_state(params, WEIGHTS, ...)
    return trainable, histories


def update_fp8_histories(histories: nnx.State, amaxes: nnx.State) -> nnx.State:
    """The histories after one step: each rolled by one place with this step's amaxes
    (column 0 of ``amaxes``, the histories' gradients, combined over micro-batches by
    maximum) as entry 0."""
    return jax.tree.map(lambda h, a: roll_history(h, a[..., 0]), histories, amaxes)
