"""The packed-documents section of BENCHMARKS.md from :func:`benchmarks.text.run_text`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.records import MiB, TextBench, copies, fmt_signed
from benchmarks.render.common import run_facts, targets_lines
from benchmarks.render.template import fields, filler, table

_fill = filler("text")


def _stall(pl: dict[str, Any]) -> str:
    """How long the slowest first-fit batch keeps a step waiting (no prefetching)."""
    slow = max(
        (r["batch_ms"]["max"] for r in pl["rows"] if r["packing"] == "first_fit"), default=None
    )
    if slow is None:
        return ""
    step_ms = pl["step"]["median_s"] * 1e3
    return _fill("stall.1", slow=format(slow, ".0f"), v=format(slow / step_ms, ".1f"))


def _lengths(stats: dict[str, Any]) -> str:
    p = stats["percentiles"]
    return f"{p['10']:,.0f} / {p['50']:,.0f} / {p['90']:,.0f}"


def render_markdown(res: dict[str, Any], command: str = _fill("section.1")) -> str:
    """The ``## Packed documents`` section of ``BENCHMARKS.md`` for the results of
    :func:`run_text`."""
    bench = TextBench.from_dict(res["bench"])
    pl, corpus, eff, att = res["pipeline"], res["corpus"], res["efficiency"], res["attention"]
    cfg, step = pl["config"], pl["step"]
    mesh = " x ".join(f"{a} {n}" for a, n in pl["mesh"].items() if n > 1)
    out = [
        "## Packed documents",
        "",
        _fill("section.2"),
        "",
        _fill(
            "section.3",
            **fields(corpus, "documents", "files"),
            v=format(corpus["bytes"] / 1e6, ".1f"),
            tokens=format(corpus["lengths"]["tokens"], ","),
            tokenizer_s=format(corpus["tokenizer_s"], ".1f"),
            mesh=mesh,
            spec=pl["spec"],
            **fields(
                vars(bench),
                *("vocab_size", "batch_size", "seq_len", "micro_batches", "warmup_steps"),
                *("rounds", "steps_per_round", "step_repeats", "efficiency_steps"),
            ),
            **fields(cfg, "layers", "hidden", "heads", "vocab", "dtype"),
            v2=format(cfg["parameters"] / 1e6, ".2f"),
            **fields(att, "s", "docs", "block"),
            v3=att["s"] // att["docs"],
        ),
        "",
        _fill("section.4", command=command, **run_facts(res["meta"])),
        "",
        *targets_lines(res["targets"]),
        _fill("section.5"),
        "",
    ]
    rows = [
        [
            r["packing"].replace("_", "-"),
            r["read_workers"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['batch_ms']['median']:.1f} / {r['batch_ms']['max']:.0f}",
            f"{step['tokens_per_s']:,.0f}",
            f"**{r['ratio']:.1f}x**",
            f"{r['round_ratios'][0]:.1f} - {r['round_ratios'][1]:.1f} "
            f"(min {r['round_ratios'][2]:.1f})",
            f"{r['warmup_s']:.2f}",
        ]
        for r in pl["rows"]
    ]
    out += [
        table(
            [
                "packing",
                "read workers",
                "pipeline tokens/s",
                "ms per batch, median / max",
                "training step tokens/s",
                "pipeline / step",
                "per round: quartiles (min)",
                f"start + {bench.warmup_steps} batches s",
            ],
            rows,
        ),
        "",
        _fill(
            "section.6",
            pipeline_steps=bench.pipeline_steps,
            v=bench.rounds * bench.step_repeats,
            stall=_stall(pl),
            v2=format(step["median_s"] * 1e3, ".0f"),
            tokens_per_batch=format(pl["tokens_per_batch"], ","),
            v3=format(step["quartiles_s"][0] * 1e3, ".0f"),
            v4=format(step["quartiles_s"][1] * 1e3, ".0f"),
            compile_s=format(step["compile_s"], ".1f"),
            first_loss=format(step["first_loss"], ".3f"),
        ),
        "",
        "### Packing efficiency",
        "",
    ]
    rows = []
    for key, label, lengths in (
        ("stdlib", f"standard library, BPE {bench.vocab_size}", corpus["lengths"]),
        (
            "lognormal",
            _fill(
                "section.7",
                lognormal_median=bench.lognormal_median,
                lognormal_sigma=format(bench.lognormal_sigma, "g"),
            ),
            res["synthetic"]["lengths"],
        ),
    ):
        e = eff[key]
        rows.append(
            [
                label,
                lengths["documents"],
                _lengths(lengths),
                f"{100 * lengths['longer_than_row']:.0f}%",
                e["first_fit"]["rows"],
                f"{e['first_fit']['efficiency']:.4f}",
                f"{e['first_fit']['segments_per_row']:.2f}",
                f"{e['concat']['efficiency']:.4f}",
                f"{e['concat']['segments_per_row']:.2f}",
            ]
        )
    out += [
        table(
            [
                "corpus",
                "documents",
                "tokens per document p10 / p50 / p90",
                f"longer than a row ({bench.seq_len})",
                "rows",
                "first-fit efficiency",
                "first-fit segments per row",
                "concat efficiency",
                "concat segments per row",
            ],
            rows,
        ),
        "",
        _fill("section.8"),
        "",
        "### Document-masked attention",
        "",
    ]
    n, cpu, gpu = att["block_products"], att["cpu"], att["gpu"]
    products = n["masked"] / n["unmasked"]
    rows = []
    for name, label in (
        ("unmasked", "plain causal"),
        ("masked", f"{att['docs']} documents (segment ids)"),
    ):
        row = [label, f"{n[name]} ({n[name + '_formula']})", f"{cpu['median_s'][name] * 1e3:,.0f}"]
        if "error" not in gpu:
            g = gpu[name]
            row += [
                f"{g['temp_bytes'] / MiB:,.1f}",
                f"{g['peak_bytes'] / MiB:,.1f}",
                f"{g['live_peak_bytes'] / MiB:,.1f}",
            ]
        rows.append(row)
    header = [
        "attention",
        _fill("section.9"),
        _fill("section.10", heads=cpu["heads"], head_dim=cpu["head_dim"]),
    ]
    if "error" not in gpu:
        header += [
            _fill("section.11", heads=gpu["heads"], head_dim=gpu["head_dim"]),
            "H100 peak MiB",
            "live-range peak MiB",
        ]
    out += [
        table(header, rows),
        "",
        _fill(
            "section.12",
            v=att["s"] // att["block"],
            v2=att["s"] // att["docs"] // att["block"],
            rounds=cpu["rounds"],
            ratio=format(cpu["ratio"], ".3f"),
            v3=format(cpu["ratio_quartiles"][0], ".3f"),
            v4=format(cpu["ratio_quartiles"][1], ".3f"),
            products=format(products, ".3f"),
            v5=": the kept products also compare document ids, and finding the blocks to "
            "skip costs time too."
            if cpu["ratio"] > products
            else ".",
        ),
    ]
    if "error" in gpu:
        out += ["", _fill("section.13", error=gpu["error"])]
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
    return _fill(
        "mask_prose.1",
        len=len(mm),
        v=size // 1024,
        count=count(mm),
        len2=len(um),
        count2=count(um),
        v2=_fill("mask_prose.heap", n=len(top), names=names) if top else "",
    )


def _gpu_prose(gpu: dict[str, Any], s: int) -> str:
    """What the H100 compiles show, from their numbers and the buffers live at the peak."""
    m, u = gpu["masked"], gpu["unmasked"]
    text = _fill(
        "gpu_prose.1",
        v=format(m["temp_bytes"] / u["temp_bytes"], ".3f"),
        fmt_signed=fmt_signed(m["temp_bytes"] - u["temp_bytes"]),
    )
    extra = [b for b in m["live_at_peak"] if b["name"].startswith("copy")]
    if m["temp_bytes"] > u["temp_bytes"] and not extra:
        return text + _mask_prose(m, u)
    if not (m["temp_bytes"] > u["temp_bytes"] and extra):
        return text
    sites = {c["copy"]: c for c in m.get("copy_sites", [])}
    skip = [b for b in extra if sites.get(b["name"], {}).get("pass_through")]
    text += _fill(
        "gpu_prose.2",
        join=", ".join(f"`{b['name']}` {b['shape']} ({b['bytes'] / MiB:.0f} MiB)" for b in extra),
        v=format(copies(m["live_at_peak"]) / MiB, ".0f"),
        v2=f"{copies(u['live_at_peak']) / MiB:.0f} MiB" if copies(u["live_at_peak"]) else "none",
    )
    if skip:
        c = sites[skip[0]["name"]]
        big = max(skip, key=lambda b: b["bytes"])
        dq = (
            _fill("gpu_prose.3")
            if big["shape"] == f"f32[1,{gpu['heads']},1,{s},{gpu['head_dim']}]"
            else ""
        )
        text += _fill(
            "gpu_prose.4",
            v="All" if len(skip) == len(extra) else len(skip),
            branch=c["branch"],
            v2=c["conditional"].split("/")[-1],
            v3="backward" if "transpose(" in c["conditional"] else "forward",
            conditional=c["conditional"],
            shape=big["shape"],
            v4=format(big["bytes"] / MiB, ".0f"),
            dq=dq,
        )
    return text
