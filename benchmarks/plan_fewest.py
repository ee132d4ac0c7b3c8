"""The fewest H100s on which the planner's formula search fits a model's training, and
that answer checked by deviceless compiles of reduced-depth slices (BENCHMARKS.md's
planner section, DeepSeek-V3 and Kimi K2).

- :func:`fewest_gpus`: :func:`sp_jax.analysis.memory_options.search` over GPU counts in
  steps of 8 (whole nodes), the first with a fitting row, and its preferred row
  (:func:`~sp_jax.analysis.memory_options.best`).
- :func:`slice_compile`: the answer's layout and memory options compiled deviceless for
  the same GPUs (:func:`sp_jax.analysis.plan.plan`, the training step as ``TrainStep``
  runs it) on the model cut to ``layers`` layers (``dense`` of them dense), beside the
  formula of that slice.

``JAX_PLATFORMS=cpu PYTHONPATH=. python -m benchmarks.plan_fewest --model deepseek-v3
[--depths 2 4]`` prints the answer and each slice as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from typing import Any

from sp_jax.analysis.memory_options import FitRow, best, search
from sp_jax.analysis.shapes import MODELS, ModelShape

__all__ = ["fewest_gpus", "row_dict", "slice_compile"]

GiB = 2**30


def row_dict(row: FitRow) -> dict[str, Any]:
    """A formula row's layout, options and GiB per GPU."""
    return {"layout": row.layout.label, "options": row.options.label,
            "device_gib": row.device_bytes / GiB, "weights_gib": row.weights_bytes / GiB,
            "optimizer_gib": row.optimizer_bytes / GiB,
            "activation_gib": row.activation_bytes / GiB, "update_gib": row.update_bytes / GiB,
            "host_gib": row.host_bytes / GiB}


def fewest_gpus(model: ModelShape, *, most: int = 4096, step: int = 8
                ) -> tuple[int, FitRow] | None:
    """The fewest GPUs (a multiple of ``step`` up to ``most``) on which a row of the
    formula search fits, and the preferred such row; None if none does."""
    for gpus in range(step, most + 1, step):
        row = best(search(model, gpus))
        if row is not None:
            return gpus, row
    return None


def slice_compile(model: ModelShape, gpus: int, row: FitRow, layers: int, dense: int
                  ) -> dict[str, Any]:
    """``row``'s layout and memory options compiled deviceless on ``gpus`` H100s for
    ``model`` cut to ``layers`` layers (the first ``dense`` dense), beside the formula
    of that slice (GiB per GPU)."""
    cut = model.replace(layers=layers, dense_layers=dense)
    formula = next(r for r in search(cut, gpus)
                   if r.layout == row.layout and r.options == row.options)
    planner = importlib.import_module("sp_jax.analysis.plan")  # (the package's plan: a function)
    t0 = time.perf_counter()
    compiled = planner.plan(cut, gpus, options=[formula.layout], batch=formula.batch,
                            progress=False, memory=formula.options)[0]
    return {"layers": layers, "dense_layers": dense, "formula": row_dict(formula),
            "compiled_gib": compiled.peak_bytes / GiB,
            "compiled_host_gib": compiled.host_bytes / GiB, "error": compiled.error,
            "compile_s": time.perf_counter() - t0,
            "compiled_over_formula": compiled.peak_bytes / formula.device_bytes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import jax

    jax.config.update("jax_platforms", "cpu")  # deviceless compiles
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--depths", type=int, nargs="*", default=[2, 4],
                        help="slice depths to compile (the first layer dense where the "
                             "model has dense layers)")
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    found = fewest_gpus(model)
    out: dict[str, Any] = {"model": args.model, "params": model.params}
    if found is None:
        print(json.dumps(out | {"gpus": None}, indent=1))
        return out
    gpus, row = found
    out |= {"gpus": gpus, "answer": row_dict(row), "slices": []}
    for depth in args.depths:
        out["slices"].append(slice_compile(model, gpus, row, depth,
                                           min(model.dense_layers, 1)))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
