"""Hugging Face checkpoints in and out: GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2 and
Gemma 3 (text) models, and the mixtures of experts Mixtral and Qwen3-MoE.

    with jax.set_mesh(mesh):
        model = from_hf("path/to/llama", parallel=ParallelConfig())  # safetensors + config
        ...                                                          # train it
        to_hf(model, "out/")          # transformers: AutoModelForCausalLM.from_pretrained

LoRA adapters (:class:`~sp_jax.LoRAConfig`) go out as PEFT writes them (:func:`to_peft`:
``peft.PeftModel.from_pretrained`` loads them onto the transformers base) or merged
(``to_hf(model, dir, merge_lora=True)``), and come back with :func:`from_peft`.

Reading needs neither torch nor transformers: tensors come from ``*.safetensors`` (one
file or a sharded ``model.safetensors.index.json``) through ``safetensors``' NumPy API,
and ``config.json`` (as transformers 4.x or 5.x writes it) is translated to a
:class:`~sp_jax.models.GPTConfig` by :func:`config_from_hf`, special token ids
(``bos_token_id``, ``eos_token_id``, ``pad_token_id``) included; :func:`to_hf` writes them
back to ``config.json`` and ``generation_config.json``.

The conversion is one table per family (``Family.rules``, in :mod:`.gpt2`, :mod:`.llama`;
:mod:`.mistral`, :mod:`.qwen2` and :mod:`.qwen3` reuse Llama's, :mod:`.mixtral` and
:mod:`.qwen3_moe` add their experts to it; :mod:`.gemma2` and :mod:`.gemma3` its
post-norms): each sp_jax parameter,
the Hugging Face tensors it comes from and two inverse functions between them. It
applies the layout changes sp_jax's fused projections need:

- GPT-2's ``c_attn`` ``[hidden, (q | k | v)]`` and Llama's ``q_proj``, ``k_proj``,
  ``v_proj`` become the per-head columns ``(head, {q, k, v}, head_dim)`` of one fused
  kernel (grouped-query Llama: ``q_kernel`` and ``(kv_head, {k, v}, head_dim)``), so that
  every tensor shard holds whole heads;
- Llama's ``gate_proj`` / ``up_proj`` become the interleaved ``(j, {gate, up})`` columns
  of the fused SwiGLU kernel, and so do each expert's (Mixtral's ``w1`` / ``w3``,
  Qwen3-MoE's ``gate_proj`` / ``up_proj``) in row ``e`` of ``experts_up`` ``[E, hidden,
  2F]`` (transformers 5.x's fused ``experts.gate_up_proj`` is read too);
- ``torch.nn.Linear`` weights ``[out, in]`` are transposed to ``[in, out]`` (GPT-2's
  ``Conv1D`` weights already are).

Loading first checks every tensor (present, no unknown ones, global shape and dtype)
against the model the config describes, naming the Hugging Face tensor and the sp_jax
path on any mismatch, and only then places each array straight into its sharding with
:func:`jax.make_array_from_callback`: each process reads only the slices its devices
hold for the tensors used as they are (embeddings, norms, output and down projections,
through safetensors' lazy slices); the fused ones are read whole once and permuted.

Adding a family: one module beside :mod:`.llama` holding one
:class:`~sp_jax.models.hf.family.Family`: its ``config.json`` -> :class:`GPTConfig`
fields (raising a ValueError on what sp_jax cannot reproduce) and back, which
:class:`GPTConfig` s it expresses, its conversion table built with the
:mod:`.family` rule constructors (``same``, ``transposed``, ``interleave``), and any
tensor-name canonicalisation; then one line in :data:`.registry.REGISTRY`, and a golden
fixture from ``scripts/make_hf_fixtures.py``. Reading, checking, placing and writing
(:mod:`.io`) are the same for every family.
"""

from sp_jax.models.hf.io import from_hf, to_hf, to_hf_state_dict
from sp_jax.models.hf.peft import from_peft, to_peft
from sp_jax.models.hf.registry import FAMILIES, config_from_hf, config_to_hf

__all__ = ["FAMILIES", "config_from_hf", "config_to_hf", "from_hf", "from_peft", "to_hf",
           "to_hf_state_dict", "to_peft"]
