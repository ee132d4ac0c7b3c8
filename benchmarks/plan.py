"""The memory planner's targets (``sp_jax.analysis.plan``): a 7B on 8 H100s, a 7B at 128k
tokens on 64 and a 70B on 64, each from deviceless compiles of the real training step,
and the planner's figures against analytic values and a CPU compile of a small model."""

from __future__ import annotations

from typing import Any

from sp_jax.analysis.checks import plan_cpu_check
from sp_jax.analysis.plan import MODELS, ModelShape, format_table, plan

__all__ = ["PLANS", "run_plans", "small_check"]

PLANS = (("7b", 8, {}), ("7b", 64, {"seq": 131072}), ("70b", 64, {}),
         ("gpt3-175b", 128, {}))
SMALL = ModelShape("small", hidden=256, layers=2, heads=8, vocab=512, seq=256)


def small_check(model: ModelShape = SMALL) -> dict[str, Any]:
    """The planner on a small model against a CPU compile of the same step
    (:func:`sp_jax.analysis.checks.plan_cpu_check`)."""
    return plan_cpu_check(model)


def run_plans(log=print) -> dict[str, Any]:
    out: dict[str, Any] = {"plans": []}
    for name, gpus, overrides in PLANS:
        model = MODELS[name].replace(**overrides)
        rows = plan(model, gpus, progress=False)
        out["plans"].append({"model": name, "seq": model.seq, "gpus": gpus,
                             "params": model.params, "table": format_table(model, rows),
                             "rows": [r.as_dict() for r in rows]})
        fits = [r.option.label for r in rows if r.fits]
        log(f"  {name} s={model.seq} on {gpus} GPUs: {len(fits)}/{len(rows)} layouts fit")
    out["small"] = small_check()
    return out
