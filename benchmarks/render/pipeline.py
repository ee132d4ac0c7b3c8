"""The pipeline section of BENCHMARKS.md from :func:`benchmarks.pipeline.run_pipeline`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.records import (
    SCHEDULES,
    MiB,
    PipelineBench,
    analytic_bytes,
    expected_ticks,
    find_record,
    measured_ticks,
)
from benchmarks.render.common import targets_lines
from benchmarks.render.template import filler, table

_fill = filler("pipeline")


def _loops(rec: dict[str, Any]) -> str:
    """'while.N: trip x copies + peeled' per direction of the activation permutes."""
    parts = []
    acts = rec["traffic"]["activations"]
    phases = len({e["phase"] for e in acts}) > 1
    for e in acts:
        ring = "next" if e["direction"] == 1 else "previous"
        loops = " + ".join(f"{trip} x {copies}" for _, trip, copies in e["loops"])
        peeled = f" + {e['outside_loops']}" if e["outside_loops"] else ""
        loop = f" ({e['phase']} loop)" if phases else ""
        parts.append(f"to {ring}{loop}: {loops or '0'}{peeled}")
    return "; ".join(parts)


def _packed_lines(packed: list[dict[str, Any]], bench: PipelineBench) -> list[str]:
    """The packed-rows subsection: 1F1B's temp on packed rows beside plain rows."""
    if not packed:
        return []
    rows = [[r["microbatches"], f"{r['plain_temp_bytes'] / MiB:,.1f}",
             f"{r['temp_bytes'] / MiB:,.1f}",
             f"{(r['temp_bytes'] - r['plain_temp_bytes']) / MiB:+,.1f}",
             f"{r['plain_peak_bytes'] / MiB:,.1f}", f"{r['peak_bytes'] / MiB:,.1f}"]
            for r in packed]
    diffs = {r["temp_bytes"] - r["plain_temp_bytes"] for r in packed}
    return [_fill("section.15"), "",
            table(["M", "1F1B temp MiB, plain rows", "1F1B temp MiB, packed rows",
                   "difference MiB", "peak MiB, plain", "peak MiB, packed"], rows), "",
            _fill("section.16", ids=format(bench.b * bench.s * 4 / 1024, ",.0f"),
                  why="" if diffs == {0} else _fill("section.16.why")), ""]


def render_markdown(res: dict[str, Any], command: str = _fill("section.1")) -> str:
    """The ``## Pipeline parallelism`` section of ``BENCHMARKS.md`` for the results of
    :func:`run_pipeline`."""
    bench = PipelineBench(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in res["bench"].items()}
    )
    recs = res["records"]
    hi = max(bench.microbatches)
    out = [
        "## Pipeline parallelism",
        "",
        _fill("section.2"),
        "",
        _fill(
            "section.3",
            stages=bench.stages,
            tensor=bench.tensor,
            layers=bench.layers,
            h=bench.h,
            a=bench.a,
            vocab=format(bench.vocab, ","),
            s=bench.s,
            b=bench.b,
            v=bench.devices // bench.stages,
        ),
        "",
        _fill("section.4", command=command, date=res["meta"]["date"], jax=res["meta"]["jax"]),
        "",
        *targets_lines(res["targets"]),
        _fill("section.5"),
        "",
    ]
    rows = []
    for m in bench.microbatches:
        g, f = find_record(recs, "gpipe", m), find_record(recs, "1f1b", m)
        st = g["stacked_residuals"]
        rows.append(
            [
                m,
                f"{g['temp_bytes'] / MiB:,.0f}",
                f"{g['peak_bytes'] / MiB:,.0f}",
                f"{st['total'] / MiB:,.0f} ({st['weights'] / MiB:,.0f})",
                f"{f['temp_bytes'] / MiB:,.0f}",
                f"{f['peak_bytes'] / MiB:,.0f}",
                f["schedule"]["max_live_inputs"],
                f"{f['temp_bytes'] / g['temp_bytes']:.3f}",
            ]
        )
    out.append(
        table(
            [
                "M",
                "GPipe temp MiB",
                "GPipe peak MiB",
                "GPipe forward loop: "
                "residuals stacked over the ticks MiB (of which fp32 weight-shaped)",
                "1F1B temp MiB",
                "1F1B peak MiB",
                "1F1B stage inputs kept",
                "1F1B / GPipe temp",
            ],
            rows,
        )
    )
    f_lo, f_hi = find_record(recs, "1f1b", 8), find_record(recs, "1f1b", hi)
    g_lo, g_hi = find_record(recs, "gpipe", 8), find_record(recs, "gpipe", hi)
    first = find_record(recs, "gpipe", min(bench.microbatches))
    per_micro = (
        (g_hi["temp_bytes"] - first["temp_bytes"]) / max(1, hi - first["microbatches"]) / MiB
    )
    ticks_lo = g_lo["schedule"]["num_ticks"]
    st = g_lo["stacked_residuals"]
    weights_tick = st["weights"] / ticks_lo / MiB
    rest_tick = (st["total"] - st["weights"]) / ticks_lo / MiB
    lean = g_hi["temp_bytes"] - g_hi["stacked_residuals"]["weights"]
    args = f_lo["argument_bytes"] / MiB
    layers = bench.layers // bench.stages
    scan = res.get("layer_scan_residuals")
    if scan:  # the unpipelined scanned GPT of one stage's blocks keeps the same weights
        kernels = sum(v for k, v in scan["by_parameter"].items() if "kernel" in k)
        same = abs(scan["bytes"] - st["weights"] / ticks_lo) <= 0.01 * scan["bytes"]
        unpipelined = _fill(
            "section.6",
            layers=scan["layers"],
            tensor=bench.tensor,
            v=format(scan["bytes"] / MiB, ",.1f"),
            v2=format(kernels / MiB, ",.1f"),
            v3=", the rest biases" if kernels < scan["bytes"] else "",
            v4=", as much as GPipe's forward loop stacks per tick" if same else "",
        )
    else:
        unpipelined = ""
    out += [
        "",
        (
            _fill(
                "section.7",
                per_micro=format(per_micro, ",.0f"),
                v=format(g_lo["temp_bytes"] / MiB, ",.0f"),
                v2=format(g_hi["temp_bytes"] / MiB, ",.0f"),
                hi=hi,
                rest_tick=format(rest_tick, ",.0f"),
                layers=layers,
                weights_tick=format(weights_tick, ",.0f"),
                unpipelined=unpipelined,
                v3=format(lean / MiB, ",.0f"),
                v4=format(f_hi["temp_bytes"] / lean, ".2f"),
                max_live_inputs=f_lo["schedule"]["max_live_inputs"],
                v5=format(f_lo["temp_bytes"] / MiB, ",.0f"),
                v6=format(f_hi["temp_bytes"] / MiB, ",.0f"),
                v7=format(f_hi["temp_bytes"] / f_lo["temp_bytes"], ".3f"),
                args=format(args, ",.0f"),
            )
        ),
    ]
    warned = [(r, w) for r in recs for w in r.get("xla_warnings", [])]
    if warned:
        out += [
            "",
            _fill(
                "section.8",
                join="; ".join(
                    f"{r['kind']} M={r['microbatches']} R={r['repeats']}: `{w.split('] ', 1)[-1]}`"
                    for r, w in warned
                ),
                v=" XLA:GPU's rematerialization pass runs when its estimate of a program's "
                "memory exceeds what it targets on the device; it recomputed some buffers "
                "of these programs instead of keeping them, so their temp above is after "
                "that pass (its estimate is not the final buffer assignment's figure)."
                if any("rematerialization" in w for _, w in warned)
                else "",
            ),
        ]
    out.append("")
    out += _packed_lines(res.get("packed") or [], bench)

    out += [_fill("section.9", tick_microbatches=bench.tick_microbatches), ""]
    rows = []
    for kind in SCHEDULES:
        for r in bench.repeats:
            rec = find_record(recs, kind, bench.tick_microbatches, r)
            sch, ticks = rec["schedule"], measured_ticks(rec["traffic"])
            want = expected_ticks(rec)
            iters = (
                f"{ticks['forward_ring']} + {ticks['backward_ring']}"
                if kind == "gpipe"
                else f"{ticks['iterations']}"
            )
            rows.append(
                [
                    {"gpipe": "GPipe", "1f1b": "1F1B"}[kind]
                    + (" (circular)" if kind == "gpipe" and r > 1 else ""),
                    r,
                    _loops(rec),
                    f"{ticks['forward_ring']} / {ticks['backward_ring']}",
                    f"{want['forward_ring']} / {want['backward_ring']}",
                    iters,
                    sch["num_ticks"],
                    "PASS" if ticks == want else "**MISS**",
                    f"{sch['bubble_tables']:.3f}",
                    f"{sch['bubble_time']:.3f}",
                    f"{sch['bubble_formula']:.3f}",
                ]
            )
    out.append(
        table(
            [
                "schedule",
                "R",
                "activation permutes in the compiled loops "
                "(trip count x copies per iteration + copies outside)",
                "sends to next / previous stage (measured)",
                "ticks with a forward / a backward (tables)",
                "tick iterations (measured)",
                "`num_ticks`",
                "match",
                "bubble (tables)",
                "bubble (time)",
                "(P-1)/(RM+P-1)",
            ],
            rows,
        )
    )
    out += ["", (_fill("section.10")), ""]

    out += [_fill("section.11"), ""]
    rows = []
    for rec in [
        find_record(recs, k, bench.tick_microbatches, r) for k in SCHEDULES for r in bench.repeats
    ]:
        tr = rec["traffic"]
        asyncs = all(e["async"] for e in tr["activations"])
        rows.append(
            [
                {"gpipe": "GPipe", "1f1b": "1F1B"}[rec["kind"]],
                rec["repeats"],
                rec["microbatches"],
                ", ".join(sorted({e["shape"] for e in tr["activations"]})),
                f"{rec['activation_bytes'] / MiB:,.0f}",
                f"{analytic_bytes(rec, res['shard_bytes']) / MiB:,.0f}",
                "yes" if asyncs else "**no**",
                f"{tr['shared_gradients'] / MiB:,.1f}",
                f"{tr['scalars']:,}",
                f"{tr['other_bytes'] / MiB:,.0f}" if tr["other"] else "0",
            ]
        )
    out.append(
        table(
            [
                "schedule",
                "R",
                "M",
                "permute shape",
                "activations MiB",
                "analytic MiB",
                "all async",
                "shared-parameter gradient all-reduce MiB",
                "scalar all-reduce bytes",
                "other stage-crossing MiB",
            ],
            rows,
        )
    )
    rec1 = find_record(recs, "1f1b", bench.tick_microbatches, 1)
    other = [o for r in recs for o in r["traffic"]["other"]]
    clean = " and ".join(
        str(r) for r in sorted({r["repeats"] for r in recs if not r["traffic"]["other"]})
    )
    scope = (
        _fill("section.12.clean", clean=clean) if not other else _fill("section.12", clean=clean)
    )
    out += [
        "",
        (
            _fill(
                "section.13",
                v=format(bench.shard_bytes / MiB, "g"),
                v2=format(2 * rec1["schedule"]["num_ticks"] * bench.shard_bytes / MiB, ",.0f"),
                tick_microbatches=bench.tick_microbatches,
                scope=scope,
                v3=format(rec1["traffic"]["shared_gradients"] / MiB, ",.1f"),
                v4=format(rec1["traffic"]["shared_gradients"] / rec1["activation_bytes"], ".2f"),
                stages=bench.stages,
            )
        ),
    ]
    if other:
        kinds = sorted({o["kind"] for o in other})
        funcs = sorted({o["function"] for o in other})
        where = [
            f"{r['kind']} M={r['microbatches']} R={r['repeats']} "
            f"({r['traffic']['other_bytes'] / MiB:,.0f} MiB)"
            for r in recs
            if r["traffic"]["other"]
        ]
        out += [
            "",
            (
                _fill(
                    "section.14",
                    join=", ".join(kinds),
                    join2=", ".join(f"`{f}`" for f in funcs),
                    join3=", ".join(where),
                )
            ),
        ]
    return "\n".join(out) + "\n"
