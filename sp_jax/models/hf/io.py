"""Reading and writing Hugging Face checkpoint directories: :func:`from_hf` (safetensors
read by lazy slices, every tensor checked, each parameter placed straight into its
sharding) and :func:`to_hf` / :func:`to_hf_state_dict`."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig
from sp_jax.layers.fp8 import WEIGHTS
from sp_jax.layers.lora import LoRAParam
from sp_jax.mesh import current_mesh
from sp_jax.models import lora as model_lora
from sp_jax.models.gpt import GPT, GPTConfig
from sp_jax.models.hf.deepseek_v3 import held_mtp_depth
from sp_jax.models.hf.family import Family, Rule, expand, stack_row
from sp_jax.models.hf.registry import (
    config_to_hf,
    family_of,
    family_read_as,
    generation_config,
    translate,
)

__all__ = ["from_hf", "to_hf", "to_hf_state_dict"]

# Tensors of Hugging Face checkpoints that are buffers, not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


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
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"from_hf: {index} has no 'weight_map' object (tensor name "
                                 "-> file), as transformers writes it.")
            files = {name: directory / f for name, f in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise FileNotFoundError(f"from_hf: {path} is missing: {index} lists it "
                                            "in its weight_map; download it again.")
                with _open_safetensors(path):  # a truncated or corrupt shard, named now
                    pass
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                bins = sorted(p.name for p in directory.glob("*.bin"))
                raise FileNotFoundError(
                    f"from_hf: no *.safetensors in {directory}"
                    + (f" (it holds {', '.join(bins)}: sp_jax reads safetensors only)"
                       if bins else "")
                    + "; with transformers, AutoModelForCausalLM.from_pretrained(dir)"
                    ".save_pretrained(out) writes model.safetensors (its default in 4.x "
                    "and 5.x).")
            files = {}
            for path in paths:
                with _open_safetensors(path) as f:
                    files.update(dict.fromkeys(f.keys(), path))
        return cls(files=files)

    def names(self) -> list[str]:
        return sorted({*self._dict, *self._files})

    def _handle(self, name: str):
        path = self._files[name]
        if path not in self._open:
            self._open[path] = _open_safetensors(path)
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


def _open_safetensors(path: pathlib.Path):
    """``safetensors.safe_open(path)`` (NumPy), or a ValueError naming the file: truncated
    (an interrupted download) or not a safetensors file at all."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="np")
    except Exception as e:  # safetensors' SafetensorError (Rust) or an OSError
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"from_hf: {path} is missing.") from e
        raise ValueError(f"from_hf: {path} is not a readable safetensors file ("
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                         "truncated (an interrupted download?) or corrupt; download or save "
                         "it again.") from e


def _read_json(path: pathlib.Path) -> Any:
    """The parsed JSON file ``path``, or a FileNotFoundError / ValueError naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"from_hf: {path} is missing (a Hugging Face checkpoint "
                                "directory holds config.json and *.safetensors).") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"from_hf: {path} is not valid JSON ({e.msg} at line {e.lineno} "
                         f"column {e.colno}).") from e


def _safetensors_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
            "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
            "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I8": np.dtype(np.int8),
            "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool)}


_SAFETENSORS_DTYPES = _safetensors_dtypes()


def _read_input(path_or_state_dict, config_json) -> tuple[_Source, dict[str, Any], str]:
    """The tensors, the ``config.json`` dict and the name its errors give it (its path,
    or ``config.json`` for a dict)."""
    directory = None
    if isinstance(path_or_state_dict, Mapping):
        if config_json is None:
            raise ValueError("from_hf: a state dict needs config_json= (the config.json dict "
                             "or its path).")
    elif isinstance(path_or_state_dict, str | os.PathLike):
        directory = pathlib.Path(path_or_state_dict)
        if not directory.is_dir():
            raise FileNotFoundError(f"from_hf: {directory} is not a directory (expected a "
                                    "Hugging Face checkpoint: config.json + *.safetensors).")
        if config_json is None:
            config_json = directory / "config.json"
    else:
        raise TypeError(f"from_hf: expected a directory path or a dict of arrays, got "
                        f"{type(path_or_state_dict).__name__}.")
    where = "config.json"
    if isinstance(config_json, str | os.PathLike):
        where = str(config_json)
        config_json = _read_json(pathlib.Path(config_json))
        if not isinstance(config_json, Mapping):
            raise ValueError(f"from_hf: {where} holds a JSON {type(config_json).__name__}, "
                             "not an object.")
    if not isinstance(config_json, Mapping):
        raise TypeError(f"from_hf: config_json must be a dict or a path, got "
                        f"{type(config_json).__name__}.")
    source = _Source(tensors=path_or_state_dict) if directory is None else \
        _Source.from_directory(directory)
    return source, dict(config_json), where


def _canonical_names(source: _Source, family: Family) -> dict[str, str]:
    """Our canonical Hugging Face name -> the name in ``source`` (buffers left out)."""
    return family.canonical_names(
        {n: n for n in source.names() if not n.endswith(_IGNORED_SUFFIXES)})


def from_hf(path_or_state_dict: str | os.PathLike | Mapping[str, Any],
            config_json: str | os.PathLike | Mapping[str, Any] | None = None, *,
            parallel: ParallelConfig = ParallelConfig(), rngs: nnx.Rngs | None = None,
            **overrides: Any) -> GPT:
    """A :class:`~sp_jax.models.GPT` holding a Hugging Face checkpoint of a family of
    :data:`~sp_jax.models.hf.FAMILIES` (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral,
    Qwen3-MoE).

    Call under ``jax.set_mesh(mesh)``: every parameter is placed straight into its
    sharding on that mesh. Torch and transformers are not imported.

    Args:
      path_or_state_dict: a checkpoint directory (``config.json`` and ``*.safetensors``,
        possibly sharded with ``model.safetensors.index.json``), or a dict of NumPy
        arrays named as in transformers' ``state_dict()`` (of a mixture of experts: the
        per-expert tensors ``save_pretrained`` writes, or transformers 5.x's fused
        ``mlp.experts.gate_up_proj`` / ``down_proj`` of its ``state_dict()``).
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
        that does not fit; naming the file: a ``config.json`` that is not valid JSON or
        lacks a key the model's shape needs (and the key), a truncated or corrupt
        safetensors file.
      FileNotFoundError: naming the file: no ``config.json``, no ``*.safetensors`` (a
        directory of ``pytorch_model.bin`` only: how to convert it), a shard the index
        lists.
    """
    lora = overrides.get("lora")
    if isinstance(lora, dict):
        from sp_jax.config import LoRAConfig
        lora = LoRAConfig.from_dict(lora)
    if lora is not None and lora.base_dtype is not None:  # QLoRA: read, then quantize
        model = from_hf(path_or_state_dict, config_json, parallel=parallel, rngs=rngs,
                        **{**overrides, "lora": dataclasses.replace(lora, base_dtype=None)})
        return model_lora.quantize_base(model, lora.base_dtype)
    source, config, where = _read_input(path_or_state_dict, config_json)
    try:
        cfg = translate(config, where, overrides)
        family = family_read_as(config["model_type"])
        if "mtp_depth" not in overrides:
            cfg = held_mtp_depth(cfg, _canonical_names(source, family))
        current_mesh(parallel, where="from_hf")  # checks the axes
        mesh = jax.sharding.get_mesh()
        rngs = nnx.Rngs(0) if rngs is None else rngs

        def build():
            return GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))

        abstract = nnx.eval_shape(build)
        graphdef, params, rest = nnx.split(abstract, _WEIGHTS, ...)
        flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
        plan = _check(source, cfg, family, flat, explicit_dtype="param_dtype" in overrides)
        loaded = {path: _place(source, entries, flat[path], mesh,
                               cfg.scan_layers and entries[0][1] is not None)
                  for path, entries in plan.items()}
        # The rng streams (and FP8 layers' zero amax histories): the model built under
        # jit, its weights dead code.
        rest = nnx.jit(lambda r: nnx.state(GPT(cfg, parallel=parallel, rngs=r),
                                           nnx.Not(_WEIGHTS)))(rngs)
    finally:
        source.close()
    values = nnx.from_flat_state([
        (k, v.from_metadata(loaded["/".join(map(str, k))], v.get_metadata()))
        for k, v in nnx.to_flat_state(params)])
    return nnx.merge(graphdef, values, rest)


def _check(source: _Source, cfg: GPTConfig, family: Family, flat: dict[str, Any], *,
           explicit_dtype: bool) -> dict[str, list[tuple[Rule, int | None, tuple[str, ...]]]]:
    """Matches every parameter to its tensors and checks them all; returns sp_jax path ->
    [(rule, layer, source names)] (one entry per layer of a scanned parameter)."""
    names = _canonical_names(source, family)
    plan: dict[str, list] = {}
    used: set[str] = set()
    errors: list[str] = []
    for path, rule, layer in expand(family.reading_rules(cfg, names), cfg):
        if path not in flat:
            raise AssertionError(f"from_hf: conversion table names {path}, not in the model")
        want = flat[path]
        shape = want.shape[1:] if cfg.scan_layers and layer is not None else want.shape
        hf = rule.hf_names(layer)
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
    for entries in plan.values():  # a scanned parameter's rows in layer order
        entries.sort(key=lambda entry: -1 if entry[1] is None else entry[1])
    unknown = sorted(set(names) - used - set(family.skipped(cfg, names) if family.skipped
                                             else ()))
    if cfg.tie_embeddings and "lm_head.weight" in unknown:  # a tied copy
        unknown.remove("lm_head.weight")
    if unknown:
        errors.append(f"unknown tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''} "
                      f"(not part of a {family.model_type} model with this config)")
    if errors:
        raise ValueError("from_hf: the checkpoint does not match the model its config "
                         "describes:\n  " + "\n  ".join(errors))
    return plan


def _place(source: _Source, entries, abstract, mesh, scanned: bool) -> jax.Array:
    """The global array of one parameter, each device's block read and converted
    (``scanned``: row ``l`` of the parameter is its stack's ``l``-th layer,
    ``entries[l]``)."""
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


_WEIGHTS = nnx.All(WEIGHTS, nnx.Not(LoRAParam))
"""What a Hugging Face checkpoint holds: the trained parameters less LoRA adapters (a
model read with ``lora=`` gets fresh adapters; :func:`sp_jax.models.hf.to_peft` writes
them)."""


def _host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _convert_to_hf(cfg: GPTConfig, flat: Mapping[str, Any],
                   model_type: str | None = None) -> dict[str, np.ndarray]:
    """sp_jax path -> array (parameters, or anything shaped like them: gradients) to the
    Hugging Face names and layouts."""
    out = {}
    for path, rule, layer in expand(family_of(cfg, model_type).rules(cfg), cfg):
        x = np.asarray(flat[path])
        if cfg.scan_layers and layer is not None:
            x = x[stack_row(cfg, layer)]
        for name, t in zip(rule.hf_names(layer), rule.to_hf(x), strict=True):
            out[name] = np.ascontiguousarray(t)
    return out


def to_hf_state_dict(model: GPT, *, model_type: str | None = None
                     ) -> dict[str, np.ndarray]:
    """The model's parameters as transformers names them (host NumPy arrays, gathered
    from every process), ready for ``safetensors.numpy.save_file``; ``model_type`` as in
    :func:`to_hf`."""
    if not isinstance(model, GPT):
        raise TypeError(f"to_hf: expected a sp_jax.models.GPT, got {type(model).__name__}.")
    family_of(model.config, model_type)  # validates first
    flat = {"/".join(map(str, k)): _host(v[...])
            for k, v in nnx.to_flat_state(nnx.state(model, _WEIGHTS))}
    return _convert_to_hf(model.config, flat, model_type)


def to_hf(model: GPT, path: str | os.PathLike, *, max_shard_bytes: int = 5 << 30,
          model_type: str | None = None, merge_lora: bool = False) -> None:
    """Writes ``model`` as a Hugging Face checkpoint directory: ``config.json``
    (:func:`config_to_hf`, with the config's ``bos_token_id`` / ``eos_token_id`` /
    ``pad_token_id``), ``generation_config.json`` (those ids, as transformers'
    ``GenerationConfig.save_pretrained`` writes them) and ``model.safetensors`` (or
    shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``), which
    transformers' ``from_pretrained`` loads with every tensor accounted for. Every
    process gathers the parameters; process 0 writes.

    ``model_type``: the family to write (one of :data:`FAMILIES`, e.g. ``"mistral"``
    for a Llama-shaped model without biases or window). By default the family the
    config remembers (``GPTConfig.hf_model_type``: the one :func:`from_hf` read, or the
    preset's), so a checkpoint goes back as the class it was read as (a Mistral without
    a window stays ``MistralForCausalLM``); when it remembers none, or that one no longer
    expresses the config, the first family that does. Raises a ValueError
    before writing anything when no family (or not ``model_type``'s) expresses the
    model's config.

    A model with LoRA adapters is written with ``merge_lora=True``: the adapters folded
    into the base kernels (:func:`sp_jax.models.lora.merge`), a plain checkpoint; else a
    ValueError (:func:`sp_jax.models.hf.to_peft` writes the adapters alone)."""
    from safetensors.numpy import save_file

    if model.config.lora is not None:
        if not merge_lora:
            raise ValueError("to_hf: the model has LoRA adapters; pass merge_lora=True to "
                             "write the merged model, or write the adapters with "
                             "sp_jax.models.hf.to_peft(model, out_dir).")
        model = model_lora.merge(model)
    config = config_to_hf(model.config, model_type)  # validates first
    tensors = to_hf_state_dict(model, model_type=model_type)
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
    (directory / "generation_config.json").write_text(
        json.dumps(generation_config(model.config), indent=2, sort_keys=True) + "\n")

