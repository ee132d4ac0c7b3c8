"""LoRA adapters as Hugging Face PEFT writes and reads them: :func:`to_peft` writes
``adapter_config.json`` and ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained`` loads onto the transformers base model;
:func:`from_peft` reads such an adapter onto a sp_jax model (the base read with
:func:`~sp_jax.models.hf.from_hf`).

The names and layouts come from the family's conversion table (:mod:`.family`): an
adapted sp_jax kernel is one rule, its Hugging Face tensors the modules PEFT adapts
(``q_proj`` ... ``down_proj``). Adapter ``j`` of a fused kernel (rows ``j * r ... (j +
1) * r`` of ``lora_b``, columns ``j * r ...`` of ``lora_a``) is the module of its part:
``lora_A.weight = a_j.T [r, in]`` (the input features are the base's, in the same
order) and ``lora_B.weight`` is that module's tensor of the rule's inverse applied to
``b_j [r, out]`` (the fused columns back to the module's ``[out_m, r]``). PEFT's keys:
``base_model.model.<module>.lora_A.weight``.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sp_jax.config import LORA_TARGETS, LoRAConfig
from sp_jax.layers.lora import LoRAParam, LoRAParts
from sp_jax.models import lora as model_lora
from sp_jax.models.gpt import GPT
from sp_jax.models.hf.family import expand, stack_row
from sp_jax.models.hf.registry import family_of

__all__ = ["from_peft", "read_peft_config", "to_peft"]

_MODULES = {t: f"{t}_proj" for t in LORA_TARGETS}
"""sp_jax's target names -> the modules PEFT adapts in transformers' Llama-shaped models."""

_PREFIX = "base_model.model."


def _kernels(model: GPT) -> list[dict[str, Any]]:
    """Each adapted kernel of ``model``: its rule, layer, the sp_jax paths of its
    adapters and the parts (:class:`~sp_jax.layers.lora.LoRAParts`) its columns and the
    adapters' rows are made of."""
    cfg = model.config
    family = family_of(cfg, None)
    layers = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and isinstance(getattr(module, "lora_a", None),
                                                         LoRAParam):
            layers["/".join(map(str, path))] = module
    out = []
    for path, rule, layer in expand(family.rules(cfg), cfg):
        owner, _, name = path.rpartition("/")
        module = layers.get(owner)
        if module is None or name not in ("kernel", "q_kernel", "kv_kernel"):
            continue
        if name == "kernel":
            parts, rows, b_name = module.lora_parts, tuple(
                module.lora_parts.names[i] for i in module.lora_parts.targeted(module.lora)), \
                "lora_b"
        else:  # the grouped q/k/v projection
            parts = LoRAParts(("q",)) if name == "q_kernel" else \
                LoRAParts(("k", "v"), cfg.attention_config().head_dim)
            rows, b_name = module.lora_adapters, name[:-len("kernel")] + "lora_b"
        out.append(dict(rule=rule, layer=layer, module=module, parts=parts, rows=rows,
                        b=b_name, a_path=owner + "/lora_a", b_path=owner + "/" + b_name))
    return out


def _row(x: np.ndarray, cfg, layer: int | None) -> np.ndarray:
    return x[stack_row(cfg, layer)] if cfg.scan_layers and layer is not None else x


def _hf_module(name: str) -> str:
    return name.removesuffix(".weight")


def to_peft(model: GPT, out_dir: str | os.PathLike, *,
            base_model_name_or_path: str | None = None) -> None:
    """Writes ``model``'s LoRA adapters as a PEFT adapter directory:
    ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
    ``target_modules``) and ``adapter_model.safetensors``, which
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads onto the transformers model of
    ``model``'s base (written by :func:`~sp_jax.models.hf.to_hf` of the model without
    adapters, or the checkpoint it was read from). Every process gathers; process 0
    writes.

    Raises:
      ValueError: the model has no adapters, or its family's modules are not the Llama
        ones PEFT names (``q_proj`` ... ``down_proj``: GPT-2's fused ``c_attn`` is not).
    """
    from safetensors.numpy import save_file

    lora = model.config.lora
    if lora is None:
        raise ValueError("to_peft: the model has no LoRA adapters; build it with "
                         "GPTConfig(lora=LoRAConfig(...)) or sp_jax.models.lora.apply.")
    cfg, r = model.config, lora.rank
    tensors: dict[str, np.ndarray] = {}
    for entry in _kernels(model):
        rule, layer, parts = entry["rule"], entry["layer"], entry["parts"]
        a = _row(np.asarray(jax.device_get(entry["module"].lora_a[...]), np.float32), cfg,
                 layer)
        b = _row(np.asarray(jax.device_get(getattr(entry["module"], entry["b"])[...]),
                            np.float32), cfg, layer)
        names = rule.hf_names(layer)
        for j, target in enumerate(entry["rows"]):
            if target not in parts.names:
                continue
            position = parts.names.index(target)
            module = _hf_module(names[position])
            if not module.endswith("." + _MODULES[target]):
                raise ValueError(f"to_peft: {cfg.hf_model_type or 'this family'}'s tensor "
                                 f"{names[position]} is not PEFT's {_MODULES[target]}; "
                                 "export the merged model with to_hf(model, dir, "
                                 "merge_lora=True) instead.")
            b_j = rule.to_hf(b[j * r:(j + 1) * r])[position]  # [out_m, r]
            tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
                a[:, j * r:(j + 1) * r].T)
            tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b_j)
    if jax.process_index() != 0:
        return
    directory = pathlib.Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(
            _MODULES[t] for t in lora.targets), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_peft_config(adapter_dir: str | os.PathLike) -> LoRAConfig:
    """The :class:`~sp_jax.LoRAConfig` of a PEFT adapter directory's
    ``adapter_config.json`` (a ValueError for what sp_jax cannot express: another PEFT
    type, per-module ranks or alphas, rsLoRA / DoRA, biases, modules outside
    ``q_proj`` ... ``down_proj``)."""
    path = pathlib.Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text())
    unsupported = [k for k, bad in (("peft_type", config.get("peft_type") != "LORA"),
                                    ("rank_pattern", bool(config.get("rank_pattern"))),
                                    ("alpha_pattern", bool(config.get("alpha_pattern"))),
                                    ("use_rslora", bool(config.get("use_rslora"))),
                                    ("use_dora", bool(config.get("use_dora"))),
                                    ("bias", config.get("bias", "none") != "none"))
                   if bad]
    if unsupported:
        raise ValueError(f"from_peft: {path} sets {unsupported}, which sp_jax's LoRA does "
                         "not express (plain LoRA: one r and lora_alpha, no biases).")
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        raise ValueError(f"from_peft: {path}'s target_modules is a pattern ({modules!r}); "
                         "list the modules (q_proj, ..., down_proj).")
    by_module = {m: t for t, m in _MODULES.items()}
    unknown = sorted(set(modules) - set(by_module))
    if unknown:
        raise ValueError(f"from_peft: {path} targets {unknown}; sp_jax's LoRA adapts "
                         f"{sorted(by_module)}.")
    return LoRAConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      targets=tuple(by_module[m] for m in modules))


def from_peft(model: GPT, adapter_dir: str | os.PathLike) -> GPT:
    """``model`` (a base without adapters, e.g. from :func:`~sp_jax.models.hf.from_hf`)
    with the PEFT adapter of ``adapter_dir`` on it: :func:`sp_jax.models.lora.apply` of
    its ``adapter_config.json``, then every ``lora_A`` / ``lora_B`` tensor placed in the
    adapters (ValueErrors naming a missing or unknown tensor, or a shape that does not
    fit)."""
    from safetensors.numpy import load_file

    lora = read_peft_config(adapter_dir)
    if model.config.lora is not None:
        raise ValueError("from_peft: the model already has adapters; read the adapter "
                         "onto its base (from_hf) instead.")
    model = model_lora.apply(model, lora)
    tensors = load_file(str(pathlib.Path(adapter_dir) / "adapter_model.safetensors"))
    used, cfg, r = set(), model.config, lora.rank
    updates: dict[tuple[int, str], dict[str, Any]] = {}
    for entry in _kernels(model):
        rule, layer, parts = entry["rule"], entry["layer"], entry["parts"]
        names = rule.hf_names(layer)
        module = entry["module"]
        key = (id(module), entry["b"])
        a_full = updates.setdefault((id(module), "lora_a"), dict(
            var=module.lora_a, value=np.array(jax.device_get(module.lora_a[...]))))
        b_full = updates.setdefault(key, dict(
            var=getattr(module, entry["b"]),
            value=np.array(jax.device_get(getattr(module, entry["b"])[...]))))
        for j, target in enumerate(entry["rows"]):
            if target not in parts.names:
                continue
            position = parts.names.index(target)
            prefix = f"{_PREFIX}{_hf_module(names[position])}"
            try:
                a_t = tensors[prefix + ".lora_A.weight"]
                b_t = tensors[prefix + ".lora_B.weight"]
            except KeyError as e:
                raise ValueError(f"from_peft: {adapter_dir} has no tensor {e.args[0]}, which "
                                 "its adapter_config.json's target_modules say it has.") from None
            used |= {prefix + ".lora_A.weight", prefix + ".lora_B.weight"}
            like = rule.to_hf(np.zeros((r, _row(b_full["value"], cfg, layer).shape[-1]),
                                       np.float32))
            hf = [np.zeros_like(t) for t in like]
            if b_t.shape != hf[position].shape or a_t.shape[0] != r:
                raise ValueError(f"from_peft: {prefix}.lora_B.weight has shape {b_t.shape} "
                                 f"(lora_A {a_t.shape}); the model's {names[position]} "
                                 f"takes {hf[position].shape} at r={r}.")
            hf[position] = b_t
            b_j = np.asarray(rule.to_ours(*hf))
            target_a = a_full["value"][stack_row(cfg, layer)] if cfg.scan_layers and \
                layer is not None else a_full["value"]
            target_b = b_full["value"][stack_row(cfg, layer)] if cfg.scan_layers and \
                layer is not None else b_full["value"]
            target_a[:, j * r:(j + 1) * r] = a_t.T
            target_b[j * r:(j + 1) * r] = b_j
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(f"from_peft: {adapter_dir} holds tensors sp_jax has no adapter "
                         f"for: {unknown[:4]}{' ...' if len(unknown) > 4 else ''}.")
    for update in updates.values():
        var = update["var"]
        var[...] = jax.device_put(jnp.asarray(update["value"], var[...].dtype),
                                  var[...].sharding)
    return model
