"""STAND-IN for the covering array (the "cover" helper writes the real one under this
name; the integrator takes theirs): the interface test_combinations.py runs, with one
combination per feature and the risky triples of issue 50."""

from __future__ import annotations

import dataclasses

import compat_features

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


def _runs(features: tuple[str, ...]) -> bool:
    """Whether the set can run in some mode on 8 devices."""
    try:
        made = compat_features.setup(features)
        compat.check("train", list(made.names), where="covering")
        made.gpt_config()
    except ValueError:
        return False
    return made.devices <= 8 and bool(_modes(made.names))


def combinations(tier: str = "all") -> list[Combination]:
    """``"feature"``: a few sets in which every feature appears at least once (greedy,
    up to 5 features a set); ``"all"``: those and the risky triples."""
    if tier not in ("all", "feature"):
        raise ValueError(f"covering.combinations: tier={tier!r}: use 'all' or 'feature'.")
    left = [f for f in compat.FEATURES if f != "cudnn_attention"]
    out = []
    while left:
        chosen = [left.pop(0)]
        for f in list(left):
            if len(chosen) < 5 and _runs((*chosen, f)):
                chosen.append(f)
                left.remove(f)
        features = tuple(chosen)
        out.append(Combination(f"f{len(out):02d}", features, _modes(features)))
    out.append(Combination("f-cudnn", ("cudnn_attention",), _modes(("cudnn_attention",))))
    if tier == "all":
        out += [Combination(k, v, _modes(v)) for k, v in RISKY.items()]
    return out
