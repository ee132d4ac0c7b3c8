"""Layout vocabulary: the one table from logical array axes to mesh axes, and the specs of
every activation and parameter sp_jax shards.

Every layer, model and baseline asks :class:`Layout` for its ``PartitionSpec`` s instead
of spelling them out, in the manner of MaxText's logical axis rules. The table
(:meth:`Layout.rules`):

=============  =========================================  ===============================
logical axis   meaning                                    mesh axes
=============  =========================================  ===============================
``batch``      batch dimension                            the data axes (may be several)
``length``     sequence inside tensor-parallel regions    the context axes (if any)
``length_sp``  sequence in sequence-parallel regions      context axes, then tensor axis
``embed``      hidden features outside the TP region      none (replicated)
``heads``      attention heads                            tensor axis
``mlp``        column-layer outputs / row-layer inputs    tensor axis
``vocab``      vocabulary entries                         tensor axis
``head_dim``   features of one head                       none
``param_embed`` hidden features of a parameter            the data axes with ``fsdp``
=============  =========================================  ===============================

The named specs built from it (``d`` = data axes, ``t`` = tensor axis):

====================  =============================  ===================================
name                  logical axes                   spec
====================  =============================  ===================================
``sp``                (batch, length_sp, embed)      ``P(d, t, None)``
``tp``                (batch, length, mlp)           ``P(d, None, t)``
``replicated``        (batch, length, embed)         ``P(d, None, None)``
``tokens``            (batch, length)                ``P(d, None)``
``heads(rank)``       (batch, length, heads, ...)    ``P(d, None, t, None, ...)``
``column_kernel``     (param_embed, mlp)             ``P(None, t)`` (fsdp: ``P(d, t)``)
``row_kernel``        (mlp, param_embed)             ``P(t, None)`` (fsdp: ``P(t, d)``)
``column_bias``       (mlp,)                         ``P(t)``
``row_bias``          (embed,)                       ``P(None)``
``vocab_table``       (vocab, param_embed)           ``P(t, None)`` (fsdp: ``P(t, d)``)
``logits``            (batch, length, vocab)         ``P(d, None, t)``
====================  =============================  ===================================

A context axis (``ParallelConfig(context_parallel=...)``: sequence sharding across
devices *inside* attention) maps ``length`` to it and ``length_sp`` to ``(context,
tensor)``: the specs above then follow without any change to the layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig

__all__ = ["Layout", "LOGICAL_AXES", "MeshAxes"]

MeshAxes = tuple[str, ...]
"""Mesh axes one logical axis is sharded over (empty: replicated)."""

LOGICAL_AXES = ("batch", "length", "length_sp", "embed", "heads", "mlp", "vocab", "head_dim",
                "param_embed")
"""The logical axis names :meth:`Layout.spec` understands."""


def _axes(value: str | tuple[str, ...] | None) -> MeshAxes:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axes of the data, context and tensor dimensions, and the specs they imply.

    Build one from a config with :meth:`of`; the layers do so on every call.

    Attributes:
      data: mesh axes the batch is sharded over (empty: replicated batch).
      tensor: the tensor-parallel mesh axis.
      context: mesh axes the sequence is sharded over inside tensor-parallel regions
        (``ParallelConfig.context_axis`` with context parallelism; else empty: the whole
        sequence is on every device of a tensor group there).
      fsdp: mesh axes the hidden dimension of kernels and vocabulary tables is sharded
        over (``ParallelConfig(fsdp=True)``: the data axes; else empty).
    """

    data: MeshAxes = ("data",)
    tensor: str = "tensor"
    context: MeshAxes = ()
    fsdp: MeshAxes = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _axes(self.data))
        object.__setattr__(self, "context", _axes(self.context))
        object.__setattr__(self, "fsdp", _axes(self.fsdp))
        if self.tensor in self.fsdp or set(self.fsdp) & set(self.context):
            raise ValueError(
                f"Layout: the fsdp axes {self.fsdp} must not include the tensor axis "
                f"{self.tensor!r} or the context axes {self.context}.")
        used = [*self.data, self.tensor, *self.context]
        if len(set(used)) != len(used):
            raise ValueError(
                f"Layout: the data axes {self.data}, tensor axis {self.tensor!r} and context "
                f"axes {self.context} must be distinct mesh axes."
            )

    @classmethod
    def of(cls, config: ParallelConfig) -> Layout:
        """The layout of a :class:`~sp_jax.ParallelConfig`."""
        if not isinstance(config, ParallelConfig):
            raise TypeError(
                f"Layout.of expects a sp_jax.ParallelConfig, got {type(config).__name__}."
            )
        return cls(data=config.data_axes, tensor=config.tensor_axis,
                   context=config.context_axes, fsdp=config.fsdp_axes)

    # -- the table ------------------------------------------------------------------------

    def rules(self) -> Mapping[str, MeshAxes]:
        """Logical axis -> mesh axes: the one table every spec is built from."""
        t = (self.tensor,)
        return {
            "batch": self.data,
            "length": self.context,
            "length_sp": (*self.context, self.tensor),
            "embed": (),
            "heads": t,
            "mlp": t,
            "vocab": t,
            "head_dim": (),
            "param_embed": self.fsdp,
        }

    def spec(self, *logical: str | None) -> P:
        """The ``PartitionSpec`` of an array whose dimensions have the ``logical`` names
        (``None`` for a replicated dimension)."""
        rules = self.rules()
        entries = []
        for name in logical:
            if name is None:
                entries.append(None)
                continue
            if name not in rules:
                raise ValueError(
                    f"Layout.spec: unknown logical axis {name!r}; valid ones are "
                    f"{list(rules)} (or None)."
                )
            axes = rules[name]
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)

    # -- activations ----------------------------------------------------------------------

    @property
    def sp(self) -> P:
        """``[batch, seq, hidden]`` in a sequence-parallel region: ``P(d, t, None)``."""
        return self.spec("batch", "length_sp", "embed")

    @property
    def tp(self) -> P:
        """``[batch, seq, features]`` with the features split: ``P(d, None, t)``."""
        return self.spec("batch", "length", "mlp")

    @property
    def replicated(self) -> P:
        """``[batch, seq, hidden]`` whole on every device of a tensor group:
        ``P(d, None, None)``."""
        return self.spec("batch", "length", "embed")

    @property
    def tokens(self) -> P:
        """``[batch, seq]`` token ids, labels or per-token losses: ``P(d, None)``."""
        return self.spec("batch", "length")

    @property
    def logits(self) -> P:
        """``[batch, seq, vocab]`` vocabulary-parallel logits: ``P(d, None, t)``."""
        return self.spec("batch", "length", "vocab")

    def heads(self, rank: int = 4) -> P:
        """``[batch, seq, heads, ...]`` of rank ``rank`` with the heads split:
        ``P(d, None, t, None, ...)``."""
        if rank < 3:
            raise ValueError(f"Layout.heads: rank={rank} must be at least 3.")
        return self.spec("batch", "length", "heads", *(["head_dim"] * (rank - 3)))

    # -- parameters -----------------------------------------------------------------------

    @property
    def column_kernel(self) -> P:
        """``[in, out]`` kernel split by columns (output features): ``P(None, t)``; with
        fsdp the input features over the data axes too: ``P(d, t)``."""
        return self.spec("param_embed", "mlp")

    @property
    def row_kernel(self) -> P:
        """``[in, out]`` kernel split by rows (input features): ``P(t, None)``; with fsdp
        the output features over the data axes too: ``P(t, d)``."""
        return self.spec("mlp", "param_embed")

    @property
    def column_bias(self) -> P:
        """``[out]`` bias of a column layer: ``P(t)``."""
        return self.spec("mlp")

    @property
    def row_bias(self) -> P:
        """``[out]`` bias of a row layer, added after the reduction: ``P(None)``."""
        return self.spec("embed")

    @property
    def vocab_table(self) -> P:
        """``[vocab, hidden]`` embedding / LM-head table split over the vocabulary:
        ``P(t, None)`` (with fsdp ``P(t, d)``)."""
        return self.spec("vocab", "param_embed")
