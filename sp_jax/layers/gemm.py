"""The GEMM a linear layer is given: precision as an injected object with its own state
(Flax's ``nnx.Linear(dot_general=...)``, haliax's ``Linear.dot_general``), not a fork of
every rule.

A GEMM has two faces. The op face is a GEMM object of :mod:`sp_jax.ops` (a frozen,
hashable dataclass: :class:`~sp_jax.ops.gemm.ComputeGemm`, in the compute dtype, or
:class:`~sp_jax.ops.fp8.Fp8Gemm`, in FP8): the static argument the ops and their custom
VJPs take as ``gemm=``, holding the arithmetic. The layer face is :class:`LayerGemm`, an
nnx module that holds the op face and the GEMM's state as an nnx variable (FP8 delayed
scaling's amax history, an :class:`~sp_jax.layers.fp8.Fp8History`), which the ops take as
``gemm_state=`` (and whose cotangent is the step's amaxes). A layer builds its
``LayerGemm`` from its config's :class:`~sp_jax.Fp8Recipe` (``fp8=``, the user's switch)
or from a GEMM object given as ``gemm=``, and hands it whole to
:func:`~sp_jax.layers.linear.shard_linear`, which threads the state through its
``shard_map``.

Checkpoint paths stay those of a layer holding its history itself: the layer exposes its
GEMM's state variable under its own name (``fp8_history``; the experts'
``experts_up_fp8_history`` / ``experts_down_fp8_history``), the same variable object, so
the module's state holds it once, at that path (nnx keeps a shared variable at the first
path in attribute order, and ``fp8_history`` sorts before ``gemm``).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from sp_jax.config import Fp8Recipe, ParallelConfig
from sp_jax.layers.fp8 import Fp8History, check_fp8_recipe, fp8_spec
from sp_jax.ops.fp8 import Fp8Gemm
from sp_jax.ops.gemm import ComputeGemm, Gemm

__all__ = ["LayerGemm", "layer_gemm"]


class LayerGemm(nnx.Module):
    """The GEMM of a linear layer (the layer face, see the module docstring).

    Attributes:
      op: the op face, a GEMM object of :mod:`sp_jax.ops` (static).
      state: its state, an :class:`~sp_jax.layers.fp8.Fp8History` ``[3,
        amax_history_len]`` (FP8 delayed scaling; replicated), or None.
    """

    def __init__(self, op: Gemm, *, eager: bool = False):
        if not isinstance(op, Gemm):
            raise TypeError(f"LayerGemm: op={op!r} must be a GEMM object "
                            "(sp_jax.ops.gemm.ComputeGemm(), sp_jax.ops.fp8.Fp8Gemm(spec)).")
        self.op = op
        init = op.init_state()
        self.state = None if init is None else Fp8History(init, out_sharding=(None, None),
                                                          eager_sharding=eager)

    def state_value(self) -> Any:
        """The state's value for the ops' ``gemm_state`` (None when stateless)."""
        return None if self.state is None else self.state[...]


def layer_gemm(where: str, fp8: Fp8Recipe | None, gemm: Gemm | None,
               parallel: ParallelConfig, *, eager: bool) -> LayerGemm:
    """A layer's :class:`LayerGemm`: from ``gemm`` (a GEMM object) or from ``fp8`` (an
    :class:`~sp_jax.Fp8Recipe`: an :class:`~sp_jax.ops.fp8.Fp8Gemm` over the mesh axes
    of ``parallel``; None: the compute dtype). TypeError / ValueError naming ``where``
    for both, or for options the layer cannot run."""
    fp8 = check_fp8_recipe(where, fp8)
    if gemm is not None:
        if fp8 is not None:
            raise ValueError(f"{where}: give fp8={fp8!r} or gemm={gemm!r}, not both (gemm "
                             "is the GEMM object fp8 would build).")
        if not isinstance(gemm, Gemm):
            raise TypeError(f"{where}: gemm={gemm!r} must be a GEMM object "
                            "(sp_jax.ops.gemm.ComputeGemm(), sp_jax.ops.fp8.Fp8Gemm(spec)) or "
                            "None.")
        return LayerGemm(gemm, eager=eager)
    spec = fp8_spec(fp8, parallel)  # FP8 options the layer cannot run fail here
    return LayerGemm(ComputeGemm() if spec is None else Fp8Gemm(spec), eager=eager)
