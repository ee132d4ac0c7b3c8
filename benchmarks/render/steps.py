"""The step-time and multi-layer stack sections of BENCHMARKS.md (``res['step_time']``,
``res['stacks']``, ``res['gpt_step_time']``)."""

from __future__ import annotations

from benchmarks.records import LABELS, STACK_LABELS, STACK_VARIANTS, VARIANTS, MiB
from benchmarks.render.template import fields, filler, table

_fill = filler("benchmarks")


def time_section(res) -> str:
    st = res["step_time"]
    sh = st["shape"]
    out = [
        "## CPU step time",
        "",
        _fill(
            "time.1",
            **fields(sh, "d", "t", "h", "a", "s", "b", "dtype"),
            **fields(st, "rounds", "warmup", "inner"),
            cpu_count=res["meta"]["cpu_count"],
        ),
        "",
    ]

    def quart(r, v):
        q = r.get("ratio_quartiles", {}).get(v)
        return f"{q[0]:.2f} - {q[1]:.2f}" if q else "-"

    rows = [
        [
            LABELS[v],
            f"{st['median_s'][v] * 1e3:.1f}",
            f"{st['ratio_to_reference'][v]:.2f}",
            quart(st, v),
            f"{st['compile_s'][v]:.1f}",
        ]
        for v in VARIANTS
    ]
    out.append(
        table(
            [
                "variant",
                "median step ms",
                "ratio to GSPMD (median)",
                "ratio 25th - 75th percentile",
                "compile + first step s",
            ],
            rows,
        )
    )
    fp32 = res.get("step_time_fp32")
    if fp32:
        rows = [
            [
                LABELS[v],
                f"{fp32['median_s'][v] * 1e3:.1f}",
                f"{fp32['ratio_to_reference'][v]:.2f}",
                quart(fp32, v),
            ]
            for v in VARIANTS
        ]
        ref = st["reference"]
        slow = st["median_s"][ref] / fp32["median_s"][ref]
        out += [
            "",
            _fill("time.2", slow=format(slow, ".1f")),
            "",
            table(
                [
                    "variant",
                    "median step ms (fp32)",
                    "ratio to GSPMD (fp32)",
                    "ratio 25th - 75th percentile",
                ],
                rows,
            ),
        ]
    return "\n".join(out) + "\n"


def stacks_section(res) -> str:
    st = res.get("stacks", {})
    if "error" in st or not st:
        return _fill("stacks.1", get=st.get("error"))
    sh = st["shape"]
    out = [
        _fill("stacks.2"),
        "",
        _fill("stacks.3", **fields(sh, "h", "a", "b", "d", "t")),
        "",
    ]
    variants = [v for v in STACK_VARIANTS if v in st["stacks"][0]]
    rows = []
    for row in st["stacks"]:
        rows.append(
            [row["stack"]["name"]]
            + [
                f"{row[v]['peak_bytes'] / MiB:.1f} / {row[v]['temp_bytes'] / MiB:.1f}"
                for v in variants
            ]
        )
    out.append(table(["stack (peak / temp MiB)"] + [STACK_LABELS[v] for v in variants], rows))
    out += ["", _fill("stacks.4"), ""]
    long8 = st["stacks"][1]
    ring = long8.get("sp_recompute_cm", {}).get("rings")
    if ring:
        rows = [
            [
                scope,
                f"{r['transfers']} / {r['expected_transfers']}",
                r["permutes"],
                r["async"],
                r["async_with_gemm"],
            ]
            for scope, r in ring["scopes"].items()
        ]
        out += [
            _fill("stacks.5", name=long8["stack"]["name"]),
            "",
            table(
                [
                    "ring (HLO scope)",
                    "arrays moved / expected",
                    "permutes",
                    "async",
                    "async with a GEMM inside",
                ],
                rows,
            ),
            "",
            _fill("stacks.6", v=ring["all_gathers_and_reduce_scatters"] or "none"),
            "",
        ]
    cm = next((t for t in res.get("targets", []) if t["id"] == "cm_memory"), None)
    if cm is not None and cm["met"] is False:
        out += [_fill("stacks.7", measured=cm["measured"]), ""]
    return "\n".join(out) + "\n"


def gpt_time_section(res) -> str:
    runs = res.get("gpt_step_time", [])
    if not runs:
        return ""
    mesh = runs[0]["mesh"]
    out = [
        _fill("gpt_time.1"),
        "",
        _fill("gpt_time.2", **fields(mesh, "data", "tensor"), **fields(runs[0], "rounds", "inner")),
        "",
    ]
    rows = []
    for r in runs:
        m = r["model"]
        q = r["ratio_quartiles"]["sp_jax"]
        rows.append(
            [
                _fill("gpt_time.3", **fields(m, "name", "layers", "hidden", "seq", "batch")),
                m["dtype"],
                f"{r['median_s']['gspmd'] * 1e3:.1f}",
                f"{r['median_s']['sp_jax'] * 1e3:.1f}",
                f"{r['ratio_to_reference']['sp_jax']:.2f}",
                f"{q[0]:.2f} - {q[1]:.2f}",
                f"{r['ratio_to_reference']['sp_jax_cm']:.2f}",
            ]
        )
    out.append(
        table(
            [
                "model",
                "compute",
                "GSPMD ms",
                "sp_jax ms",
                "sp_jax / GSPMD",
                "25th - 75th percentile",
                "with collective matmul / GSPMD",
            ],
            rows,
        )
    )
    rows = [
        [f"{r['model']['name']} {r['model']['dtype']}"]
        + [
            f"{r['hlo'][v]['copy']} / {r['hlo'][v]['collective_arrays']}"
            for v in ("gspmd", "sp_jax", "sp_jax_cm")
        ]
        for r in runs
        if "hlo" in r
    ]
    out += [
        "",
        _fill("gpt_time.4"),
        "",
        table(["model", "GSPMD", "sp_jax", "sp_jax + collective matmul"], rows),
        "",
        _fill("gpt_time.5"),
        "",
    ]
    return "\n".join(out)
