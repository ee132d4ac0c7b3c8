"""FSDP on 8 x H100 (deviceless compiles): the training step's temp memory with parameters
sharded over data against the replicated step, and the backward weight gathers.

Run ``python -m benchmarks.fsdp [--quick] [--json PATH] [--markdown PATH]`` (a minute
or two on 2 CPU cores; needs the CUDA PJRT plugin). For each layout it compiles the GPT
training step (:func:`sp_jax.training.train_step_fn`: forward, backward, AdamW;
parameters and optimizer state donated; rotary positions, bf16 compute, fp32 master
weights, ``recompute_allgather``, vocabulary 32,000) of ``layers`` layers at h=4096,
s=2048 (one sequence per data shard), with and without ``ParallelConfig(fsdp=True)``,
and reads ``memory_analysis()`` and the compiled HLO:

- temp of the fsdp step over temp of the replicated one (target: <= 0.6x);
- every all-gather of a weight in the backward pass (JAX scope ``fsdp_gather`` under
  ``transpose(jvp())``): its dtype (target: bf16), whether XLA scheduled it
  asynchronously (``is_sync`` false on its start; target: all), and whether the schedule
  put work between its start and done (reported; where it put none, the scheduler's cost
  model gave the independent work to another collective).

Public ``sp_jax`` names and :mod:`sp_jax.analysis` only.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from benchmarks.section import write_outputs  # noqa: E402
from sp_jax.analysis.checks import fsdp_step_report  # noqa: E402

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class FsdpBench:
    """The layouts: ``(data, tensor, scan_layers)`` each, at ``layers`` x ``h``."""

    layers: int = 4
    h: int = 4096
    heads: int = 32
    s: int = 2048
    vocab: int = 32000
    layouts: tuple[tuple[int, int, bool], ...] = ((8, 1, False), (8, 1, True), (4, 2, False))


FULL = FsdpBench()
QUICK = FsdpBench(layers=2, h=512, heads=8, s=256, vocab=1024, layouts=((8, 1, False),))


def compile_step(bench: FsdpBench, data: int, tensor: int, scan: bool, fsdp: bool
                 ) -> dict[str, Any]:
    """Temp / peak MiB of one training step and its backward weight gathers
    (:func:`sp_jax.analysis.checks.fsdp_step_report`)."""
    return fsdp_step_report(bench, data, tensor, scan, fsdp)


def run_fsdp(bench: FsdpBench) -> dict[str, Any]:
    rows = []
    for data, tensor, scan in bench.layouts:
        row = {"data": data, "tensor": tensor, "scan": scan,
               "replicated": compile_step(bench, data, tensor, scan, False),
               "fsdp": compile_step(bench, data, tensor, scan, True)}
        row["temp_ratio"] = row["fsdp"]["temp_mib"] / row["replicated"]["temp_mib"]
        rows.append(row)
        print(f"[fsdp] {data}x{tensor}{' scan' if scan else ''}: temp "
              f"{row['fsdp']['temp_mib']:.1f} / {row['replicated']['temp_mib']:.1f} MiB "
              f"({row['temp_ratio']:.2f}x); backward gathers "
              f"{row['fsdp']['bwd_gathers_async']} of {row['fsdp']['bwd_gathers']} async "
              f"({row['fsdp']['bwd_gathers_overlapped']} with work inside), "
              f"{row['fsdp']['bwd_gather_dtypes']}", flush=True)
    first = rows[0]
    targets = [
        {"id": "fsdp_temp", "target": f"fsdp temp <= 0.6x the replicated step's "
                                      f"({first['data']}x{first['tensor']})",
         "measured": f"{first['temp_ratio']:.2f}x ({first['fsdp']['temp_mib']:.1f} / "
                     f"{first['replicated']['temp_mib']:.1f} MiB)",
         "met": first["temp_ratio"] <= 0.6},
        {"id": "fsdp_bwd_gathers", "target": "every backward weight all-gather async and "
                                             "bf16 (every layout)",
         "measured": "; ".join(f"{r['data']}x{r['tensor']}{' scan' if r['scan'] else ''}: "
                               f"{r['fsdp']['bwd_gathers_async']} of "
                               f"{r['fsdp']['bwd_gathers']}, {r['fsdp']['bwd_gather_dtypes']}"
                               for r in rows),
         "met": all(r["fsdp"]["bwd_gathers_async"] == r["fsdp"]["bwd_gathers"] > 0
                    and r["fsdp"]["bwd_gather_dtypes"] == ["bf16"] for r in rows)},
    ]
    return {"bench": dataclasses.asdict(bench), "rows": rows, "targets": targets}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.render.fsdp import render_markdown

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the section here")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    res = run_fsdp(QUICK if args.quick else FULL)
    res["meta"] = {"runtime_s": time.perf_counter() - t0, "jax": jax.__version__}
    write_outputs(res, json_path=args.json, markdown_path=args.markdown,
                  render=render_markdown, log=lambda m: print(f"[fsdp] {m}", flush=True))
    return res


if __name__ == "__main__":
    main()
