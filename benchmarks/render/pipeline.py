"""The pipeline section of BENCHMARKS.md from :func:`benchmarks.pipeline.run_pipeline`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.pipeline import (
    SCHEDULES,
    MiB,
    PipelineBench,
    analytic_bytes,
    expected_ticks,
    find_record,
    measured_ticks,
)
from benchmarks.section import status, table


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


def render_markdown(res: dict[str, Any], command: str = "JAX_PLATFORMS=cpu python -m "
                    "benchmarks.pipeline") -> str:
    """The ``## Pipeline parallelism`` section of ``BENCHMARKS.md`` for the results of
    :func:`run_pipeline`."""
    bench = PipelineBench(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in res["bench"].items()})
    recs = res["records"]
    hi = max(bench.microbatches)
    out = [
        "## Pipeline parallelism",
        "",
        "`ParallelConfig(pipeline_axis=\"stage\", pipeline_microbatches=M, "
        "pipeline_schedule=\"gpipe\" | \"1f1b\", pipeline_repeats=R)` on a `(stage, data, "
        "context, tensor)` mesh: the scanned blocks are split over the stage axis, one "
        "SPMD program runs a schedule's tick loops (`sp_jax.pipeline`), and activations "
        "move between stages by collective-permute, as their sequence-parallel shard "
        "`[b, s/(c t), h]`: one to the next stage per tick that forwards, one gradient "
        "to the previous stage per tick that back-propagates. `benchmarks/pipeline.py`.",
        "",
        f"Deviceless compiles for 8 x H100 (one host, topology 1x1x8) of the whole "
        f"training step (`sp_jax.training.step.train_step_fn`: the pipeline's loss and "
        f"gradients, AdamW): stage {bench.stages} x data 1 x context 1 x tensor "
        f"{bench.tensor}, a GPT of {bench.layers} blocks with h={bench.h}, a={bench.a}, "
        f"rotary positions, vocabulary {bench.vocab:,} (tied embedding, as the GPT "
        f"compiles above), s={bench.s}, b={bench.b} per micro-batch, bf16 compute with "
        f"fp32 parameters, `recompute_allgather`, fp32 weight gradients; parameters and "
        f"optimizer state donated. Per-GPU memory from `memory_analysis()` (peak = "
        f"arguments + outputs + temp - aliased). Device `d` is on stage "
        f"`d // {bench.devices // bench.stages}`.",
        "",
        f"Reproduce: `{command}` (about 5 minutes on 2 CPU cores; `--markdown PATH` "
        f"writes this section, `--json PATH` the numbers; needs the CUDA plugin, "
        f"`pip install -e '.[gpu-aot]'`). Run of {res['meta']['date']}, jax "
        f"{res['meta']['jax']}.",
        "",
        "### Targets",
        "",
        table(["target", "measured", "status"],
               [[t["target"], t["measured"], status(t["met"])] for t in res["targets"]]),
        "",
        "### Memory per GPU vs micro-batches (R = 1)",
        "",
    ]
    rows = []
    for m in bench.microbatches:
        g, f = find_record(recs, "gpipe", m), find_record(recs, "1f1b", m)
        st = g["stacked_residuals"]
        rows.append([m, f"{g['temp_bytes'] / MiB:,.0f}", f"{g['peak_bytes'] / MiB:,.0f}",
                     f"{st['total'] / MiB:,.0f} ({st['weights'] / MiB:,.0f})",
                     f"{f['temp_bytes'] / MiB:,.0f}", f"{f['peak_bytes'] / MiB:,.0f}",
                     f["schedule"]["max_live_inputs"],
                     f"{f['temp_bytes'] / g['temp_bytes']:.3f}"])
    out.append(table(["M", "GPipe temp MiB", "GPipe peak MiB", "GPipe forward loop: "
                       "residuals stacked over the ticks MiB (of which fp32 weight-shaped)",
                       "1F1B temp MiB", "1F1B peak MiB", "1F1B stage inputs kept",
                       "1F1B / GPipe temp"], rows))
    f_lo, f_hi = find_record(recs, "1f1b", 8), find_record(recs, "1f1b", hi)
    g_lo, g_hi = find_record(recs, "gpipe", 8), find_record(recs, "gpipe", hi)
    first = find_record(recs, "gpipe", min(bench.microbatches))
    per_micro = (g_hi["temp_bytes"] - first["temp_bytes"]) / max(1, hi - first[
        "microbatches"]) / MiB
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
        unpipelined = (
            f" The unpipelined scanned GPT keeps them too, once per step where GPipe keeps "
            f"them once per tick: `jax.vjp` of the loss of a GPT of the stage's "
            f"{scan['layers']} blocks on tensor {bench.tensor} "
            f"(`sp_jax.analysis.saved_residuals`, abstract) keeps "
            f"{scan['bytes'] / MiB:,.1f} MiB per GPU of fp32 block weights as outputs of its "
            f"layer scan ({kernels / MiB:,.1f} MiB of it the four kernels of each block"
            + (", the rest biases" if kernels < scan["bytes"] else "") + ")"
            + (", as much as GPipe's forward loop stacks per tick" if same else "") + ".")
    else:
        unpipelined = ""
    out += ["", (
        f"GPipe differentiates its forward loop, so the residuals of every tick stay alive "
        f"until the backward loop: temp grows by {per_micro:,.0f} MiB per micro-batch "
        f"(one more tick; {g_lo['temp_bytes'] / MiB:,.0f} MiB at M=8, "
        f"{g_hi['temp_bytes'] / MiB:,.0f} MiB at M={hi}). The forward loop's carry shows "
        f"what: per tick {rest_tick:,.0f} MiB of activations, masks and attention "
        f"statistics of the stage's {layers} layers, and {weights_tick:,.0f} MiB shaped "
        f"like the stage's fp32 layer weights. These are not copies of the chunk a tick "
        f"runs (the runner picks it from the stacked weights again in the backward loop: "
        f"a `jax.checkpoint` around `lax.dynamic_index_in_dim`) but residuals of the layer "
        f"scan inside the stage: the linear layers' custom VJPs (`sp_jax.ops.linear`) keep "
        f"each layer's fp32 kernel shard (and bias) for the input gradient, and the scan "
        f"stacks them." + unpipelined + f" Without them GPipe's temp at "
        f"M={hi} would be about {lean / MiB:,.0f} MiB (a linear VJP that reads its kernel "
        f"from the stacked parameters in the backward instead of keeping it would remove "
        f"them; not tried here); the 1F1B target holds against that figure too "
        f"({f_hi['temp_bytes'] / lean:.2f}x). 1F1B back-propagates "
        f"each micro-batch as soon as the last stage has its loss and keeps only the stage "
        f"inputs in flight (at most 2V - 1 = {f_lo['schedule']['max_live_inputs']} "
        f"`[b, s/t, h]` shards per stage whatever M, V = stages x R), recomputing the "
        f"stage's forward inside its backward (`jax.vjp` per tick, so the layer scan's "
        f"weight residuals live for one tick): temp is {f_lo['temp_bytes'] / MiB:,.0f} MiB "
        f"at M=8 and "
        f"{f_hi['temp_bytes'] / MiB:,.0f} MiB at M={hi} "
        f"({f_hi['temp_bytes'] / f_lo['temp_bytes']:.3f}x). The price of the flat memory is "
        f"that recomputation: one more forward per micro-batch and stage (about 4/3 of "
        f"GPipe's FLOPs if a backward costs two forwards). Arguments (parameters, AdamW "
        f"moments, tokens) are {args:,.0f} MiB per GPU in both.")]
    warned = [(r, w) for r in recs for w in r.get("xla_warnings", [])]
    if warned:
        out += ["", "XLA logged while compiling: " + "; ".join(
            f"{r['kind']} M={r['microbatches']} R={r['repeats']}: "
            f"`{w.split('] ', 1)[-1]}`" for r, w in warned) + "." + (
            " XLA:GPU's rematerialization pass runs when its estimate of a program's "
            "memory exceeds what it targets on the device; it recomputed some buffers "
            "of these programs instead of keeping them, so their temp above is after "
            "that pass (its estimate is not the final buffer assignment's figure)."
            if any("rematerialization" in w for _, w in warned) else "")]
    out.append("")

    out += [f"### Ticks and bubble (M = {bench.tick_microbatches})", ""]
    rows = []
    for kind in SCHEDULES:
        for r in bench.repeats:
            rec = find_record(recs, kind, bench.tick_microbatches, r)
            sch, ticks = rec["schedule"], measured_ticks(rec["traffic"])
            want = expected_ticks(rec)
            iters = (f"{ticks['forward_ring']} + {ticks['backward_ring']}"
                     if kind == "gpipe" else f"{ticks['iterations']}")
            rows.append([{"gpipe": "GPipe", "1f1b": "1F1B"}[kind] + (
                " (circular)" if kind == "gpipe" and r > 1 else ""), r,
                _loops(rec), f"{ticks['forward_ring']} / {ticks['backward_ring']}",
                f"{want['forward_ring']} / {want['backward_ring']}", iters,
                sch["num_ticks"], "PASS" if ticks == want else "**MISS**",
                f"{sch['bubble_tables']:.3f}", f"{sch['bubble_time']:.3f}",
                f"{sch['bubble_formula']:.3f}"])
    out.append(table(["schedule", "R", "activation permutes in the compiled loops "
                       "(trip count x copies per iteration + copies outside)",
                       "sends to next / previous stage (measured)",
                       "ticks with a forward / a backward (tables)",
                       "tick iterations (measured)", "`num_ticks`", "match",
                       "bubble (tables)", "bubble (time)", "(P-1)/(RM+P-1)"], rows))
    out += ["", (
        "XLA:GPU unrolls each tick loop by two (double buffering: two ticks per "
        "iteration, an odd tick peeled outside the loop), so ticks are counted from the "
        "stage-ring collective-permutes: copies in a loop body times the loop's "
        "`known_trip_count`, plus the copies outside. GPipe's forward loop sends one "
        "activation to the next stage per tick and its backward loop (autodiff of the "
        "forward one) one gradient to the previous stage; each runs R M + P - 1 ticks. "
        "1F1B runs R M + P R + P - 2 ticks in three loops: warm-up (the first P R - 1 "
        "ticks, forwards only: activations only), steady state (a forward and a backward "
        "per stage: both sends) and cool-down (the last P R - 1 ticks, backwards only: "
        "gradients only); its tick iterations are its sends both ways less the ticks "
        "that hold both (iterations of the loops whose body sends both ways). The "
        "*tables* bubble counts idle stage-slots over all slots; 1F1B's is larger as it "
        "counts a forward and a backward slot in every tick, also in the warm-up and "
        "cool-down ticks that only have one kind of work. In *time* (forward and "
        "backward halves weighed alike; warm-up ticks run no backward, cool-down ticks "
        "no forward) 1F1B's bubble equals GPipe's, the formula (P - 1) / (R M + P - 1); "
        "with R = 2 it shrinks as the formula says."), ""]

    out += ["### Stage-axis traffic per step (bytes per GPU)", ""]
    rows = []
    for rec in [find_record(recs, k, bench.tick_microbatches, r) for k in SCHEDULES
                for r in bench.repeats]:
        tr = rec["traffic"]
        asyncs = all(e["async"] for e in tr["activations"])
        rows.append([{"gpipe": "GPipe", "1f1b": "1F1B"}[rec["kind"]], rec["repeats"],
                     rec["microbatches"],
                     ", ".join(sorted({e["shape"] for e in tr["activations"]})),
                     f"{rec['activation_bytes'] / MiB:,.0f}",
                     f"{analytic_bytes(rec, res['shard_bytes']) / MiB:,.0f}",
                     "yes" if asyncs else "**no**",
                     f"{tr['shared_gradients'] / MiB:,.1f}", f"{tr['scalars']:,}",
                     f"{tr['other_bytes'] / MiB:,.0f}" if tr["other"] else "0"])
    out.append(table(["schedule", "R", "M", "permute shape", "activations MiB",
                       "analytic MiB", "all async",
                       "shared-parameter gradient all-reduce MiB", "scalar all-reduce bytes",
                       "other stage-crossing MiB"], rows))
    rec1 = find_record(recs, "1f1b", bench.tick_microbatches, 1)
    other = [o for r in recs for o in r["traffic"]["other"]]
    clean = " and ".join(str(r) for r in sorted(
        {r["repeats"] for r in recs if not r["traffic"]["other"]}))
    scope = (f"In every compile (R = {clean})" if not other
             else f"In the compiles with R = {clean}")
    out += ["", (
        f"Activations: the collective-permutes of the tick loops whose pairs shift the "
        f"stage ring by one (same position on the next / previous stage), bytes x "
        f"executions per step; analytic: one `[b, s/(c t), h]` bf16 shard = "
        f"{bench.shard_bytes / MiB:g} MiB per tick that forwards (to the next stage) "
        f"and per tick that back-propagates (to the previous one): 2 (R M + P - 1) "
        f"sends per step for both schedules (GPipe: its forward loop and its backward "
        f"loop; 1F1B: its warm-up ticks send no gradient and its cool-down ticks no "
        f"activation; a lockstep loop sending both ways every tick would send "
        f"2 (R M + P R + P - 2), "
        f"{2 * rec1['schedule']['num_ticks'] * bench.shard_bytes / MiB:,.0f} MiB at "
        f"M={bench.tick_microbatches}, R = 1). Every other collective is checked for "
        f"replica groups that span stages (all-gather, reduce-scatter, all-reduce, "
        f"all-to-all; groups parsed from all three of XLA's notations). {scope} the "
        f"only one is the all-reduce over the stage axis of the gradients of the "
        f"parameters every stage holds (tied embedding `[vocab/t, h]` and final norm, "
        f"fp32 since weight gradients are fp32: "
        f"{rec1['traffic']['shared_gradients'] / MiB:,.1f} MiB, once per step, "
        f"{rec1['traffic']['shared_gradients'] / rec1['activation_bytes']:.2f}x the "
        f"activation traffic of 1F1B at M={bench.tick_microbatches}) plus a few scalars "
        f"(loss, token counts). All {bench.stages} stages take part in that all-reduce "
        f"although only the first (embedding) and the last (LM head) add non-zero terms "
        f"to the tied embedding's gradient; Megatron reduces it between those two "
        f"stages only.")]
    if other:
        kinds = sorted({o["kind"] for o in other})
        funcs = sorted({o["function"] for o in other})
        where = [f"{r['kind']} M={r['microbatches']} R={r['repeats']} "
                 f"({r['traffic']['other_bytes'] / MiB:,.0f} MiB)" for r in recs
                 if r["traffic"]["other"]]
        out += ["", (
            "**Also crossing stages:** " + ", ".join(kinds) + " issued by "
            + ", ".join(f"`{f}`" for f in funcs) + " in " + ", ".join(where) + " (operand "
            "bytes per GPU and step).")]
    return "\n".join(out) + "\n"
