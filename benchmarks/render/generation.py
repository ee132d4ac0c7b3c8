"""The generation section of BENCHMARKS.md from the results of
:func:`benchmarks.generation.run_generation`."""

from __future__ import annotations

from typing import Any

from benchmarks.records import TORCH_ENV, GenerationBench, collectives_per_token, fmt_mesh, fmt_size
from benchmarks.render.common import run_facts, targets_lines
from benchmarks.render.template import fields, filler, table

_fill = filler("generation")

_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "mlp_hidden", "vocab")


def _cpu_rows(cpu: dict[str, Any], bench: GenerationBench) -> list[list[Any]]:
    rows = []
    for r in cpu["rows"]:
        ours = r["sp_jax"]
        theirs = r["transformers"]
        mesh = fmt_mesh(r["mesh"]) + (" (reference)" if r.get("reference") else "")
        row = [
            r["batch"],
            mesh,
            f"{ours['tokens_per_s']:,.0f}",
            f"{ours['median_s'] * 1e3:,.0f} ({ours['quartiles_s'][0] * 1e3:,.0f} - "
            f"{ours['quartiles_s'][1] * 1e3:,.0f})",
        ]
        if "error" in theirs:
            row += ["not measured", "", "not measured", "", "not compared"]
        else:
            tok = r["tokens"]
            row += [
                f"{theirs['tokens_per_s']:,.0f}",
                f"{theirs['median_s'] * 1e3:,.0f} ({theirs['quartiles_s'][0] * 1e3:,.0f}"
                f" - {theirs['quartiles_s'][1] * 1e3:,.0f})",
                f"**{r['ratio']:.2f}x**",
                f"{r['round_ratios'][0]:.2f} - {r['round_ratios'][1]:.2f}",
                "yes"
                if tok["equal"]
                else _fill(
                    "cpu_rows.1",
                    fraction=format(tok["fraction"], ".1%"),
                    v=tok["first_difference"][0],
                    v2=tok["first_difference"][1],
                ),
            ]
        rows.append(row)
    return rows


def _cpu_prose(cpu: dict[str, Any], bench: GenerationBench) -> str:
    """The compiles, the greedy tokens, and what the reference meshes show."""
    rows = cpu["rows"]
    first = [
        f"batch {r['batch']} on {fmt_mesh(r['mesh'])} {r['first_call_s'][0]:.1f} s"
        for r in rows
        if r["first_call_s"]
    ]
    text = _fill("cpu_prose.1", join=", ".join(first)) if first else ""
    if any("error" in r["transformers"] for r in rows):
        return _fill("cpu_prose.2", text=text, error=rows[0]["transformers"]["error"])
    equal = all(r["tokens"]["equal"] for r in rows)
    text += _fill(
        "cpu_prose.3",
        v="equal in every row. " if equal else "not all equal (the table's last column). ",
    )
    refs = [r for r in rows if r.get("reference")]
    if not refs:
        return text
    parts = []
    for ref in refs:
        main = next(
            (r for r in rows if not r.get("reference") and r["batch"] == ref["batch"]), None
        )
        if main is None:
            continue
        parts.append(
            _fill(
                "cpu_prose.4",
                batch=ref["batch"],
                tokens_per_s=format(ref["sp_jax"]["tokens_per_s"], ",.0f"),
                fmt_mesh=fmt_mesh(ref["mesh"]),
                ratio=format(ref["ratio"], ".2f"),
                v=format(ref["sp_jax"]["tokens_per_s"] / main["sp_jax"]["tokens_per_s"], ".1f"),
                fmt_mesh2=fmt_mesh(main["mesh"]),
            )
        )
    layers = cpu["config"]["layers"]
    return _fill(
        "cpu_prose.5", text=text, join="; ".join(parts), threads=cpu["threads"], v=2 * layers + 1
    )


def _collective_prose(gpu: dict[str, Any]) -> str:
    """How the HLO holds the collectives that run per token (the layer loop's unrolling,
    combining)."""
    per = collectives_per_token(gpu)
    layers, exp = gpu["config"]["layers"], gpu["expected"]
    ar = per.get("all-reduce", {"in_hlo": 0, "runs": 0, "in_loop": 0, "trips": []})
    text = _fill("collective_prose.1", in_hlo=ar["in_hlo"], ops=exp["all-reduce"]["ops"])
    if ar["trips"]:
        trips = ar["trips"][0]
        per_trip = ar["in_loop"]
        unroll = layers // trips
        how = (
            "one layer per trip"
            if unroll == 1
            else _fill("collective_prose.2", layers=layers, unroll=unroll, per_trip=per_trip)
        )
        text += (
            _fill(
                "collective_prose.3",
                per_trip=per_trip,
                trips=trips,
                how=how,
                v=ar["in_hlo"] - per_trip,
            )
            if trips * unroll == layers
            else _fill("collective_prose.4", per_trip=per_trip, trips=trips)
        )
    combined = ar["runs"] < exp["all-reduce"]["ops"]
    text += ". " + (_fill("collective_prose.5") if combined else _fill("collective_prose.6"))
    n = sum(k["in_hlo"] for k in per.values())
    text += _fill(
        "collective_prose.7",
        batch=gpu["batch"],
        hidden=gpu["config"]["hidden"],
        dtype=gpu["config"]["dtype"],
        tensor=gpu["tensor"],
        sum=sum(k["async"] for k in per.values()),
        n=n,
        sum2=sum(k["overlapped"] for k in per.values()),
    )
    return text


def render_markdown(res: dict[str, Any], command: str = _fill("section.1")) -> str:
    """The ``## Generation`` section of ``BENCHMARKS.md`` for the results of
    :func:`run_generation`."""
    bench = GenerationBench.from_dict(res["bench"])
    cpu, gpu = res["cpu"], res["gpu"]
    c = cpu["config"]
    versions = cpu.get("transformers_versions")
    out = [
        "## Generation",
        "",
        _fill("section.2"),
        "",
        _fill(
            "section.3",
            **fields(c, *_MODEL_KEYS),
            cpu_preset=bench.cpu_preset,
            v=_fill("with", values=", ".join(f"{k}={v}" for k, v in bench.cpu_overrides))
            if bench.cpu_overrides
            else "",
            v2=format(cpu["parameters"] / 1e6, ".2f"),
            dtype=c["dtype"],
            prompt_len=bench.prompt_len,
            new_tokens=bench.new_tokens,
            v3=_fill(
                "reference_meshes", meshes=", ".join(fmt_mesh(m) for m in bench.reference_meshes)
            )
            if bench.reference_meshes
            else "",
            v4=_fill(
                "versions",
                transformers=versions["transformers"],
                torch=versions["torch"],
                threads=versions["threads"],
            )
            if versions
            else "",
            threads=cpu["threads"],
            rounds=bench.rounds,
            warmup=bench.warmup,
        ),
        "",
        _fill("section.4", command=command, torch_env=TORCH_ENV, **run_facts(res["meta"])),
        "",
        *targets_lines(res["targets"]),
        _fill("section.5"),
        "",
        table(
            [
                "batch",
                "mesh (data x tensor)",
                "sp_jax tokens/s",
                "sp_jax ms per call (quartiles)",
                "transformers tokens/s",
                "transformers ms per call (quartiles)",
                "sp_jax / transformers",
                "per round (quartiles)",
                "greedy tokens equal",
            ],
            _cpu_rows(cpu, bench),
        ),
        "",
    ]
    out += [_cpu_prose(cpu, bench)]
    out += ["", _fill("section.6"), ""]
    if "error" in gpu:
        out += [_fill("gpu_not_measured", error=gpu["error"])]
        return "\n".join(out) + "\n"
    g, a = gpu["config"], gpu["analytic"]
    out += [
        _fill(
            "section.7",
            gpu_preset=bench.gpu_preset,
            v=f" with {', '.join(f'{k}={v}' for k, v in bench.gpu_overrides)}"
            if bench.gpu_overrides
            else "",
            **fields(g, *_MODEL_KEYS),
            tensor=gpu["tensor"],
            batch=gpu["batch"],
            cache_tokens=format(gpu["cache_tokens"], ","),
            kv_local=a["kv_local"],
            head_dim=a["head_dim"],
            compile_s=format(gpu["compile_s"], ".1f"),
        ),
        "",
        table(
            ["", "per GPU"],
            [
                ["arguments (measured)", f"**{fmt_size(gpu['argument_bytes'])}**"],
                ["parameters (analytic)", fmt_size(a["parameter_bytes"])],
                [
                    _fill(
                        "section.8",
                        layers=g["layers"],
                        batch=gpu["batch"],
                        cache_tokens=format(gpu["cache_tokens"], ","),
                        kv_local=a["kv_local"],
                        head_dim=a["head_dim"],
                    ),
                    fmt_size(a["cache_bytes"]),
                ],
                [
                    _fill("section.9"),
                    f"**{fmt_size(a['parameter_bytes'] + a['cache_bytes'])}**",
                ],
                ["outputs (logits + cache)", fmt_size(gpu["output_bytes"])],
                ["aliased (the cache)", fmt_size(gpu["alias_bytes"])],
                ["temp", fmt_size(gpu["temp_bytes"])],
                ["peak", fmt_size(gpu["peak_bytes"])],
            ],
        ),
        "",
        _fill("section.10", tensor=gpu["tensor"]),
        "",
        table(
            ["parameter", "shape", "dtype", "held", "per GPU"],
            [
                [
                    f"`{p['name']}`",
                    "x".join(str(n) for n in p["shape"]),
                    p["dtype"],
                    f"1/{gpu['tensor']}" if p["split"] else "whole",
                    fmt_size(p["bytes"]),
                ]
                for p in a["parameters"]
            ],
        ),
        "",
        _fill("section.11"),
        "",
    ]
    per = collectives_per_token(gpu)
    exp = gpu["expected"]
    rows = []
    for kind in sorted(set(per) | set(exp)):
        m = per.get(kind, {"in_hlo": 0, "runs": 0, "bytes": 0})
        e = exp.get(kind, {"ops": 0, "bytes": 0})
        rows.append(
            [kind, m["in_hlo"], m["runs"], e["ops"], fmt_size(m["bytes"]), fmt_size(e["bytes"])]
        )
    out += [
        table(
            [
                "collective",
                "instructions in the HLO",
                "run per token",
                "expected per token",
                "bytes per GPU per token",
                "expected bytes",
            ],
            rows,
        ),
        "",
        _fill("section.12", collective_prose=_collective_prose(gpu)),
    ]
    return "\n".join(out) + "\n"
