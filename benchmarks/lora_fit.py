"""LoRA and QLoRA of Llama-3-70B (s = 4096, rank 16 on every linear layer, remat) on the
fewest H100s the planner's formula finds, checked by deviceless compiles of
reduced-depth slices; and the compiled LoRA step against the full fine-tune's at the same
shape (the peaks; that no weight-gradient GEMM of a frozen kernel is compiled is
``tests/test_lora.py``'s check of the step's HLO).

``JAX_PLATFORMS=cpu PYTHONPATH=. python -m benchmarks.lora_fit [--depths 2 4]`` prints
JSON: for ``nf4`` (1 GPU) and ``bf16`` (the fewest GPUs, tensor 4) the formula's answer
and each slice compiled beside its formula, the peak extrapolated to 80 layers from the
slices (a per-layer slope), and the full fine-tune's slice on the same layout.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from benchmarks.plan_fewest import fewest_gpus, row_dict, slice_compile
from sp_jax.analysis.shapes import MODELS

__all__ = ["main"]

GiB = 2**30


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import jax

    jax.config.update("jax_platforms", "cpu")  # deviceless compiles
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--base-dtypes", nargs="*", default=["nf4", "bf16"])
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for base in args.base_dtypes:
        model = MODELS["llama-3-70b"].replace(seq=4096, lora_rank=16, base_dtype=base)
        gpus, row = fewest_gpus(model, step=1, most=64)
        entry = {"gpus": gpus, "answer": row_dict(row), "slices": []}
        for depth in args.depths:
            entry["slices"].append(slice_compile(model, gpus, row, depth, 0))
            full = slice_compile(model.replace(lora_rank=0, base_dtype=None), gpus, row,
                                 depth, 0)
            entry["slices"][-1]["full_finetune"] = {
                k: full[k] for k in ("compiled_gib", "error", "compile_s")}
            print(json.dumps(entry["slices"][-1]), flush=True)
        s = entry["slices"]
        if len(s) >= 2:
            slope = (s[-1]["compiled_gib"] - s[0]["compiled_gib"]) / (
                s[-1]["layers"] - s[0]["layers"])
            entry["extrapolated_80_layers_gib"] = s[0]["compiled_gib"] + slope * (
                model.layers - s[0]["layers"])
        out[base] = entry
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
