"""The collectives and 8 x H100 memory sections of BENCHMARKS.md (``res['collectives_cpu']``,
``res['gpu']``)."""

from __future__ import annotations

from typing import Any

from benchmarks.records import LABELS, VARIANTS
from benchmarks.render.common import fmt_mib
from benchmarks.render.template import fields, filler, table

_fill = filler("benchmarks")
_COLL_VARIANTS = ("gspmd", "sp_save", "sp_recompute")


def coll_rows(by_phase, megatron_bwd=None):
    rows = []
    for phase in ("forward", "backward", "unknown"):
        tab = by_phase[phase]
        if phase == "unknown" and not tab:
            continue

        def cell(kind, tab=tab):
            row = tab.get(kind)
            if not row or not row["activation"]:
                return "0"
            s = f"{row['activation']} ({row['activation_units']:.2f})"
            if row["activation_async_ops"]:
                s += f", {row['activation_async_ops']}/{row['activation_ops']} async"
            return s

        params = sum(r["param"] for r in tab.values())
        param_ops = sum(r["ops"] - r["activation_ops"] for r in tab.values())
        param_async = sum(r["async_ops"] - r["activation_async_ops"] for r in tab.values())
        if params and param_async:
            params = f"{params} in {param_ops} ops, {param_async} async"
        elif params:
            params = f"{params} in {param_ops} ops"
        other = sum(
            r["activation"]
            for k, r in tab.items()
            if k not in ("all-gather", "reduce-scatter", "all-reduce")
        )
        rows.append(
            [phase, cell("all-gather"), cell("reduce-scatter"), cell("all-reduce"), other, params]
        )
    return rows


def _coll_lines(by_variant: dict[str, Any], fragment: str) -> list[str]:
    """The per-phase collectives table of the variants' programs ``by_variant``, and
    fragment ``fragment`` with what their forward-only compiles gather and scatter."""
    rows = [[LABELS[v], *r] for v in _COLL_VARIANTS for r in coll_rows(by_variant[v]["by_phase"])]
    header = [
        "variant",
        "phase",
        "all-gather",
        "reduce-scatter",
        "all-reduce (activations)",
        "other kinds",
        "param-grad arrays",
    ]
    fo = {v: by_variant[v].get("forward_only_compile", {}) for v in _COLL_VARIANTS}
    join = "; ".join(
        f"{LABELS[v]}: "
        + ", ".join(f"{k} {r['activation']}" for k, r in fo[v].items() if r["activation"])
        for v in fo
    )
    return [table(header, rows), "", _fill(fragment, join=join), ""]


def collectives_section(res) -> str:
    cpu = res["collectives_cpu"]
    sh = cpu["shape"]
    meg = res["megatron"]
    out = [
        "## Collectives per layer",
        "",
        _fill(
            "collectives.1",
            all_gather=meg["forward"]["all-gather"],
            reduce_scatter=meg["forward"]["reduce-scatter"],
            reduce_scatter2=meg["backward"]["reduce-scatter"],
            all_gather2=meg["backward"]["all-gather"],
        ),
        "",
        _fill("collectives.2", **fields(sh, "d", "t", "h", "a", "s", "b")),
        "",
        *_coll_lines(cpu, "collectives.3"),
    ]
    gpu = res.get("gpu", {})
    if "error" in gpu:
        out += ["### H100", "", _fill("h100_not_measured", error=gpu["error"]), ""]
        return "\n".join(out)
    blk = gpu["block"]
    bs = blk["shape"]
    out += [
        _fill("collectives.4", **fields(bs, "h", "a", "s", "b")),
        "",
        _fill("collectives.5"),
        "",
        *_coll_lines(blk, "collectives.6"),
    ]
    fo = {v: blk[v].get("forward_only_compile", {}) for v in _COLL_VARIANTS}
    cpu_ar = sum(
        t.get("all-reduce", {}).get("activation", 0) for t in cpu["gspmd"]["by_phase"].values()
    )
    gpu_ar = sum(
        t.get("all-reduce", {}).get("activation", 0) for t in blk["gspmd"]["by_phase"].values()
    )
    g_ops = [o for o in blk["gspmd"]["ops"] if "activation" in o["classes"]]
    g_total = {k: sum(1 for o in g_ops if o["kind"] == k) for k in ("all-gather", "reduce-scatter")}
    g_fwd = {k: fo["gspmd"].get(k, {}).get("activation", 0) for k in g_total}
    by_op: dict[str, int] = {}
    for o in g_ops:
        if o["kind"] == "all-gather" and o["phase"] == "backward":
            key = o.get("op", "") or "?"
            by_op[key] = by_op.get(key, 0) + 1
    out += [
        (
            _fill(
                "collectives.7",
                all_gather=g_fwd["all-gather"],
                reduce_scatter=g_fwd["reduce-scatter"],
                v=g_total["all-gather"] - g_fwd["all-gather"],
                v2=g_total["reduce-scatter"] - g_fwd["reduce-scatter"],
                join=", ".join(f"`{k}` x{n}" for k, n in sorted(by_op.items())),
                v3=_fill("collectives.7.cpu_all_reduce", cpu_ar=cpu_ar, gpu_ar=gpu_ar)
                if cpu_ar and not gpu_ar
                else "",
            )
        ),
        "",
    ]
    out += [_fill("collectives.8"), ""]
    for v in _COLL_VARIANTS:
        rows = [
            [
                o["phase"],
                o["kind"],
                " ".join(o["arrays"]),
                "/".join(sorted(set(o["classes"]))),
                "yes" if o["async"] else "no",
                o["overlapped_ops"],
                o["role"],
            ]
            for o in blk[v]["ops"]
        ]
        out += [
            f"<details><summary>{LABELS[v]}</summary>",
            "",
            table(
                [
                    "phase",
                    "kind",
                    "per-device arrays",
                    "class",
                    "async",
                    "ops overlapped",
                    "issued by",
                ],
                rows,
            ),
            "",
            "</details>",
            "",
        ]
    return "\n".join(out)


def peak_summary(peak) -> dict[str, Any]:
    """Live bytes at the peak, and those of forward attention-score buffers."""
    if not peak:
        return {"live": "-", "fwd_scores": "-", "fwd_scores_bytes": 0}
    fwd = sum(b for n, b in peak["entries"] if "bqhd,bkhd->bhqk" in n and "transpose(" not in n)
    return {
        "live": fmt_mib(peak["peak_bytes"]),
        "fwd_scores": fmt_mib(fwd),
        "fwd_scores_bytes": fwd,
    }


def _memory_cells(program: dict[str, Any], *kinds: str) -> list[str]:
    """MiB of a compiled program's ``<kind>_bytes`` for ``kinds``, then its live bytes at
    the peak and the forward attention scores' among them."""
    m, pk = program["memory"], peak_summary(program.get("peak_live"))
    return [*(fmt_mib(m[f"{k}_bytes"]) for k in kinds), pk["live"], pk["fwd_scores"]]


def gpu_section(res) -> str:
    gpu = res.get("gpu", {})
    if "error" in gpu:
        return _fill("gpu.1", error=gpu["error"])
    gpt, blk = gpu["gpt"], gpu["block"]
    sh = gpt["shape"]
    out = [
        _fill("gpu.2"),
        "",
        _fill("gpu.3"),
        "",
        _fill("gpu.4", **fields(gpt, "layers", "vocab"), **fields(sh, "h", "a", "s", "b")),
        "",
    ]
    rows = [
        [LABELS[v], *_memory_cells(gpt[v], "peak", "temp", "argument", "output")]
        for v in ("sp_save", "sp_recompute")
    ]
    out.append(
        table(
            [
                "variant",
                "peak MiB",
                "temp MiB",
                "arguments MiB",
                "outputs MiB",
                "live at peak MiB",
                "forward attention scores/probabilities live at peak MiB",
            ],
            rows,
        )
    )
    rec_pk = gpt["sp_recompute"].get("peak_live")
    if rec_pk:
        out += ["", _fill("gpu.5"), ""]
        out.append(
            table(
                ["live buffers", "MiB"],
                [[f"`{n}`", fmt_mib(b)] for n, b in rec_pk["entries"][:10]],
            )
        )
        fwd = peak_summary(rec_pk)
        if fwd["fwd_scores_bytes"]:
            out += ["", (_fill("gpu.6", fwd_scores=fwd["fwd_scores"]))]
    out += ["", _fill("gpu.7"), ""]
    roles: dict[str, dict[str, list]] = {}
    for v in ("sp_save", "sp_recompute"):
        for o in gpt[v]["ops"]:
            if o["phase"] != "backward":
                continue
            roles.setdefault(o["role"], {}).setdefault(v, []).append(o)

    def cell(ops):
        if not ops:
            return "-"
        n_async = sum(o["async"] for o in ops)
        overlap = sum(o["overlapped_ops"] for o in ops) / len(ops)
        return f"{n_async}/{len(ops)} async (overlap {overlap:.1f})"

    rows = [
        [role, cell(d.get("sp_save")), cell(d.get("sp_recompute"))]
        for role, d in sorted(roles.items())
    ]
    out.append(table(["role", "sp_jax save", "sp_jax recompute"], rows))
    out += ["", _fill("gpu.8", **fields(blk["shape"], "h", "s", "b")), ""]
    rows = [
        [LABELS[v], blk[v]["devices"], *_memory_cells(blk[v], "peak", "temp", "argument")]
        for v in VARIANTS
    ]
    out.append(
        table(
            [
                "variant",
                "devices",
                "peak MiB",
                "temp MiB",
                "arguments MiB",
                "live at peak MiB",
                "forward attention scores live at peak MiB",
            ],
            rows,
        )
    )
    return "\n".join(out) + "\n"
