"""STAND-IN for the covering array (the "cover" helper writes the real one under this
name; the integrator takes theirs): the interface test_combinations.py runs, with one
combination per feature and the risky triples of issue 50."""

from __future__ import annotations

import dataclasses

from sp_jax import compat


@dataclasses.dataclass(frozen=True)
class Combination:
    """A feature set and the modes it runs in; ``id`` stable (a test id)."""

    id: str
    features: tuple[str, ...]
    modes: tuple[str, ...]


RISKY = {  # the triples issue 50 names
    "triple-pipeline-experts-fp8": ("pipeline_1f1b", "expert_parallel", "fp8_delayed"),
    "triple-context-packed-window": ("context_ring", "packed_documents", "sliding_window"),
    "triple-fsdp-offload-pipeline": ("fsdp", "offload_optimizer", "pipeline_gpipe"),
    "triple-zero1-experts-pipeline": ("zero1", "expert_parallel", "pipeline_gpipe"),
}


def _modes(features: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(m for m in compat.MODES if all(
        compat.cell(m, a, b).status not in ("n/a", "refused", "exclusive")
        for a in features for b in features))


def combinations(tier: str = "all") -> list[Combination]:
    """``"feature"``: one combination per feature (with tensor + sequence parallelism);
    ``"all"``: those and the risky triples."""
    if tier not in ("all", "feature"):
        raise ValueError(f"covering.combinations: tier={tier!r}: use 'all' or 'feature'.")
    out = []
    for name in compat.FEATURES:
        features = tuple(dict.fromkeys(("tensor_sequence", name)))
        if _modes(features):
            out.append(Combination(f"f-{name}", features, _modes(features)))
    if tier == "all":
        out += [Combination(k, v, _modes(v)) for k, v in RISKY.items()]
    return out
