"""The generation section of BENCHMARKS.md from the results of
:func:`benchmarks.generation.run_generation`."""

from __future__ import annotations

from typing import Any

from benchmarks.generation import (
    TORCH_ENV,
    GenerationBench,
    collectives_per_token,
    fmt_mesh,
    fmt_size,
)
from benchmarks.section import status, table


def _cpu_rows(cpu: dict[str, Any], bench: GenerationBench) -> list[list[Any]]:
    rows = []
    for r in cpu["rows"]:
        ours = r["sp_jax"]
        theirs = r["transformers"]
        mesh = fmt_mesh(r["mesh"]) + (" (reference)" if r.get("reference") else "")
        row = [r["batch"], mesh, f"{ours['tokens_per_s']:,.0f}",
               f"{ours['median_s'] * 1e3:,.0f} ({ours['quartiles_s'][0] * 1e3:,.0f} - "
               f"{ours['quartiles_s'][1] * 1e3:,.0f})"]
        if "error" in theirs:
            row += ["not measured", "", "not measured", "", "not compared"]
        else:
            tok = r["tokens"]
            row += [f"{theirs['tokens_per_s']:,.0f}",
                    f"{theirs['median_s'] * 1e3:,.0f} ({theirs['quartiles_s'][0] * 1e3:,.0f}"
                    f" - {theirs['quartiles_s'][1] * 1e3:,.0f})",
                    f"**{r['ratio']:.2f}x**",
                    f"{r['round_ratios'][0]:.2f} - {r['round_ratios'][1]:.2f}",
                    "yes" if tok["equal"] else
                    f"no: {tok['fraction']:.1%} equal, first difference at row "
                    f"{tok['first_difference'][0]}, token {tok['first_difference'][1]}"]
        rows.append(row)
    return rows


def _cpu_prose(cpu: dict[str, Any], bench: GenerationBench) -> str:
    """The compiles, the greedy tokens, and what the reference meshes show."""
    rows = cpu["rows"]
    first = [f"batch {r['batch']} on {fmt_mesh(r['mesh'])} {r['first_call_s'][0]:.1f} s"
             for r in rows if r["first_call_s"]]
    text = (f"sp_jax's first call (the prefill and the decode step compiled): "
            f"{', '.join(first)}. " if first else "")
    if any("error" in r["transformers"] for r in rows):
        return text + f"transformers not measured: `{rows[0]['transformers']['error']}`."
    equal = all(r["tokens"]["equal"] for r in rows)
    text += ("Greedy tokens: the last round's of each sp_jax mesh against transformers', "
             "token for token: " + ("equal in every row. " if equal else
                                    "not all equal (the table's last column). "))
    refs = [r for r in rows if r.get("reference")]
    if not refs:
        return text
    parts = []
    for ref in refs:
        main = next((r for r in rows if not r.get("reference") and r["batch"] == ref["batch"]),
                    None)
        if main is None:
            continue
        parts.append(f"batch {ref['batch']}: {ref['sp_jax']['tokens_per_s']:,.0f} tokens/s on "
                     f"{fmt_mesh(ref['mesh'])}, {ref['ratio']:.2f}x transformers, "
                     f"{ref['sp_jax']['tokens_per_s'] / main['sp_jax']['tokens_per_s']:.1f}x "
                     f"its {fmt_mesh(main['mesh'])} rate")
    layers = cpu["config"]["layers"]
    return text + (
        f"The reference rows run the same model and `generate` on fewer simulated "
        f"devices ({'; '.join(parts)}). At this size a decode step is a few small matrix "
        f"products, so the calls measure per-token overhead more than arithmetic: on the "
        f"8-device meshes each token's program spans 8 simulated devices sharing "
        f"{cpu['threads']} cores, with {2 * layers + 1} all-reduces and an all-gather "
        f"between them (each a rendezvous of the 8); transformers runs one torch process "
        f"of {cpu['threads']} threads.")


def _collective_prose(gpu: dict[str, Any]) -> str:
    """How the HLO holds the collectives that run per token (the layer loop's unrolling,
    combining)."""
    per = collectives_per_token(gpu)
    layers, exp = gpu["config"]["layers"], gpu["expected"]
    ar = per.get("all-reduce", {"in_hlo": 0, "runs": 0, "in_loop": 0, "trips": []})
    text = (f"The compiled program holds {ar['in_hlo']} all-reduce instructions for the "
            f"{exp['all-reduce']['ops']} that run per token")
    if ar["trips"]:
        trips = ar["trips"][0]
        per_trip = ar["in_loop"]
        unroll = layers // trips
        how = ("one layer per trip" if unroll == 1 else
               f"XLA unrolled the {layers}-layer scan by {unroll} when it compiled the "
               f"scan's `while` loop: {per_trip} = 2 per layer x {unroll} layers")
        text += (f": {per_trip} in the body of the layer loop, which runs {trips} times "
                 f"({how}), and {ar['in_hlo'] - per_trip} outside it (the embedding's)"
                 if trips * unroll == layers else
                 f": {per_trip} in a loop that runs {trips} times")
    combined = ar["runs"] < exp["all-reduce"]["ops"]
    text += (". " + ("XLA combined some of them: fewer run than expected, moving the same "
                     "bytes. " if combined else
                     "None was combined: each layer's two all-reduces depend on each other "
                     "through the residual stream (the MLP's input is the attention's "
                     "output after its all-reduce), so XLA's combiner has no two "
                     "independent ones to merge. "))
    n = sum(k["in_hlo"] for k in per.values())
    text += (f"Each all-reduce sums a `[{gpu['batch']}, 1, {gpu['config']['hidden']}]` "
             f"{gpu['config']['dtype']} partial product over the {gpu['tensor']} tensor "
             f"shards (the row layers' outputs, and the embedding's vocabulary blocks); the "
             f"all-gather collects the logits' vocabulary blocks. "
             f"{sum(k['async'] for k in per.values())} of the {n} instructions are "
             f"asynchronous (start/done pairs); {sum(k['overlapped'] for k in per.values())} "
             f"have other instructions scheduled between their start and done.")
    return text


def render_markdown(res: dict[str, Any], command: str = "JAX_PLATFORMS=cpu python -m "
                    "benchmarks.generation --torch-python PATH") -> str:
    """The ``## Generation`` section of ``BENCHMARKS.md`` for the results of
    :func:`run_generation`."""
    bench = GenerationBench.from_dict(res["bench"])
    cpu, gpu = res["cpu"], res["gpu"]
    c = cpu["config"]
    versions = cpu.get("transformers_versions")
    out = [
        "## Generation",
        "",
        "Text out of a model: `sp_jax.models.generate` (the prompts through the training "
        "path once, then one jitted decode step per token with a KV cache sharded like the "
        "attention; `sp_jax/models/decode.py`). `benchmarks/generation.py`.",
        "",
        f"**CPU decode**: a Llama of {c['layers']} layers, hidden {c['hidden']}, "
        f"{c['heads']} heads over {c['kv_heads']} key/value heads, MLP {c['mlp_hidden']}, "
        f"vocabulary {c['vocab']} (`GPTConfig.llama(\"{bench.cpu_preset}\")`"
        + (f" with {', '.join(f'{k}={v}' for k, v in bench.cpu_overrides)}" if
           bench.cpu_overrides else "")
        + f"; {cpu['parameters'] / 1e6:.2f}M parameters, {c['dtype']}, random weights of "
        f"seed 0), written by `sp_jax.models.hf.to_hf` and read back by `from_hf` on each "
        f"mesh; {bench.prompt_len}-token random prompts, {bench.new_tokens} new tokens "
        f"per row, greedy, no eos. sp_jax: `generate` on 8 simulated CPU devices (data x "
        f"tensor mesh)"
        + (f", and for reference on {', '.join(fmt_mesh(m) for m in bench.reference_meshes)}"
           if bench.reference_meshes else "")
        + ". transformers"
        + (f" {versions['transformers']} (torch {versions['torch']}, CPU, "
           f"{versions['threads']} threads)" if versions else "")
        + f": `LlamaForCausalLM.from_pretrained(dir).generate(do_sample=False, "
        f"max_new_tokens={bench.new_tokens}, min_new_tokens={bench.new_tokens})` in a "
        f"subprocess of a Python with torch (torch is no dependency of sp_jax), limited to "
        f"the {cpu['threads']} cores the JAX process runs on (`torch.set_num_threads`). "
        f"Tokens/s: batch x new tokens over the seconds of one whole `generate` call (the "
        f"prefill of the prompts included), median of {bench.rounds} rounds after "
        f"{bench.warmup} warm-up call(s) of each (the compiles); each round runs, per "
        f"batch, transformers once and sp_jax on each of the batch's meshes, in an order "
        f"rotated every round; the ratio is of the medians, the per-round column the "
        f"quartiles of the same ratio within each round.",
        "",
        f"Reproduce: `{command}` (or `{TORCH_ENV}=PATH`; `--quick`: tiny shapes; "
        f"`--markdown PATH` writes this section, `--json PATH` the numbers). Run of "
        f"{res['meta']['date']}, jax {res['meta']['jax']}, {res['meta']['cpu_count']} cores, "
        f"{res['meta']['runtime_s']:.0f} s.",
        "",
        "### Targets",
        "",
        table(["target", "measured", "status"],
              [[t["target"], t["measured"], status(t["met"])] for t in res["targets"]]),
        "",
        "### CPU decode: sp_jax vs transformers",
        "",
        table(["batch", "mesh (data x tensor)", "sp_jax tokens/s",
               "sp_jax ms per call (quartiles)", "transformers tokens/s",
               "transformers ms per call (quartiles)", "sp_jax / transformers",
               "per round (quartiles)", "greedy tokens equal"], _cpu_rows(cpu, bench)),
        "",
    ]
    out += [_cpu_prose(cpu, bench)]
    out += ["", "### 8 x H100: one decode step (deviceless compile)", ""]
    if "error" in gpu:
        out += [f"Not measured: `{gpu['error']}`."]
        return "\n".join(out) + "\n"
    g, a = gpu["config"], gpu["analytic"]
    out += [
        f"`GPTConfig.llama(\"{bench.gpu_preset}\", dtype=bfloat16, param_dtype=bfloat16, "
        f"scan_layers=True)`"
        + (f" with {', '.join(f'{k}={v}' for k, v in bench.gpu_overrides)}" if
           bench.gpu_overrides else "")
        + f" ({g['layers']} layers, hidden {g['hidden']}, {g['heads']} heads over "
        f"{g['kv_heads']} key/value heads, MLP {g['mlp_hidden']}, vocabulary {g['vocab']}) "
        f"on data 1 x tensor {gpu['tensor']}: `sp_jax.models.decode.decode_step` for a "
        f"batch of {gpu['batch']} with a {gpu['cache_tokens']:,}-token cache, compiled by "
        f"`sp_jax.analysis.compile_for_gpu` from abstract arguments (`nnx.eval_shape` of the "
        f"model in eval mode, its parameters in their sharding; the cache `[layers, batch, "
        f"length, {gpu['tensor']} x {a['kv_local']}, {a['head_dim']}]` sharded "
        f"`P(None, data, None, tensor, None)` and donated) in {gpu['compile_s']:.1f} s. "
        f"Per GPU, `memory_analysis()`; peak = arguments + outputs + temp - aliased "
        f"(the donated cache).",
        "",
        table(["", "per GPU"], [
            ["arguments (measured)", f"**{fmt_size(gpu['argument_bytes'])}**"],
            ["parameters (analytic)", fmt_size(a["parameter_bytes"])],
            [f"cache (analytic: 2 x {g['layers']} layers x {gpu['batch']} x "
             f"{gpu['cache_tokens']:,} x {a['kv_local']} x {a['head_dim']} x 2 bytes)",
             fmt_size(a["cache_bytes"])],
            ["parameters + cache (analytic)",
             f"**{fmt_size(a['parameter_bytes'] + a['cache_bytes'])}**"],
            ["outputs (logits + cache)", fmt_size(gpu["output_bytes"])],
            ["aliased (the cache)", fmt_size(gpu["alias_bytes"])],
            ["temp", fmt_size(gpu["temp_bytes"])],
            ["peak", fmt_size(gpu["peak_bytes"])]]),
        "",
        "Analytic parameters: each tensor's bytes / "
        f"{gpu['tensor']} for those the decode layout splits over the tensor axis (the "
        "q/k/v and MLP up-projection columns, the attention output and MLP down-projection "
        "rows, the embedding's and LM head's vocabulary rows), whole for the rest (norm "
        "scales):",
        "",
        table(["parameter", "shape", "dtype", "held", "per GPU"],
              [[f"`{p['name']}`", "x".join(str(n) for n in p["shape"]), p["dtype"],
                f"1/{gpu['tensor']}" if p["split"] else "whole", fmt_size(p["bytes"])]
               for p in a["parameters"]]),
        "",
        "### Collectives per decoded token (8 x H100)",
        "",
    ]
    per = collectives_per_token(gpu)
    exp = gpu["expected"]
    rows = []
    for kind in sorted(set(per) | set(exp)):
        m = per.get(kind, {"in_hlo": 0, "runs": 0, "bytes": 0})
        e = exp.get(kind, {"ops": 0, "bytes": 0})
        rows.append([kind, m["in_hlo"], m["runs"], e["ops"], fmt_size(m["bytes"]),
                     fmt_size(e["bytes"])])
    out += [table(["collective", "instructions in the HLO", "run per token",
                   "expected per token", "bytes per GPU per token", "expected bytes"], rows), "",
            "Run per token: each instruction times the trip count of the loops around it "
            "(`sp_jax.analysis.execution_counts`). Expected: 2 all-reduces per layer (the "
            "attention output and MLP down-projection row layers) + 1 (the "
            "vocabulary-parallel embedding), each `[batch, 1, hidden]`, and 1 all-gather of "
            "the `[batch, vocabulary]` logits (vocabulary padded to a multiple of the tensor "
            "size). " + _collective_prose(gpu)]
    return "\n".join(out) + "\n"
