"""Regenerates the golden Hugging Face fixtures of tests/test_hf.py (run by hand).

    pip install torch transformers safetensors numpy   # in an environment of its own
    python scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--only NAME ...]

For each of thirteen small random-init models (GPT-2, a grouped-query Llama with Llama-3.1
rope scaling, a Mistral with a sliding window of 4 tokens, a tied Qwen2, a tied Qwen3
with its q/k norms, an untied Qwen3 whose head_dim (8) is not hidden / heads (4:
``qwen3_head_dim``), a Mistral-Nemo-shaped Mistral (hidden 40, 4 heads of 16:
``mistral_head_dim``), a Llama with an explicit head_dim (6, not 32 / 4:
``llama_head_dim``), a Qwen2 with a window on some layers only (``max_window_layers``:
``qwen2_layer_windows``), the mixtures of experts Mixtral and a tied Qwen3-MoE: 4 experts
of width 16, 2 per token, in every layer, and Gemma 2 (4 layers, sliding / full
alternating, soft caps 5 and 3 that change the logits, checked) and Gemma 3 text (6
layers, 5 sliding : 1 full, local rotary base 1e4, global 1e6 with linear scaling 8):
both with head_dim 8 apart from hidden / heads (16 / 4), query_pre_attn_scalar 24, a
window of 4 tokens, their zero-initialised norm weights drawn around 0 so that ``1 +
weight`` is tested) it writes ``<out>/<name>/`` (``--only``: those
named) with transformers' own ``save_pretrained`` (``config.json``,
``generation_config.json`` and ``model.safetensors``) and ``golden.npz``:

- ``input_ids`` int32 ``[2, 16]``, transformers' fp32 ``logits`` ``[2, 16, vocab]``, its
  ``loss`` for ``labels=input_ids`` and ``grad/<tensor>``: the gradients of that loss for
  a few named tensors (named as ``save_pretrained`` writes them: one tensor per expert);
- mixtures of experts (``[4, 16]`` inputs, for meshes that split the batch four ways),
  whose routers are drawn wider (std 0.5: no token's k-th and next expert are within
  1e-4 in probability, so routing cannot flip on rounding): ``loss`` is the plain
  next-token loss (``output_router_logits=False``), ``aux_loss`` transformers'
  load-balancing loss (``output_router_logits=True``), ``loss_with_aux`` its loss then
  (``loss + router_aux_loss_coef * aux_loss``) and the gradients are those of
  ``loss_with_aux``;
- greedy generation (every model; a mixture of experts' prompts drawn after its ``[4,
  16]`` inputs, and its routing on the prompt and new tokens checked free of near-ties
  as above), for three prompts of 5, 9 and 3 tokens (``i`` = 0,
  1, 2), each run alone: ``gen_prompt_<i>`` int32 ``[len]``, ``gen_tokens_<i>`` int32
  ``[32]`` (the new tokens of ``generate(do_sample=False, max_new_tokens=32,
  min_new_tokens=32)`` with no end-of-sequence token, so all 32 are produced; checked
  against an argmax loop of full forward passes) and ``gen_next_logits_<i>`` fp32
  ``[vocab]`` (the logits of the first new token).

Nothing of sp_jax is imported: the fixtures are an independent reference.

    python scripts/make_hf_fixtures.py --add-greedy NAME [NAME ...] [--out ...]

adds the greedy generation keys to existing fixtures (loaded with transformers from
``<out>/<NAME>/``) without touching their weights or any array already in their
``golden.npz`` (written back bit-identical; the mixtures of experts' fixtures predate
their generation keys).

    python scripts/make_hf_fixtures.py --check DIR

loads an ``sp_jax.models.hf.to_hf`` output directory with transformers (strict: every
tensor present, none unexpected) and checks its logits against a ``golden.npz`` in it,
and its special token ids against ``config.json``'s and ``generation_config.json``'s.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers

SEQ, BATCH = 16, 2
GEN_PROMPTS, GEN_NEW = (5, 9, 3), 32  # prompt lengths; new tokens per prompt
GRADS = {  # the tensors whose gradients are recorded
    "gpt2": ["transformer.h.0.attn.c_attn.weight", "transformer.wte.weight",
             "transformer.h.1.mlp.c_fc.bias"],
    "llama": ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight",
              "model.embed_tokens.weight", "lm_head.weight"],
    "mistral": ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                "model.embed_tokens.weight", "lm_head.weight"],
    "qwen2": ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias",
              "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"],
    "qwen3": ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"],
    "qwen3_head_dim": ["model.layers.0.self_attn.q_norm.weight",
                       "model.layers.1.self_attn.k_norm.weight",
                       "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"],
    "mistral_head_dim": ["model.layers.0.self_attn.q_proj.weight",
                         "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"],
    "llama_head_dim": ["model.layers.0.self_attn.k_proj.weight",
                       "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"],
    "qwen2_layer_windows": ["model.layers.0.self_attn.q_proj.bias",
                            "model.layers.1.self_attn.k_proj.weight",
                            "model.layers.2.self_attn.v_proj.weight", "model.embed_tokens.weight"],
    "mixtral": ["model.layers.0.block_sparse_moe.gate.weight",
                "model.layers.1.block_sparse_moe.experts.2.w1.weight",
                "model.layers.0.block_sparse_moe.experts.1.w2.weight",
                "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight",
                "lm_head.weight"],
    "gemma2": ["model.layers.0.self_attn.q_proj.weight",
               "model.layers.1.post_attention_layernorm.weight",
               "model.layers.2.pre_feedforward_layernorm.weight",
               "model.layers.3.post_feedforward_layernorm.weight", "model.norm.weight",
               "model.embed_tokens.weight"],
    "gemma3": ["model.layers.0.self_attn.q_norm.weight",
               "model.layers.5.self_attn.k_norm.weight",
               "model.layers.5.self_attn.k_proj.weight",
               "model.layers.1.post_attention_layernorm.weight",
               "model.layers.4.post_feedforward_layernorm.weight",
               "model.layers.2.mlp.gate_proj.weight", "model.embed_tokens.weight"],
    "qwen3_moe": ["model.layers.1.mlp.gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
                  "model.layers.1.mlp.experts.3.up_proj.weight",
                  "model.layers.1.mlp.experts.1.down_proj.weight",
                  "model.layers.0.self_attn.q_norm.weight", "model.embed_tokens.weight"],
}
MOE = ("mixtral", "qwen3_moe")  # mixtures of experts
MOE_BATCH = 4
ROUTER_SEEDS = {"mixtral": 2, "qwen3_moe": 1}  # routers without near-ties (golden_moe checks)
# save_pretrained's per-expert tensor -> (transformers 5.x's fused parameter, which half of
# gate_up_proj: 0 gate, 1 up; None: down_proj)
PER_EXPERT = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
              "down_proj": ("down_proj", None)}
# the shapes every Llama-shaped fixture shares: 8 query heads over 2 key/value heads
LLAMA_SHAPED = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
# the Gemma fixtures: narrower (16 wide, 4 query heads of 8 over 2 key/value heads: head_dim
# apart from hidden / heads), queries scaled by 24 ** -0.5 (not head_dim ** -0.5), a
# sliding window of 4 tokens
GEMMA_SHAPED = dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=24,
                    sliding_window=4, max_position_embeddings=64, rms_norm_eps=1e-6,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2)
# weights drawn wider than transformers' init (std 0.02) in the Gemma fixtures, so that the
# attention scores and the logits reach the soft caps (checked by softcap_effect)
GEMMA_STD = {"embed_tokens": 0.5, "q_proj": 0.3, "k_proj": 0.3}
GEMMA = ("gemma2", "gemma3")
NAMES = {"gemma3_text": "gemma3"}  # GRADS' key of a model_type, where it differs


def configs() -> dict[str, tuple[transformers.PretrainedConfig, type]]:
    return {
        "gpt2": (transformers.GPT2Config(
            vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=8,
            activation_function="gelu_new", layer_norm_epsilon=1e-5,
            bos_token_id=99, eos_token_id=99), transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig(
            **LLAMA_SHAPED, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
                          "rope_theta": 10000.0}), transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig(
            **LLAMA_SHAPED, rms_norm_eps=1e-5, sliding_window=4, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2), transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config(
            **LLAMA_SHAPED, rms_norm_eps=1e-6, tie_word_embeddings=True,
            use_sliding_window=False, bos_token_id=90, eos_token_id=91, pad_token_id=92),
            transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config(
            **LLAMA_SHAPED, head_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
            use_sliding_window=False, attention_bias=False, eos_token_id=[94, 95],
            pad_token_id=93), transformers.Qwen3ForCausalLM),
        # head_dim apart from hidden / heads (8, not 32 / 8 = 4: q 64 wide, o_proj 64 -> 32),
        # as Qwen3-0.6B's 128 with 1024 / 16 heads; untied head
        "qwen3_head_dim": (transformers.Qwen3Config(
            **LLAMA_SHAPED, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
            use_sliding_window=False, attention_bias=False, eos_token_id=95,
            pad_token_id=93), transformers.Qwen3ForCausalLM),
        # head_dim apart from hidden / heads, as Mistral-Nemo (5120 / 32 heads, head_dim
        # 128): hidden 40, 4 heads of 16 (q 64 wide, o_proj 64 -> 40), with a window of 4
        "mistral_head_dim": (transformers.MistralConfig(
            **{**LLAMA_SHAPED, "hidden_size": 40, "num_attention_heads": 4}, head_dim=16,
            rms_norm_eps=1e-5, sliding_window=4, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2), transformers.MistralForCausalLM),
        # a Llama with an explicit head_dim (6, not 32 / 4 = 8: q 24 wide, narrower than
        # hidden, o_proj 24 -> 32)
        "llama_head_dim": (transformers.LlamaConfig(
            **{**LLAMA_SHAPED, "num_attention_heads": 4}, head_dim=6, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
            transformers.LlamaForCausalLM),
        # windows on some layers only (max_window_layers=1 of 3: layer 0 full, 1 and 2
        # sliding, window 4), as Qwen2's config reads them (E71)
        "qwen2_layer_windows": (transformers.Qwen2Config(
            **{**LLAMA_SHAPED, "num_hidden_layers": 3}, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
            max_window_layers=1, bos_token_id=90, eos_token_id=91, pad_token_id=92),
            transformers.Qwen2ForCausalLM),
        "mixtral": (transformers.MixtralConfig(
            **{**LLAMA_SHAPED, "intermediate_size": 16}, num_local_experts=4,
            num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
            router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2),
            transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig(
            **LLAMA_SHAPED, head_dim=4, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
            rms_norm_eps=1e-6, tie_word_embeddings=True, router_aux_loss_coef=0.01,
            eos_token_id=95, pad_token_id=93), transformers.Qwen3MoeForCausalLM),
        # Gemma 2: 4 layers alternating sliding (even) / full (odd), as transformers'
        # default layer_types; attention-logit and final-logit soft caps that bind
        "gemma2": (transformers.Gemma2Config(
            **GEMMA_SHAPED, num_hidden_layers=4, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0), transformers.Gemma2ForCausalLM),
        # Gemma 3 (text): 6 layers, 5 sliding : 1 full (the default pattern); the local
        # layers' rotary base 1e4, the full layer's 1e6 with linear scaling (factor 8, as
        # Gemma 3 4B-27B), q/k norms
        "gemma3": (transformers.Gemma3TextConfig(
            **GEMMA_SHAPED, num_hidden_layers=6, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0}}),
            transformers.Gemma3ForCausalLM),
    }


def models(only: list[str] | None = None) -> dict[str, transformers.PreTrainedModel]:
    out = {}
    for name, (cfg, cls) in configs().items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = cls(cfg).float().eval()
        with torch.no_grad():  # non-trivial norms and biases (the inits are 1 and 0)
            for pname, p in model.named_parameters():
                if pname.endswith("bias") or "norm" in pname or "ln_" in pname:
                    p.add_(0.1 * torch.randn_like(p))
            routers = torch.Generator().manual_seed(ROUTER_SEEDS.get(name, 0))
            for pname, p in model.named_parameters():  # decisive routing (see the docstring)
                if pname.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                    p.copy_(0.5 * torch.randn(p.shape, generator=routers))
            if name in GEMMA:  # attention scores and logits that reach the soft caps
                for pname, p in model.named_parameters():
                    std = next((v for k, v in GEMMA_STD.items() if f".{k}." in pname), None)
                    if std is not None:
                        p.copy_(std * torch.randn_like(p))
        out[name] = model
    return out


def saved_grad(params: dict[str, torch.nn.Parameter], name: str) -> torch.Tensor:
    """The gradient of the tensor ``save_pretrained`` writes as ``name``: the parameter's
    (transformers 4.x), or one expert's slice of transformers 5.x's fused
    ``experts.gate_up_proj`` / ``down_proj`` (Mixtral's ``block_sparse_moe`` module named
    ``mlp``)."""
    if name in params:
        return params[name].grad
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if name in params:
        return params[name].grad
    head, e, kind, _ = name.rsplit(".", 3)
    fused, half = PER_EXPERT[kind]
    grad = params[f"{head}.{fused}"].grad[int(e)]
    if half is None:
        return grad
    width = grad.shape[0] // 2
    return grad[half * width:(half + 1) * width]


def golden_moe(model, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A mixture of experts' golden values (the docstring's second item)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (MOE_BATCH, SEQ)).astype(np.int64)
    tokens = torch.from_numpy(ids)
    model.zero_grad()
    out = model(input_ids=tokens, labels=tokens, output_router_logits=True)
    out.loss.backward()
    with torch.no_grad():
        plain = model(input_ids=tokens, labels=tokens)
    k = model.config.num_experts_per_tok
    gap = min(float((p[:, k - 1] - p[:, k]).min()) for p in (
        torch.softmax(layer.detach().float(), -1).sort(-1, descending=True).values
        for layer in out.router_logits))
    if gap < 1e-4:
        raise SystemExit(f"{model.config.model_type}: a token's top-{k} routing is within "
                         f"{gap:.1e} of a tie; draw the routers differently")
    coef = model.config.router_aux_loss_coef
    if not torch.allclose(out.loss, plain.loss + coef * out.aux_loss):
        raise SystemExit(f"{model.config.model_type}: loss with output_router_logits is not "
                         "loss + router_aux_loss_coef * aux_loss")
    params = dict(model.named_parameters())
    result = {"input_ids": ids.astype(np.int32),
              "logits": plain.logits.numpy().astype(np.float32),
              "loss": np.float32(plain.loss.item()),
              "aux_loss": np.float32(out.aux_loss.item()),
              "loss_with_aux": np.float32(out.loss.item())}
    for name in GRADS[model.config.model_type]:
        result["grad/" + name] = saved_grad(params, name).numpy().astype(np.float32)
    print(f"{model.config.model_type}: smallest top-{k} routing gap {gap:.2e}")
    result.update(greedy(model, rng, vocab))
    return result


def routing_gap(model, seq: torch.Tensor) -> float:
    """The smallest gap between a token's k-th and next router probability over every
    layer of a mixture of experts on ``seq`` [1, len]."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(input_ids=seq, output_router_logits=True).router_logits
    return min(float((p[:, k - 1] - p[:, k]).min()) for p in (
        torch.softmax(layer.float(), -1).sort(-1, descending=True).values for layer in logits))


def golden(model, vocab: int, seed: int = 0, name: str | None = None) -> dict[str, np.ndarray]:
    """A dense model's golden values; ``name``: the fixture's (its GRADS entry, else its
    model_type's)."""
    if model.config.model_type in MOE:
        return golden_moe(model, vocab, seed)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int64)
    tokens = torch.from_numpy(ids)
    model.zero_grad()
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    params = dict(model.named_parameters())
    result = {"input_ids": ids.astype(np.int32),
              "logits": out.logits.detach().numpy().astype(np.float32),
              "loss": np.float32(out.loss.item())}
    mt = model.config.model_type
    for tensor in GRADS.get(name, GRADS[NAMES.get(mt, mt)]):
        result["grad/" + tensor] = params[tensor].grad.numpy().astype(np.float32)
    if mt == "gemma2":
        softcap_effect(model, tokens, out.logits.detach())
    result.update(greedy(model, rng, vocab))
    return result


def softcap_effect(model, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """Fails unless each of Gemma 2's soft caps (attention logits, final logits) changes
    the logits by more than 1e-2 (the fixture's weights reach them)."""
    config, attentions = model.config, [layer.self_attn for layer in model.model.layers]
    for which in ("attn_logit_softcapping", "final_logit_softcapping"):
        saved = getattr(config, which)
        setattr(config, which, None)
        for a in attentions:
            a.attn_logit_softcapping = config.attn_logit_softcapping
        try:
            with torch.no_grad():
                uncapped = model(input_ids=tokens).logits
        finally:
            setattr(config, which, saved)
            for a in attentions:
                a.attn_logit_softcapping = config.attn_logit_softcapping
        effect = float((uncapped - logits).abs().max())
        print(f"gemma2: without {which} the logits move by {effect:.3f}")
        if effect < 1e-2:
            raise SystemExit(f"gemma2: {which} does not change the logits; draw wider weights")


def greedy(model, rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """transformers' greedy generation of ``GEN_NEW`` tokens after each of the prompts,
    with no end-of-sequence token (every token is produced), checked against an argmax
    loop of full forward passes."""
    gen = model.generation_config
    saved = (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id)
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = None, 0, None
    out = {}
    try:
        for i, n in enumerate(GEN_PROMPTS):
            prompt = rng.integers(0, vocab, (n,)).astype(np.int64)
            ids = torch.from_numpy(prompt)[None]
            with torch.no_grad():
                # an explicit mask: otherwise generate() masks the prompt's pad_token_id
                new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=GEN_NEW, min_new_tokens=GEN_NEW)[0, n:]
                first = model(input_ids=ids).logits[0, -1]
                seq = ids
                for _ in range(GEN_NEW):  # the same tokens by plain argmax
                    nxt = model(input_ids=seq).logits[0, -1].argmax()
                    seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            if new.shape[0] != GEN_NEW or not torch.equal(new, seq[0, n:]):
                raise SystemExit(f"{model.config.model_type}: generate() differs from the "
                                 f"argmax loop: {new.tolist()} vs {seq[0, n:].tolist()}")
            if model.config.model_type in MOE:  # decisive routing of every token
                gap = routing_gap(model, seq)
                print(f"{model.config.model_type}: prompt {i}: smallest routing gap {gap:.2e}")
                if gap < 1e-4:
                    raise SystemExit(f"{model.config.model_type}: prompt {i}'s routing is "
                                     f"within {gap:.1e} of a tie; draw it differently")
            out[f"gen_prompt_{i}"] = prompt.astype(np.int32)
            out[f"gen_tokens_{i}"] = new.numpy().astype(np.int32)
            out[f"gen_next_logits_{i}"] = first.numpy().astype(np.float32)
    finally:
        gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = saved
    return out


def generate(out: pathlib.Path, only: list[str] | None = None) -> None:
    for name, model in models(only).items():
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*"):
            old.unlink()
        model.save_pretrained(directory)  # safetensors: the default in 4.x and 5.x
        np.savez(directory / "golden.npz", **golden(model, model.config.vocab_size, name=name))
        print(f"wrote {directory}")


def add_greedy(out: pathlib.Path, names: list[str]) -> None:
    """Adds the greedy generation keys to existing fixtures (``--add-greedy``): the
    prompts drawn from the same stream as a full regeneration would (after the inputs,
    which are checked equal to the stored ones); every stored array kept bit-identical."""
    for name in names:
        directory = out / name
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32).eval()
        with np.load(directory / "golden.npz") as stored:
            kept = {key: stored[key] for key in stored.files}
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        ids = rng.integers(0, vocab, kept["input_ids"].shape).astype(np.int32)
        if not np.array_equal(ids, kept["input_ids"]):
            raise SystemExit(f"{name}: the stored input_ids are not the seed-0 draw")
        new = {key: v for key, v in greedy(model, rng, vocab).items() if key not in kept}
        np.savez(directory / "golden.npz", **kept, **new)
        with np.load(directory / "golden.npz") as written:
            for key, value in kept.items():
                if written[key].dtype != value.dtype or \
                        written[key].tobytes() != value.tobytes():
                    raise SystemExit(f"{name}: {key} changed on rewriting")
        print(f"{directory}: added {sorted(new)}")


def check(directory: pathlib.Path) -> None:
    """Strict load of an sp_jax-written checkpoint; logits against its golden.npz; the
    special token ids of config.json in transformers' model and generation configs."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} or info.get(
        "error_msgs")
    if problems:
        raise SystemExit(f"strict loading failed: {problems}")
    model.eval()
    ref = np.load(directory / "golden.npz")
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ref["input_ids"].astype(np.int64))).logits
    err = float(np.max(np.abs(logits.numpy() - ref["logits"])))
    config = json.loads((directory / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        want = config.get(key)
        for where, got in (("config", getattr(model.config, key)),
                           ("generation_config", getattr(model.generation_config, key))):
            if got != want:
                raise SystemExit(f"{key}: {where} has {got!r}, config.json {want!r}")
    print(f"{directory}: {type(model).__name__} loaded strictly, special tokens kept, "
          f"max |logits - golden| = {err:.2e}")
    if err > 1e-5:
        raise SystemExit("logits differ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(pathlib.Path(__file__).parents[1] / "tests" /
                                         "fixtures" / "hf"))
    p.add_argument("--check", default=None, help="a to_hf directory to load strictly")
    p.add_argument("--only", nargs="+", default=None, choices=sorted(GRADS),
                   help="write these fixtures only (default: all)")
    p.add_argument("--add-greedy", nargs="+", default=None, choices=sorted(GRADS),
                   help="add the greedy generation keys to these existing fixtures")
    a = p.parse_args()
    if a.check:
        check(pathlib.Path(a.check))
    elif a.add_greedy:
        add_greedy(pathlib.Path(a.out), a.add_greedy)
    else:
        generate(pathlib.Path(a.out), a.only)


if __name__ == "__main__":
    main()
