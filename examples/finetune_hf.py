"""Continue training a Hugging Face checkpoint with tensor + sequence parallelism, on text or
token ids, and write it back as a Hugging Face checkpoint.

    python examples/finetune_hf.py --hf-dir DIR [--mesh 2,4] [--steps 50]
        [--data 'docs/*.jsonl' [--text-field text] | --data sft.jsonl --prompt-field P
         --completion-field C | --data chats.jsonl --messages-field messages |
         --data ids.npy] [--tokenizer tokenizer.json]
        [--lora-rank R [--lora-alpha A] [--lora-targets q k v ...] [--base-dtype nf4]
         [--merge-lora]] [--dpo --data pairs.jsonl [--dpo-beta 0.1]]
        [--out DIR_OUT] [--precision bf16] [--fp8 current|delayed] [--fsdp [optimizer|full]]
        [--recompute-allgather] [--remat] [--offload-activations]

``DIR`` is a local checkpoint directory (``config.json`` + ``*.safetensors``, e.g. from
``huggingface-cli download gpt2 --local-dir DIR`` or ``save_pretrained``) of a family
``sp_jax.models.hf`` reads (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text,
and the mixtures of experts Mixtral and Qwen3-MoE); neither torch nor transformers is
needed. ``--data`` takes text, JSON lines and parquet files, tokenized with the
checkpoint's own ``tokenizer.json`` (or ``--tokenizer``; its end of document must be the
checkpoint's ``eos_token_id``) and packed into rows with segment ids
(``sp_jax.data.PackedText``); with ``--prompt-field`` and ``--completion-field`` only the
completions are trained (the prompts' labels ignored, as TRL's completion-only loss).
``--data`` also takes token ids: a ``.npy`` array or a raw ``.bin`` of uint16 ids
(nanoGPT's format). The last ``--held-out-fraction`` is held out: the held-out loss and
perplexity are reported. Without ``--data`` the run uses synthetic sequences any model can
learn, to show the loop works. ``--messages-field`` reads conversations (a list of
``{"role", "content"}`` per JSON line), renders them with the checkpoint's own
``chat_template`` and trains on the assistant's tokens only. ``--lora-rank`` trains LoRA
adapters on the frozen base (``sp_jax.LoRAConfig``; the optimizer state and checkpoints
hold the adapters only) and ``--out`` then writes a PEFT adapter directory that
``peft.PeftModel.from_pretrained`` loads onto the checkpoint (``--merge-lora``: the merged
model instead). ``--dpo`` trains on preference pairs (JSON lines of ``prompt``, ``chosen``,
``rejected``) with TRL's sigmoid DPO loss, the reference the base with the adapters
switched off. Otherwise ``--out`` writes the same family (``model_type``) with the
checkpoint's special token ids and, for text, the tokenizer files: transformers'
``AutoTokenizer`` and ``AutoModelForCausalLM`` both load it. The loop is
``sp_jax.training.Trainer``: ``--ckpt-dir``, ``--resume``, ``--log-json`` and the
divergence checks work as in ``examples/train_gpt.py``. CPU-only machines simulate the
mesh's devices. """

from __future__ import annotations

import sp_jax  # noqa: F401 - first: on a machine without a GPU, JAX then starts quietly

# isort: split
import argparse
import contextlib
import functools
import json
import math
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

import sp_jax.training as training
from sp_jax.models import hf
from sp_jax.training import cli, finetune
from sp_jax.xla_flags import simulate_cpu_devices


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (a usage error, exit 2, names the bad one) before JAX starts."""
    p = argparse.ArgumentParser(description=cli.description(__doc__),
                                formatter_class=cli.HelpFormatter)
    finetune.add_data_arguments(p)
    finetune.add_adapter_arguments(p)
    add = p.add_argument_group("model and output").add_argument
    add("--no-dropout", action="store_true", help="dropout rates of 0")
    add("--out", default=None, help="write the trained model here (Hugging Face format)")
    cli.add_fp8_argument(p)
    cli.add_trainer_arguments(p, steps=50, batch_size=8, micro_batches=1, lr=1e-4,
                              warmup_steps=None, final_lr_fraction=1.0, weight_decay=0.0,
                              eval_every=10, eval_batches=2)
    cli.add_parallel_arguments(p)
    p.add_argument("--local-devices", type=int, default=None,
                   help="simulated CPU devices (default: the mesh's; needed for a --mesh "
                        "with a -1 size); no effect on GPUs but the count a -1 size is "
                        "resolved with")
    a = p.parse_args(argv)
    try:
        a.mesh_shape = training.parse_mesh(a.mesh, fill=True)  # one size may be -1
        launch = training.Launch.plan(distributed="off")  # one process
        a.mesh_shape = launch.resolve_mesh(a.mesh_shape, a.local_devices)  # the -1's size
        a.local_devices = launch.local_device_count(a.mesh_shape, a.local_devices)
        cli.check_pipeline_args(a)
        finetune.check_data_args(a)
        finetune.check_adapter_args(a)
        a.trainer = cli.check_run_args(a)
    except ValueError as e:
        p.error(str(e))
    if not pathlib.Path(a.hf_dir, "config.json").is_file():
        p.error(f"--hf-dir {a.hf_dir}: no config.json there (a Hugging Face checkpoint "
                "directory holds config.json and *.safetensors)")
    return a


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    mesh = training.build_mesh(args.mesh_shape, training.MESH_AXES)
    overrides = {"dtype": jnp.bfloat16} if args.precision == "bf16" else {}
    if args.no_dropout:
        overrides.update(dropout=0.0, attention_dropout=0.0)
    if args.fp8:
        overrides["fp8"] = cli.fp8_recipe(args)
    if cli.scan_layers(args):  # a STAGE axis: the stages hold slices of the stack
        overrides["scan_layers"] = True
    if args.remat:
        overrides["remat"] = True
    lora = finetune.lora_config(args)
    if lora is not None:
        overrides["lora"] = lora
    with jax.set_mesh(mesh), contextlib.ExitStack() as stack:
        try:  # the library's checks (sizes against the mesh, the checkpoint) name the fix
            # one writer per --ckpt-dir, and --resume's checkpoint: before the model loads
            manager = stack.enter_context(training.open_checkpoints(args.trainer))
            model = hf.from_hf(args.hf_dir, parallel=cli.parallel_config(args),
                               rngs=nnx.Rngs(args.seed), **overrides)
            cfg = model.config
            n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
            print(f"loaded {args.hf_dir}: {cfg.num_layers} layers, hidden {cfg.hidden}, "
                  f"{cfg.num_heads} heads ({cfg.num_kv_heads} key/value), vocabulary "
                  f"{cfg.vocab_size}, {n_params / 1e6:.2f}M parameters; mesh "
                  f"{training.mesh_description(mesh)}")
            if lora is not None:
                n_lora = sum(x.size for x in jax.tree.leaves(sp_jax.models.lora.adapters(
                    model)))
                print(f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on "
                      f"{' '.join(lora.targets)}: {n_lora / 1e6:.3f}M trained parameters, "
                      "the base frozen")
            args.seq_len = finetune.seq_len_for(args, cfg.max_seq_len)
            source = json.loads(pathlib.Path(args.hf_dir, "config.json").read_text())
            data, tokenizer = finetune.load_data(args, source, seq_len=args.seq_len,
                                                 vocab_size=cfg.vocab_size)
            print(f"data: {data.summary()}; --seq-len {args.seq_len}")
            model.train()  # dropout as the checkpoint's config says (off with --no-dropout)
            loss_fn = functools.partial(training.dpo_loss, beta=args.dpo_beta) \
                if args.dpo else training.lm_loss
            step = training.TrainStep(model, cli.optimizer(args), loss_fn=loss_fn,
                                      **cli.offload_options(args))
            metadata = cli.run_metadata(args, cfg)
            if lora is not None:  # the checkpoints hold the adapters: their base is this
                metadata["base"] = {"hf_dir": str(pathlib.Path(args.hf_dir).resolve())}
            result = training.Trainer(step, data, args.trainer, checkpoints=manager,
                                      metadata=metadata, lr_schedule=cli.lr_schedule).run()
        except (ValueError, OSError, training.TrainingStopped) as e:
            print(f"error: {e}", file=sys.stderr)
            return getattr(e, "status", training.faults.EXIT_ERROR)
        before = result.eval_losses.get(0)
        if result.eval_loss is not None:
            print(f"held-out loss after {args.steps} steps: {result.eval_loss:.4f}"
                  + (f" (before {before:.4f})" if before is not None else "")
                  + f"; perplexity {math.exp(min(result.eval_loss, 700)):.2f}"
                  + (f" (before {math.exp(min(before, 700)):.2f})" if before is not None
                     else ""))
        step.sync_model()
        if args.out and lora is not None and not args.merge_lora:
            hf.to_peft(model, args.out,
                       base_model_name_or_path=str(pathlib.Path(args.hf_dir).resolve()))
            print(f"wrote {args.out} (peft: PeftModel.from_pretrained(base, "
                  f"{args.out!r}))")
        elif args.out:  # the family read, e.g. a Mistral without a window stays a Mistral
            hf.to_hf(model, args.out, model_type=source["model_type"],
                     merge_lora=args.merge_lora)
            files = (finetune.save_tokenizer(tokenizer, args.out, max_seq_len=cfg.max_seq_len)
                     if tokenizer is not None else [])
            print(f"wrote {args.out} (transformers: AutoModelForCausalLM.from_pretrained"
                  + (f"; {', '.join(files)}: AutoTokenizer.from_pretrained)" if files
                     else ")"))
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    warnings.formatwarning = cli.format_warning  # "warning: <message>", one line
    args = parse()
    simulate_cpu_devices(args.local_devices)  # no GPU here: before JAX starts its backend
    sys.exit(main(args))
