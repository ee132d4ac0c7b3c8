"""The packed-documents section of BENCHMARKS.md from :func:`benchmarks.text.run_text`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.section import status, table
from benchmarks.text import MiB, TextBench, copies, fmt_signed


def _stall(pl: dict[str, Any]) -> str:
    """How long the slowest first-fit batch keeps a step waiting (no prefetching)."""
    slow = max((r["batch_ms"]["max"] for r in pl["rows"] if r["packing"] == "first_fit"),
               default=None)
    if slow is None:
        return ""
    step_ms = pl["step"]["median_s"] * 1e3
    return (f"; the slowest first-fit batch took {slow:.0f} ms, {slow / step_ms:.1f} steps' "
            f"time: a trainer that reads each batch just before its step waits that long "
            f"once every 64 steps")


def _lengths(stats: dict[str, Any]) -> str:
    p = stats["percentiles"]
    return f"{p['10']:,.0f} / {p['50']:,.0f} / {p['90']:,.0f}"


def render_markdown(res: dict[str, Any], command: str = "JAX_PLATFORMS=cpu python -m "
                    "benchmarks.text") -> str:
    """The ``## Packed documents`` section of ``BENCHMARKS.md`` for the results of
    :func:`run_text`."""
    bench = TextBench.from_dict(res["bench"])
    pl, corpus, eff, att = res["pipeline"], res["corpus"], res["efficiency"], res["attention"]
    cfg, step = pl["config"], pl["step"]
    mesh = " x ".join(f"{a} {n}" for a, n in pl["mesh"].items() if n > 1)
    out = [
        "## Packed documents",
        "",
        "Text documents tokenized and packed into rows with segment ids "
        "(`sp_jax.data.PackedText`, Grain's first-fit or concatenate-then-split packing), "
        "and attention that stays inside each document (`segment_ids` through "
        "`sp_jax.attention.blockwise_attention`, which skips the block products of other "
        "documents). `benchmarks/text.py`.",
        "",
        f"Corpus: the Python standard library's `.py` files ({corpus['documents']} of "
        f"{corpus['files']}, one document each, {corpus['bytes'] / 1e6:.1f} MB of JSON "
        f"lines, {corpus['lengths']['tokens']:,} tokens), a byte-level BPE tokenizer of "
        f"{bench.vocab_size} ids trained on it (`sp_jax.data.train_tokenizer`, "
        f"{corpus['tokenizer_s']:.1f} s). **Pipeline vs step**: `train_batch` of "
        f"{bench.batch_size} rows of {bench.seq_len} in {bench.micro_batches} micro-batches "
        f"onto the demo's mesh ({mesh}, `{pl['spec']}` from "
        f"`Layout.micro_batched_tokens`), each batch on the devices before the next; "
        f"{bench.warmup_steps} warm-up batches, then {bench.rounds} rounds, each reading "
        f"{bench.steps_per_round} batches from every pipeline (order rotated) and running "
        f"{bench.step_repeats} training steps (`sp_jax.training.TrainStep` of "
        f"`examples/train_gpt.py`'s model and optimizer from `sp_jax.training.cli`: "
        f"{cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, vocabulary "
        f"{cfg['vocab']}, {cfg['parameters'] / 1e6:.2f}M parameters, {cfg['dtype']}; "
        f"compiled first, timed on one packed batch) on 8 simulated CPU devices; tokens are "
        f"row positions (padding included) for both. **Packing "
        f"efficiency**: `sp_jax.data.packing_efficiency` (non-padding / all positions) of "
        f"the rows of {bench.efficiency_steps} batches. **Attention**: s={att['s']} in one "
        f"row of {att['docs']} documents of {att['s'] // att['docs']} tokens (segment ids "
        f"1..{att['docs']}) against plain causal attention, blocks of {att['block']}, "
        f"forward+backward (`jax.value_and_grad` of `sum(out * probe)` for q, k, v).",
        "",
        f"Reproduce: `{command}` (`--quick`: tiny shapes; `--markdown PATH` writes this "
        f"section, `--json PATH` the numbers). Run of {res['meta']['date']}, jax "
        f"{res['meta']['jax']}, {res['meta']['cpu_count']} cores, "
        f"{res['meta']['runtime_s']:.0f} s.",
        "",
        "### Targets",
        "",
        table(["target", "measured", "status"],
               [[t["target"], t["measured"], status(t["met"])] for t in res["targets"]]),
        "",
        "### Input pipeline vs training step (tokens/s, CPU)",
        "",
    ]
    rows = [[r["packing"].replace("_", "-"), r["read_workers"], f"{r['tokens_per_s']:,.0f}",
             f"{r['batch_ms']['median']:.1f} / {r['batch_ms']['max']:.0f}",
             f"{step['tokens_per_s']:,.0f}", f"**{r['ratio']:.1f}x**",
             f"{r['round_ratios'][0]:.1f} - {r['round_ratios'][1]:.1f} "
             f"(min {r['round_ratios'][2]:.1f})", f"{r['warmup_s']:.2f}"] for r in pl["rows"]]
    out += [table(["packing", "read workers", "pipeline tokens/s",
                    "ms per batch, median / max", "training step tokens/s",
                    "pipeline / step", "per round: quartiles (min)",
                    f"start + {bench.warmup_steps} batches s"], rows), "",
            f"Tokens/s: all timed tokens over all timed seconds ({bench.pipeline_steps} "
            f"batches per pipeline, {bench.rounds * bench.step_repeats} steps). First-fit "
            f"hands out rows from packs of 64 rows per stream: most batches copy rows "
            f"already packed, and one in 64 tokenizes and packs the next 64 rows of each "
            f"stream (the max column), so only the total says what the pipeline sustains"
            f"{_stall(pl)}. "
            f"The step: {step['median_s'] * 1e3:.0f} ms median per "
            f"{pl['tokens_per_batch']:,} tokens (quartiles {step['quartiles_s'][0] * 1e3:.0f} "
            f"- {step['quartiles_s'][1] * 1e3:.0f} ms), compiled in "
            f"{step['compile_s']:.1f} s, first loss {step['first_loss']:.3f}. Read workers "
            f"are threads advancing the row streams concurrently (`read_workers`; the "
            f"tokenizer releases the GIL).", "",
            "### Packing efficiency", ""]
    rows = []
    for key, label, lengths in (
            ("stdlib", f"standard library, BPE {bench.vocab_size}", corpus["lengths"]),
            ("lognormal", f"log-normal lengths (median {bench.lognormal_median} bytes, "
                          f"sigma {bench.lognormal_sigma:g}), bytes", res["synthetic"]["lengths"])):
        e = eff[key]
        rows.append([label, lengths["documents"], _lengths(lengths),
                     f"{100 * lengths['longer_than_row']:.0f}%", e["first_fit"]["rows"],
                     f"{e['first_fit']['efficiency']:.4f}",
                     f"{e['first_fit']['segments_per_row']:.2f}",
                     f"{e['concat']['efficiency']:.4f}",
                     f"{e['concat']['segments_per_row']:.2f}"])
    out += [table(["corpus", "documents", "tokens per document p10 / p50 / p90",
                    f"longer than a row ({bench.seq_len})", "rows", "first-fit efficiency",
                    "first-fit segments per row", "concat efficiency",
                    "concat segments per row"], rows), "",
            "First-fit cuts a document longer than a row into row-sized pieces first (each "
            "a segment of its own), then places pieces and short documents into the first "
            "of 64 open rows with room; padding is what no remaining element fits. "
            "Concatenate-then-split has no padding by construction.", "",
            "### Document-masked attention", ""]
    n, cpu, gpu = att["block_products"], att["cpu"], att["gpu"]
    products = n["masked"] / n["unmasked"]
    rows = []
    for name, label in (("unmasked", "plain causal"),
                        ("masked", f"{att['docs']} documents (segment ids)")):
        row = [label, f"{n[name]} ({n[name + '_formula']})",
               f"{cpu['median_s'][name] * 1e3:,.0f}"]
        if "error" not in gpu:
            g = gpu[name]
            row += [f"{g['temp_bytes'] / MiB:,.1f}", f"{g['peak_bytes'] / MiB:,.1f}",
                    f"{g['live_peak_bytes'] / MiB:,.1f}"]
        rows.append(row)
    header = ["attention", "block products per (row, head), forward: kernel count "
              "(arithmetic)", f"CPU ms (fp32, {cpu['heads']} heads of {cpu['head_dim']})"]
    if "error" not in gpu:
        header += [f"H100 temp MiB (bf16, {gpu['heads']} heads of {gpu['head_dim']})",
                   "H100 peak MiB", "live-range peak MiB"]
    out += [table(header, rows), "",
            f"Block products: causal attention over n = {att['s'] // att['block']} blocks "
            f"computes n (n + 1) / 2; with documents aligned to blocks only the blocks of "
            f"each document's own causal triangle remain, documents x m (m + 1) / 2 with m = "
            f"{att['s'] // att['docs'] // att['block']} blocks per document (the backward "
            f"pass computes the same products again). CPU: median of {cpu['rounds']} "
            f"interleaved rounds, masked / unmasked {cpu['ratio']:.3f} (quartiles "
            f"{cpu['ratio_quartiles'][0]:.3f} - {cpu['ratio_quartiles'][1]:.3f}); the ratio "
            f"of products is {products:.3f}" + (
                ": the kept products also compare document ids, and finding the blocks to "
                "skip costs time too." if cpu["ratio"] > products else ".")]
    if "error" in gpu:
        out += ["", f"H100 compile not measured: `{gpu['error']}`."]
    else:
        out += ["", _gpu_prose(gpu, att["s"])]
    return "\n".join(out) + "\n"


def _mask_prose(m: dict[str, Any], u: dict[str, Any]) -> str:
    """Why masked temp exceeds unmasked without copies: the boolean block masks in each
    program's temp allocation (:func:`temp_masks`)."""
    if "temp_masks" not in m:
        return ""

    def count(masks: list[dict[str, Any]]) -> str:
        ops: dict[str, int] = {}
        for b in masks:
            ops[b["op"] or "?"] = ops.get(b["op"] or "?", 0) + 1
        return ", ".join(f"{n} `{op}`" for op, n in sorted(ops.items()))

    mm, um = m["temp_masks"], u["temp_masks"]
    if len(mm) <= len(um):
        return ""
    size = max(b["bytes"] for b in mm)
    top = [b for b in mm if b["offset"] + b["bytes"] > u["temp_bytes"]]
    names = ", ".join(f"`{b['name']}` {b['shape']}" for b in top)
    return (f" The temp allocations (XLA's buffer assignment) hold {len(mm)} boolean block "
            f"masks of up to {size // 1024} KiB in the masked program ({count(mm)}: `eq` "
            f"compares document ids, `ge` is the causal mask) against {len(um)} in the "
            f"unmasked one ({count(um)}): XLA materialises a block pair's document mask as "
            f"a buffer of its own beside the causal one rather than fusing it into the "
            f"scores"
            + (f", and the heap places {len(top)} of them past the unmasked program's temp "
               f"size ({names})" if top else "")
            + ". Combining the two into one mask per block pair is the thing to try (not "
            "tried here: the kernels are outside this benchmark).")


def _gpu_prose(gpu: dict[str, Any], s: int) -> str:
    """What the H100 compiles show, from their numbers and the buffers live at the peak."""
    m, u = gpu["masked"], gpu["unmasked"]
    text = (f"H100: deviceless compile for one GPU (`sp_jax.analysis.compile_for_gpu`, q, k, "
            f"v, the probe and the document ids as arguments; per-GPU `memory_analysis()`, "
            f"peak = arguments + outputs + temp; live-range peak: the largest sum of buffers "
            f"live at once in XLA's buffer assignment). Masked temp is "
            f"{m['temp_bytes'] / u['temp_bytes']:.3f}x the unmasked one "
            f"({fmt_signed(m['temp_bytes'] - u['temp_bytes'])}).")
    extra = [b for b in m["live_at_peak"] if b["name"].startswith("copy")]
    if m["temp_bytes"] > u["temp_bytes"] and not extra:
        return text + _mask_prose(m, u)
    if not (m["temp_bytes"] > u["temp_bytes"] and extra):
        return text
    sites = {c["copy"]: c for c in m.get("copy_sites", [])}
    skip = [b for b in extra if sites.get(b["name"], {}).get("pass_through")]
    text += (" At the masked program's live-range peak, buffers of XLA copies: "
             + ", ".join(f"`{b['name']}` {b['shape']} ({b['bytes'] / MiB:.0f} MiB)"
                         for b in extra)
             + f" ({copies(m['live_at_peak']) / MiB:.0f} MiB; "
             + (f"{copies(u['live_at_peak']) / MiB:.0f} MiB" if copies(u["live_at_peak"])
                else "none") + " in the unmasked program).")
    if skip:
        c = sites[skip[0]["name"]]
        big = max(skip, key=lambda b: b["bytes"])
        dq = (": the fp32 dq accumulator of the whole sequence, which the backward's inner "
              "loop over q blocks carries" if big["shape"] ==
              f"f32[1,{gpu['heads']},1,{s},{gpu['head_dim']}]" else "")
        text += (
            f" {'All' if len(skip) == len(extra) else len(skip)} of them are made in the "
            f"{c['branch']} branch of the conditional `{c['conditional'].split('/')[-1]}` "
            f"of the {'backward' if 'transpose(' in c['conditional'] else 'forward'} pass "
            f"(`{c['conditional']}`), a branch that only passes its "
            f"operand through: the `lambda a: a` of `when_shared` in "
            f"`sp_jax/attention/kernels.py`, taken when a (q block, k block) product is "
            f"skipped. XLA gives the conditional's result a buffer of its own, so skipping a "
            f"product copies the loop's carried accumulators, the largest {big['shape']} "
            f"({big['bytes'] / MiB:.0f} MiB{dq}). A conditional that returns only the "
            f"block's contribution (dq_i, dk_j, dv_j), added outside it, would carry nothing "
            f"large through the branch (not tried here: the kernels are outside this "
            f"benchmark).")
    return text
