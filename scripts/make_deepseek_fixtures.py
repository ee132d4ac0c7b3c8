"""Regenerates the golden Hugging Face fixtures of tests/test_hf_deepseek.py: DeepSeek-V3
(``model_type`` ``deepseek_v3``) and GLM-4.5 (``glm4_moe``) from transformers (run by hand,
in an environment of its own):

    pip install torch transformers safetensors numpy
    python scripts/make_deepseek_fixtures.py [--out tests/fixtures/hf] [--only NAME ...]

Small random-init models, each written to ``<out>/<name>/`` with transformers' own
``save_pretrained`` (``config.json``, ``generation_config.json``, ``model.safetensors``):

- ``deepseek_v3``: multi-head latent attention with ``q_lora_rank`` (12) and
  ``rope_interleave``, YaRN rope scaling (factor 4 over 16 original positions, ``mscale``
  1 and ``mscale_all_dim`` 0.5: an attention factor and a softmax scale other than 1),
  3 layers of which the first is dense (``first_k_dense_replace=1``), 8 routed experts
  in 2 groups (``n_group=2``, ``topk_group=1``), 2 per token, 1 shared expert,
  ``routed_scaling_factor`` 2.5, a random ``e_score_correction_bias``;
- ``deepseek_v3_direct``: q projected directly (``q_lora_rank=None``), no interleave, no
  rope scaling, ``norm_topk_prob=False``, 2 groups choosing 2;
- ``deepseek_v3_mtp``: ``deepseek_v3`` with one multi-token-prediction layer
  (``num_mtp_layers=1``): transformers 5.x's ``MtpModel`` (enorm, hnorm, eh_proj, a
  decoder layer with experts, post_norm; the main model's embedding and head) drawn at
  random and stored as DeepSeek's checkpoints hold it, ``model.layers.3.*`` (``eh_proj``,
  ``enorm``, ``hnorm``, ``shared_head.norm``, the decoder layer per expert, and copies of
  ``embed_tokens`` / ``shared_head.head``), with ``mtp_logits`` [4, 15, 64] (the MTP
  layer on the main model's final-normed hidden states of positions 0..14 and the
  tokens 1..15, as transformers' ``MTPCandidateGenerator`` calls it) and ``mtp_loss``
  (their mean cross-entropy against tokens 2..15);
- ``glm4_moe``: grouped-query attention (8 heads over 4, head_dim 8 apart from hidden /
  heads) with partial rotary (0.5), q/k/v biases, q/k norms (``use_qk_norm``), sigmoid
  routing in 2 groups choosing 1, 1 dense layer, 1 shared expert;
- ``glm4_moe_mtp``: ``glm4_moe`` with one multi-token-prediction layer, stored and
  compared as ``deepseek_v3_mtp``'s (GLM-4.5's checkpoints hold their MTP layer as
  DeepSeek's do: ``model.layers.3.*``).

and ``golden.npz``: ``input_ids`` int32 ``[4, 16]``, transformers' fp32 ``logits``, its
``loss`` for ``labels=input_ids`` (the plain next-token loss: these models add no
auxiliary loss), ``grad/<tensor>`` (the loss's gradients of a few non-expert tensors)
and greedy generation of three prompts (5, 9, 3 tokens) as scripts/make_hf_fixtures.py
writes them (``gen_prompt_<i>``, ``gen_tokens_<i>`` [32], ``gen_next_logits_<i>``). The
routers are drawn wide (std 0.5) and every routing decision on the inputs and the
generations is checked free of near-ties (1e-4, groups and experts), so rounding cannot
flip a choice. ``<out>/yarn.json``: transformers' ``_compute_yarn_parameters``
(``inv_freq``, attention factor) for DeepSeek-V3's, Kimi K2's and small settings.

Nothing of sp_jax is imported: the fixtures are an independent reference.

    python scripts/make_deepseek_fixtures.py --check DIR

loads an ``sp_jax.models.hf.to_hf`` output directory with transformers (strict: every
tensor present, none unexpected) and checks its logits against the ``golden.npz`` in it.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers.modeling_rope_utils import _compute_yarn_parameters

BATCH, SEQ, VOCAB = 4, 16, 64
GEN_PROMPTS, GEN_NEW = (5, 9, 3), 32
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, num_mtp_layers=0)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6)
MODELS = {
    "deepseek_v3": ("DeepseekV3", dict(
        COMMON, **MLA, q_lora_rank=12, rope_interleave=True, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16, mscale=1.0,
                             mscale_all_dim=0.5, beta_fast=32.0, beta_slow=1.0))),
    "deepseek_v3_direct": ("DeepseekV3", dict(
        COMMON, **MLA, q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "deepseek_v3_mtp": ("DeepseekV3", dict(
        COMMON, **MLA, q_lora_rank=12, rope_interleave=True, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16, mscale=1.0,
                             mscale_all_dim=0.5, beta_fast=32.0, beta_slow=1.0))),
    "glm4_moe": ("Glm4Moe", dict(
        COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=8, attention_bias=True,
        use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
    "glm4_moe_mtp": ("Glm4Moe", dict(
        COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=8, attention_bias=True,
        use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, rms_norm_eps=1e-5, num_mtp_layers=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
}
GRADS = {
    "deepseek_v3": ["model.layers.0.self_attn.q_a_proj.weight",
                    "model.layers.1.self_attn.kv_b_proj.weight",
                    "model.layers.2.mlp.shared_experts.up_proj.weight",
                    "model.layers.2.mlp.gate.weight", "model.layers.0.mlp.down_proj.weight",
                    "model.embed_tokens.weight"],
    "deepseek_v3_direct": ["model.layers.1.self_attn.q_proj.weight",
                           "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                           "model.layers.1.mlp.gate.weight", "lm_head.weight"],
    "deepseek_v3_mtp": ["model.layers.1.self_attn.q_b_proj.weight"],
    "glm4_moe_mtp": ["model.layers.1.self_attn.q_proj.weight"],
    "glm4_moe": ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_norm.weight",
                 "model.layers.2.self_attn.k_proj.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.2.mlp.shared_experts.down_proj.weight"],
}
MARGIN = 1e-4
YARN = [  # (rope parameters, qk_rope_head_dim, max_position_embeddings)
    (dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
          beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096), 64, 163840),
    (dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, mscale=1.0, mscale_all_dim=1.0,
          beta_fast=1.0, beta_slow=1.0, original_max_position_embeddings=4096), 64, 131072),
    (MODELS["deepseek_v3"][1]["rope_parameters"], 4, 64),
    (dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
          truncate=False), 8, 64),
]


class TieCheck:
    """Forward hooks on every router recording the smallest margin of its choices: the
    topk_group-th against the next group score, the k-th against the next expert score
    among the chosen groups."""

    def __init__(self, model):
        self.margin = float("inf")
        for module in model.modules():
            if type(module).__name__.endswith("TopkRouter"):
                module.register_forward_hook(self.hook)

    def hook(self, module, inputs, output):
        x = inputs[0].reshape(-1, module.hidden_dim).float()
        scores = torch.sigmoid(x @ module.weight.float().T) + module.e_score_correction_bias
        g = module.num_group
        groups = scores.view(len(x), g, -1).topk(2, dim=-1)[0].sum(-1).sort(-1, True)[0]
        if module.topk_group < g:
            self.margin = min(self.margin, float((groups[:, module.topk_group - 1]
                                                  - groups[:, module.topk_group]).min()))
        _, _, chosen = output
        masked = scores.clone()
        group_idx = scores.view(len(x), g, -1).topk(2, dim=-1)[0].sum(-1).topk(
            module.topk_group, dim=-1)[1]
        keep = torch.zeros(len(x), g, dtype=torch.bool).scatter_(1, group_idx, True)
        masked[~keep.repeat_interleave(scores.shape[1] // g, dim=1)] = -1e9
        top = masked.sort(-1, True)[0]
        self.margin = min(self.margin, float((top[:, module.top_k - 1]
                                              - top[:, module.top_k]).min()))
        del chosen


def _randomize(model, gen, prefix=""):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(prefix):
                continue
            if name.endswith("gate.weight") and p.shape[0] == COMMON["n_routed_experts"]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.ndim == 1:  # norms around 1, biases around 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2
                        + (0.0 if name.endswith("bias") else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def _mtp(model, ids, gen):
    """transformers' MTP model of ``model`` (``config.num_mtp_layers`` layers, drawn at
    random; the embedding and head are the main model's) and its depth-1 logits on
    ``ids`` [B, S]: ``[B, S - 1, V]`` (position ``i``: the main model's final-normed
    hidden state ``i`` with token ``i + 1``, at position id ``i + 1`` as transformers'
    MTPCandidateGenerator passes them; rotary attention is relative: any offset gives
    the same logits)."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, model.config.num_mtp_layers).eval()
    _randomize(mtp, gen, prefix="layers.")
    ties = TieCheck(mtp)
    h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    positions = torch.arange(1, ids.shape[1])[None].expand(len(ids), -1)
    hidden = mtp.forward_layer(0, h[:, :-1], positions, None, input_ids=ids[:, 1:])
    return mtp, ties, mtp._project_to_logits(hidden)


def _mtp_tensors(mtp, model) -> dict[str, torch.Tensor]:
    """The MTP layers as DeepSeek's checkpoints hold them: ``model.layers.<L>.*`` (``L``
    from ``num_hidden_layers``), the experts one module each, ``post_norm`` as
    ``shared_head.norm``, and copies of the embedding and head."""
    out, n = {}, model.config.num_hidden_layers
    for key, value in mtp.state_dict().items():
        if not key.startswith("layers."):
            continue
        k, rest = key.split(".", 2)[1:]
        p = f"model.layers.{n + int(k)}."
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):
            f = value.shape[1] // 2
            for e in range(len(value)):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = value[e, :f]
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = value[e, f:]
        elif rest.endswith("experts.down_proj"):
            for e in range(len(value)):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[p + rest] = value
    for k in range(model.config.num_mtp_layers):
        out[f"model.layers.{n + k}.embed_tokens.weight"] = model.model.embed_tokens.weight
        out[f"model.layers.{n + k}.shared_head.head.weight"] = model.lm_head.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def make(name: str, out: pathlib.Path) -> None:
    prefix, kw = MODELS[name]
    config = getattr(transformers, prefix + "Config")(**kw)
    config._attn_implementation = "eager"
    for seed in range(100):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
        _randomize(model, gen)
        ties = TieCheck(model)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out_ = model(input_ids=ids, labels=ids)
        arrays = {"input_ids": ids.numpy().astype(np.int32),
                  "logits": out_.logits.detach().numpy(),
                  "loss": np.float32(out_.loss.item())}
        mtp = None
        if kw.get("num_mtp_layers"):
            with torch.no_grad():
                mtp, mtp_ties, mtp_logits = _mtp(model, ids, gen)
                mtp_loss = torch.nn.functional.cross_entropy(
                    mtp_logits[:, :-1].reshape(-1, VOCAB), ids[:, 2:].reshape(-1))
            arrays.update(mtp_logits=mtp_logits.numpy(), mtp_loss=np.float32(mtp_loss.item()))
        out_.loss.backward()
        params = dict(model.named_parameters())
        for tensor in GRADS[name]:
            arrays["grad/" + tensor] = params[tensor].grad.numpy()
        with torch.no_grad():
            for i, n in enumerate(GEN_PROMPTS):
                prompt = torch.randint(0, VOCAB, (1, n), generator=gen)
                result = model.generate(prompt, do_sample=False, max_new_tokens=GEN_NEW,
                                        min_new_tokens=GEN_NEW, output_logits=True,
                                        return_dict_in_generate=True)
                tokens = result.sequences[0, n:]
                full = model(input_ids=result.sequences).logits[0]
                assert torch.equal(full[n - 1:-1].argmax(-1), tokens), name
                arrays[f"gen_prompt_{i}"] = prompt[0].numpy().astype(np.int32)
                arrays[f"gen_tokens_{i}"] = tokens.numpy().astype(np.int32)
                arrays[f"gen_next_logits_{i}"] = result.logits[0][0].numpy()
        if mtp is not None:
            ties.margin = min(ties.margin, mtp_ties.margin)
        if ties.margin > MARGIN:
            break
        print(f"{name}: seed {seed} has a routing margin {ties.margin:.2e}; drawing again")
    else:
        raise RuntimeError(f"{name}: no seed without routing near-ties")
    directory = out / name
    model.save_pretrained(directory)
    if mtp is not None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(directory / "model.safetensors")
        save_file({**tensors, **_mtp_tensors(mtp, model)}, directory / "model.safetensors",
                  metadata={"format": "pt"})
    np.savez(directory / "golden.npz", **arrays)
    size = sum(f.stat().st_size for f in directory.iterdir())
    print(f"{name}: seed {seed}, routing margin {ties.margin:.2e}, loss "
          f"{float(arrays['loss']):.6f}, {size / 1e6:.2f} MB")


def yarn(out: pathlib.Path) -> None:
    rows = []
    for rope, rope_dim, positions in YARN:
        config = transformers.DeepseekV3Config(qk_rope_head_dim=rope_dim, rope_parameters=rope,
                                               max_position_embeddings=positions)
        inv, factor = _compute_yarn_parameters(config)
        rows.append(dict(rope=rope, head_dim=rope_dim, inv_freq=inv.numpy().tolist(),
                         attention_factor=factor))
    (out / "yarn.json").write_text(json.dumps(rows, indent=1) + "\n")


def check(directory: pathlib.Path) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    unexpected = [k for k in info["unexpected_keys"]  # MTP layers: transformers' MtpModel
                  if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)]
    assert not info["missing_keys"] and not unexpected, info
    golden = np.load(directory / "golden.npz")
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.from_numpy(
            golden["input_ids"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, golden["logits"], rtol=1e-5, atol=1e-5)
    print(f"{directory}: loads strictly, logits equal the golden ones")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/hf", type=pathlib.Path)
    parser.add_argument("--only", nargs="*", default=list(MODELS))
    parser.add_argument("--check", type=pathlib.Path)
    args = parser.parse_args()
    if args.check is not None:
        check(args.check)
        return
    torch.set_grad_enabled(True)
    for name in args.only:
        make(name, args.out)
    yarn(args.out)


if __name__ == "__main__":
    main()
