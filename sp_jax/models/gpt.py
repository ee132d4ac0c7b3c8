"""A GPT language model built from the sequence-parallel layers."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.attention import sequence_order, to_held, to_natural
from sp_jax.config import ParallelConfig
from sp_jax.layers import (
    MLP,
    AttentionConfig,
    CausalSelfAttention,
    Dropout,
    MLPConfig,
    RopeScaling,
    VocabParallelEmbedding,
    check_block_fields,
    document_labels,
    make_norm,
    parallel_cross_entropy,
    settle_block_fields,
)
from sp_jax.layers.linear import column_sp_matmul
from sp_jax.layout import Layout
from sp_jax.mesh import (
    axis_size,
    check_activations,
    current_mesh,
    reshard,
    to_sequence_parallel,
)
from sp_jax.models.pipelined import check_pipeline, pipeline_forward_loss, pipeline_loss_and_grads

__all__ = ["GPT", "GPTConfig", "Block", "POSITIONS", "RopeScaling"]

POSITIONS = ("learned", "rotary")
"""Position encodings a :class:`GPT` supports: a learned table or rotary embeddings."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of a :class:`GPT`.

    Attributes:
      vocab_size: vocabulary size ``V`` (any size: padded internally to a multiple of the
        tensor size; padded entries never appear in logits or loss).
      max_seq_len: longest sequence (size of the learned position table).
      num_layers: transformer blocks.
      num_heads: attention heads (a multiple of the tensor size).
      hidden: model width.
      mlp_hidden: MLP inner width (default ``4 * hidden``).
      num_kv_heads: key/value heads (default ``num_heads``): fewer is grouped-query
        attention (1: multi-query); a divisor of ``num_heads``, and a divisor or a
        multiple of the tensor size (split, or replicated so each shard holds the one its
        query heads use; :class:`~sp_jax.layers.CausalSelfAttention`).
      dropout: dropout rate on the embeddings and on each block's residual branches (the
        attention and MLP outputs); active in train mode (``model.train()``, the mode of
        a freshly built model), off in ``model.eval()``.
      attention_dropout: dropout rate on the attention probabilities (GPT-2's
        ``attn_pdrop``), in train mode.
      tie_embeddings: the LM head reuses the token embedding table.
      positions: ``"learned"`` (table added to the embeddings) or ``"rotary"``.
      rope_base: rotary base frequency (Llama-2: 1e4, Llama-3: 5e5).
      rope_scaling: Llama-3.1 style frequency scaling (:class:`RopeScaling`, or a dict of
        its fields), or None.
      qkv_bias / out_bias / mlp_bias: biases on the q/k/v projection, the attention
        output projection and the MLP projections (GPT-2: all; Llama: none).
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      norm_epsilon: epsilon of the norms (GPT-2: 1e-5; Llama-2: 1e-5 or 1e-6).
      dtype: compute dtype (e.g. ``jnp.bfloat16``); parameters stay in ``param_dtype``.
      param_dtype: parameter (master weight) dtype.
      remat: recompute each block in the backward pass (``jax.checkpoint``) instead of
        keeping its activations; composes with ``recompute_allgather``.
      attention_block_q / attention_block_k: query and key/value block sizes of the
        blockwise attention (:func:`sp_jax.attention.blockwise_attention`; the largest
        divisors of the sequence length up to these).
      mlp_activation: ``"gelu"`` (tanh approximation), ``"gelu_exact"``, ``"relu"``,
        ``"swiglu"`` or ``"geglu"`` (gated: gate and up fused in one column layer,
        :class:`~sp_jax.layers.MLP`).
      attention_implementation: ``"xla"`` (the blockwise kernel, every backend) or
        ``"cudnn"`` (cuDNN's fused attention on GPUs; not with ring attention).
      scan_layers: store the blocks' parameters stacked along a leading layer axis and
        run them with one ``lax.scan`` (compile time independent of ``num_layers``).
        Same initial values as the unrolled model; parameters ``blocks/...`` get shape
        ``[num_layers, ...]``.
      qk_norm: RMS-normalise each head's query and key (Qwen3's ``q_norm`` / ``k_norm``,
        scales ``[head_dim]`` per layer, epsilon ``norm_epsilon``) before the rotary
        angles (:class:`~sp_jax.layers.AttentionConfig`).
      sliding_window: None (causal attention over every earlier token) or ``w``: token
        ``i`` attends tokens ``i - w < j <= i`` only (Mistral's ``sliding_window``); key
        blocks wholly outside the window are skipped. Not with ring attention.
      bos_token_id / eos_token_id / pad_token_id: the checkpoint's special token ids
        (``config.json``'s), kept for :func:`~sp_jax.models.hf.to_hf` and generation;
        None when it has none. ``eos_token_id`` may be several ids (a list in
        ``config.json``, a tuple here). The model itself does not use them.
    """

    vocab_size: int
    max_seq_len: int
    num_layers: int
    num_heads: int
    hidden: int
    mlp_hidden: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = True
    positions: str = "learned"
    rope_base: float = 10000.0
    norm: str = "layernorm"
    norm_epsilon: float = 1e-5
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False
    attention_block_q: int = 512
    attention_block_k: int = 512
    attention_implementation: str = "xla"
    mlp_activation: str = "gelu"
    num_kv_heads: int | None = None
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    out_bias: bool = True
    mlp_bias: bool = True
    attention_dropout: float = 0.0
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive int.")
        if self.mlp_hidden is None and isinstance(self.hidden, int):
            object.__setattr__(self, "mlp_hidden", 4 * self.hidden)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r} must be True or "
                            "False.")
        if self.positions not in POSITIONS:
            raise ValueError(
                f"GPTConfig.positions={self.positions!r} is not a known position encoding; "
                f"use one of {list(POSITIONS)}."
            )
        settle_block_fields(self)
        check_block_fields("GPTConfig", self)  # the fields the blocks' configs share
        self._check_token_ids()

    def _check_token_ids(self) -> None:
        """The special token ids: ints or None (``eos_token_id``: also several, kept as a
        tuple)."""
        def is_id(v: Any) -> bool:
            return isinstance(v, int | np.integer) and not isinstance(v, bool)

        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if name == "eos_token_id" and isinstance(value, list | tuple) and value \
                    and all(map(is_id, value)):
                object.__setattr__(self, name, tuple(int(v) for v in value))
                continue
            if value is None:
                continue
            if not is_id(value):
                raise TypeError(f"GPTConfig.{name}={value!r} must be a token id (an int) or "
                                "None" + (" or a list of ids" if name == "eos_token_id"
                                          else "") + ".")
            object.__setattr__(self, name, int(value))

    @classmethod
    def gpt2(cls, size: str = "small", **overrides: Any) -> GPTConfig:
        """GPT-2's shapes (Radford et al. 2019; Hugging Face ``gpt2``, ``gpt2-medium``, ...):
        learned positions, LayerNorm (eps 1e-5), tanh-gelu MLP of ``4 * hidden``, biases
        everywhere, tied embeddings, vocabulary 50257, 1024 positions. Only shapes:
        nothing is downloaded (see :func:`sp_jax.models.hf.from_hf` for weights).

        Args:
          size: ``"small"`` (124M), ``"medium"`` (355M), ``"large"`` (774M), ``"xl"``
            (1.5B) or ``"tiny"`` (a 2-layer model of the same structure, for tests).
          overrides: any other :class:`GPTConfig` field (e.g. ``dtype``, ``remat``).
        """
        shapes = {"tiny": (2, 4, 64), "small": (12, 12, 768), "medium": (24, 16, 1024),
                  "large": (36, 20, 1280), "xl": (48, 25, 1600)}
        if size not in shapes:
            raise ValueError(f"GPTConfig.gpt2: size={size!r} is not one of {list(shapes)}.")
        layers, heads, hidden = shapes[size]
        base = dict(vocab_size=50257, max_seq_len=1024, num_layers=layers, num_heads=heads,
                    hidden=hidden, qkv_bias=True, out_bias=True, mlp_bias=True,
                    norm="layernorm", norm_epsilon=1e-5, mlp_activation="gelu",
                    positions="learned", tie_embeddings=True)
        if size == "tiny":
            base.update(vocab_size=256, max_seq_len=128)
        return cls(**{**base, **overrides})

    @classmethod
    def llama(cls, name: str = "llama-2-7b", **overrides: Any) -> GPTConfig:
        """Llama-family shapes (Touvron et al. 2023; Meta's Llama 3): rotary positions,
        RMSNorm, SwiGLU MLP, no biases, untied head. Only shapes: nothing is downloaded.

        Args:
          name: ``"llama-2-7b"`` (32 heads, 4096 wide, MLP 11008, vocabulary 32000, 4096
            positions, rope_base 1e4), ``"llama-3-8b"`` (8 key/value heads, MLP 14336,
            vocabulary 128256, 8192 positions, rope_base 5e5), ``"llama-3.1-8b"`` (the
            same with Llama-3.1's :class:`RopeScaling` and 131072 positions) or
            ``"llama-tiny"`` (2 layers, 8 heads over 2 key/value heads, 64 wide: the
            structure of Llama-3 at test size).
          overrides: any other :class:`GPTConfig` field.
        """
        common = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                      qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                      num_layers=32, num_heads=32, hidden=4096)
        presets = {
            "llama-2-7b": dict(vocab_size=32000, max_seq_len=4096, mlp_hidden=11008,
                               num_kv_heads=32, rope_base=10000.0, norm_epsilon=1e-5),
            "llama-3-8b": dict(vocab_size=128256, max_seq_len=8192, mlp_hidden=14336,
                               num_kv_heads=8, rope_base=500000.0, norm_epsilon=1e-5),
            "llama-3.1-8b": dict(vocab_size=128256, max_seq_len=131072, mlp_hidden=14336,
                                 num_kv_heads=8, rope_base=500000.0, norm_epsilon=1e-5,
                                 rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
            "llama-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=2, num_heads=8,
                               num_kv_heads=2, hidden=64, mlp_hidden=160,
                               rope_base=500000.0, norm_epsilon=1e-5),
        }
        if name not in presets:
            raise ValueError(f"GPTConfig.llama: name={name!r} is not one of {list(presets)}.")
        return cls(**{**common, **presets[name], **overrides})

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward and backward, recomputation not counted;
        PaLM's accounting): ``6 N + 12 L h s`` with ``N`` the matmul parameters (every
        block's projections and the LM head) and the attention scores and values over
        ``seq_len`` (default ``max_seq_len``) keys, causal masking not discounted."""
        s = self.max_seq_len if seq_len is None else int(seq_len)
        h, kv = self.hidden, (self.num_kv_heads or self.num_heads)
        attention = 2 * h * h + 2 * h * kv * (h // self.num_heads)
        mlp_hidden = self.mlp_hidden or 4 * h
        gated = self.mlp_activation in ("swiglu", "geglu")
        mlp = (3 if gated else 2) * h * mlp_hidden
        matmul_params = self.num_layers * (attention + mlp) + self.vocab_size * h
        return float(6 * matmul_params + 12 * self.num_layers * h * s)

    def attention_config(self) -> AttentionConfig:
        """The :class:`~sp_jax.layers.AttentionConfig` of every block (the fields of the
        same names, and ``rotary`` for ``positions="rotary"``)."""
        return AttentionConfig(rotary=self.positions == "rotary",
                               **self._fields_of(AttentionConfig))

    def mlp_config(self) -> MLPConfig:
        """The :class:`~sp_jax.layers.MLPConfig` of every block (the fields of the same
        names)."""
        return MLPConfig(**self._fields_of(MLPConfig))

    def _fields_of(self, config_class: type) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(config_class)
                if hasattr(self, f.name)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Builds a config from a plain dict, rejecting unknown keys."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"Unknown GPTConfig key(s) {unknown}; valid keys are {valid}.")
        return cls(**d)


class Block(nnx.Module):
    """One transformer layer: :class:`CausalSelfAttention` then :class:`MLP`.

    Its dropouts hold no rng stream; they draw from ``nnx.Rngs(dropout=key)`` built
    from the ``key`` passed to each call (so a block can be rematerialised).

    Args:
      config: the :class:`GPTConfig` (its ``attention_config()`` and ``mlp_config()``).
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: ``params`` rng stream.
    """

    def __init__(self, config: GPTConfig, parallel: ParallelConfig = ParallelConfig(), *,
                 rngs: nnx.Rngs):
        self.attention = CausalSelfAttention(config.attention_config(), parallel=parallel,
                                             rngs=rngs)
        self.mlp = MLP(config.mlp_config(), parallel=parallel, rngs=rngs)

    def __call__(self, x: jax.Array, key: jax.Array | None = None,
                 documents: Documents = None) -> jax.Array:
        """``x``: hidden states ``[batch, seq, hidden]`` in the SP layout -> same shape and
        layout; ``key``: the dropout key of this block, or None; ``documents``: None or
        ``(segment_ids, positions)`` ``[batch, seq]`` of packed rows (either None), in
        the order ``x`` is held (see :meth:`GPT.loss`)."""
        x = jnp.asarray(x)
        check_activations("Block", x, self.attention.config.hidden, "hidden")
        rngs = None if key is None else nnx.Rngs(dropout=key)
        segment_ids, positions = documents if documents is not None else (None, None)
        return self.mlp(self.attention(x, rngs=rngs, segment_ids=segment_ids,
                                       positions=positions), rngs=rngs)


# (segment_ids, positions) of packed rows, either None, or None: unpacked sequences
Documents = tuple[jax.Array | None, jax.Array | None] | None


def _run_block(block: Block, x: jax.Array, key: jax.Array | None, remat: bool,
               documents: Documents = None) -> jax.Array:
    """Applies ``block``; with ``remat`` its activations are recomputed in backward."""
    if not remat:
        return block(x, key, documents)
    graphdef, state = nnx.split(block)
    return jax.checkpoint(lambda s, x, k, d: nnx.merge(graphdef, s)(x, k, d))(
        state, x, key, documents)


def _stack_blocks(blocks: list[Block], layer_axis: str | None = None,
                  repeats: int = 1) -> Block:
    """One :class:`Block` whose variables hold ``blocks``' values stacked on axis 0
    (sharded over ``layer_axis``, the pipeline axis, when given). With ``repeats > 1``
    the stack is ``[repeats, L / repeats, ...]`` (still in layer order) sharded over
    ``layer_axis`` on its second dimension: stage ``s`` of ``P`` then holds the layer
    chunks ``r P + s`` (the circular assignment), each where the schedule runs it."""

    def stack(*variables):
        first = variables[0]
        value = jnp.stack([v[...] for v in variables])
        metadata = first.get_metadata()
        inner = metadata.get("out_sharding")
        if inner is not None or layer_axis is not None:
            inner = inner if inner is not None else (None,) * (value.ndim - 1)
            metadata["out_sharding"] = (layer_axis, *inner)
        if repeats > 1:
            value = value.reshape(repeats, value.shape[0] // repeats, *value.shape[1:])
            metadata["out_sharding"] = (None, *metadata["out_sharding"])
        mesh = jax.sharding.get_abstract_mesh()
        if layer_axis is not None and not mesh.empty:  # each stage holds its layers
            value = reshard(value, P(*metadata["out_sharding"]), mesh)
        return first.from_metadata(value, metadata)

    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(stack, *states, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.merge(nnx.graphdef(blocks[0]), stacked)


def _scan_blocks(stacked: Block, x: jax.Array, keys: jax.Array | None, remat: bool,
                 documents: Documents = None) -> jax.Array:
    """Runs the layers of a stacked block with ``lax.scan`` (one per-layer key each)."""
    graphdef, state = nnx.split(stacked)

    def layer(x, xs):
        layer_state, key = xs
        return nnx.merge(graphdef, layer_state)(x, key, documents), None

    body = jax.checkpoint(layer) if remat else layer
    return jax.lax.scan(body, x, (state, keys))[0]


class GPT(nnx.Module):
    """Decoder-only transformer in the TP+SP layout.

    ``tokens [batch, seq] -> logits [batch, seq, vocab]``. Hidden states between blocks
    are sequence-sharded ``P(data, tensor, None)``; the LM head (tied to the embedding, or
    its own vocabulary-parallel ``[vocab, hidden]`` table) produces vocabulary-parallel logits
    ``P(data, None, tensor)`` from them, which :meth:`loss` consumes with
    :func:`parallel_cross_entropy` without gathering the vocabulary.

    Mode: a freshly built GPT is in **train mode**, like every Flax NNX module: with a
    dropout rate above 0 its dropouts are active (drawing from the ``rngs`` passed to the
    call, else the ``dropout`` stream given here). Call ``model.eval()`` before
    evaluating or generating and ``model.train()`` to switch back; with the default
    rates of 0 both modes compute the same function.

    Args:
      config: the :class:`GPTConfig`.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: rng streams (``params``; ``dropout`` when ``config.dropout > 0``).
    """

    def __init__(self, config: GPTConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}.")
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(f"GPT: parallel={parallel!r} must be a sp_jax.ParallelConfig "
                            "(use ParallelConfig.from_dict for a plain dict).")
        cfg = config
        self.config, self.parallel = cfg, parallel
        self.embed = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden, parallel=parallel, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, rngs=rngs)
        if cfg.positions == "learned":
            self.position = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.max_seq_len, cfg.hidden),
                                             cfg.param_dtype))
        else:
            self.position = None
        self.dropout = Dropout(cfg.dropout, parallel=parallel, rngs=rngs)
        if parallel.pipeline_axis is not None:
            check_pipeline(cfg, parallel, current_mesh(parallel, where="GPT", required=False))
        blocks = [Block(cfg, parallel, rngs=rngs) for _ in range(cfg.num_layers)]
        self.blocks = _stack_blocks(blocks, parallel.pipeline_axis,
                                    parallel.pipeline_repeats) if cfg.scan_layers \
            else nnx.List(blocks)
        self.final_norm = make_norm(cfg.norm, cfg.hidden, parallel=parallel,
                                    epsilon=cfg.norm_epsilon, dtype=cfg.dtype,
                                    param_dtype=cfg.param_dtype, rngs=rngs)
        # An untied head is a second vocabulary table [V, hidden] (the layout of Megatron's
        # output layer), vocabulary-parallel like the embedding.
        self.head = None if cfg.tie_embeddings else VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden, parallel=parallel, param_dtype=cfg.param_dtype, rngs=rngs)

    # -- pieces -------------------------------------------------------------------------

    @staticmethod
    def _ids(x: jax.Array) -> jax.Array:
        """Token ids or labels of any integer dtype as int32 (a float array is left for
        :meth:`_check_tokens` to reject)."""
        x = jnp.asarray(x)
        return x.astype(jnp.int32) if jnp.issubdtype(x.dtype, jnp.integer) else x

    def _check_tokens(self, tokens: jax.Array) -> None:
        if tokens.ndim != 2:
            raise ValueError(
                f"GPT expects token ids of shape [batch, seq], got rank {tokens.ndim} shape "
                f"{tokens.shape}."
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(
                f"GPT: token ids must be integers, got dtype {tokens.dtype}; cast them "
                "(e.g. tokens.astype(jnp.int32))."
            )
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"GPT: sequence length {tokens.shape[1]} exceeds max_seq_len="
                f"{self.config.max_seq_len}."
            )

    def hidden_states(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """Final-normed hidden states ``[batch, seq, hidden]``, SP layout, in the order of
        ``tokens``; ``segment_ids`` / ``positions`` as in :meth:`loss`."""
        tokens = self._ids(tokens)
        order = self._order(tokens)
        held = self._hidden_states(to_held(tokens, order, self.parallel), rngs, None, order,
                                   self._documents(tokens, segment_ids, positions, order))
        return to_natural(held, order, self.parallel)

    def _documents(self, tokens: jax.Array, segment_ids: jax.Array | None,
                   positions: jax.Array | None, order: np.ndarray | None) -> Documents:
        """``(segment_ids, positions)`` int32 in the held ``order`` (None when neither is
        given), checked against ``tokens``."""
        if segment_ids is None and positions is None:
            return None
        if self.parallel.pipeline_axis is not None:
            raise ValueError("GPT: segment_ids / positions (packed documents) are not "
                             "supported with pipeline_axis yet; train packed rows without "
                             "pipeline stages.")
        held = []
        for name, a in (("segment_ids", segment_ids), ("positions", positions)):
            if a is not None:
                a = jnp.asarray(a)
                if not jnp.issubdtype(a.dtype, jnp.integer) or a.shape != tokens.shape:
                    raise ValueError(
                        f"GPT: {name} must be integers of the tokens' shape {tokens.shape} "
                        f"([batch, seq]), got {a.dtype} {a.shape}.")
                a = to_held(a.astype(jnp.int32), order, self.parallel)
            held.append(a)
        if positions is not None and self.position is not None:
            self._check_positions(positions)
        return held[0], held[1]

    def _check_positions(self, positions: jax.Array) -> None:
        """Learned positions index a table of ``max_seq_len`` rows (checked on concrete
        values only)."""
        if isinstance(positions, jax.core.Tracer):
            return
        top = int(jnp.max(positions))
        if top >= self.config.max_seq_len or int(jnp.min(positions)) < 0:
            raise ValueError(f"GPT: positions up to {top} are outside the learned position "
                             f"table of max_seq_len={self.config.max_seq_len} rows.")

    def _order(self, tokens: jax.Array) -> np.ndarray | None:
        """The order the model holds the sequence in (zigzag with ring context
        parallelism, else None: the natural order)."""
        mesh = current_mesh(self.parallel, where="GPT")
        return sequence_order(self.parallel, mesh, tokens.shape[-1])

    def _hidden_states(self, tokens: jax.Array, rngs: Any, table: jax.Array | None,
                       order: np.ndarray | None, documents: Documents = None) -> jax.Array:
        """:meth:`hidden_states` of ``tokens`` already in the held ``order``; ``table``:
        the embedding's padded table if already made; ``documents``: from
        :meth:`_documents`."""
        self._check_pipeline_call()
        training = self.training
        stream = None
        if training:  # keys are drawn here, outside any rematerialised block
            stream = rngs.dropout if rngs is not None else self.dropout.rngs
        x = self._embed(tokens, table, order, stream() if training else None,
                        None if documents is None else documents[1])
        if self.config.scan_layers:
            keys = jnp.stack([stream() for _ in range(self.config.num_layers)]) \
                if training else None
            x = _scan_blocks(self.blocks, x, keys, self.config.remat, documents)
        else:
            for block in self.blocks:
                x = _run_block(block, x, stream() if training else None, self.config.remat,
                               documents)
        return self.final_norm(x)

    @property
    def training(self) -> bool:
        """Whether a call draws dropout masks: a rate above 0 and train mode."""
        return max(self.config.dropout, self.config.attention_dropout) > 0 and \
            not self.dropout.deterministic

    def _embed(self, tokens: jax.Array, table: jax.Array | None, order: np.ndarray | None,
               key: jax.Array | None, positions: jax.Array | None = None) -> jax.Array:
        """Token (and learned position) embeddings of ``tokens`` in the held ``order``,
        SP layout, with the embedding dropout of ``key`` (None: none); ``positions``:
        ``[batch, seq]`` held-order positions of packed rows, or None (the row's own)."""
        self._check_tokens(tokens)
        x = self.embed(tokens, table=table)
        if self.position is not None:
            table_p = self.position[...]
            if positions is not None:  # per row: [b, s, hidden], laid out like x
                mesh = current_mesh(self.parallel, where="GPT")
                layout = Layout.of(self.parallel)
                rows = reshard(table_p, P(), mesh).at[
                    reshard(positions, layout.spec("activation_batch", None), mesh)].get(
                        out_sharding=layout.spec("activation_batch", None, None))
                x = x + reshard(rows.astype(x.dtype), jax.typeof(x).sharding.spec, mesh)
            else:
                rows = table_p[: tokens.shape[1]] if order is None else \
                    jnp.take(table_p, jnp.asarray(order), axis=0)
                x = x + rows.astype(x.dtype)[None]
            x = to_sequence_parallel(x, self.parallel, where="GPT")
        return self.dropout(x, rngs=key)

    def _vocab_table(self) -> jax.Array:
        """The LM head's padded ``[Vp, hidden]`` table (the embedding's when tied)."""
        mesh = current_mesh(self.parallel, where="GPT")
        return (self.embed if self.head is None else self.head).padded_table(mesh)

    def _lm_head(self, h: jax.Array, table: jax.Array) -> jax.Array:
        """Vocabulary-parallel logits ``P(data, None, tensor)`` of final-normed hidden
        states ``h`` (SP layout) with the padded ``table``."""
        mesh = current_mesh(self.parallel, where="GPT")
        layout = Layout.of(self.parallel)
        par = self.parallel

        def lm_head(h, table):
            return column_sp_matmul(h, table.T, None, par)

        return jax.shard_map(lm_head, in_specs=(layout.sp, layout.vocab_table),
                             out_specs=layout.logits)(reshard(h, layout.sp, mesh), table)

    def _check_pipeline_call(self) -> None:
        """A pipelined GPT runs whole only as a training step's loss (the schedule of
        :mod:`sp_jax.pipeline`)."""
        if self.parallel.pipeline_axis is not None:
            raise ValueError(
                f"GPT with ParallelConfig(pipeline_axis={self.parallel.pipeline_axis!r}) "
                "runs as a pipeline: call model.loss(tokens[, labels]) (or train it with "
                "TrainStep); for logits or hidden states, restore the parameters into a "
                "GPT without pipeline_axis.")

    def padded_logits(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """Logits over the padded vocabulary ``[batch, seq, padded_vocab]``,
        ``P(data, None, tensor)``; entries ``>= vocab_size`` are padding.
        ``segment_ids`` / ``positions`` as in :meth:`loss`."""
        tokens = self._ids(tokens)
        order = self._order(tokens)
        held = self._padded_logits(to_held(tokens, order, self.parallel), rngs, order,
                                   self._documents(tokens, segment_ids, positions, order))
        return to_natural(held, order, self.parallel, "activation_vocab")

    def _padded_logits(self, tokens: jax.Array, rngs: Any, order: np.ndarray | None,
                       documents: Documents = None) -> jax.Array:
        """:meth:`padded_logits` of ``tokens`` already in the held ``order``, in that
        order."""
        table = self._vocab_table()  # [Vp, hidden], layout.vocab_table
        # A tied head shares the padded table with the embedding: made once.
        h = self._hidden_states(tokens, rngs, table if self.head is None else None, order,
                                documents)
        return self._lm_head(h, table)

    # -- public API -----------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """``tokens [batch, seq]`` -> ``logits [batch, seq, vocab_size]``
        (``segment_ids`` / ``positions``: packed documents, as in :meth:`loss`).

        Sharded ``P(data, None, tensor)`` over the vocabulary when ``vocab_size`` is a
        multiple of the tensor size; otherwise the padding is cut off and the logits come
        back sharded over the sequence ``P(data, tensor, None)``. For training use
        :meth:`loss`, which never materialises more than a vocabulary block per device.
        """
        logits = self.padded_logits(tokens, segment_ids=segment_ids, positions=positions,
                                    rngs=rngs)
        vocab = self.config.vocab_size
        if logits.shape[-1] == vocab:
            return logits
        mesh = current_mesh(self.parallel, where="GPT")
        layout = Layout.of(self.parallel)
        par = self.parallel
        if tokens.shape[1] % axis_size(mesh, (*par.context_axes, par.tensor_axis)) == 0:
            logits = reshard(logits, layout.sp, mesh)
        else:
            logits = reshard(logits, layout.spec("activation_batch", None, None), mesh)
        return logits[..., :vocab]

    def pipeline_loss_and_grads(self, tokens: jax.Array, labels: jax.Array,
                                key: jax.Array | None, *, ignore_index: int = -100
                                ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """A training step's loss and gradients through the pipeline of
        ``ParallelConfig(pipeline_axis=...)``, by its schedule (what
        :class:`~sp_jax.training.TrainStep` runs for a pipelined GPT).

        Args:
          tokens / labels: ``[M, batch, seq]``, ``M = pipeline_microbatches``, labels
            aligned as in :meth:`loss`.
          key: dropout key; micro-batch ``i`` draws from ``fold_in(key, i)`` as
            :func:`~sp_jax.training.lm_loss` of the unpipelined model does.
          ignore_index: the target id that contributes no loss.
        Returns:
          ``(loss_sum, count, grads)``: the float32 sum of per-token losses, the number
          of target tokens and the gradients of ``loss_sum``, a pure dict shaped like
          ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``.
        """
        if self.parallel.pipeline_axis is None:
            raise ValueError("GPT.pipeline_loss_and_grads needs ParallelConfig("
                             "pipeline_axis=...); use jax.grad of GPT.loss otherwise.")
        tokens, labels = self._ids(tokens), self._ids(labels)
        if tokens.ndim != 3 or labels.shape != tokens.shape:
            raise ValueError(
                f"GPT.pipeline_loss_and_grads expects tokens and labels [micro_batches, "
                f"batch, seq] of one shape, got {tokens.shape} and {labels.shape}.")
        if tokens.shape[0] != self.parallel.pipeline_microbatches:
            raise ValueError(
                f"GPT: the batch has {tokens.shape[0]} micro-batches (its leading "
                f"dimension) but ParallelConfig.pipeline_microbatches="
                f"{self.parallel.pipeline_microbatches}; make them equal (the example's "
                "--microbatches sets both).")
        self._check_tokens(tokens[0])
        return pipeline_loss_and_grads(self, tokens, labels, key, ignore_index=ignore_index)

    def loss(self, tokens: jax.Array, labels: jax.Array | None = None, *,
             segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
             ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
             rngs: Any = None) -> jax.Array:
        """Mean next-token loss over the targets that are not ``ignore_index``.

        ``model.loss(tokens)``: the targets are the tokens themselves, shifted inside:
        position ``i`` predicts ``tokens[:, i + 1]`` and the last position has no target
        (the loss Hugging Face computes from ``labels=input_ids``).

        ``model.loss(tokens, labels)``: explicit targets, **already aligned** with the
        positions: ``labels[:, i]`` is what position ``i`` must predict (e.g.
        ``tokens[:, 1:]`` of a ``seq + 1`` window). Hugging Face-style labels (a copy of
        the inputs, shifted by the model) must be shifted first: ``labels[:, 1:]`` padded
        with ``ignore_index``.

        Args:
          tokens: ``[batch, seq]`` input ids.
          labels: ``[batch, seq]`` target ids (``ignore_index`` = no loss), or None.
          segment_ids: int ``[batch, seq]`` document ids of packed rows (0 = padding),
            sharded like the tokens, or None: attention does not cross documents, and
            padding and the last token of each document before the next one in the row
            have no target (:func:`~sp_jax.layers.document_labels`).
          positions: int ``[batch, seq]`` token positions (restarting at 0 in each
            document) for the rotary or learned position embeddings, or None (``0 ..
            seq - 1`` in every row).
          ignore_index: the target id that contributes no loss.
          label_smoothing / z_loss: as :func:`~sp_jax.layers.parallel_cross_entropy`.
          rngs: dropout rngs (e.g. ``nnx.Rngs(dropout=key)``) in train mode.
        Returns:
          scalar float32.
        """
        tokens = self._ids(tokens)
        if labels is None:
            self._check_tokens(tokens)
            pad = jnp.full_like(tokens[:, :1], ignore_index)
            labels = jnp.concatenate([tokens[:, 1:], pad], axis=1)
        if segment_ids is not None:
            self._documents(tokens, segment_ids, None, None)  # checked first
            mesh = current_mesh(self.parallel, where="GPT")
            whole = Layout.of(self.parallel).spec("activation_batch", None)
            labels = document_labels(reshard(self._ids(labels), whole, mesh),
                                     reshard(self._ids(segment_ids), whole, mesh),
                                     ignore_index)
        if self.parallel.pipeline_axis is not None:
            self._check_tokens(tokens)
            self._documents(tokens, segment_ids, positions, None)  # refused
            labels = self._ids(labels)
            stream = None
            if self.training:
                stream = rngs.dropout if rngs is not None else self.dropout.rngs
            total = pipeline_forward_loss(
                self, tokens, labels, stream, ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss=z_loss)
            return total / jnp.maximum(jnp.sum(labels != ignore_index), 1)
        order = self._order(tokens)  # the loss is a mean: the held order will do
        labels = to_held(self._ids(labels), order, self.parallel)
        documents = self._documents(tokens, segment_ids, positions, order)
        per_token = parallel_cross_entropy(
            self._padded_logits(to_held(tokens, order, self.parallel), rngs, order,
                                documents), labels,
            parallel=self.parallel,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            vocab_size=self.config.vocab_size)
        count = jnp.sum(labels != ignore_index)
        return jnp.sum(per_token) / jnp.maximum(count, 1)
