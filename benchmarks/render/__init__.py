"""BENCHMARKS.md from the results of ``python -m benchmarks`` (:func:`benchmarks.run.run`):
the run's own sections and those of the stand-alone sections (:mod:`benchmarks.render.pipeline`,
...), in one document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.memory import TERMS
from benchmarks.render.fsdp import render_markdown as render_fsdp
from benchmarks.render.generation import render_markdown as render_generation
from benchmarks.render.moe import render_markdown as render_moe
from benchmarks.render.pipeline import render_markdown as render_pipeline
from benchmarks.render.template import fill, table
from benchmarks.render.text import render_markdown as render_text
from benchmarks.targets import MiB
from benchmarks.variants import LABELS, VARIANTS

JSON_NAME = "bench.json"
PLOT_T = "bench_memory_vs_t.png"
PLOT_S = "bench_memory_vs_s.png"
PLOT_CONTEXT = "bench_context_memory.png"

LABELS_CP = {"tp_sp": "TP+SP alone", "ring": "ring", "ulysses": "Ulysses"}
GPU_CHECK_NAME = "gpu_check.md"


def _fill(fragment: str, **values: Any) -> str:
    return fill("benchmarks", fragment, **values)


def _fmt_mib(x: float, digits: int = 1) -> str:
    return f"{x / MiB:.{digits}f}"


def _status(met) -> str:
    return {True: "met", False: "**not met**", None: "not measured"}[met]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    return table(header, rows)


def _targets_section(res) -> str:
    rows = [[i + 1, t["target"], t["measured"], _status(t["met"])]
            for i, t in enumerate(res["targets"])]
    return _fill("targets", met=sum(t["met"] is True for t in res["targets"]),
                 total=len(res["targets"]),
                 table=_table(["#", "target", "measured", "status"], rows))


def _memory_section(res) -> str:
    mem = res["memory"]
    sh = mem["shape"]
    real = mem["realistic"]
    rec = real["sp_recompute"]
    unit = rec["unit_bytes"]
    rows = []
    for v in VARIANTS:
        m = real[v]
        f_main = m["formula"]["none" if v == "unsharded" else "tp_sp"]
        f_sel = m["formula"]["none"] - (5 * sh["a"] * sh["s"] / sh["h"]) * m["unit_bytes"] \
            if v == "unsharded" else m["formula"]["tp_sp_selective"]
        rows.append([
            LABELS[v], _fmt_mib(m["activation_bytes"]),
            f"{m['activation_bytes'] / m['unit_bytes']:.2f}",
            f"{_fmt_mib(f_main)} ({m['activation_bytes'] / f_main:.2f}x)",
            _fmt_mib(f_sel), _fmt_mib(m["weight_residual_bytes"]),
        ])
    main_table = _table(["variant", "activations MiB", "units", "formula 34+5as/h MiB "
                         "(measured/formula)", "formula selective (34) MiB",
                         "weights kept (not counted) MiB"], rows)
    rows = []
    paper_total = 0.0
    for key, name, paper in TERMS:
        p = 5 * sh["a"] * sh["s"] / sh["h"] if paper is None else paper
        paper_total += p
        vals = [f"{real[v]['terms'][key] / real[v]['unit_bytes']:.2f}"
                for v in ("sp_recompute", "sp_save", "gspmd", "unsharded")]
        rows.append([name, f"{p:g}", *vals, _fill(f"why.{key}")])
    rows.append(["**total**", f"{paper_total:g}",
                 *[f"**{real[v]['activation_bytes'] / real[v]['unit_bytes']:.2f}**"
                   for v in ("sp_recompute", "sp_save", "gspmd", "unsharded")], ""])
    terms_table = _table(["term", "paper", "sp_jax recompute", "sp_jax save", "GSPMD",
                          "unsharded", "what we keep"], rows)
    sxs = 5 * sh["a"] * sh["s"] / sh["h"]
    paper = {key: (sxs if p is None else p) for key, _, p in TERMS}
    names = {key: name for key, name, _ in TERMS}
    t = {k: rec["terms"][k] / unit for k in rec["terms"]}
    diffs = [f"{names[k]} {t[k] - paper[k]:+.2f}" for k in t
             if abs(t[k] - paper[k]) >= 0.005 and k != "attention_sxs"]
    measured = rec["activation_bytes"] / unit
    g = {k: real["gspmd"]["terms"][k] / real["gspmd"]["unit_bytes"] for k in t}
    differ = [f"{names[k]} ({g[k]:.2f} vs {t[k]:.2f})" for k in t if abs(g[k] - t[k]) >= 0.005]
    vt, vs = mem["vs_t"], mem["vs_s"]
    rows = []
    for i, tv in enumerate(vt["t"]):
        rows.append([tv] + [_fmt_mib(vt["measured"][v][i]) for v in ("sp_recompute", "sp_save",
                                                                      "gspmd")]
                    + [_fmt_mib(vt["formula"][k][i]) for k in ("tp_sp", "tp_sp_selective",
                                                               "tp")])
    vs_t = _table(["t", "sp_jax recompute", "sp_jax save", "GSPMD", "formula TP+SP",
                   "formula TP+SP selective", "formula TP (no SP)"], rows)
    rows = []
    for i, sv in enumerate(vs["s"]):
        rows.append([sv] + [_fmt_mib(vs["measured"][v][i]) for v in ("sp_recompute", "sp_save",
                                                                      "gspmd", "unsharded")]
                    + [_fmt_mib(vs["formula"][k][i]) for k in ("tp_sp", "tp_sp_selective",
                                                               "none")])
    vs_s = _table(["s", "sp_jax recompute", "sp_jax save", "GSPMD", "unsharded",
                   "formula TP+SP", "formula TP+SP selective", "formula none (t=1)"], rows)
    residuals = []
    for v in ("sp_recompute", "gspmd"):
        rows = [[str(tuple(r["device_shape"])), r["dtype"], f"{r['bytes'] / unit:.3f}",
                 r["kind"], r["term"], r["source"].split(" from ")[-1].split("/")[-1]]
                for r in real[v]["residuals"]]
        residuals.append(_fill("residuals", label=LABELS[v], table=_table(
            ["per-device shape", "dtype", "units", "kind", "term", "source"], rows)))
    return _fill(
        "memory", h=sh["h"], a=sh["a"], s=sh["s"], b=sh["b"], t=sh["t"],
        unit_mib=_fmt_mib(unit), table=main_table, sxs=f"{sxs:.0f}", terms=terms_table,
        measured=f"{measured:.2f}", paper_total=f"{34 + sxs:g}",
        kept_sxs=f"{t['attention_sxs']:.2f}", sxs_g=f"{sxs:g}",
        vs_selective=f"{measured - 34:+.2f}", diffs="; ".join(diffs),
        gspmd_residuals=(_fill("gspmd_same") if not differ else
                         _fill("gspmd_except", differ="; ".join(differ))),
        gspmd_like_recompute=(_fill("gspmd_like_recompute")
                              if abs(g["column_inputs"] - t["column_inputs"]) < 0.005 else ""),
        vs_t=vs_t, plot_t=PLOT_T, vs_s=vs_s, plot_s=PLOT_S, residuals="\n".join(residuals))


def _coll_rows(by_phase, megatron_bwd=None):
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
        other = sum(r["activation"] for k, r in tab.items()
                    if k not in ("all-gather", "reduce-scatter", "all-reduce"))
        rows.append([phase, cell("all-gather"), cell("reduce-scatter"), cell("all-reduce"),
                     other, params])
    return rows


def _collectives_section(res) -> str:
    cpu = res["collectives_cpu"]
    sh = cpu["shape"]
    meg = res["megatron"]
    out = [
        "## Collectives per layer",
        "",
        "Counted in the optimized HLO of one block's forward+backward (gradients of a scalar "
        "loss w.r.t. parameters and input). Each cell: moved activation arrays (their "
        "per-device elements in units of s\\*b\\*h, b per data shard; an all-gather's result "
        "is 1.0, a reduce-scatter's 1/t); arrays, not instructions, so combiners do not "
        "change the count. Parameter-gradient all-reduces (replicated parameters: norms, "
        "row biases; every parameter over the data axis) are counted separately. The phase "
        "comes from JAX's `op_name` metadata (`transpose(jvp(...))` = backward); *unknown* "
        "= an instruction XLA created without it. "
        f"Megatron per layer: forward {meg['forward']['all-gather']} AG + "
        f"{meg['forward']['reduce-scatter']} RS; backward {meg['backward']['reduce-scatter']}"
        f" RS + {meg['backward']['all-gather']} AG (+2 re-gathers with recompute), no "
        "all-reduce of activations.",
        "",
        f"### XLA:CPU, 8 simulated devices (data={sh['d']} x tensor={sh['t']}; h={sh['h']}, "
        f"a={sh['a']}, s={sh['s']}, b={sh['b']}; s has a factor 5 so no activation can be "
        "mistaken for a parameter by its shape)",
        "",
    ]
    rows = []
    for v in ("gspmd", "sp_save", "sp_recompute"):
        for r in _coll_rows(cpu[v]["by_phase"]):
            rows.append([LABELS[v], *r])
    out.append(_table(["variant", "phase", "all-gather", "reduce-scatter",
                       "all-reduce (activations)", "other kinds", "param-grad arrays"], rows))
    fo = {v: cpu[v]["forward_only_compile"] for v in ("gspmd", "sp_save", "sp_recompute")}
    out += ["", "Forward pass compiled alone (a check of the phase attribution): " + "; ".join(
        f"{LABELS[v]}: " + ", ".join(f"{k} {r['activation']}" for k, r in fo[v].items()
                                    if r["activation"]) for v in fo) + ".", ""]
    gpu = res.get("gpu", {})
    if "error" in gpu:
        out += ["### H100", "", f"Not measured: `{gpu['error']}`", ""]
        return "\n".join(out)
    blk = gpu["block"]
    bs = blk["shape"]
    out += [f"### XLA:GPU, 8 x H100 (deviceless compile; tensor=8, h={bs['h']}, a={bs['a']}, "
            f"s={bs['s']}, b={bs['b']})", "",
            "`k/n async`: instructions XLA scheduled asynchronously (`is_sync` false on the "
            "start), i.e. free to overlap computation.", ""]
    rows = []
    for v in ("gspmd", "sp_save", "sp_recompute"):
        for r in _coll_rows(blk[v]["by_phase"]):
            rows.append([LABELS[v], *r])
    out.append(_table(["variant", "phase", "all-gather", "reduce-scatter",
                       "all-reduce (activations)", "other kinds", "param-grad arrays"], rows))
    fo = {v: blk[v].get("forward_only_compile", {}) for v in ("gspmd", "sp_save",
                                                               "sp_recompute")}
    out += ["", "Forward pass compiled alone (assigns the ops XLA made without metadata): " +
            "; ".join(f"{LABELS[v]}: " + ", ".join(
                f"{k} {r['activation']}" for k, r in fo[v].items() if r["activation"])
                for v in fo) + ".", ""]
    cpu_ar = sum(t.get("all-reduce", {}).get("activation", 0)
                 for t in cpu["gspmd"]["by_phase"].values())
    gpu_ar = sum(t.get("all-reduce", {}).get("activation", 0)
                 for t in blk["gspmd"]["by_phase"].values())
    g_ops = [o for o in blk["gspmd"]["ops"] if "activation" in o["classes"]]
    g_total = {k: sum(1 for o in g_ops if o["kind"] == k) for k in ("all-gather",
                                                                     "reduce-scatter")}
    g_fwd = {k: fo["gspmd"].get(k, {}).get("activation", 0) for k in g_total}
    by_op: dict[str, int] = {}
    for o in g_ops:
        if o["kind"] == "all-gather" and o["phase"] == "backward":
            key = o.get("op", "") or "?"
            by_op[key] = by_op.get(key, 0) + 1
    out += [(
        f"GSPMD baseline on H100: forward {g_fwd['all-gather']} all-gathers + "
        f"{g_fwd['reduce-scatter']} reduce-scatters, backward "
        f"{g_total['all-gather'] - g_fwd['all-gather']} all-gathers + "
        f"{g_total['reduce-scatter'] - g_fwd['reduce-scatter']} reduce-scatters of "
        "activations (total minus the forward-only compile; Megatron: 2 + 2 forward, 2 + 2 "
        "backward, +2 re-gathers with recompute). Its backward all-gathers by the JAX "
        "operation XLA partitioned: " + ", ".join(f"`{k}` x{n}" for k, n in
                                                 sorted(by_op.items())) +
        "." + (" On XLA:CPU the same program all-reduces activations "
               f"({cpu_ar} in the CPU table) where XLA:GPU, with {gpu_ar}, emits "
               "reduce-scatters (its reduce-scatter creator rewrites all-reduce + slice)."
               if cpu_ar and not gpu_ar else "")), ""]
    out += ["Every collective of the H100 block compiles, in program order:", ""]
    for v in ("gspmd", "sp_save", "sp_recompute"):
        rows = [[o["phase"], o["kind"], " ".join(o["arrays"]), "/".join(sorted(set(o["classes"]))),
                 "yes" if o["async"] else "no", o["overlapped_ops"], o["role"]]
                for o in blk[v]["ops"]]
        out += [f"<details><summary>{LABELS[v]}</summary>", "",
                _table(["phase", "kind", "per-device arrays", "class", "async",
                        "ops overlapped", "issued by"], rows), "", "</details>", ""]
    return "\n".join(out)


def _peak_summary(peak) -> dict[str, Any]:
    """Live bytes at the peak, and those of forward attention-score buffers."""
    if not peak:
        return {"live": "-", "fwd_scores": "-", "fwd_scores_bytes": 0}
    fwd = sum(b for n, b in peak["entries"]
              if "bqhd,bkhd->bhqk" in n and "transpose(" not in n)
    return {"live": _fmt_mib(peak["peak_bytes"]), "fwd_scores": _fmt_mib(fwd),
            "fwd_scores_bytes": fwd}


def _gpu_section(res) -> str:
    gpu = res.get("gpu", {})
    if "error" in gpu:
        return f"## 8 x H100 memory\n\nNot measured: `{gpu['error']}`\n"
    gpt, blk = gpu["gpt"], gpu["block"]
    sh = gpt["shape"]
    out = [
        "## 8 x H100: peak memory and async collectives (deviceless compile)",
        "",
        "`sp_jax.analysis.compile_for_gpu`: the real XLA:GPU pipeline (SPMD partitioner, "
        "latency-hiding scheduler, memory planning) for an 8 x H100 SXM mesh, without a GPU. "
        "Per-device peak = temp + arguments + outputs - aliased (`memory_analysis()`); "
        "*live at peak*: the largest sum of simultaneously live buffers in XLA's live-range "
        "analysis (dumped with `xla_dump_to`; the allocator's peak above also counts "
        "fragmentation). The "
        "benchmark process disables XLA:CPU's `cse_barrier_expander` pass; GPU compiles run "
        "with the default pass list (`xla_disable_hlo_passes=''`).",
        "",
        f"### GPT, {gpt['layers']} layers, h={sh['h']}, a={sh['a']}, s={sh['s']}, b={sh['b']}, "
        f"vocabulary {gpt['vocab']}, tensor=8, forward+backward (parameter gradients)",
        "",
    ]
    rows = []
    for v in ("sp_save", "sp_recompute"):
        m, pk = gpt[v]["memory"], _peak_summary(gpt[v].get("peak_live"))
        rows.append([LABELS[v], _fmt_mib(m["peak_bytes"]), _fmt_mib(m["temp_bytes"]),
                     _fmt_mib(m["argument_bytes"]), _fmt_mib(m["output_bytes"]),
                     pk["live"], pk["fwd_scores"]])
    out.append(_table(["variant", "peak MiB", "temp MiB", "arguments MiB", "outputs MiB",
                       "live at peak MiB", "forward attention scores/probabilities live at "
                       "peak MiB"], rows))
    rec_pk = gpt["sp_recompute"].get("peak_live")
    if rec_pk:
        out += ["", "What is live at the peak of the sp_jax recompute GPT (XLA's live-range "
                "dump; JAX `op_name` of the instruction that produced each buffer; "
                "`jvp()` = forward, `transpose(jvp())` = backward):", ""]
        out.append(_table(["live buffers", "MiB"], [[f"`{n}`", _fmt_mib(b)]
                                                    for n, b in rec_pk["entries"][:10]]))
        fwd = _peak_summary(rec_pk)
        if fwd["fwd_scores_bytes"]:
            out += ["", (
                f"{fwd['fwd_scores']} MiB of the peak are the *forward* pass's attention "
                "score matrices (`jvp()/.../bqhd,bkhd->bhqk/dot_general`, fp32 "
                "`[b, a/t, s, s]`) and more are its bf16 probabilities (part of "
                "`jvp()/.../convert_element_type`), alive during the backward pass: XLA "
                "merged the backward's recomputation of the scores (the backward of the "
                "attention kernel recomputes them from q, k and the "
                "log-sum-exp, behind an optimization barrier meant to prevent this) with the "
                "identical forward computation, so the forward's s x s arrays are kept "
                "instead of recomputed. The residual count above does not see this (it is a "
                "property of the compiled program, not of the VJP).")]
    out += ["", "Backward collectives of the GPT by role (async / total; mean number of "
            "instructions overlapped between start and done):", ""]
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
    rows = [[role, cell(d.get("sp_save")), cell(d.get("sp_recompute"))]
            for role, d in sorted(roles.items())]
    out.append(_table(["role", "sp_jax save", "sp_jax recompute"], rows))
    out += ["", f"### One block, forward+backward (h={blk['shape']['h']}, s={blk['shape']['s']},"
            f" b={blk['shape']['b']}; unsharded on 1 H100, others on 8)", ""]
    rows = []
    for v in VARIANTS:
        m, pk = blk[v]["memory"], _peak_summary(blk[v].get("peak_live"))
        rows.append([LABELS[v], blk[v]["devices"], _fmt_mib(m["peak_bytes"]),
                     _fmt_mib(m["temp_bytes"]), _fmt_mib(m["argument_bytes"]), pk["live"],
                     pk["fwd_scores"]])
    out.append(_table(["variant", "devices", "peak MiB", "temp MiB", "arguments MiB",
                       "live at peak MiB", "forward attention scores live at peak MiB"], rows))
    return "\n".join(out) + "\n"


def _time_section(res) -> str:
    st = res["step_time"]
    sh = st["shape"]
    out = [
        "## CPU step time",
        "",
        f"Jitted forward+backward of one block on the 8 simulated CPU devices "
        f"(data={sh['d']} x tensor={sh['t']}; unsharded: one device), h={sh['h']}, "
        f"a={sh['a']}, s={sh['s']}, b={sh['b']}, {sh['dtype']} compute, fp32 parameters, the "
        f"same weights and input. {st['rounds']} rounds after {st['warmup']} warm-up calls; "
        f"each round times every variant once ({st['inner']} steps, rotated order). Ratio: "
        "median over rounds of the variant's time / the GSPMD baseline's time in the same "
        f"round. The {res['meta']['cpu_count']} CPU cores run all 8 simulated devices, so "
        "these numbers compare the programs' work and collective overheads, not GPU speed.",
        "",
    ]

    def quart(r, v):
        q = r.get("ratio_quartiles", {}).get(v)
        return f"{q[0]:.2f} - {q[1]:.2f}" if q else "-"

    rows = [[LABELS[v], f"{st['median_s'][v] * 1e3:.1f}",
             f"{st['ratio_to_reference'][v]:.2f}", quart(st, v), f"{st['compile_s'][v]:.1f}"]
            for v in VARIANTS]
    out.append(_table(["variant", "median step ms", "ratio to GSPMD (median)",
                       "ratio 25th - 75th percentile", "compile + first step s"], rows))
    fp32 = res.get("step_time_fp32")
    if fp32:
        rows = [[LABELS[v], f"{fp32['median_s'][v] * 1e3:.1f}",
                 f"{fp32['ratio_to_reference'][v]:.2f}", quart(fp32, v)] for v in VARIANTS]
        ref = st["reference"]
        slow = st["median_s"][ref] / fp32["median_s"][ref]
        out += ["", "The same with fp32 compute (secondary, not a target: on XLA:CPU the bf16 "
                f"step of the GSPMD baseline takes {slow:.1f}x its fp32 step, which shifts the "
                "balance between matmuls and data movement):", "",
                _table(["variant", "median step ms (fp32)", "ratio to GSPMD (fp32)",
                        "ratio 25th - 75th percentile"], rows)]
    return "\n".join(out) + "\n"


def _stacks_section(res) -> str:
    from benchmarks.stacks import LABELS as STACK_LABELS
    from benchmarks.stacks import STACK_VARIANTS

    st = res.get("stacks", {})
    if "error" in st or not st:
        return f"## Multi-layer stacks on 8 x H100\n\nNot measured: {st.get('error')}\n"
    sh = st["shape"]
    out = [
        "## Multi-layer stacks on 8 x H100",
        "",
        f"Forward+backward of `layers` blocks in a row (gradients w.r.t. the parameters "
        f"and the input), h={sh['h']}, a={sh['a']}, b={sh['b']}, data={sh['d']} x "
        f"tensor={sh['t']}, bf16 compute, compiled for H100 without a GPU with the "
        "recommended XLA flags. Per-device MiB from `memory_analysis()`: **peak** = temp + "
        "arguments + outputs - aliased, and **temp** (arguments and outputs, the "
        "parameters and their gradients, are the same for every variant). A single block "
        "hides what stays alive across layers; these stacks show it.",
        "",
    ]
    variants = [v for v in STACK_VARIANTS if v in st["stacks"][0]]
    rows = []
    for row in st["stacks"]:
        rows.append([row["stack"]["name"]] + [
            f"{row[v]['peak_bytes'] / MiB:.1f} / {row[v]['temp_bytes'] / MiB:.1f}"
            for v in variants])
    out.append(_table(["stack (peak / temp MiB)"] + [STACK_LABELS[v] for v in variants],
                      rows))
    out += ["",
            "What changed in sp_jax to get here (each found in XLA's buffer live ranges, "
            "`compile_for_gpu(..., live_buffers=True)`): the row layers' backward gathers dy "
            "once and computes dx and dW from it together (`row_sequence_parallel_matmul`), "
            "so no gathered dy waits for a weight-gradient GEMM at the end of the backward "
            "pass; kernels are cast to the compute dtype again in the backward pass behind "
            "a barrier, so XLA no longer keeps a bf16 copy of every fp32 weight from forward "
            "to backward; bias and norm-parameter gradients are released with dx, so no "
            "layer's incoming gradient waits for them. The GSPMD baseline uses the same norm "
            "function and so benefits from the last change too. The MLP's activation runs "
            "inside the down projection's op (`row_sequence_parallel_matmul(activation=...)`"
            "), which keeps only the activation's input and computes the activation again "
            "in its backward: the `[b, s, mlp_hidden / t]` hidden layer is kept once per "
            "layer (8 MiB here), not as the activation's input and output both. The GSPMD "
            "baseline, written as a user would with `jax.checkpoint` around the activation, "
            "keeps both (removing one there means recomputing the down projection's GEMM "
            "and reduce-scatter, or a custom VJP like sp_jax's).",
            ""]
    long8 = st["stacks"][1]
    ring = long8.get("sp_recompute_cm", {}).get("rings")
    if ring:
        rows = [[scope, f"{r['transfers']} / {r['expected_transfers']}", r["permutes"],
                 r["async"], r["async_with_gemm"]] for scope, r in ring["scopes"].items()]
        out += [f"Collective matmul in the {long8['stack']['name']} schedule (recompute): "
                "every ring's transfers, against `t - 1` per ring and layer (XLA may "
                "combine two transfers of one step into one permute):", "",
                _table(["ring (HLO scope)", "arrays moved / expected", "permutes",
                        "async", "async with a GEMM inside"], rows), "",
                "All-gathers and reduce-scatters of activations left: "
                f"{ring['all_gathers_and_reduce_scatters'] or 'none'}.", ""]
    cm = next((t for t in res.get("targets", []) if t["id"] == "cm_memory"), None)
    if cm is not None and cm["met"] is False:
        out += ["Collective matmul's memory target is missed in this run "
                f"({cm['measured']}). Its rings assemble each gathered or reduced chunk "
                "into a full `[b, s, h]` buffer with dynamic-update-slices and keep the "
                "in-flight chunk of both directions, a few MiB per layer that the plain "
                "path's single collective does not hold. The extra was +3.7 MiB per layer "
                "before the attention became the blockwise kernel (issue 10, which also "
                "grew every variant's stack by about 1 MiB per layer) and is +5.3 MiB now; "
                "which buffer XLA's schedule keeps longer since then is not isolated yet. "
                "The option is off by default.", ""]
    return "\n".join(out) + "\n"


def _gpt_time_section(res) -> str:
    runs = res.get("gpt_step_time", [])
    if not runs:
        return ""
    mesh = runs[0]["mesh"]
    out = [
        "## CPU: the whole GPT training step",
        "",
        f"`sp_jax.training.TrainStep` (forward, backward, clipping, AdamW) of the sp_jax GPT "
        f"and of the GSPMD baseline GPT (`benchmarks.baseline.GspmdGPT`, the same model "
        f"written with annotations) from the same weights on the same batches, "
        f"data={mesh['data']} x tensor={mesh['tensor']} simulated CPU devices; "
        f"{runs[0]['rounds']} interleaved rounds of {runs[0]['inner']} steps. Ratio: median "
        "over rounds of the step time / the GSPMD step time of the same round.",
        "",
    ]
    rows = []
    for r in runs:
        m = r["model"]
        q = r["ratio_quartiles"]["sp_jax"]
        rows.append([
            f"{m['name']} ({m['layers']} layers, h={m['hidden']}, s={m['seq']}, batch "
            f"{m['batch']})", m["dtype"], f"{r['median_s']['gspmd'] * 1e3:.1f}",
            f"{r['median_s']['sp_jax'] * 1e3:.1f}", f"{r['ratio_to_reference']['sp_jax']:.2f}",
            f"{q[0]:.2f} - {q[1]:.2f}", f"{r['ratio_to_reference']['sp_jax_cm']:.2f}"])
    out.append(_table(["model", "compute", "GSPMD ms", "sp_jax ms", "sp_jax / GSPMD",
                       "25th - 75th percentile", "with collective matmul / GSPMD"], rows))
    rows = [[f"{r['model']['name']} {r['model']['dtype']}"] + [
        f"{r['hlo'][v]['copy']} / {r['hlo'][v]['collective_arrays']}"
        for v in ("gspmd", "sp_jax", "sp_jax_cm")] for r in runs if "hlo" in r]
    out += ["", "Data movement in the compiled steps (copies XLA:CPU inserts to change "
            "layouts / arrays moved by collectives):", "",
            _table(["model", "GSPMD", "sp_jax", "sp_jax + collective matmul"], rows), "",
            "Where sp_jax is slower on the CPU it is with fp32 compute, where the matmuls "
            "are cheap and data movement weighs more: XLA:CPU copies every array that "
            "sp_jax's explicit collectives gather or scatter along the sequence (not the "
            "major dimension of `[batch, seq, hidden]`), while GSPMD picks layouts that "
            "avoid some of them; with bf16 compute the matmuls dominate and sp_jax is "
            "faster. Collective matmul trades one collective for `t - 1` permutes and `t` "
            "smaller GEMMs; on a CPU, where nothing overlaps, that is pure overhead, and "
            "the option is meant for GPUs (see the H100 schedule above).", ""]
    return "\n".join(out)


def _mesh(r: dict[str, Any]) -> str:
    return f"{r['context']} x {r['tensor']}"


def _context_section(res) -> str:
    gpu, cpu = res.get("context", {}), res.get("context_cpu", {})
    if not gpu and not cpu:
        return ""
    b = res["meta"]["config"]["context"]
    out = [
        "## Long context: a context mesh axis",
        "",
        "`ParallelConfig(context_parallel=\"ring\" | \"ulysses\")` on a `(data, context, "
        "tensor)` mesh: the sequence is sharded over (context, tensor) in the SP layout, "
        "column layers gather over tensor only, and attention runs across the context axis "
        "(`sp_jax.attention`: ring attention passes k/v blocks around the context ring on "
        "a zigzag order; Ulysses all-to-alls the sequence shards to head shards and back; "
        "both use the blockwise kernel, which never forms an `s x s` array). "
        "`benchmarks/context.py`.",
        "",
    ]
    if "runs" in gpu:
        out += [f"### {b['layers']} layers of h={b['h']}, a={b['a']} on H100s (deviceless "
                "compiles)", "",
                f"A GPT of {b['layers']} blocks with h={b['h']}, a={b['a']}, rotary "
                f"positions, `scan_layers`, bf16 compute with fp32 parameters, "
                f"`recompute_allgather`, attention blocks of {b['block']}, batch 1, a "
                "256-entry vocabulary (so the blocks dominate); the gradients of the loss. "
                "Per-GPU memory from `memory_analysis()` (peak = arguments + outputs + temp "
                "- aliased; H100: 80 GB). 8 GPUs: one host (1x1x8); 32 and 64 GPUs: hosts "
                "of 8.", ""]
        rows = [[f"{r['s']:,}", r["gpus"], LABELS_CP[r["mode"]], _mesh(r),
                 f"{r['argument_bytes'] / 2**30:.2f}", f"{r['temp_bytes'] / 2**30:.2f}",
                 f"{r['peak_bytes'] / 2**30:.2f}", "yes" if r["fits_h100"] else "**no**",
                 f"{r['compile_s']:.0f}"] for r in gpu["runs"]]
        out += [_table(["tokens", "GPUs", "attention", "context x tensor",
                        "arguments GiB", "temp GiB", "peak GiB", "fits 80 GB",
                        "compile s"], rows), ""]
        out += [_fits_summary(gpu["runs"]), ""]
    scaling = cpu.get("scaling")
    if scaling:
        out += [f"### Activation bytes per device vs sequence length (one block, h="
                f"{scaling['h']}, a={scaling['a']})", "",
                "Residuals `jax.vjp` keeps for backward on the simulated CPU devices "
                "(abstract, per device from the residuals' shardings), activations only "
                "(batch 2 minus batch 1). MiB per device; last column: bytes x context x "
                "tensor / s, the same for every mesh when memory scales as s / (context x "
                "tensor).", "",
                f"![activation memory vs s on context meshes](docs/{PLOT_CONTEXT})", ""]
        rows = [[LABELS_CP[m["mode"]] if m["context"] * m["tensor"] > 1 else "unsharded",
                 _mesh(m)] + [_fmt_mib(x) for x in m["bytes"]]
                + [f"{min(m['per_token_x_devices']):.0f} - "
                   f"{max(m['per_token_x_devices']):.0f}"]
                for m in scaling["meshes"]]
        out += [_table(["attention", "context x tensor", *(f"s={s:,}" for s in scaling["s"]),
                        "bytes x c x t / s"], rows), ""]
    if gpu.get("communication"):
        out += ["### Context-axis communication per layer (one block, 8 x H100)", "",
                "Bytes per device of the context-axis collectives in the compiled "
                "forward+backward of one block against the analytic volumes (ring: the "
                "device's heads of k and v over the whole sequence, `kv`, moves "
                "`(c-1)/c kv` forward; backward `(c-1)/c kv` again plus fp32 dk/dv "
                "accumulators for the same steps and their return home (`kv / c`, sent "
                "in bf16); Ulysses: 4 all-to-alls of `s*b*h/(c*t)` elements each way).", ""]
        rows = []
        for c in gpu["communication"]:
            for key, want in c["analytic_bytes"].items():
                got = c["measured_bytes"].get(key, 0)
                rows.append([LABELS_CP[c["mode"]], _mesh(c), f"{c['s']:,}", key,
                             c["ops"].get(key, 0), c["async_ops"].get(key, 0),
                             _fmt_mib(got), _fmt_mib(want)])
        out += [_table(["attention", "context x tensor", "tokens", "phase / collective",
                        "ops", "async", "measured MiB", "analytic MiB"], rows), ""]
    if cpu.get("balance"):
        rows = [[bl["context"], f"{bl['s']:,}", bl["block"],
                 f"{min(bl['ring']['counts'])} - {max(bl['ring']['counts'])}",
                 f"{bl['ring']['max_over_mean']:.2f}",
                 f"{min(bl['ring_contiguous']['counts'])} - "
                 f"{max(bl['ring_contiguous']['counts'])}",
                 f"{bl['ring_contiguous']['max_over_mean']:.2f}"] for bl in cpu["balance"]]
        out += ["### Ring attention: causal load balance", "",
                "Block products per device (`sp_jax.attention.attention_block_counts`, "
                "equal to the kernels' own loop counters in `tests/test_attention.py`); "
                "each is one block x block score block, so attention FLOPs per device are "
                "proportional. The zigzag order gives device r chunks r and 2c-1-r; the "
                "contiguous split is shown for contrast.", "",
                _table(["context", "tokens", "block", "zigzag products", "zigzag max/mean",
                        "contiguous products", "contiguous max/mean"], rows), ""]
    st = cpu.get("step_time")
    if st:
        q = st["ratio_quartiles"]
        out += ["### CPU: blockwise attention vs the query-blocked kernel", "",
                f"Attention forward+backward (`jax.grad`), fp32, batch 1, s={st['s']}, "
                f"{st['heads']} heads of {st['head_dim']} sharded over {st['devices']} "
                f"simulated CPU devices, {st['rounds']} interleaved rounds: the blockwise "
                f"kernel (blocks of {st['block']}, key blocks above the diagonal skipped) "
                f"{st['median_s']['blockwise'] * 1e3:.1f} ms, the query-blocked kernel it "
                f"replaced (`benchmarks.superseded.causal_attention`: all keys per query block, "
                f"masked) {st['median_s']['query_blocked'] * 1e3:.1f} ms: ratio "
                f"{st['ratio_blockwise_to_query_blocked']:.2f}x (quartiles {q[0]:.2f} - "
                f"{q[1]:.2f}).", ""]
    return "\n".join(out)


def _fits_summary(runs: list[dict[str, Any]]) -> str:
    """What the table shows, from its rows."""
    parts = []
    for s in sorted({r["s"] for r in runs}):
        rows = [r for r in runs if r["s"] == s]
        fit = [f"{LABELS_CP[r['mode']]} on {r['gpus']} GPUs ({_mesh(r)})" for r in rows
               if r["fits_h100"]]
        no = [f"{LABELS_CP[r['mode']]} on {r['gpus']} GPUs ({_mesh(r)})" for r in rows
              if not r["fits_h100"]]
        parts.append(f"at {s:,} tokens {', '.join(fit) or 'nothing'} fit"
                     + (f"; {', '.join(no)} does not" if no else ""))
    return (
        "In this run " + "; ".join(parts) + ". With the blockwise kernel no `s x s` array "
        "exists in any mode, so attention memory is linear in s, and TP+SP alone keeps as "
        "many activations per device as context x tensor = its tensor size: on one 8-GPU "
        "host it matches ring and Ulysses at c x t = 8 (the expectation that TP+SP alone "
        "could not hold 128k tokens came from the `[b, a/t, s, s]` scores of a "
        "materialised softmax). What the context axis adds is scale beyond a host: tensor "
        "parallelism stops at the NVLink-connected GPUs of one host and at a/t heads, the "
        "context axis does not (Ulysses is bounded too: context <= a/t). Context "
        "parallelism replicates the weights over the context axis, hence the larger "
        "arguments (parameters and their gradients: 1/t of the model per GPU).")


def _unmeasured(res, key: str, title: str) -> str | None:
    """``""`` when the run has no ``key`` section, the "Not measured" section when it
    failed, else None (render it)."""
    section = res.get(key)
    if not section:
        return ""
    if "error" in section:
        return _fill("not_measured", title=title, error=section["error"])
    return None


def _pipeline_section(res) -> str:
    """``benchmarks.pipeline``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "pipeline", "Pipeline parallelism")
    return render_pipeline(res["pipeline"]) if skipped is None else skipped


def _text_section(res) -> str:
    """``benchmarks.text``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "text", "Packed documents")
    return render_text(res["text"]) if skipped is None else skipped


def _generation_section(res) -> str:
    """``benchmarks.generation``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "generation", "Generation")
    return render_generation(res["generation"]) if skipped is None else skipped


def _moe_section(res) -> str:
    """``benchmarks.moe``'s section (its own targets, tables and prose)."""
    skipped = _unmeasured(res, "moe", "Mixture of experts")
    return render_moe(res["moe"]) if skipped is None else skipped


def _fp8_section(res) -> str:
    """``benchmarks.fp8``'s section (its own targets and tables)."""
    from benchmarks.render.fp8 import render_markdown as render_fp8

    skipped = _unmeasured(res, "fp8", "FP8")
    return render_fp8(res["fp8"]) if skipped is None else skipped


def _fsdp_section(res) -> str:
    """``benchmarks.fsdp``'s section (its own targets and table)."""
    skipped = _unmeasured(res, "fsdp", "FSDP on 8 x H100")
    return render_fsdp(res["fsdp"]) if skipped is None else skipped


def _plan_section(res) -> str:
    skipped = _unmeasured(res, "plan", "Memory planner")
    if skipped is not None:
        return skipped
    pl = res["plan"]
    out = ["## Memory planner (`python -m sp_jax.plan`)", "",
           'Per-GPU memory of GPT training runs from deviceless H100 compiles of the real '
           'training step (`sp_jax.training.train_step_fn`: forward, backward, AdamW; '
           'parameters and optimizer state donated; layers scanned; bf16 compute, fp32 '
           'master weights; `recompute_allgather` always on), for the layouts '
           '`sp_jax.analysis.plan.candidates` proposes: meshes data x context x tensor, '
           'and, where there are GPUs beyond one tensor group, pipelined meshes stages x '
           'data x context x tensor (the stage axis outermost, across hosts; the two '
           'largest stage counts that divide the layers and those GPUs; a 1F1B schedule of '
           'M = 4 x stages micro-batches of one sequence per data shard, so a pipelined '
           "row's batch is data x M; `--stages` and `--microbatches` choose others). "
           'Parameters and optimizer state: the per-device shards the step takes (formula '
           "beside; a pipeline divides the layers' share by the stages); gradients: fp32 "
           "shards like the parameters; activations + temp: XLA's temp minus the gradients "
           '(formula: selective-recompute TP+SP activations only, rough; a 1F1B stage '
           "keeps 2 x stages - 1 bf16 stage inputs `[b, s/(c t), h]` and one micro-batch's "
           'activations of its L / stages layers); collectives: bytes per step, each '
           'collective of the compiled program times the trip counts of the loops around '
           'it (`sp_jax.analysis.hlo.execution_counts`).', ""]
    for p in pl["plans"]:
        out += [f"### {p['model']}, s={p['seq']:,}, {p['gpus']} GPUs", "", p["table"], ""]
    sm = pl["small"]
    out += ["Check against a CPU compile (the same step for a small model, h=256, 2 layers, "
            "data 2 x tensor 4, sharded over data): activations + temp "
            f"{sm['row']['activation_bytes'] / 2**20:.2f} MiB from the H100 compile, "
            f"{sm['cpu_activation_bytes'] / 2**20:.2f} MiB from XLA:CPU.", ""]
    return "\n".join(out)


def render_markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    head = _fill("head", quick_flag=_fill("quick_flag") if meta["quick"] else "",
                 date=meta["date"], jax=meta["jax"], flax=meta["flax"],
                 python=meta["python"], devices=meta["devices"], cpu_count=meta["cpu_count"],
                 runtime=f"{meta['runtime_s']:.0f}", json=JSON_NAME)
    body = [_targets_section(res), _memory_section(res), _collectives_section(res),
            _gpu_section(res), _stacks_section(res), _time_section(res),
            _gpt_time_section(res), _context_section(res), _pipeline_section(res),
            _text_section(res), _generation_section(res), _fsdp_section(res),
            _moe_section(res), _fp8_section(res), _plan_section(res)]
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in meta["section_seconds"].items())
    tail = _fill("run", seconds=secs, xla_flags=meta["xla_flags"])
    return head + "\n" + "\n\n".join(body) + "\n\n" + tail


def real_gpu_section(gpu_check: Path) -> str:
    """The latest ``make gpu-check`` report, when one was copied to ``docs/``."""
    head = ("## On a real GPU (`make gpu-check`)\n\n"
            "`make gpu-check` runs the GPT training step on the GPUs of the machine (1 to 8) "
            "for sp_jax (plain, collective matmul, and FP8 with current and delayed scaling: "
            "tokens/s beside bf16, MFU against the bf16 peak, the cuBLASLt FP8 GEMMs "
            "counted), the GSPMD baseline GPT and the unsharded model: step time, "
            "tokens/s, MFU, the allocator's real peak next to "
            "the compiled program's predicted peak, and a profiler trace "
            "(`scripts/gpu_check.py`). ")
    if not gpu_check.exists():
        return head + ("It has not run on a GPU yet: every GPU number above comes from "
                       "deviceless compiles. After a run, copy "
                       f"`runs/gpu-check/gpu_check.md` to `docs/{GPU_CHECK_NAME}` and rerun "
                       "`make bench` to include it here.\n")
    return head + f"The latest run (`docs/{GPU_CHECK_NAME}`):\n\n" + gpu_check.read_text()


def render_document(res: dict[str, Any], docs: Path) -> str:
    """The whole ``BENCHMARKS.md``: the run's results ``res`` and the latest ``make
    gpu-check`` report when one was copied to ``docs/``."""
    return render_markdown(res) + "\n" + real_gpu_section(Path(docs) / GPU_CHECK_NAME)
