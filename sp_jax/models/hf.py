"""Hugging Face checkpoints in and out: GPT-2 and Llama-family models.

    with jax.set_mesh(mesh):
        model = from_hf("path/to/llama", parallel=ParallelConfig())  # safetensors + config
        ...                                                          # train it
        to_hf(model, "out/")          # transformers: AutoModelForCausalLM.from_pretrained

Reading needs neither torch nor transformers: tensors come from ``*.safetensors`` (one
file or a sharded ``model.safetensors.index.json``) through ``safetensors``' NumPy API,
and ``config.json`` (as transformers 4.x or 5.x writes it) is translated to a
:class:`~sp_jax.models.GPTConfig` by :func:`config_from_hf`.

The conversion is one table per family (:func:`_rules`): each sp_jax parameter, the
Hugging Face tensors it comes from and two inverse functions between them. It applies
the layout changes sp_jax's fused projections need:

- GPT-2's ``c_attn`` ``[hidden, (q | k | v)]`` and Llama's ``q_proj``, ``k_proj``,
  ``v_proj`` become the per-head columns ``(head, {q, k, v}, head_dim)`` of one fused
  kernel (grouped-query Llama: ``q_kernel`` and ``(kv_head, {k, v}, head_dim)``), so that
  every tensor shard holds whole heads;
- Llama's ``gate_proj`` / ``up_proj`` become the interleaved ``(j, {gate, up})`` columns
  of the fused SwiGLU kernel;
- ``torch.nn.Linear`` weights ``[out, in]`` are transposed to ``[in, out]`` (GPT-2's
  ``Conv1D`` weights already are).

Loading first checks every tensor (present, no unknown ones, global shape and dtype)
against the model the config describes, naming the Hugging Face tensor and the sp_jax
path on any mismatch, and only then places each array straight into its sharding with
:func:`jax.make_array_from_callback`: each process reads only the slices its devices
hold for the tensors used as they are (embeddings, norms, output and down projections,
through safetensors' lazy slices); the fused ones are read whole once and permuted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig
from sp_jax.layers._sharding import current_mesh
from sp_jax.layers.transformer import RopeScaling
from sp_jax.models.gpt import GPT, GPTConfig

__all__ = ["FAMILIES", "config_from_hf", "config_to_hf", "from_hf", "to_hf",
           "to_hf_state_dict"]

FAMILIES = ("gpt2", "llama")
"""The ``model_type`` s of ``config.json`` that :func:`from_hf` reads."""

# Tensors of Hugging Face checkpoints that are buffers, not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
                     "gelu": "gelu_exact", "relu": "relu"}


# --------------------------------------------------------------------------------------
# config.json <-> GPTConfig
# --------------------------------------------------------------------------------------


def _dtype_of(config: Mapping[str, Any]):
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return jnp.dtype(str(name).removeprefix("torch."))
    except TypeError as e:
        raise ValueError(f"config.json: dtype {name!r} is not a dtype sp_jax knows.") from e


def config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict).

    ``model_type`` ``"gpt2"`` or ``"llama"``, as written by transformers 4.x (``rope_theta``
    and ``rope_scaling`` at the top level) or 5.x (``rope_parameters``). Options sp_jax
    cannot reproduce exactly raise a ValueError naming the key (e.g. GPT-2's
    ``scale_attn_by_inverse_layer_idx``, a Llama ``head_dim`` other than ``hidden /
    heads``, rope types other than default and ``llama3``). ``param_dtype`` is the
    config's ``dtype`` (``torch_dtype`` in 4.x), float32 when absent.

    GPT-2 has three dropout rates; sp_jax has one for embeddings and residuals
    (``dropout`` = ``resid_pdrop``, which must equal ``embd_pdrop`` unless ``dropout`` is
    overridden) and ``attention_dropout`` = ``attn_pdrop``.

    Args:
      config: the parsed ``config.json``.
      overrides: :class:`GPTConfig` fields to set instead (e.g. ``dtype=jnp.bfloat16``,
        ``remat=True``, ``dropout=0.0``).
    """
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"config.json: model_type={kind!r} is not one sp_jax converts; "
                         f"supported: {list(FAMILIES)}.")
    get = config.get
    if kind == "gpt2":
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
            if bool(get(key, ok)) != ok:
                raise ValueError(f"config.json: {key}={get(key)!r} is not supported (sp_jax "
                                 f"computes GPT-2 attention with {key}={ok}).")
        act = get("activation_function", "gelu_new")
        if act not in _GPT2_ACTIVATIONS:
            raise ValueError(f"config.json: activation_function={act!r} is not one of "
                             f"{sorted(_GPT2_ACTIVATIONS)}.")
        resid, embd = float(get("resid_pdrop", 0.1)), float(get("embd_pdrop", 0.1))
        if resid != embd and "dropout" not in overrides:
            raise ValueError(
                f"config.json: embd_pdrop={embd} differs from resid_pdrop={resid}; sp_jax has "
                "one rate for both: pass dropout=... to choose it.")
        fields = dict(
            vocab_size=get("vocab_size"), max_seq_len=get("n_positions"),
            num_layers=get("n_layer"), num_heads=get("n_head"), hidden=get("n_embd"),
            mlp_hidden=get("n_inner") or 4 * get("n_embd"), dropout=resid,
            attention_dropout=float(get("attn_pdrop", 0.1)),
            tie_embeddings=bool(get("tie_word_embeddings", True)), positions="learned",
            norm="layernorm", norm_epsilon=float(get("layer_norm_epsilon", 1e-5)),
            mlp_activation=_GPT2_ACTIVATIONS[act], qkv_bias=True, out_bias=True,
            mlp_bias=True, param_dtype=_dtype_of(config))
    else:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"config.json: head_dim={get('head_dim')} differs from "
                             f"hidden_size / num_attention_heads = {hidden // heads}; sp_jax "
                             "derives the head size from the width.")
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={get('hidden_act')!r}: sp_jax's Llama "
                             "MLP is SwiGLU ('silu').")
        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        elif rope_type in (None, "default"):
            scaling = None
        else:
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported; sp_jax "
                             "implements 'default' and 'llama3'.")
        bias = bool(get("attention_bias", False))
        fields = dict(
            vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings"),
            num_layers=get("num_hidden_layers"), num_heads=heads, hidden=hidden,
            mlp_hidden=get("intermediate_size"),
            num_kv_heads=get("num_key_value_heads") or heads,
            attention_dropout=float(get("attention_dropout", 0.0)),
            tie_embeddings=bool(get("tie_word_embeddings", False)), positions="rotary",
            rope_base=theta, rope_scaling=scaling, norm="rmsnorm",
            norm_epsilon=float(get("rms_norm_eps", 1e-6)), mlp_activation="swiglu",
            qkv_bias=bias, out_bias=bias, mlp_bias=bool(get("mlp_bias", False)),
            param_dtype=_dtype_of(config))
    return GPTConfig(**{**fields, **overrides})


def _family(cfg: GPTConfig) -> str:
    """The Hugging Face family that expresses ``cfg`` exactly, or a ValueError naming the
    field that no family has."""
    gpt2 = dict(positions="learned", norm="layernorm", qkv_bias=True, out_bias=True,
                mlp_bias=True, num_kv_heads=cfg.num_heads, rope_scaling=None)
    llama = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                 out_bias=cfg.qkv_bias)
    for name, want in (("gpt2", gpt2), ("llama", llama)):
        if all(getattr(cfg, k) == v for k, v in want.items()) and (
                name != "gpt2" or cfg.mlp_activation in _GPT2_ACTIVATIONS.values()):
            return name
    raise ValueError(
        "to_hf: this GPTConfig is neither GPT-2-shaped (learned positions, LayerNorm, "
        "gelu/relu MLP, all biases, no grouped-query attention) nor Llama-shaped (rotary, "
        f"RMSNorm, SwiGLU, qkv_bias == out_bias): positions={cfg.positions!r}, "
        f"norm={cfg.norm!r}, mlp_activation={cfg.mlp_activation!r}, qkv_bias={cfg.qkv_bias}, "
        f"out_bias={cfg.out_bias}, mlp_bias={cfg.mlp_bias}, num_kv_heads={cfg.num_kv_heads}.")


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` for transformers (4.x and 5.x read it: Llama's
    rope settings are written in both spellings). Raises a ValueError when neither
    GPT-2 nor Llama expresses ``cfg``."""
    family = _family(cfg)
    dtype = jnp.dtype(cfg.param_dtype).name
    if family == "gpt2":
        act = {v: k for k, v in reversed(_GPT2_ACTIVATIONS.items())}[cfg.mlp_activation]
        return dict(
            model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len, n_embd=cfg.hidden, n_layer=cfg.num_layers,
            n_head=cfg.num_heads, n_inner=cfg.mlp_hidden, activation_function=act,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.norm_epsilon,
            tie_word_embeddings=cfg.tie_embeddings, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
            dtype=dtype)
    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.hidden // cfg.num_heads,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rope_base,
        rope_scaling=None if cfg.rope_scaling is None else rope,
        rope_parameters={**rope, "rope_theta": cfg.rope_base},
        attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias,
        attention_dropout=cfg.attention_dropout, tie_word_embeddings=cfg.tie_embeddings,
        dtype=dtype)


# --------------------------------------------------------------------------------------
# The conversion table
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One sp_jax parameter (per layer: ``{i}`` in the names) and its Hugging Face
    tensors. ``to_ours(*hf) -> ours`` and ``to_hf(ours) -> tuple(hf)`` are inverse
    permutations; ``direct``: ``"same"`` / ``"T"`` when ``ours`` is the one Hugging Face
    tensor as it is / transposed (read by slices), else None (read whole)."""

    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., Any]
    to_hf: Callable[[Any], tuple]
    direct: str | None = None


def _same(ours: str, hf: str) -> _Rule:
    return _Rule(ours, (hf,), lambda x: x, lambda x: (x,), "same")


def _transposed(ours: str, hf: str) -> _Rule:
    return _Rule(ours, (hf,), lambda x: x.T, lambda x: (x.T,), "T")


def _interleave(ours: str, hf: tuple[str, ...], cols: tuple[int, ...], group: int,
                transpose: bool) -> _Rule:
    """``ours`` ``[..., n * (c_1 + ... + c_k)]`` whose columns are ``(j, {t_1 .. t_k},
    ...)`` with ``n`` groups, from Hugging Face tensors ``t_m`` ``[..., n * c_m]`` (columns
    ``(j, ...)``) or, with ``transpose``, their ``[n * c_m, in]`` Linear weights."""

    def to_ours(*ts):
        ts = [t.T if transpose else t for t in ts]
        parts = [t.reshape(*t.shape[:-1], group, c) for t, c in zip(ts, cols, strict=True)]
        out = jnp.concatenate(parts, axis=-1) if isinstance(ts[0], jax.Array) else \
            np.concatenate(parts, axis=-1)
        return out.reshape(*out.shape[:-2], -1)

    def to_hf(x):
        x = x.reshape(*x.shape[:-1], group, sum(cols))
        bounds = np.cumsum((0, *cols))
        ts = [x[..., a:b].reshape(*x.shape[:-2], -1)
              for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return tuple(t.T if transpose else t for t in ts)

    return _Rule(ours, hf, to_ours, to_hf)


def _rules(cfg: GPTConfig, family: str) -> list[_Rule]:
    """The conversion table of ``cfg`` (``family``: ``"gpt2"`` or ``"llama"``)."""
    h, d = cfg.num_heads, cfg.hidden // cfg.num_heads
    a, m = "blocks/{i}/attention/", "blocks/{i}/mlp/"
    if family == "gpt2":
        p = "transformer.h.{i}."
        rules = [_same("embed/embedding", "transformer.wte.weight"),
                 _same("position", "transformer.wpe.weight"),
                 _same(a + "norm/scale", p + "ln_1.weight"),
                 _same(a + "norm/bias", p + "ln_1.bias"),
                 _same(a + "out/kernel", p + "attn.c_proj.weight"),
                 _same(a + "out/bias", p + "attn.c_proj.bias"),
                 _same(m + "norm/scale", p + "ln_2.weight"),
                 _same(m + "norm/bias", p + "ln_2.bias"),
                 _same(m + "up/kernel", p + "mlp.c_fc.weight"),
                 _same(m + "up/bias", p + "mlp.c_fc.bias"),
                 _same(m + "down/kernel", p + "mlp.c_proj.weight"),
                 _same(m + "down/bias", p + "mlp.c_proj.bias"),
                 _same("final_norm/scale", "transformer.ln_f.weight"),
                 _same("final_norm/bias", "transformer.ln_f.bias")]
        # c_attn columns (q | k | v) x (head, head_dim) -> (head, {q, k, v}, head_dim)
        for kind in ("kernel", "bias"):
            rules.append(_Rule(
                a + "qkv/" + kind, (p + "attn.c_attn." + ("weight" if kind == "kernel"
                                                            else "bias"),),
                lambda w: _swap_qkv(w, 3, h, d), lambda w: (_swap_qkv(w, h, 3, d),)))
        if not cfg.tie_embeddings:
            rules.append(_same("head/embedding", "lm_head.weight"))
        return rules
    p = "model.layers.{i}."
    q, k, v = (p + f"self_attn.{n}_proj." for n in "qkv")
    rules = [_same("embed/embedding", "model.embed_tokens.weight"),
             _same(a + "norm/scale", p + "input_layernorm.weight"),
             _transposed(a + "out/kernel", p + "self_attn.o_proj.weight"),
             _same(m + "norm/scale", p + "post_attention_layernorm.weight"),
             _transposed(m + "down/kernel", p + "mlp.down_proj.weight"),
             _same("final_norm/scale", "model.norm.weight"),
             _interleave(m + "up/kernel", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                         (1, 1), cfg.mlp_hidden, transpose=True)]
    # q/k/v weights (and biases): one fused (head, {q, k, v}, head_dim) kernel, or with
    # grouped-query attention q_kernel and (kv_head, {k, v}, head_dim)
    for kind, names, transpose in (("weight", ("kernel", "q_kernel", "kv_kernel"), True),
                                   ("bias", ("bias", "q_bias", "kv_bias"), False)):
        if kind == "bias" and not cfg.qkv_bias:
            continue
        if cfg.num_kv_heads == h:
            rules.append(_interleave(a + "qkv/" + names[0], (q + kind, k + kind, v + kind),
                                     (d, d, d), h, transpose=transpose))
        else:
            rules += [(_transposed if transpose else _same)(a + "qkv/" + names[1], q + kind),
                      _interleave(a + "qkv/" + names[2], (k + kind, v + kind), (d, d),
                                  cfg.num_kv_heads, transpose=transpose)]
    if cfg.out_bias:
        rules.append(_same(a + "out/bias", p + "self_attn.o_proj.bias"))
    if cfg.mlp_bias:
        rules += [_interleave(m + "up/bias", (p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                              (1, 1), cfg.mlp_hidden, transpose=False),
                  _same(m + "down/bias", p + "mlp.down_proj.bias")]
    if not cfg.tie_embeddings:
        rules.append(_same("head/embedding", "lm_head.weight"))
    return rules


def _swap_qkv(w, first: int, second: int, d: int):
    """Columns ``(first, second, d)`` -> ``(second, first, d)`` of ``w [..., cols]``."""
    lead = w.shape[:-1]
    x = w.reshape(*lead, first, second, d)
    return jnp.swapaxes(x, -3, -2).reshape(*lead, -1) if isinstance(w, jax.Array) else \
        np.swapaxes(x, -3, -2).reshape(*lead, -1)


def _expand(rules: list[_Rule], cfg: GPTConfig) -> list[tuple[str, _Rule, int | None]]:
    """(sp_jax path, rule, layer) for every tensor: per-layer rules once per layer (with
    ``scan_layers`` the path has no layer index: layer ``l`` is row ``l`` of it)."""
    out = []
    for rule in rules:
        if "{i}" not in rule.ours:
            out.append((rule.ours, rule, None))
            continue
        for i in range(cfg.num_layers):
            path = rule.ours.replace("{i}/", "") if cfg.scan_layers else \
                rule.ours.format(i=i)
            out.append((path, rule, i))
    return out


def _names(rule: _Rule, layer: int | None) -> tuple[str, ...]:
    return tuple(n.format(i=layer) for n in rule.hf)


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


class _Source:
    """Named tensors from safetensors files (lazy slices) or a dict of arrays."""

    def __init__(self, tensors: Mapping[str, Any] | None = None,
                 files: Mapping[str, pathlib.Path] | None = None):
        self._dict = dict(tensors or {})
        self._files = dict(files or {})  # name -> file
        self._open: dict[pathlib.Path, Any] = {}

    @classmethod
    def from_directory(cls, directory: pathlib.Path) -> _Source:
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: directory / f for name, f in weight_map.items()}
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise FileNotFoundError(
                    f"from_hf: no *.safetensors in {directory}; save the model with "
                    "save_pretrained(..., safe_serialization=True).")
            files = {}
            for path in paths:
                with safe_open(path, framework="np") as f:
                    files.update({name: path for name in f.keys()})  # noqa: SIM118
        return cls(files=files)

    def names(self) -> list[str]:
        return sorted({*self._dict, *self._files})

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self._files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="np")
        return self._open[path]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        if name in self._dict:
            x = self._dict[name]
            return tuple(np.shape(x)), np.dtype(x.dtype)
        sl = self._handle(name).get_slice(name)
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()]

    def full(self, name: str) -> np.ndarray:
        if name in self._dict:
            return np.asarray(self._dict[name])
        return self._handle(name).get_tensor(name)

    def slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self._dict:
            return np.asarray(self._dict[name])[index]
        return self._handle(name).get_slice(name)[index]

    def close(self) -> None:
        self._open.clear()


def _safetensors_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
            "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
            "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I8": np.dtype(np.int8),
            "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool)}


_SAFETENSORS_DTYPES = _safetensors_dtypes()


def _read_input(path_or_state_dict, config_json) -> tuple[_Source, dict[str, Any]]:
    if isinstance(path_or_state_dict, Mapping):
        if config_json is None:
            raise ValueError("from_hf: a state dict needs config_json= (the config.json dict "
                             "or its path).")
        source = _Source(tensors=path_or_state_dict)
    elif isinstance(path_or_state_dict, str | os.PathLike):
        directory = pathlib.Path(path_or_state_dict)
        if not directory.is_dir():
            raise FileNotFoundError(f"from_hf: {directory} is not a directory (expected a "
                                    "Hugging Face checkpoint: config.json + *.safetensors).")
        source = _Source.from_directory(directory)
        if config_json is None:
            config_json = directory / "config.json"
    else:
        raise TypeError(f"from_hf: expected a directory path or a dict of arrays, got "
                        f"{type(path_or_state_dict).__name__}.")
    if isinstance(config_json, str | os.PathLike):
        config_json = json.loads(pathlib.Path(config_json).read_text())
    if not isinstance(config_json, Mapping):
        raise TypeError(f"from_hf: config_json must be a dict or a path, got "
                        f"{type(config_json).__name__}.")
    return source, dict(config_json)


def _canonical_names(source: _Source, family: str) -> dict[str, str]:
    """Our canonical Hugging Face name -> the name in ``source`` (GPT-2 checkpoints are
    written with and without the ``transformer.`` prefix)."""
    names = {n: n for n in source.names() if not n.endswith(_IGNORED_SUFFIXES)}
    if family == "gpt2" and "transformer.wte.weight" not in names and "wte.weight" in names:
        names = {("transformer." + n if n != "lm_head.weight" else n): n for n in names}
    return names


def from_hf(path_or_state_dict: str | os.PathLike | Mapping[str, Any],
            config_json: str | os.PathLike | Mapping[str, Any] | None = None, *,
            parallel: ParallelConfig = ParallelConfig(), rngs: nnx.Rngs | None = None,
            **overrides: Any) -> GPT:
    """A :class:`~sp_jax.models.GPT` holding a Hugging Face GPT-2 or Llama checkpoint.

    Call under ``jax.set_mesh(mesh)``: every parameter is placed straight into its
    sharding on that mesh. Torch and transformers are not imported.

    Args:
      path_or_state_dict: a checkpoint directory (``config.json`` and ``*.safetensors``,
        possibly sharded with ``model.safetensors.index.json``), or a dict of NumPy
        arrays named as in transformers' ``state_dict()``.
      config_json: the ``config.json`` dict or path (default: the directory's).
      parallel: the :class:`~sp_jax.ParallelConfig` of the model.
      rngs: rng streams for the model's dropout (default ``nnx.Rngs(0)``); parameters
        come from the checkpoint.
      overrides: :class:`~sp_jax.models.GPTConfig` fields that differ from the
        translated config (:func:`config_from_hf`), e.g. ``dtype=jnp.bfloat16``,
        ``remat=True``, ``scan_layers=True``, ``param_dtype=jnp.float32``. A tensor
        whose dtype does not convert exactly to ``param_dtype`` is an error unless
        ``param_dtype`` is given here.
    Returns:
      the model, in train mode like any new module (``model.eval()`` for inference).
    Raises:
      ValueError: before any array is placed, naming the Hugging Face tensor and the
        sp_jax path: a tensor missing, unknown, of the wrong global shape or of a dtype
        that does not fit.
    """
    source, config = _read_input(path_or_state_dict, config_json)
    try:
        cfg = config_from_hf(config, **overrides)
        family = config["model_type"]
        current_mesh(parallel, where="from_hf")  # checks the axes
        mesh = jax.sharding.get_mesh()
        rngs = nnx.Rngs(0) if rngs is None else rngs

        def build():
            return GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))

        abstract = nnx.eval_shape(build)
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
        plan = _check(source, cfg, family, flat, explicit_dtype="param_dtype" in overrides)
        loaded = {path: _place(source, entries, flat[path], mesh,
                               cfg.scan_layers and entries[0][1] is not None)
                  for path, entries in plan.items()}
        # The rng streams: the model built under jit, its parameters dead code.
        rest = nnx.jit(lambda r: nnx.state(GPT(cfg, parallel=parallel, rngs=r),
                                           nnx.Not(nnx.Param)))(rngs)
    finally:
        source.close()
    values = nnx.from_flat_state([
        (k, v.from_metadata(loaded["/".join(map(str, k))], v.get_metadata()))
        for k, v in nnx.to_flat_state(params)])
    return nnx.merge(graphdef, values, rest)


def _check(source: _Source, cfg: GPTConfig, family: str, flat: dict[str, Any], *,
           explicit_dtype: bool) -> dict[str, list[tuple[_Rule, int | None, tuple[str, ...]]]]:
    """Matches every parameter to its tensors and checks them all; returns sp_jax path ->
    [(rule, layer, source names)] (one entry per layer of a scanned parameter)."""
    names = _canonical_names(source, family)
    plan: dict[str, list] = {}
    used: set[str] = set()
    errors: list[str] = []
    for path, rule, layer in _expand(_rules(cfg, family), cfg):
        if path not in flat:
            raise AssertionError(f"from_hf: conversion table names {path}, not in the model")
        want = flat[path]
        shape = want.shape[1:] if cfg.scan_layers and layer is not None else want.shape
        hf = _names(rule, layer)
        expected = jax.eval_shape(rule.to_hf, jax.ShapeDtypeStruct(shape, want.dtype))
        stored = []
        for name, exp in zip(hf, expected, strict=True):
            if name not in names:
                errors.append(f"{name} (for {path}) is missing")
                continue
            got_shape, got_dtype = source.shape_dtype(names[name])
            if got_shape != exp.shape:
                errors.append(f"{name} has shape {got_shape}, but {path} {tuple(want.shape)} "
                              f"needs {exp.shape}")
            if not jnp.issubdtype(got_dtype, jnp.floating):
                errors.append(f"{name} has dtype {got_dtype}, not a floating dtype")
            elif not explicit_dtype and jnp.promote_types(got_dtype, want.dtype) != want.dtype:
                errors.append(f"{name} is {got_dtype}, which {path} ({want.dtype}) cannot hold "
                              "exactly; pass param_dtype= to convert it")
            used.add(name)
            stored.append(names[name])
        plan.setdefault(path, []).append((rule, layer, tuple(stored)))
    unknown = sorted(set(names) - used)
    if cfg.tie_embeddings and "lm_head.weight" in unknown:  # a tied copy
        unknown.remove("lm_head.weight")
    if unknown:
        errors.append(f"unknown tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''} "
                      f"(not part of a {family} model with this config)")
    if errors:
        raise ValueError("from_hf: the checkpoint does not match the model its config "
                         "describes:\n  " + "\n  ".join(errors))
    return plan


def _place(source: _Source, entries, abstract, mesh, scanned: bool) -> jax.Array:
    """The global array of one parameter, each device's block read and converted
    (``scanned``: row ``l`` of the parameter is layer ``l``, ``entries[l]``)."""
    spec = getattr(abstract, "sharding", None)
    spec = spec.spec if isinstance(spec, NamedSharding) else P(
        *(abstract.get_metadata().get("out_sharding") or ()))
    sharding = NamedSharding(mesh, spec)
    dtype = abstract.dtype
    whole: dict[int, np.ndarray] = {}

    def layer_block(k: int, index: tuple) -> np.ndarray:
        rule, _, names = entries[k]
        if rule.direct == "same":
            return source.slice(names[0], index)
        if rule.direct == "T":
            return source.slice(names[0], index[::-1]).T
        if k not in whole:
            whole[k] = np.asarray(rule.to_ours(*(source.full(n) for n in names)))
        return whole[k][index]

    def block(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(abstract.shape) - len(index))
        if not scanned:
            return layer_block(0, index).astype(dtype)
        rows = range(len(entries))[index[0]]
        return np.stack([layer_block(k, index[1:]) for k in rows]).astype(dtype)

    return jax.make_array_from_callback(tuple(abstract.shape), sharding, block)


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def _host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _convert_to_hf(cfg: GPTConfig, flat: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """sp_jax path -> array (parameters, or anything shaped like them: gradients) to the
    Hugging Face names and layouts."""
    out = {}
    for path, rule, layer in _expand(_rules(cfg, _family(cfg)), cfg):
        x = np.asarray(flat[path])
        if cfg.scan_layers and layer is not None:
            x = x[layer]
        for name, t in zip(_names(rule, layer), rule.to_hf(x), strict=True):
            out[name] = np.ascontiguousarray(t)
    return out


def to_hf_state_dict(model: GPT) -> dict[str, np.ndarray]:
    """The model's parameters as transformers names them (host NumPy arrays, gathered
    from every process), ready for ``safetensors.numpy.save_file``."""
    if not isinstance(model, GPT):
        raise TypeError(f"to_hf: expected a sp_jax.models.GPT, got {type(model).__name__}.")
    _family(model.config)
    flat = {"/".join(map(str, k)): _host(v[...])
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return _convert_to_hf(model.config, flat)


def to_hf(model: GPT, path: str | os.PathLike, *, max_shard_bytes: int = 5 << 30) -> None:
    """Writes ``model`` as a Hugging Face checkpoint directory: ``config.json``
    (:func:`config_to_hf`) and ``model.safetensors`` (or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``), which transformers'
    ``from_pretrained`` loads with every tensor accounted for. Every process gathers the
    parameters; process 0 writes. Raises a ValueError before writing anything when
    neither GPT-2 nor Llama expresses the model's config."""
    from safetensors.numpy import save_file

    config = config_to_hf(model.config)  # validates first
    tensors = to_hf_state_dict(model)
    if jax.process_index() != 0:
        return
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensors[name], size + nbytes
    shards.append(current)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata=metadata)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, directory / file, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                 "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

