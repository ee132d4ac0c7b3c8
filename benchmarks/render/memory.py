"""The activation-memory section of BENCHMARKS.md (``res['memory']``)."""

from __future__ import annotations

from typing import Any

from benchmarks.records import LABELS, TERMS, VARIANTS
from benchmarks.render.common import PLOT_S, PLOT_T, fmt_mib
from benchmarks.render.template import fields, filler, table

_fill = filler("benchmarks")


def _sweep_table(
    sweep: dict[str, Any],
    axis: str,
    variants: tuple[str, ...],
    formulas: tuple[str, ...],
    header: list[str],
) -> str:
    """One row per value of ``sweep[axis]``: the ``variants``' measured MiB, then the
    ``formulas``' MiB, under ``axis`` and ``header``."""
    rows = [
        [x]
        + [fmt_mib(sweep["measured"][v][i]) for v in variants]
        + [fmt_mib(sweep["formula"][k][i]) for k in formulas]
        for i, x in enumerate(sweep[axis])
    ]
    return table([axis, *header], rows)


def memory_section(res) -> str:
    mem = res["memory"]
    sh = mem["shape"]
    real = mem["realistic"]
    rec = real["sp_recompute"]
    unit = rec["unit_bytes"]
    rows = []
    for v in VARIANTS:
        m = real[v]
        f_main = m["formula"]["none" if v == "unsharded" else "tp_sp"]
        f_sel = (
            m["formula"]["none"] - (5 * sh["a"] * sh["s"] / sh["h"]) * m["unit_bytes"]
            if v == "unsharded"
            else m["formula"]["tp_sp_selective"]
        )
        rows.append(
            [
                LABELS[v],
                fmt_mib(m["activation_bytes"]),
                f"{m['activation_bytes'] / m['unit_bytes']:.2f}",
                f"{fmt_mib(f_main)} ({m['activation_bytes'] / f_main:.2f}x)",
                fmt_mib(f_sel),
                fmt_mib(m["weight_residual_bytes"]),
            ]
        )
    main_table = table(
        [
            "variant",
            "activations MiB",
            "units",
            "formula 34+5as/h MiB (measured/formula)",
            "formula selective (34) MiB",
            "weights kept (not counted) MiB",
        ],
        rows,
    )
    rows = []
    paper_total = 0.0
    for key, name, paper in TERMS:
        p = 5 * sh["a"] * sh["s"] / sh["h"] if paper is None else paper
        paper_total += p
        vals = [
            f"{real[v]['terms'][key] / real[v]['unit_bytes']:.2f}"
            for v in ("sp_recompute", "sp_save", "gspmd", "unsharded")
        ]
        rows.append([name, f"{p:g}", *vals, _fill(f"why.{key}")])
    rows.append(
        [
            "**total**",
            f"{paper_total:g}",
            *[
                f"**{real[v]['activation_bytes'] / real[v]['unit_bytes']:.2f}**"
                for v in ("sp_recompute", "sp_save", "gspmd", "unsharded")
            ],
            "",
        ]
    )
    terms_table = table(
        ["term", "paper", "sp_jax recompute", "sp_jax save", "GSPMD", "unsharded", "what we keep"],
        rows,
    )
    sxs = 5 * sh["a"] * sh["s"] / sh["h"]
    paper = {key: (sxs if p is None else p) for key, _, p in TERMS}
    names = {key: name for key, name, _ in TERMS}
    t = {k: rec["terms"][k] / unit for k in rec["terms"]}
    diffs = [
        f"{names[k]} {t[k] - paper[k]:+.2f}"
        for k in t
        if abs(t[k] - paper[k]) >= 0.005 and k != "attention_sxs"
    ]
    measured = rec["activation_bytes"] / unit
    g = {k: real["gspmd"]["terms"][k] / real["gspmd"]["unit_bytes"] for k in t}
    differ = [f"{names[k]} ({g[k]:.2f} vs {t[k]:.2f})" for k in t if abs(g[k] - t[k]) >= 0.005]
    vt, vs = mem["vs_t"], mem["vs_s"]
    vs_t = _sweep_table(
        vt,
        "t",
        ("sp_recompute", "sp_save", "gspmd"),
        ("tp_sp", "tp_sp_selective", "tp"),
        [
            "sp_jax recompute",
            "sp_jax save",
            "GSPMD",
            "formula TP+SP",
            "formula TP+SP selective",
            "formula TP (no SP)",
        ],
    )
    vs_s = _sweep_table(
        vs,
        "s",
        ("sp_recompute", "sp_save", "gspmd", "unsharded"),
        ("tp_sp", "tp_sp_selective", "none"),
        [
            "sp_jax recompute",
            "sp_jax save",
            "GSPMD",
            "unsharded",
            "formula TP+SP",
            "formula TP+SP selective",
            "formula none (t=1)",
        ],
    )
    residuals = []
    for v in ("sp_recompute", "gspmd"):
        rows = [
            [
                str(tuple(r["device_shape"])),
                r["dtype"],
                f"{r['bytes'] / unit:.3f}",
                r["kind"],
                r["term"],
                r["source"].split(" from ")[-1].split("/")[-1],
            ]
            for r in real[v]["residuals"]
        ]
        residuals.append(
            _fill(
                "residuals",
                label=LABELS[v],
                table=table(["per-device shape", "dtype", "units", "kind", "term", "source"], rows),
            )
        )
    return _fill(
        "memory",
        **fields(sh, "h", "a", "s", "b", "t"),
        unit_mib=fmt_mib(unit),
        table=main_table,
        sxs=f"{sxs:.0f}",
        terms=terms_table,
        measured=f"{measured:.2f}",
        paper_total=f"{34 + sxs:g}",
        kept_sxs=f"{t['attention_sxs']:.2f}",
        sxs_g=f"{sxs:g}",
        vs_selective=f"{measured - 34:+.2f}",
        diffs="; ".join(diffs),
        gspmd_residuals=(
            _fill("gspmd_same") if not differ else _fill("gspmd_except", differ="; ".join(differ))
        ),
        gspmd_like_recompute=(
            _fill("gspmd_like_recompute")
            if abs(g["column_inputs"] - t["column_inputs"]) < 0.005
            else ""
        ),
        vs_t=vs_t,
        plot_t=PLOT_T,
        vs_s=vs_s,
        plot_s=PLOT_S,
        residuals="\n".join(residuals),
    )
