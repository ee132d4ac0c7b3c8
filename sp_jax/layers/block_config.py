"""The configurations of a transformer block's two halves, each handed whole to its module
(:class:`AttentionConfig` to :class:`~sp_jax.layers.CausalSelfAttention` or the attention
class its ``attention`` names, :class:`MLPConfig` to :class:`~sp_jax.layers.MLP`), and the
grouped-query rules of how key/value heads relate to query heads and to the tensor axis.

Both configs are frozen dataclasses of plain values (names, numbers, dtypes), validated at
construction, so a block's shape can be written down, compared and saved. Their fields
have the names of the :class:`~sp_jax.models.GPTConfig` fields they come from (one word
per concept), which makes them with ``attention_config()`` / ``mlp_config()``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sp_jax.attention import IMPLEMENTATIONS, cudnn_takes
from sp_jax.compat import check_mode
from sp_jax.config import Fp8Recipe, LoRAConfig
from sp_jax.layers.attention_registry import check_attention_name
from sp_jax.layers.norm import NORMS
from sp_jax.layers.rotary import RopeScaling, YarnScaling

__all__ = ["MLA_FIELDS", "MLP_ACTIVATIONS", "AttentionConfig", "check_mla_fields", "MLPConfig",
           "MoEConfig", "check_block_fields",
           "check_block_config",
           "check_kv_heads", "kv_heads_per_shard", "kv_heads_replicated",
           "settle_block_fields"]

MLP_ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], bool]] = {
    "gelu": (jax.nn.gelu, False),  # tanh approximation (GPT-2)
    "gelu_exact": (functools.partial(jax.nn.gelu, approximate=False), False),
    "relu": (jax.nn.relu, False),
    "swiglu": (jax.nn.silu, True),  # Llama
    "geglu": (functools.partial(jax.nn.gelu, approximate=False), True),
    "geglu_tanh": (jax.nn.gelu, True),  # Gemma's gelu_pytorch_tanh, gated
}
"""MLP activation name -> (elementwise function, gated): a gated MLP computes
``act(gate(x)) * up(x)`` (SwiGLU, GeGLU)."""


def check_kv_heads(owner: str, num_heads: int, num_kv_heads: Any) -> None:
    """The grouped-query rule: ``num_kv_heads`` is a positive divisor of ``num_heads``
    (each key/value head serves ``num_heads / num_kv_heads`` consecutive query heads);
    a ValueError naming ``owner.num_kv_heads`` otherwise."""
    if (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int)
            or num_kv_heads <= 0 or num_heads % num_kv_heads):
        raise ValueError(
            f"{owner}.num_kv_heads={num_kv_heads!r} must be a positive divisor of "
            f"num_heads={num_heads} (each key/value head serves num_heads / num_kv_heads "
            "query heads).")


def kv_heads_per_shard(num_kv_heads: int, tensor_size: int, where: str) -> int:
    """The tensor-layout rule (Megatron's): key/value heads each tensor shard holds,
    ``num_kv_heads / t`` when ``t`` divides them, else 1 (replicated: ``t`` a multiple of
    ``num_kv_heads``); a ValueError naming the fix for any other pair."""
    if num_kv_heads % tensor_size == 0:
        return num_kv_heads // tensor_size
    if tensor_size % num_kv_heads == 0:
        return 1
    raise ValueError(
        f"{where}: num_kv_heads={num_kv_heads} cannot be laid out over a tensor axis of size "
        f"{tensor_size}: the key/value heads are split when the tensor size divides them "
        "and replicated when it is a multiple of them; choose num_kv_heads a divisor or a "
        f"multiple of {tensor_size}.")


def kv_heads_replicated(num_kv_heads: int, tensor_size: int, where: str) -> bool:
    """Whether the key/value heads are replicated over a tensor axis of ``tensor_size``
    (each shard holding the one its query heads read) rather than split
    (:func:`kv_heads_per_shard`)."""
    return kv_heads_per_shard(num_kv_heads, tensor_size, where) * tensor_size != num_kv_heads


_POSITIVE_INTS = ("hidden", "num_heads", "mlp_hidden", "attention_block_q",
                  "attention_block_k")
_BOOLS = ("rotary", "qkv_bias", "out_bias", "mlp_bias", "qk_norm", "post_norms",
          "scale_embeddings")
# None or a positive number: (field, what it is, the fix's example)
_OPTIONAL_POSITIVE = (
    ("attention_scale", "the factor of the attention scores", "e.g. 256 ** -0.5"),
    ("attention_softcap", "the attention scores' soft cap", "e.g. 50.0"),
    ("final_logit_softcap", "the logits' soft cap", "e.g. 30.0"),
    ("rope_local_base", "the sliding-window layers' rotary base", "e.g. 10000.0"))
_RATES = ("dropout", "attention_dropout")


def settle_block_fields(config: Any) -> None:
    """Fills the defaults that follow from other fields (``num_kv_heads``: ``num_heads``;
    a dict ``rope_scaling``: its :class:`RopeScaling`, or with ``rope_type="yarn"`` its
    :class:`YarnScaling`; a dict ``fp8``: its
    :class:`~sp_jax.Fp8Recipe`) of a frozen config in place."""
    if isinstance(getattr(config, "fp8", None), dict):
        object.__setattr__(config, "fp8", Fp8Recipe(**config.fp8))
    if isinstance(getattr(config, "lora", None), dict):
        object.__setattr__(config, "lora", LoRAConfig.from_dict(config.lora))
    if getattr(config, "num_kv_heads", 0) is None:
        object.__setattr__(config, "num_kv_heads", config.num_heads)
    if isinstance(getattr(config, "rope_scaling", None), dict):
        fields = dict(config.rope_scaling)
        kind = YarnScaling if fields.pop("rope_type", "llama3") == "yarn" else RopeScaling
        object.__setattr__(config, "rope_scaling", kind(**fields))


def _check_partial_rotary(owner: str, config: Any, head_dim: int) -> None:
    """``partial_rotary_factor``: in ``(0, 1]``, turning an even number of features
    (``int(head_dim * f)``), 1.0 with multi-head latent attention."""
    f = getattr(config, "partial_rotary_factor", 1.0)
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
        raise ValueError(f"{owner}.partial_rotary_factor={f!r} must be in (0, 1] (the share "
                         "of each head's features the rotary angles turn; 1.0: all).")
    if f != 1 and (int(head_dim * f) % 2 or int(head_dim * f) == 0):
        raise ValueError(f"{owner}.partial_rotary_factor={f} turns int({head_dim} * {f}) = "
                         f"{int(head_dim * f)} features of each head; choose a factor that "
                         "turns an even, positive number (GLM-4.5: 0.5 of 128).")
    if f != 1 and getattr(config, "attention", "mha") == "mla":
        raise ValueError(f"{owner}.partial_rotary_factor={f}: multi-head latent attention's "
                         "rotary features are qk_rope_head_dim; leave it 1.0.")


def _float_dtype(owner: str, name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    try:
        ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{owner}.{name}={value!r} is not a floating dtype; use e.g. "
                        f"jnp.float32 or jnp.bfloat16{' (or None)' if optional else ''}.")


def check_block_config(owner: str, config: Any, cls: type, public: str, method: str) -> None:
    """A TypeError naming ``owner`` unless ``config`` is a ``cls`` (``public``: its
    public name), which a ``GPTConfig`` gives its blocks with ``config.<method>()``."""
    if not isinstance(config, cls):
        raise TypeError(f"{owner}: config must be a {public}, got {type(config).__name__}; "
                        f"a GPTConfig gives its blocks' with config.{method}().")


def check_block_fields(owner: str, config: Any) -> None:
    """The one check of a transformer block's fields, for every config that has them
    (:class:`AttentionConfig`, :class:`MLPConfig`, :class:`~sp_jax.models.GPTConfig`):
    each field ``config`` has is checked; a ValueError or TypeError names
    ``owner.field``, the value and the fix. ``rotary`` may also be given as
    ``positions="rotary"``."""
    has = functools.partial(hasattr, config)
    for name in filter(has, _POSITIVE_INTS):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive int.")
    for name in filter(has, _BOOLS):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{owner}.{name}={getattr(config, name)!r} must be True or False.")
    if has("num_heads"):
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            if config.hidden % config.num_heads:
                raise ValueError(f"{owner}: hidden={config.hidden} must be divisible by "
                                 f"num_heads={config.num_heads}, or give head_dim (the "
                                 "features per head; q, k, v are num_heads x head_dim "
                                 "wide).")
            head_dim = config.hidden // config.num_heads
        elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"{owner}.head_dim={head_dim!r} must be a positive int (the "
                             "features per head) or None (hidden / num_heads).")
        check_kv_heads(owner, config.num_heads, config.num_kv_heads)
        rotary = getattr(config, "rotary", getattr(config, "positions", None) == "rotary")
        if rotary and head_dim % 2:
            raise ValueError(f"{owner}: rotary embeddings need an even head size, got "
                             f"head_dim={head_dim}; choose an even head_dim (or hidden / "
                             "num_heads).")
        _check_partial_rotary(owner, config, head_dim)
    if has("fp8") and config.fp8 is not None and not isinstance(config.fp8, Fp8Recipe):
        raise TypeError(f"{owner}.fp8={config.fp8!r} must be a sp_jax.Fp8Recipe (e.g. "
                        "Fp8Recipe('current') or Fp8Recipe('delayed')) or None.")
    if has("lora") and config.lora is not None:
        if not isinstance(config.lora, LoRAConfig):
            raise TypeError(f"{owner}.lora={config.lora!r} must be a sp_jax.LoRAConfig (e.g. "
                            "LoRAConfig(rank=16)), a dict of its fields, or None.")
    if has("rope_scaling") and config.rope_scaling is not None \
            and not isinstance(config.rope_scaling, RopeScaling | YarnScaling):
        raise TypeError(f"{owner}.rope_scaling={config.rope_scaling!r} must be a "
                        "RopeScaling or a YarnScaling, a dict of its fields (with "
                        "rope_type='yarn' for YaRN's), or None.")
    if isinstance(getattr(config, "rope_scaling", None), YarnScaling) \
            and getattr(config, "rope_local_base", None) is not None:
        raise ValueError(f"{owner}: rope_scaling=YarnScaling(...) with rope_local_base="
                         f"{config.rope_local_base}: YaRN's attention factor is one per "
                         "model; use YaRN without a local base, or the Llama-3 scaling.")
    for name, what, example in filter(lambda f: has(f[0]), _OPTIONAL_POSITIVE):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not value > 0):
            raise ValueError(f"{owner}.{name}={value!r} must be None or a positive number "
                             f"({what}, {example}).")
    if has("norm_offset") and (isinstance(config.norm_offset, bool)
                               or not isinstance(config.norm_offset, int | float)):
        raise TypeError(f"{owner}.norm_offset={config.norm_offset!r} must be a number (0.0: "
                        "the norms scale by their weight; 1.0: by 1 + weight, as Gemma).")
    for name in ("rope_base", "norm_epsilon"):
        if has(name) and not (isinstance(getattr(config, name), int | float)
                              and getattr(config, name) > 0):
            raise ValueError(f"{owner}.{name}={getattr(config, name)!r} must be a positive "
                             "number.")
    if config.norm not in NORMS:
        raise ValueError(f"{owner}.norm={config.norm!r} is not a known norm; use one of "
                         f"{sorted(NORMS)}.")
    if has("mlp_activation") and config.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(f"{owner}.mlp_activation={config.mlp_activation!r} is not a known "
                         f"activation; use one of {sorted(MLP_ACTIVATIONS)}.")
    if has("sliding_window") and config.sliding_window is not None and (
            isinstance(config.sliding_window, bool) or not isinstance(config.sliding_window, int)
            or config.sliding_window <= 0):
        raise ValueError(f"{owner}.sliding_window={config.sliding_window!r} must be a positive "
                         "int (the keys each query sees, itself included) or None (every "
                         "earlier key).")
    for name in filter(has, _RATES):
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ValueError(f"{owner}.{name}={getattr(config, name)} must be in [0, 1).")
    if has("attention"):
        check_attention_name(owner, config.attention)
    if has("kv_lora_rank"):
        check_mla_fields(owner, config)
    if has("attention_implementation"):
        if config.attention_implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"{owner}.attention_implementation={config.attention_implementation!r} is "
                "not a known kernel; use 'xla' (every backend) or 'cudnn' (GPUs).")
    check_mode(None, config=config, where=owner)  # refused in every mode: sp_jax.compat
    _float_dtype(owner, "dtype", config.dtype, optional=True)
    _float_dtype(owner, "param_dtype", config.param_dtype, optional=False)
    if has("attention_implementation") and config.attention_implementation == "cudnn":
        _check_cudnn_compute(owner, config)


def _check_cudnn_compute(owner: str, config: Any) -> None:
    """A ValueError unless the attention of ``config`` computes in a dtype cuDNN's fused
    attention takes (``sp_jax.attention.CUDNN_DTYPES``): its ``dtype``, or with
    ``dtype=None`` the parameters' (the activations promote with them, so an fp32
    ``param_dtype`` computes in fp32 whatever the input). On a GPU, JAX would raise a
    NotImplementedError at trace time, and only there."""
    name, compute = ("dtype", config.dtype) if config.dtype is not None else (
        "param_dtype", config.param_dtype)
    if not cudnn_takes(compute):
        raise ValueError(
            f"{owner}: attention_implementation='cudnn' computes attention in "
            f"{jnp.dtype(compute).name} ({name}={jnp.dtype(compute).name}), but cuDNN's fused "
            "attention takes float16 or bfloat16 only; use dtype=jnp.bfloat16 (parameters "
            "may stay float32: param_dtype) or attention_implementation='xla'.")


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")
"""Multi-head latent attention's shape fields (:class:`AttentionConfig`,
:class:`~sp_jax.models.GPTConfig`), DeepSeek-V3's names."""


def check_mla_fields(owner: str, config: Any) -> None:
    """Multi-head latent attention's fields (:data:`MLA_FIELDS`): with ``attention="mla"``
    each a positive int (``q_lora_rank`` may be None: q projected directly; with rotary
    embeddings ``qk_rope_head_dim`` even); with another attention all None. A ValueError
    names ``owner.field``, the value and the fix."""
    values = {name: getattr(config, name) for name in MLA_FIELDS}
    absorb = getattr(config, "mla_absorb", True)
    if not isinstance(absorb, bool) or (not absorb and config.attention != "mla"):
        raise ValueError(f"{owner}.mla_absorb={absorb!r} must be True or False, and False "
                         "only with attention='mla' (how multi-head latent attention "
                         "decodes from its latent cache).")
    if config.attention != "mla":
        given = [name for name, value in values.items() if value is not None]
        if given:
            raise ValueError(f"{owner}: {given} are multi-head latent attention's fields; "
                             f"attention={config.attention!r} does not read them: set "
                             "attention='mla' or leave them None.")
        return
    for name, value in values.items():
        if value is None and name == "q_lora_rank":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive int with "
                             "attention='mla' (DeepSeek-V3: q_lora_rank=1536, kv_lora_rank="
                             "512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim="
                             "128; q_lora_rank may be None).")
    rotary = getattr(config, "rotary", getattr(config, "positions", None) == "rotary")
    if rotary and values["qk_rope_head_dim"] % 2:
        raise ValueError(f"{owner}.qk_rope_head_dim={values['qk_rope_head_dim']} must be "
                         "even (the rotary angles turn pairs of features).")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Shape and numerics of a block's attention (:class:`~sp_jax.layers.CausalSelfAttention`
    or the attention class registered as ``attention``).

    Attributes:
      hidden: model width; divisible by ``num_heads`` unless ``head_dim`` is given.
      num_heads: attention heads; divisible by the tensor-axis size.
      head_dim: features per head (None: ``hidden / num_heads``, filled in at
        construction). q, k and v are ``num_heads x head_dim`` (k, v: ``num_kv_heads x
        head_dim``) wide and the output projection maps ``num_heads x head_dim`` back to
        ``hidden`` (Qwen3's, Mistral-Nemo's head size of 128 apart from the width). Even
        with ``rotary``.
      num_kv_heads: key/value heads (default ``num_heads``); a divisor of ``num_heads``.
        Fewer than ``num_heads``: grouped-query attention (1: multi-query), each key/value
        head serving ``num_heads / num_kv_heads`` consecutive query heads (Hugging Face's
        ``repeat_kv`` order); the tensor size must divide or be a multiple of it
        (:func:`kv_heads_per_shard`). With Ulysses the key/value heads per tensor shard
        must also divide by the context size.
      dropout: dropout rate on the block output (sharding-invariant masks).
      attention_dropout: dropout rate on the attention probabilities, inside the
        attention kernels (:class:`~sp_jax.attention.AttentionDropout`: masks from a hash
        of the global batch row, head and positions, equal under every sharding and
        context layout; ``attention_implementation="xla"`` only).
      rotary: apply rotary position embeddings to q and k.
      rope_base: rotary base frequency.
      partial_rotary_factor: the share of each head's features the rotary angles turn
        (the first ``int(head_dim * f)``, rotate-half among them; the rest pass through:
        GLM-4.5's 0.5, Hugging Face's ``partial_rotary_factor``); 1.0: all.
      rope_scaling: Llama-3 frequency scaling (:class:`~sp_jax.layers.RopeScaling`, or a
        dict of its fields) or None.
      qkv_bias: give the q/k/v projection a bias (GPT-2 has one; off by default: the key
        bias has an exactly zero gradient, since softmax ignores a constant added to every
        score).
      out_bias: give the output projection a bias (GPT-2: yes, Llama: no).
      qk_norm: RMS-normalise each head's query and key over ``head_dim`` (Qwen3's
        ``q_norm`` / ``k_norm``: scales ``[head_dim]`` shared by the heads, epsilon
        ``norm_epsilon``) before the rotary angles.
      sliding_window: None, or ``w``: query ``i`` attends keys ``i - w < j <= i`` only
        (Mistral's sliding window; key blocks wholly before the window are skipped).
        Not with ring attention.
      window_per_layer: each layer's window is data, not this config: the
        :class:`~sp_jax.layers.CausalSelfAttention` holds it as a :class:`LayerWindow`
        variable (an int32 scalar; ``GPTConfig.layer_windows``), so the layers of a
        scanned stack share one program. ``sliding_window`` must then be None.
      attention_scale: the factor of the scores ``q . k`` before the softmax (None:
        ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
      attention_softcap: None, or ``c``: the scaled scores become ``c * tanh(s / c)``
        before the mask and softmax (Gemma 2's ``attn_logit_softcapping``).
      norm_offset: the norms scale by ``norm_offset + weight`` (0.0; Gemma: 1.0, its
        RMSNorm's ``1 + weight`` with the weight initialised to 0), the q/k norms too.
      post_norms: a second norm on the attention's output before the residual add
        (Gemma 2 / 3's ``post_attention_layernorm``).
      rope_local_base: None, or the rotary base of the layers with a sliding window
        (Gemma 3's ``rope_local_base_freq``; ``rope_scaling`` then applies to the full
        layers only), chosen by the layer's window, so it is data under
        ``window_per_layer``.
      norm: ``"layernorm"`` or ``"rmsnorm"`` (the pre-norm).
      norm_epsilon: epsilon of the norm.
      attention_block_q / attention_block_k: query and key/value rows per block of the
        attention kernels (:func:`sp_jax.attention.blockwise_attention`: the largest
        divisors of the sequence up to these).
      attention_implementation: ``"xla"`` (sp_jax's blockwise kernel, every backend) or ``"cudnn"``
        (cuDNN's fused attention through :func:`jax.nn.dot_product_attention`, GPUs
        only; not with ring attention, which merges partial results by their
        log-sum-exp, which the cuDNN call does not return).
      dtype: compute dtype (None: the promoted dtype of input and parameters).
      param_dtype: parameter dtype.
      fp8: an :class:`~sp_jax.Fp8Recipe`: the block's linear layers compute in FP8
        (the q/k/v and output projections; attention itself does not), or None (the
        compute dtype).
      lora: a :class:`~sp_jax.LoRAConfig`: adapters on the projections it targets
        (``"q"``, ``"k"``, ``"v"``, ``"o"``), the base frozen; or None.
      attention: the registered name of the attention class the block runs
        (:func:`~sp_jax.layers.register_attention`; ``"mha"``:
        :class:`~sp_jax.layers.CausalSelfAttention`, multi-head, grouped-query and
        multi-query attention; ``"mla"``: :class:`~sp_jax.layers.MultiHeadLatentAttention`).
        A variant reads the fields of this config it needs.
      q_lora_rank / kv_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim:
        multi-head latent attention's shape (``attention="mla"``, DeepSeek-V3's fields of
        the same names; :func:`check_mla_fields`): the query's low rank (None: q
        projected directly), the keys' and values' latent width, each query/key head's
        features without and with the rotary angles, and each value head's features.
        None (and unread) for other attentions.
      mla_absorb: how multi-head latent attention decodes from its latent cache: True
        (absorbed: the key up projection folded into the query, attention in latent
        space) or False (each step up-projects the cached latent into this shard's
        per-head keys and values, then attends as multi-head attention: the same
        numbers, more memory and FLOPs per step; for comparison). Only True with other
        attentions.
    """

    hidden: int
    num_heads: int
    num_kv_heads: int | None = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    rotary: bool = False
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    qkv_bias: bool = False
    out_bias: bool = True
    norm: str = "layernorm"
    norm_epsilon: float = 1e-5
    attention_block_q: int = 512
    attention_block_k: int = 512
    attention_implementation: str = "xla"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qk_norm: bool = False
    sliding_window: int | None = None
    fp8: Fp8Recipe | None = None
    lora: LoRAConfig | None = None
    head_dim: int | None = None  # an int once constructed
    window_per_layer: bool = False
    attention_scale: float | None = None
    attention_softcap: float | None = None
    norm_offset: float = 0.0
    post_norms: bool = False
    rope_local_base: float | None = None
    attention: str = "mha"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    partial_rotary_factor: float = 1.0
    mla_absorb: bool = True
    _head_dim_given: bool = dataclasses.field(default=False, init=False, repr=False,
                                              compare=False)

    def __post_init__(self) -> None:
        settle_block_fields(self)
        check_block_fields("AttentionConfig", self)
        object.__setattr__(self, "_head_dim_given", self.head_dim is not None)
        if self.head_dim is None:  # today's head size, from the width
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)

    @property
    def attention_width(self) -> int:
        """Width of the attention's output (and of q): ``num_heads x head_dim``, which
        the output projection maps back to ``hidden``."""
        return self.num_heads * self.head_dim

    def replace(self, **changes: Any) -> AttentionConfig:
        """A copy with ``changes`` applied (validated like the constructor); a
        ``head_dim`` derived from ``hidden / num_heads`` is derived again."""
        if not self._head_dim_given:
            changes.setdefault("head_dim", None)
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Shape and numerics of a :class:`~sp_jax.layers.MLP` block.

    Attributes:
      hidden: model width.
      mlp_hidden: inner width; divisible by the tensor-axis size.
      dropout: dropout rate on the block output.
      mlp_activation: a name of :data:`MLP_ACTIVATIONS`: ``"gelu"`` (tanh approximation,
        GPT-2), ``"gelu_exact"``, ``"relu"``, or gated ``"swiglu"`` (Llama) /
        ``"geglu"``: gate and up fused in ONE column layer ``[hidden, 2 * mlp_hidden]``
        whose columns are interleaved ``(j, {gate, up})``, so every tensor shard holds
        matching gate and up columns.
      mlp_bias: biases on the up (gate) and down projections (GPT-2: yes, Llama: no).
      norm / norm_epsilon: the pre-norm.
      dtype / param_dtype: compute and parameter dtypes.
      fp8: an :class:`~sp_jax.Fp8Recipe`: the block's linear layers compute in FP8
        (the up and down projections; the activation in the compute dtype), or None
        (the compute dtype).
      lora: a :class:`~sp_jax.LoRAConfig`: adapters on the projections it targets
        (``"gate"``, ``"up"``, ``"down"``), the base frozen; or None.
      norm_offset: the pre-norm (and post-norm) scales by ``norm_offset + weight``
        (Gemma: 1.0).
      post_norms: a second norm on the MLP's output before the residual add (Gemma 2 /
        3's ``post_feedforward_layernorm``; the pre-norm is its
        ``pre_feedforward_layernorm``).
    """

    hidden: int
    mlp_hidden: int
    dropout: float = 0.0
    mlp_activation: str = "gelu"
    mlp_bias: bool = True
    norm: str = "layernorm"
    norm_epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    fp8: Fp8Recipe | None = None
    lora: LoRAConfig | None = None
    norm_offset: float = 0.0
    post_norms: bool = False

    def __post_init__(self) -> None:
        check_block_fields("MLPConfig", self)

    @property
    def gated(self) -> bool:
        """Whether the activation is a gated linear unit."""
        return MLP_ACTIVATIONS[self.mlp_activation][1]

    def replace(self, **changes: Any) -> MLPConfig:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and numerics of a :class:`~sp_jax.layers.MoE` (mixture-of-experts) block.

    Attributes:
      hidden: model width.
      num_experts: routed experts ``E`` (divisible by the expert-axis size).
      experts_per_token: ``k`` experts each token is sent to (at most ``E``).
      moe_mlp_hidden: inner width ``F`` of each expert (divisible by the tensor size).
      moe_capacity_factor: None (dropless: every token reaches its ``k`` experts) or a
        positive factor ``c``: each expert takes at most ``ceil(c * seq * k / E)`` of a
        sequence's (token, choice) pairs, first choices first, in position order
        (:func:`sp_jax.ops.moe.capacity_keep`); the rest are dropped (the residual
        carries those tokens).
      num_shared_experts: experts every token also goes through (DeepSeek's / Qwen2-MoE's
        shared experts, without a gate): one dense MLP of width ``num_shared_experts *
        moe_mlp_hidden`` beside the routed ones.
      moe_norm_topk: renormalise the ``k`` chosen router probabilities to sum to 1
        (Mixtral, Qwen3-MoE's ``norm_topk_prob``).
      moe_scoring: ``"softmax"`` (the default) or ``"sigmoid"`` (DeepSeek-V3, GLM-4.5):
        how the router scores the experts (:func:`sp_jax.ops.moe.router_scores`).
      moe_groups / moe_topk_groups: group-limited top-k (DeepSeek-V3's ``n_group`` /
        ``topk_group``): the experts in ``moe_groups`` groups, each token choosing among
        those of its best ``moe_topk_groups`` groups (ranked by the sum of their two
        highest biased scores; :func:`sp_jax.ops.moe.select_experts`); 1 / 1: plain top-k.
      moe_routed_scale: the factor of the routed experts' weights (DeepSeek-V3's
        ``routed_scaling_factor``, 2.5); 1.0 by default.
      moe_bias_update_rate: aux-loss-free balancing (DeepSeek-V3): a per-expert bias
        (``router_bias``, a :class:`~sp_jax.layers.RouterBias`) added to the scores for
        the choice only, moved each training step by this rate towards the mean load
        (:func:`~sp_jax.layers.update_router_biases`); 0.0: not updated. The layer holds
        the bias when this is > 0 or the scoring is ``"sigmoid"``.
      moe_seq_aux_loss_coef: weight of DeepSeek-V3's sequence-wise balance loss
        (``alpha sum_i f_i P_i`` per sequence, averaged over the sequences and summed over
        the layers: ``moe_seq_aux_loss`` of :func:`~sp_jax.layers.moe_losses`); 0.0: off.
      mlp_activation: the experts' activation (:data:`MLP_ACTIVATIONS`; gated ones with
        interleaved ``(gate, up)`` columns, as :class:`MLPConfig`).
      dropout: dropout rate on the block output.
      norm / norm_epsilon: the pre-norm.
      dtype / param_dtype: compute and parameter dtypes (the router runs in fp32).
      fp8: an :class:`~sp_jax.Fp8Recipe`: the experts' grouped GEMMs (and the shared
        experts' projections) compute in FP8 (:func:`sp_jax.ops.moe.fp8_grouped_gemm`;
        the router, the activation and generation's decode steps in ``dtype``), or None
        (the compute dtype).
      norm_offset / post_norms: as :class:`MLPConfig`.
    """

    hidden: int
    num_experts: int
    experts_per_token: int
    moe_mlp_hidden: int
    moe_capacity_factor: float | None = None
    num_shared_experts: int = 0
    moe_norm_topk: bool = True
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0
    moe_bias_update_rate: float = 0.0
    moe_seq_aux_loss_coef: float = 0.0
    mlp_activation: str = "swiglu"
    dropout: float = 0.0
    norm: str = "rmsnorm"
    norm_epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    fp8: Fp8Recipe | None = None
    norm_offset: float = 0.0
    post_norms: bool = False

    def __post_init__(self) -> None:
        settle_block_fields(self)
        check_block_fields("MoEConfig", self)
        check_moe_fields("MoEConfig", self)

    @property
    def gated(self) -> bool:
        """Whether the activation is a gated linear unit."""
        return MLP_ACTIVATIONS[self.mlp_activation][1]

    @property
    def router_bias(self) -> bool:
        """Whether the layer holds a selection bias (a sigmoid router's
        ``e_score_correction_bias``, or one a nonzero ``moe_bias_update_rate`` trains)."""
        return self.moe_scoring == "sigmoid" or self.moe_bias_update_rate > 0

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)


def check_moe_fields(owner: str, config: Any) -> None:
    """The mixture-of-experts fields of ``config`` (:class:`MoEConfig` or a
    :class:`~sp_jax.models.GPTConfig` with ``num_experts > 0``); a ValueError or
    TypeError names ``owner.field``, the value and the fix."""
    def positive_int(name: str) -> int:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive int.")
        return value

    experts = positive_int("num_experts")
    k = positive_int("experts_per_token")
    positive_int("moe_mlp_hidden")
    if k > experts:
        raise ValueError(f"{owner}.experts_per_token={k} must be at most num_experts="
                         f"{experts}.")
    shared = config.num_shared_experts
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"{owner}.num_shared_experts={shared!r} must be an int >= 0.")
    factor = config.moe_capacity_factor
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float)
                               or not factor > 0):
        raise ValueError(f"{owner}.moe_capacity_factor={factor!r} must be None (dropless) "
                         "or a positive number (e.g. 1.25).")
    if not isinstance(config.moe_norm_topk, bool):
        raise TypeError(f"{owner}.moe_norm_topk={config.moe_norm_topk!r} must be True or "
                        "False.")
    scoring = config.moe_scoring
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"{owner}.moe_scoring={scoring!r} is not a router scoring; use "
                         "'softmax' (Mixtral, Qwen3-MoE) or 'sigmoid' (DeepSeek-V3).")
    groups, top = positive_int("moe_groups"), positive_int("moe_topk_groups")
    if experts % groups or top > groups:
        raise ValueError(f"{owner}.moe_groups={groups} and moe_topk_groups={top} with "
                         f"num_experts={experts}: the groups must divide the experts and "
                         "moe_topk_groups be at most moe_groups (DeepSeek-V3: 8 groups of "
                         "32, 4 chosen).")
    if groups > 1 and top < groups and (experts // groups < 2 or k > top * experts // groups):
        raise ValueError(f"{owner}.experts_per_token={k} with moe_groups={groups}, "
                         f"moe_topk_groups={top}: each group needs at least 2 experts (a "
                         "group's rank is its top-2 sum) and the chosen groups at least k "
                         f"experts ({top} x {experts // groups}); choose fewer groups or "
                         "more chosen ones.")
    for name in ("moe_routed_scale", "moe_bias_update_rate", "moe_seq_aux_loss_coef"):
        value = getattr(config, name)
        number = not isinstance(value, bool) and isinstance(value, int | float)
        if not number or not (value > 0 if name == "moe_routed_scale" else value >= 0):
            raise ValueError(f"{owner}.{name}={value!r} must be a number "
                             f"{'> 0' if name == 'moe_routed_scale' else '>= 0 (0: off)'}.")
