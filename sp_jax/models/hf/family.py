"""What one Hugging Face model family is: :class:`Family` (its config.json mapping and its
conversion table) and :class:`Rule` (one sp_jax parameter and the Hugging Face tensors it
comes from), with the rule constructors the families' tables are written with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sp_jax.models.gpt_config import GPTConfig, YarnScaling

__all__ = ["ATTENTION", "MLP", "PLAIN", "Family", "Rule", "expand", "has_fields", "interleave",
           "on_layers", "per_expert", "require", "same", "stack_row", "swap_qkv", "transposed"]

# The sp_jax paths of one block's attention and MLP ("{i}": the layer).
ATTENTION = "blocks/{i}/attention/"
MLP = "blocks/{i}/mlp/"


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family (``model_type`` of ``config.json``).

    Attributes:
      model_type: ``config.json``'s ``model_type`` (``"gpt2"``, ``"llama"``,
        ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"mixtral"``, ``"qwen3_moe"``).
      description: how the :class:`GPTConfig` s it expresses look, for the error naming a
        config no family expresses (``"Llama-shaped (rotary, RMSNorm, ...)"``).
      config_from_hf: ``(config.json dict, overrides) -> GPTConfig fields`` (all but
        ``param_dtype``, the config's ``dtype`` in every family); raises a ValueError
        naming the key sp_jax cannot reproduce exactly.
      config_to_hf: ``GPTConfig -> config.json`` entries (all but ``model_type`` and
        ``dtype``), for a config :attr:`expresses` accepts.
      expresses: whether this family expresses a :class:`GPTConfig` exactly.
      rules: the conversion table of a :class:`GPTConfig`: one :class:`Rule` per sp_jax
        parameter (what :func:`~sp_jax.models.hf.to_hf` writes).
      read_rules: the conversion table for reading a checkpoint whose canonical tensor
        names are the second argument, when it may name its tensors in more than one way
        (the mixture-of-experts families: transformers 5.x's fused expert tensors, as its
        ``state_dict()`` gives them, or the per-expert ones ``save_pretrained`` writes);
        None: :attr:`rules`.
      yarn: the family reads and writes YaRN's rope scaling (DeepSeek-V3's, GLM-4.5's);
        the others refuse it (:meth:`writes`).
      canonicalize: the canonical Hugging Face names (those the rules use) of a
        checkpoint's tensors: ``{name: name}`` -> ``{canonical: name}``; None when the
        checkpoint's names are the canonical ones (GPT-2's come with and without the
        ``transformer.`` prefix).
      skipped: ``(cfg, canonical names) ->`` the tensors of a checkpoint that a model of
        ``cfg`` leaves unread (DeepSeek's MTP layers beyond ``cfg.mtp_depth``); None:
        every tensor is read.
    """

    model_type: str
    description: str
    config_from_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[GPTConfig], dict[str, Any]]
    expresses: Callable[[GPTConfig], bool]
    rules: Callable[[GPTConfig], list[Rule]]
    canonicalize: Callable[[dict[str, str]], dict[str, str]] | None = None
    read_rules: Callable[[GPTConfig, Collection[str]], list[Rule]] | None = None
    yarn: bool = False
    skipped: Callable[[GPTConfig, Collection[str]], Collection[str]] | None = None

    def writes(self, cfg: GPTConfig) -> bool:
        """Whether this family writes ``cfg`` exactly: :attr:`expresses` it, and its rope
        scaling is one the family reads (YaRN's, :class:`~sp_jax.layers.YarnScaling`,
        only with :attr:`yarn`)."""
        return self.expresses(cfg) and (self.yarn or not isinstance(cfg.rope_scaling,
                                                                    YarnScaling))

    def reading_rules(self, cfg: GPTConfig, names: Collection[str]) -> list[Rule]:
        """The conversion table that reads a checkpoint of ``cfg`` whose canonical
        tensor names are ``names``."""
        return self.rules(cfg) if self.read_rules is None else self.read_rules(cfg, names)

    def canonical_names(self, names: dict[str, str]) -> dict[str, str]:
        """Canonical Hugging Face name -> the name in the checkpoint, of ``names``
        (``{name: name}``)."""
        return names if self.canonicalize is None else self.canonicalize(names)


def has_fields(cfg: GPTConfig, **want: Any) -> bool:
    """Whether every named field of ``cfg`` has the value given."""
    return all(getattr(cfg, k) == v for k, v in want.items())


PLAIN = dict(norm_offset=0.0, post_norms=False, scale_embeddings=False, attention_scale=None,
             attention_softcap=None, final_logit_softcap=None, rope_local_base=None,
             attention="mha", num_dense_layers=0, moe_scoring="softmax", moe_groups=1,
             moe_topk_groups=1, moe_routed_scale=1.0, partial_rotary_factor=1.0)
"""The :class:`GPTConfig` fields of a block without Gemma's parts (``has_fields(cfg,
**PLAIN, ...)``): the families other than :mod:`.gemma2` / :mod:`.gemma3` express only
these values (multi-head attention, ``attention="mha"``, among them: a registered
attention variant has no family until one writes it; no dense layers before the
experts but in a family that writes them, :mod:`.qwen3_moe`; softmax routing without
groups or a routed scale, and rotary angles on every feature of a head: DeepSeek's
routing and GLM-4.5's partial rotary are :mod:`.deepseek_v3` / :mod:`.glm4_moe`'s)."""


def require(config: Mapping[str, Any], model_type: str, *keys: str) -> None:
    """A ValueError naming the first of ``keys`` that ``config`` (a ``config.json``
    dict) lacks or holds as null: the model's shape cannot be guessed."""
    for key in keys:
        if config.get(key) is None:
            raise ValueError(f"config.json: the key {key!r} is missing (a {model_type} "
                             "config.json needs it: the model's shape depends on it).")


# --------------------------------------------------------------------------------------
# The conversion table
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One sp_jax parameter (per layer: ``{i}`` in the names) and its Hugging Face
    tensors. ``to_ours(*hf) -> ours`` and ``to_hf(ours) -> tuple(hf)`` are inverse
    permutations; ``direct``: ``"same"`` / ``"T"`` when ``ours`` is the one Hugging Face
    tensor as it is / transposed (read by slices), else None (read whole); ``layers``:
    the layers a per-layer rule applies to (None: every layer; a model whose dense and
    mixture-of-experts layers alternate has rules for each kind)."""

    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., Any]
    to_hf: Callable[[Any], tuple]
    direct: str | None = None
    layers: frozenset[int] | None = None

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        """The Hugging Face tensors of layer ``layer`` (None: not a per-layer rule)."""
        return tuple(n.format(i=layer) for n in self.hf)


def same(ours: str, hf: str) -> Rule:
    """``ours`` is the Hugging Face tensor ``hf`` as it is."""
    return Rule(ours, (hf,), lambda x: x, lambda x: (x,), "same")


def transposed(ours: str, hf: str) -> Rule:
    """``ours`` is ``hf`` transposed (a ``torch.nn.Linear`` weight ``[out, in]``)."""
    return Rule(ours, (hf,), lambda x: x.T, lambda x: (x.T,), "T")


def interleave(ours: str, hf: tuple[str, ...], cols: tuple[int, ...], group: int,
               transpose: bool) -> Rule:
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

    return Rule(ours, hf, to_ours, to_hf)


def per_expert(ours: str, inner: Rule, num_experts: int) -> Rule:
    """``ours`` ``[E, ...]`` whose row ``e`` is ``inner`` (a rule of one expert's tensors,
    their names holding ``{e}``) of expert ``e``'s tensors (transformers'
    ``experts.{e}.*`` modules, as ``save_pretrained`` writes them)."""
    k = len(inner.hf)
    names = tuple(n.replace("{e}", str(e)) for e in range(num_experts) for n in inner.hf)

    def to_ours(*ts):
        rows = [inner.to_ours(*ts[e * k:(e + 1) * k]) for e in range(num_experts)]
        return jnp.stack(rows) if isinstance(rows[0], jax.Array) else np.stack(rows)

    def to_hf(x):
        return tuple(t for e in range(num_experts) for t in inner.to_hf(x[e]))

    return Rule(ours, names, to_ours, to_hf)


def on_layers(rules: list[Rule], layers: Collection[int]) -> list[Rule]:
    """``rules`` applied to ``layers`` only (an empty list when there are none)."""
    layers = frozenset(layers)
    return [dataclasses.replace(r, layers=layers) for r in rules] if layers else []


def swap_qkv(w, first: int, second: int, d: int):
    """Columns ``(first, second, d)`` -> ``(second, first, d)`` of ``w [..., cols]``."""
    lead = w.shape[:-1]
    x = w.reshape(*lead, first, second, d)
    return jnp.swapaxes(x, -3, -2).reshape(*lead, -1) if isinstance(w, jax.Array) else \
        np.swapaxes(x, -3, -2).reshape(*lead, -1)


def stack_row(cfg: GPTConfig, layer: int) -> int:
    """The row of layer ``layer`` in its scanned stack: ``layer`` itself, or with
    ``num_dense_layers = k`` its row in ``dense_blocks`` (``layer < k``) or in
    ``blocks`` (``layer - k``)."""
    k = cfg.num_dense_layers
    return layer if layer < k else layer - k


def expand(rules: list[Rule], cfg: GPTConfig) -> list[tuple[str, Rule, int | None]]:
    """(sp_jax path, rule, layer) for every tensor: per-layer rules once per layer (with
    ``scan_layers`` the path has no layer index: layer ``l`` is row :func:`stack_row` of
    it, under ``dense_blocks/`` for the first ``num_dense_layers``, the rules' paths
    naming ``blocks/`` for every layer)."""
    out = []
    for rule in rules:
        if "{i}" not in rule.ours:
            out.append((rule.ours, rule, None))
            continue
        for i in range(cfg.num_layers):
            if rule.layers is not None and i not in rule.layers:
                continue
            path = rule.ours.replace("{i}/", "") if cfg.scan_layers else \
                rule.ours.format(i=i)
            if cfg.scan_layers and i < cfg.num_dense_layers:
                path = "dense_" + path  # blocks/... -> dense_blocks/...
            out.append((path, rule, i))
    return out
