"""Activations on the host (``ParallelConfig(offload_activations=True)``), measured by
deviceless 8 x H100 compiles: a scanned stack of GPT blocks (``lax.scan`` over the
layers, as ``GPTConfig(scan_layers=True)`` runs them), forward and backward, with and
without the option, at two depths.

* device temp growth per layer: ``(temp(L2) - temp(L1)) / (L2 - L1)`` from
  ``memory_analysis()``;
* host bytes per layer: the same difference of ``host_temp_size_in_bytes``, against the
  analytic size of what the rules move (:func:`offloaded_bytes_per_layer`);
* the HLO's host buffers (memory space ``S(5)``) in the scan's while bodies.

The compile: :func:`sp_jax.analysis.checks.scanned_stack_report`.

Also every form of a GPT's layers a user can pick (:func:`measure_forms`: unrolled,
scanned, with and without a data axis, remat, pipeline stages under GPipe and 1F1B;
h=256, s=1024, 2 and 4 layers, 4 and 8 for scanned remat and stages:
:func:`sp_jax.analysis.checks.per_layer_memory`).

Run: ``JAX_PLATFORMS=cpu python -m benchmarks.activation_offload`` (the forms first, 32
small compiles, about 15 minutes on 2 busy CPU cores, one JSON line per form; then the
eight compiles at h=4096, about 8 minutes, one JSON object per setting, without and with
``remat``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from sp_jax.analysis.checks import (
    STACK_FORMS,
    offloaded_bytes_per_layer,
    per_layer_memory,
    scanned_stack_report,
)

__all__ = ["H100_BF16_FLOPS", "PCIE_GEN5_BYTES_PER_S", "layer_flops", "measure", "measure_forms",
           "offloaded_bytes_per_layer"]

PCIE_GEN5_BYTES_PER_S = 64e9
"""An H100 SXM's host link, PCIe Gen5 x16: about 64 GB/s each way (NVIDIA's figure; an
estimate of the transfer time, not a measurement)."""

H100_BF16_FLOPS = 989e12
"""An H100 SXM's dense bf16 tensor-core peak (NVIDIA's figure): the compute time below is
a lower bound."""


def layer_flops(*, hidden: int, seq: int, tensor: int, batch: int = 1,
                mlp_hidden: int | None = None) -> float:
    """Forward + backward FLOPs of one block per device: ``6 x`` the GEMMs' (weights
    ``4 h^2 + 2 h f`` over ``t``) per token, plus causal attention's ``q k`` and ``p v``
    (``2 x 2 s^2 h / t`` forward, half of it masked away, times 3 with the backward)."""
    f = mlp_hidden or 4 * hidden
    gemm = 6 * (4 * hidden * hidden + 2 * hidden * f) / tensor * batch * seq
    attention = 3 * 2 * seq * seq * hidden / tensor * batch
    return gemm + attention


def _host_buffers_in_while_bodies(hlo: str) -> int:
    names = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    count = 0
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if m and m.group(1) in names and "S(5)" in block:
            count += 1
    return count


def measure(*, depths: tuple[int, int] = (4, 8), hidden: int = 4096, seq: int = 8192,
            heads: int = 32, tensor: int = 8, remat: bool = False) -> dict[str, Any]:
    """Per-layer device temp growth with and without offload, host bytes per layer and
    the analytic size; ``ratio`` is the offload run's growth over the other's."""
    l1, l2 = depths
    out: dict[str, Any] = {"shape": {"layers": depths, "hidden": hidden, "seq": seq,
                                     "heads": heads, "tensor": tensor, "dtype": "bfloat16",
                                     "recompute_allgather": True, "remat": remat}}
    for offload in (False, True):
        runs = {n: scanned_stack_report(layers=n, hidden=hidden, seq=seq, heads=heads,
                                        tensor=tensor, remat=remat, offload=offload)
                for n in depths}
        key = "offload" if offload else "device"
        out[key] = {
            "temp_bytes": {n: r["temp_bytes"] for n, r in runs.items()},
            "host_temp_bytes": {n: r["host_temp_bytes"] for n, r in runs.items()},
            "temp_growth_per_layer": (runs[l2]["temp_bytes"] - runs[l1]["temp_bytes"])
            / (l2 - l1),
            "host_bytes_per_layer": (runs[l2]["host_temp_bytes"]
                                     - runs[l1]["host_temp_bytes"]) / (l2 - l1),
            "while_bodies_with_host_buffers": _host_buffers_in_while_bodies(runs[l2]["hlo"]),
        }
    analytic = offloaded_bytes_per_layer(hidden=hidden, seq=seq, heads=heads, tensor=tensor,
                                         remat=remat)
    out["analytic_bytes_per_layer"] = analytic
    out["analytic_total_per_layer"] = sum(analytic.values())
    out["ratio"] = out["offload"]["temp_growth_per_layer"] / \
        out["device"]["temp_growth_per_layer"]
    moved = 2 * out["offload"]["host_bytes_per_layer"]  # to the host and back
    out["bytes_moved_per_layer"] = moved
    out["pcie_seconds_per_layer_estimate"] = moved / PCIE_GEN5_BYTES_PER_S
    out["compute_seconds_per_layer_at_peak"] = layer_flops(
        hidden=hidden, seq=seq, tensor=tensor) / H100_BF16_FLOPS
    return out


def measure_forms(*, hidden: int = 256, seq: int = 1024, heads: int = 8, tensor: int = 8,
                  depths: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Per form of a GPT's layers (:data:`~sp_jax.analysis.checks.STACK_FORMS`: unrolled,
    scanned, with and without a data axis, remat, pipeline stages) the device temp growth
    and host bytes per layer (MiB, per layer of a stage) with and without the option,
    and their ratio (what ``tests/test_offload_activations.py`` checks); ``depths``: None
    for :func:`~sp_jax.analysis.checks.per_layer_memory`'s per form."""
    import jax

    shape = {"hidden": hidden, "seq": seq, "heads": heads, "tensor": tensor}
    rows = []
    for form in STACK_FORMS:
        device = per_layer_memory(form, offload=False, depths=depths, **shape)
        row = {"form": form, "device": {k: v / 2**20 for k, v in device.items()}}
        try:
            host = per_layer_memory(form, offload=True, depths=depths, **shape)
        except jax.errors.JaxRuntimeError as err:  # a form XLA:GPU cannot compile
            rows.append({**row, "offload": f"does not compile: {str(err)[:200]}"})
            continue
        rows.append({**row, "offload": {k: v / 2**20 for k, v in host.items()},
                     "ratio": host["growth_bytes"] / device["growth_bytes"]})
    return rows


if __name__ == "__main__":
    for row in measure_forms():
        print(json.dumps(row))
    for remat in (False, True):
        print(json.dumps(measure(remat=remat), indent=1, default=str))
