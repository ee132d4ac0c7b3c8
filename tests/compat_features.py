"""Each feature of ``sp_jax.compat``'s table, declared once: how it changes the model's
configuration, its ``ParallelConfig``, the mesh and the call, for a test that builds the
smallest model with a set of features (tests/test_compat.py: every refused cell raised
at its entry point; a combination harness builds on the same declarations).

``setup(names)`` combines the declarations of ``names`` (and the features they imply) on
the smallest mesh they need; two features setting one field to different values are two
values of one option (a ValueError).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType

import sp_jax
from sp_jax import compat
from sp_jax.models import GPTConfig

AXES = ("stage", "data", "expert", "context", "tensor")
"""The mesh's axes, outermost first (a size-1 axis where no feature asks for it)."""

BASE = dict(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=4, hidden=32,
            attention_block_q=4, attention_block_k=4)
"""The smallest model: every feature's declaration changes it."""


@dataclasses.dataclass(frozen=True)
class Feature:
    """How one feature changes the model and the call.

    Attributes:
      config: ``GPTConfig`` fields.
      parallel: ``ParallelConfig`` fields.
      axes: mesh axes it needs, with their sizes (at least).
      call: options of the call: ``documents`` (segment_ids / positions given),
        ``custom_loss`` (a loss_fn other than lm_loss), ``offload`` (TrainStep's
        ``offload_optimizer``).
      implies: features it brings along unless one of the same option is given (a
        pipeline: scanned layers).
      held_by: features whose declaration holds this one too, its own then left out
        (a window: ``layer_windows`` gives each layer's, and GPTConfig takes one of the
        two fields).
    """

    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    parallel: dict[str, Any] = dataclasses.field(default_factory=dict)
    axes: dict[str, int] = dataclasses.field(default_factory=dict)
    call: dict[str, bool] = dataclasses.field(default_factory=dict)
    implies: tuple[str, ...] = ()
    held_by: tuple[str, ...] = ()


def _pipeline(schedule: str) -> Feature:
    return Feature(parallel=dict(pipeline_axis="stage", pipeline_microbatches=2,
                                 pipeline_schedule=schedule), axes={"stage": 2},
                   implies=("scan_layers",))


_EXPERTS = dict(num_experts=4, moe_mlp_hidden=16)

FEATURES: dict[str, Feature] = {
    "tensor_sequence": Feature(axes={"tensor": 2}),
    "collective_matmul": Feature(parallel=dict(collective_matmul=True)),
    "recompute_allgather": Feature(parallel=dict(recompute_allgather=True)),
    "fsdp": Feature(parallel=dict(fsdp=True), axes={"data": 2}),
    "context_ring": Feature(parallel=dict(context_parallel="ring"), axes={"context": 2}),
    "context_ulysses": Feature(parallel=dict(context_parallel="ulysses"), axes={"context": 2}),
    "pipeline_gpipe": _pipeline("gpipe"),
    "pipeline_1f1b": _pipeline("1f1b"),
    "scan_layers": Feature(config=dict(scan_layers=True)),
    "unrolled_layers": Feature(config=dict(scan_layers=False)),
    "experts": Feature(config=_EXPERTS),
    "expert_parallel": Feature(parallel=dict(expert_axis="expert"), axes={"expert": 2},
                               implies=("experts",)),
    "interleaved_experts": Feature(config=dict(_EXPERTS, moe_layer_freq=2)),
    "dense_layers": Feature(config=dict(_EXPERTS, num_dense_layers=1)),
    "fp8_current": Feature(config=dict(fp8=sp_jax.Fp8Recipe("current"))),
    "fp8_delayed": Feature(config=dict(fp8=sp_jax.Fp8Recipe("delayed", 4))),
    "packed_documents": Feature(call=dict(documents=True)),
    "sliding_window": Feature(config=dict(sliding_window=3), held_by=("layer_windows",)),
    "layer_windows": Feature(config=dict(layer_windows=(3, None))),
    "cudnn_attention": Feature(config=dict(attention_implementation="cudnn")),
    "attention_dropout": Feature(config=dict(attention_dropout=0.1)),
    "attention_softcap": Feature(config=dict(attention_softcap=5.0)),
    "custom_loss": Feature(call=dict(custom_loss=True)),
    "zero1": Feature(parallel=dict(fsdp="optimizer"), axes={"data": 2}),
    "grad_reduce_dtype": Feature(parallel=dict(grad_reduce_dtype="bfloat16"), axes={"data": 2}),
    "offload_optimizer": Feature(call=dict(offload=True)),
    "offload_activations": Feature(parallel=dict(offload_activations=True)),
}
"""Every feature of ``sp_jax.compat.FEATURES``, declared."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``setup`` gives: the configuration's fields, the ``ParallelConfig``, the mesh
    shape over :data:`AXES` and the call's options; ``names``: the features (the given
    ones and those they imply)."""

    names: tuple[str, ...]
    config: dict[str, Any]
    parallel: sp_jax.ParallelConfig
    shape: tuple[int, ...]
    call: dict[str, bool]

    def gpt_config(self) -> GPTConfig:
        """The ``GPTConfig`` (its construction checks what is refused in every mode)."""
        return GPTConfig(**self.config)

    def mesh(self) -> jax.sharding.Mesh:
        """The mesh, Explicit axes, over the first devices."""
        return jax.make_mesh(self.shape, AXES, axis_types=(AxisType.Explicit,) * len(AXES),
                             devices=jax.devices()[:int(np.prod(self.shape))])


def _merge(into: dict[str, Any], new: dict[str, Any], what: str) -> None:
    for k, v in new.items():
        if k in into and into[k] != v:
            raise ValueError(f"compat_features: {what} sets {k}={v!r} against {into[k]!r} "
                             "(two values of one option)")
        into[k] = v


def setup(names: Iterable[str]) -> Setup:
    """The model and call with the features ``names`` (and what they imply) together."""
    chosen = list(dict.fromkeys(names))
    for name in list(chosen):
        for implied in FEATURES[name].implies:
            others = [f for f in chosen if compat.cell("train", implied, f).status ==
                      "exclusive"]
            if implied not in chosen and not others:
                chosen.append(implied)
    config, parallel, axes, call = dict(BASE), {}, {}, {}
    for name in chosen:
        feature = FEATURES[name]
        if set(feature.held_by) & set(chosen):
            continue
        _merge(config, feature.config, name)
        _merge(parallel, feature.parallel, name)
        _merge(call, feature.call, name)
        for axis, size in feature.axes.items():
            axes[axis] = max(axes.get(axis, 1), size)
    return Setup(tuple(chosen), config, sp_jax.ParallelConfig(**parallel),
                 tuple(axes.get(a, 1) for a in AXES), call)
