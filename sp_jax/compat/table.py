"""The table of what combines: the features, the modes, the refusals, the coverage rows,
:func:`check` and :func:`check_mode` (``sp_jax.compat`` re-exports every public name; its
docstring says how the table is used). Imports nothing from sp_jax outside this package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["ALIASES", "COVERED", "FEATURES", "IMPLIES", "MODES", "REFUSALS", "STATUSES",
           "TABLE", "Cell", "CombinationError", "Refusal", "build", "cell", "check",
           "check_mode", "cover", "coverage_source", "features_of", "fix_text",
           "load_coverage", "refusals", "spelled"]

_ROOT = Path(__file__).resolve().parents[2]  # the checkout, where sp_jax is one

MODES: dict[str, str] = {
    "train": "a training step: TrainStep, or jax.grad of GPT.loss",
    "eval": "logits or hidden states without gradients (GPT.__call__, GPT.hidden_states)",
    "generate": "sp_jax.models.generate: prefill and key/value-cache decoding",
}
"""The modes, each with what it covers."""

FEATURES: dict[str, str] = {
    "tensor_sequence": "tensor + sequence parallelism (ParallelConfig.tensor_axis)",
    "collective_matmul": "ParallelConfig(collective_matmul=True): ring-overlapped GEMMs",
    "recompute_allgather": "ParallelConfig(recompute_allgather=True)",
    "fsdp": "ParallelConfig(fsdp=True): parameters sharded over the data axes",
    "context_ring": "ParallelConfig(context_parallel='ring'): ring attention",
    "context_ulysses": "ParallelConfig(context_parallel='ulysses'): all-to-all attention",
    "pipeline_gpipe": "ParallelConfig(pipeline_axis=..., pipeline_schedule='gpipe')",
    "pipeline_1f1b": "ParallelConfig(pipeline_axis=..., pipeline_schedule='1f1b')",
    "scan_layers": "GPTConfig(scan_layers=True): the layers stacked, run by one lax.scan",
    "unrolled_layers": "GPTConfig(scan_layers=False), the default: one module per layer",
    "experts": "GPTConfig(num_experts=E > 0): mixture-of-experts layers",
    "expert_parallel": "ParallelConfig(expert_axis=...): experts sharded over a mesh axis",
    "interleaved_experts": "GPTConfig(moe_layer_freq > 1): dense layers between expert ones",
    "dense_layers": "GPTConfig(num_dense_layers=k > 0): k dense layers before the experts",
    "sigmoid_routing": "GPTConfig(moe_scoring='sigmoid', moe_groups=...): DeepSeek-V3's "
                       "routing (sigmoid scores, group-limited top-k, routed scale)",
    "aux_free_bias": "GPTConfig(moe_bias_update_rate > 0): the experts' selection bias moved "
                     "by each training step (aux-loss-free balancing)",
    "seq_aux_loss": "GPTConfig(moe_seq_aux_loss_coef > 0): DeepSeek-V3's sequence-wise "
                    "balance loss",
    "fp8_current": "GPTConfig(fp8=Fp8Recipe('current')): FP8 GEMMs, current scaling",
    "fp8_delayed": "GPTConfig(fp8=Fp8Recipe('delayed')): FP8 GEMMs, amax history",
    "packed_documents": "segment_ids / positions: several documents per row",
    "sliding_window": "GPTConfig(sliding_window=w): attention to the last w tokens",
    "layer_windows": "GPTConfig(layer_windows=...): each layer's window as data",
    "cudnn_attention": "GPTConfig(attention_implementation='cudnn'): cuDNN's kernel",
    "grouped_query": "GPTConfig(num_kv_heads < num_heads): grouped-query attention",
    "attention_dropout": "GPTConfig(attention_dropout > 0): dropout on the probabilities",
    "attention_softcap": "GPTConfig(attention_softcap=c): scores c * tanh(s / c) (Gemma 2)",
    "custom_loss": "TrainStep(loss_fn=...) other than the default lm_loss",
    "zero1": "ParallelConfig(fsdp='optimizer'): the optimizer state sharded over data (ZeRO-1)",
    "grad_reduce_dtype": "ParallelConfig(grad_reduce_dtype=...): gradients reduced in bf16",
    "offload_optimizer": "TrainStep(offload_optimizer / offload_params): state on the host",
    "offload_activations": "ParallelConfig(offload_activations=True): saved values on the host",
    "mla_attention": "GPTConfig(attention='mla'): multi-head latent attention (DeepSeek-V3)",
    "mtp": "GPTConfig(mtp_depth=D > 0): multi-token prediction modules (DeepSeek-V3)",
    "lora": "GPTConfig(lora=LoRAConfig(...)): low-rank adapters on a frozen base",
}
"""Every feature the table knows, with a one-line description. ``unrolled_layers`` is an
option's default value: :func:`features_of` reports it only with ``defaults=True`` (what
:func:`check_mode` asks), since the refusals name it."""

ALIASES: dict[str, tuple[str, ...]] = {
    "pipeline": ("pipeline_gpipe", "pipeline_1f1b"),
    "fp8": ("fp8_current", "fp8_delayed"),
    "context": ("context_ring", "context_ulysses"),
}
"""Names for a whole option (either of its values): ``check`` accepts them, the table's
entries are written with them."""

_NAMES: dict[str, str] = {  # how a message spells a feature (a caller may spell the value)
    "tensor_sequence": "tensor + sequence parallelism",
    "collective_matmul": "collective_matmul=True",
    "recompute_allgather": "recompute_allgather=True",
    "fsdp": "fsdp=True",
    "context_ring": "ring attention",
    "context_ulysses": "Ulysses attention",
    "pipeline_gpipe": "pipeline stages",
    "pipeline_1f1b": "pipeline stages",
    "pipeline": "pipeline stages",
    "scan_layers": "scan_layers=True",
    "unrolled_layers": "scan_layers=False",
    "experts": "a mixture of experts (num_experts > 0)",
    "expert_parallel": "expert_axis",
    "interleaved_experts": "moe_layer_freq > 1",
    "dense_layers": "dense layers before the experts (num_dense_layers > 0)",
    "sigmoid_routing": "DeepSeek-V3 routing (moe_scoring='sigmoid' or moe_groups > 1)",
    "aux_free_bias": "aux-loss-free balancing (moe_bias_update_rate > 0)",
    "seq_aux_loss": "the sequence-wise balance loss (moe_seq_aux_loss_coef > 0)",
    "fp8_current": "FP8 (fp8=Fp8Recipe('current'))",
    "fp8_delayed": "FP8 (fp8=Fp8Recipe('delayed'))",
    "fp8": "FP8 (fp8=Fp8Recipe(...))",
    "context": "a context axis",
    "packed_documents": "packed documents (segment_ids / positions)",
    "sliding_window": "a sliding window",
    "layer_windows": "layer_windows (a window per layer)",
    "cudnn_attention": "attention_implementation='cudnn'",
    "grouped_query": "grouped-query attention (num_kv_heads < num_heads)",
    "attention_dropout": "attention dropout",
    "attention_softcap": "an attention soft cap (attention_softcap)",
    "custom_loss": "a custom loss_fn",
    "zero1": "fsdp='optimizer' (ZeRO-1)",
    "grad_reduce_dtype": "grad_reduce_dtype",
    "offload_optimizer": "optimizer offload",
    "offload_activations": "offload_activations=True",
    "mla_attention": "multi-head latent attention (attention='mla')",
    "mtp": "multi-token prediction (mtp_depth > 0)",
    "lora": "LoRA adapters (lora=LoRAConfig(...))",
}

STATUSES: dict[str, tuple[str, str]] = {
    "supported": ("+", "supported: a test runs it (its node ids)"),
    "refused": ("x", "refused: a ValueError says what to do instead"),
    "exclusive": ("=", "exclusive: two values of one option"),
    "n/a": ("·", "not applicable: the feature has no meaning in this mode"),
    "untested": ("?", "not refused, but no test runs it yet"),
}
"""Each status of a cell: its symbol in :func:`render` and its meaning."""


class CombinationError(ValueError):
    """A combination of features (or a feature in a mode) that sp_jax refuses."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of :data:`TABLE`.

    Attributes:
      status: one of :data:`STATUSES`.
      tests: with ``supported``: pytest node ids that run the combination.
      fix: with ``refused``: what to do instead (the end of the error message; a
        ``{feature}`` field in it is that feature as the message spells it).
      first: with ``refused``: the feature the message names first (the subject).
      alone: with ``refused``: the feature whose refusal in this mode (alone) refuses the
        pair too, or ``""``.
      unless: with ``refused``: features any of which lifts the refusal (e.g. a pipeline,
        which reduces the gradients in its own schedule), or ``()``.
      via: with ``refused``: the pair whose refusal refuses this one because a feature
        brings the other of that pair along (:data:`IMPLIES`: pipeline stages scan the
        layers, so they are refused with what ``scan_layers`` is), or ``()``.
    """

    status: str
    tests: tuple[str, ...] = ()
    fix: str = ""
    first: str = ""
    alone: str = ""
    unless: tuple[str, ...] = ()
    via: tuple[str, ...] = ()


class Refusal(NamedTuple):
    """One entry of :data:`REFUSALS`: in ``modes``, ``first`` with ``second`` (None:
    ``first`` alone) is refused, ``fix`` saying what to do, unless one of the features of
    ``unless`` is there too. Features may be aliases (each of their values)."""

    modes: tuple[str, ...]
    first: str
    second: str | None
    fix: str
    unless: tuple[str, ...] = ()


def _expand(name: str) -> tuple[str, ...]:
    if name in ALIASES:
        return ALIASES[name]
    if name not in FEATURES:
        raise ValueError(f"sp_jax.compat: unknown feature {name!r}; use one of "
                         f"{sorted(FEATURES)} or {sorted(ALIASES)}.")
    return (name,)


def _key(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


# -- the table: refusals, exclusive values, features without meaning in a mode -------------
# Features may be aliases (every member gets the cell). What no entry names, and no
# coverage row runs, is "untested".

_ALL = tuple(MODES)
_TRAIN_EVAL = ("train", "eval")
_LIFTED_BY_A_PIPELINE = ("pipeline",)
_REDUCE_FIX = ("{grad_reduce_dtype} without a pipeline reduces the gradients of a dense "
               "sp_jax GPT on an Explicit mesh (no fsdp='full', expert_axis, experts or fp8), "
               "in the step's data-manual gradient function; leave grad_reduce_dtype=None, or "
               "use a pipeline (pipeline_axis=...), which reduces in its own schedule.")

REFUSALS: list[Refusal] = [
    Refusal(_ALL, "grouped_query", "mla_attention",
            "{mla_attention} has no key/value heads to group: every head's keys and values "
            "are up-projected from one shared latent; leave num_kv_heads None (or equal to "
            "num_heads) with attention='mla'."),
    Refusal(_ALL, "mla_attention", "cudnn_attention",
            "{mla_attention} needs attention_implementation='xla': its keys (qk_nope_head_dim + "
            "qk_rope_head_dim) and values (v_head_dim) have different head sizes, which "
            "jax.nn.dot_product_attention's cuDNN kernel does not take, and its latent ring "
            "merges steps by log-sum-exp."),
    Refusal(_ALL, "cudnn_attention", "context_ring",
            "attention_implementation='cudnn' cannot run ring attention (its steps are merged "
            "by log-sum-exp, which cuDNN's kernel does not return); use "
            "attention_implementation='xla' or context_parallel='ulysses'."),
    Refusal(_TRAIN_EVAL, "packed_documents", "cudnn_attention",
            "segment_ids (packed documents) need implementation='xla': "
            "jax.nn.dot_product_attention's cuDNN kernel takes no document ids in this JAX "
            "(only a dense [s, s] mask, which would undo the memory savings)."),
    Refusal(_ALL, "attention_dropout", "cudnn_attention",
            "{attention_dropout} needs attention_implementation='xla' (cuDNN's kernel draws "
            "masks of its own, which would not be the same under every sharding)."),
    Refusal(_ALL, "attention_softcap", "cudnn_attention",
            "{attention_softcap} needs attention_implementation='xla' "
            "(jax.nn.dot_product_attention's cuDNN kernel takes a scale but no soft cap of the "
            "scores; a dense bias or mask cannot express c * tanh(s / c))."),
    Refusal(_ALL, "layer_windows", "cudnn_attention",
            "{layer_windows} needs attention_implementation='xla': cuDNN's kernel takes a "
            "static window (an int: its local_window_size), not each layer's as data."),
    Refusal(_ALL, "pipeline", "unrolled_layers",
            "{pipeline} needs GPTConfig(scan_layers=True): the stages hold slices of the "
            "stacked blocks."),
    Refusal(_ALL, "interleaved_experts", "scan_layers",
            "scan_layers stacks alike layers, but {interleaved_experts} mixes dense and "
            "expert layers; use moe_layer_freq=1 or scan_layers=False."),
    Refusal(_ALL, "dense_layers", "interleaved_experts",
            "{dense_layers} makes every layer after the first num_dense_layers a mixture of "
            "experts; use moe_layer_freq=1 with it (or num_dense_layers=0 and "
            "moe_layer_freq alone)."),
    Refusal(("train",), "custom_loss", "pipeline",
            "a pipelined model trains with the default loss_fn=lm_loss through its own "
            "schedule (model.pipeline_loss_and_grads); a custom loss_fn cannot run on it."),
    Refusal(_ALL, "mtp", "pipeline",
            "{mtp}'s modules run after the last layer on the final hidden states and share "
            "the embedding of the first stage, which the pipeline's schedule does not carry "
            "to the last stage yet (torchtitan refuses it too); train with mtp_depth=0 on "
            "pipeline stages, or without pipeline_axis."),
    Refusal(_ALL, "lora", "fp8",
            "{lora} multiply in the compute dtype inside the base layer's op (their GEMM "
            "object, sp_jax.ops.lora.LoRAGemm, is the layer's one GEMM); pass fp8=None, or "
            "store the frozen base in fp8 with LoRAConfig(base_dtype='fp8')."),
    Refusal(_ALL, "lora", "experts",
            "{lora} adapt the dense linear layers; the experts' grouped GEMMs take no "
            "adapters yet, so a mixture of experts would train its attention only; "
            "fine-tune it without lora (or a dense model with it)."),
    Refusal(_ALL, "lora", "mla_attention",
            "{lora} adapt q/k/v/o of multi-head or grouped-query attention; multi-head "
            "latent attention's low-rank projections take no adapters yet; use "
            "attention='mha' with lora, or train MLA without it."),
    *(Refusal(("train",), "grad_reduce_dtype", other, _REDUCE_FIX, _LIFTED_BY_A_PIPELINE)
      for other in ("fsdp", "experts", "expert_parallel", "fp8")),
    # interleaved_experts and dense_layers: refused through IMPLIES (they bring experts)
]
"""Each refusal (:class:`Refusal`); a feature may be an alias (each of its values is
refused)."""

_EXCLUSIVE = [("context_ring", "context_ulysses"), ("pipeline_gpipe", "pipeline_1f1b"),
              ("fp8_current", "fp8_delayed"), ("scan_layers", "unrolled_layers"),
              ("fsdp", "zero1")]  # fsdp=True (full) and fsdp="optimizer"

IMPLIES: dict[str, tuple[str, ...]] = {
    "pipeline": ("scan_layers",),
    "interleaved_experts": ("experts", "unrolled_layers"),
    "dense_layers": ("experts",),
    "expert_parallel": ("experts",),
    "sigmoid_routing": ("experts",),
    "aux_free_bias": ("experts",),
    "seq_aux_loss": ("experts",),
}
"""What a feature brings along: a model with it has these too (pipeline stages hold
slices of the stacked layers; dense layers between or before experts are a mixture of
experts). A pair refused with what one feature brings is refused with that feature too
(:attr:`Cell.via`), with the same fix and the same lifting features."""

_NOT_APPLICABLE = [(("generate",), "packed_documents"), (("eval", "generate"), "custom_loss"),
                   *((("eval", "generate"), f) for f in (
                       "zero1", "grad_reduce_dtype", "offload_optimizer",
                       "offload_activations", "aux_free_bias",
                       "seq_aux_loss"))]  # training only: no gradients, no update

COVERED: list[tuple[tuple[str, ...], tuple[str, ...], str]] = []
"""The coverage rows in :data:`TABLE`: ``(modes, features, pytest node id)``, the test
runs these features together in these modes (so every pair of them, and each alone, is
supported there). Empty until :func:`load_coverage` or :func:`cover` (the rows live in
the test suite, ``tests/compat_coverage.py``)."""

_SOURCE: list[str] = []  # where the coverage rows came from (one entry, or none)


def _brought(feature: str) -> tuple[str, ...]:
    """``feature`` and what it brings along (:data:`IMPLIES`, aliases expanded)."""
    return (feature, *(x for name, implied in IMPLIES.items() if feature in _expand(name)
                       for x in implied))


def _imply(cells: dict[frozenset[str], Cell]) -> None:
    """Adds to one mode's ``cells`` the pairs refused through what a feature brings along
    (:data:`IMPLIES`): as the first refused pair of what the two bring (FEATURES' order)."""
    for x, y in itertools.combinations(FEATURES, 2):
        found = [(cells[_key(a, b)], a, b) for a in _brought(x) for b in _brought(y)
                 if (a, b) != (x, y) and _key(a, b) in cells
                 and cells[_key(a, b)].status == "refused"]
        if _key(x, y) in cells or not found:
            continue
        old, a, b = found[0]
        first, brought = (x, a) if a != x else (y, b)  # the feature that brings the other
        cells[_key(x, y)] = Cell("refused", fix=f"{{{first}}} brings {{{brought}}} along: "
                                 f"{old.fix}", first=first, unless=old.unless,
                                 via=tuple(f for f in FEATURES if f in (a, b)))


def build(coverage: Iterable[tuple[tuple[str, ...], tuple[str, ...], str]] = ()
          ) -> dict[str, dict[frozenset[str], Cell]]:
    """A table (``{mode: {frozenset({a, b}): Cell}}``) of :data:`REFUSALS`, the exclusive
    values, the features without meaning in a mode and the ``coverage`` rows
    ``(modes, features, pytest node id)``; an AssertionError where a row runs a refused,
    exclusive or meaningless cell (a refusal lifted by a feature of the row excepted)."""
    table: dict[str, dict[frozenset[str], Cell]] = {m: {} for m in MODES}

    def put(modes: Iterable[str], a: str, b: str | None, value: Cell) -> None:
        for mode in modes:
            for x in _expand(a):
                for y in _expand(b) if b is not None else (x,):
                    if x == y and b is not None:
                        continue  # an alias against itself: its members are exclusive
                    key = _key(x, y)
                    old = table[mode].get(key)
                    if old is not None and old != value and old.status != "exclusive":
                        raise AssertionError(f"sp_jax.compat: two cells for {mode} {x} x {y}")
                    if old is None:
                        table[mode][key] = dataclasses.replace(
                            value, first=x if value.status == "refused" else "")

    for a, b in _EXCLUSIVE:
        put(_ALL, a, b, Cell("exclusive"))
    for modes, a, b, fix, unless in REFUSALS:
        lifted = tuple(x for u in unless for x in _expand(u))
        put(modes, a, b, Cell("refused", fix=fix, unless=lifted))
    for modes, a in _NOT_APPLICABLE:
        put(modes, a, None, Cell("n/a"))
    for cells in table.values():
        _imply(cells)
    for modes, features, test in coverage:
        for mode in modes:
            for x, y in itertools.combinations_with_replacement(features, 2):
                old = table[mode].get(_key(x, y))
                if old is not None and old.status == "refused" and \
                        set(old.unless) & set(features):
                    continue  # run with the feature that lifts the refusal
                if old is not None and old.status != "supported":
                    raise AssertionError(f"sp_jax.compat: {test} runs {x} x {y} in {mode}, "
                                         f"which the table says is {old.status}")
                tests = () if old is None else old.tests
                table[mode][_key(x, y)] = Cell("supported", tests=(*tests, test))
    for cells in table.values():
        for x, y in itertools.combinations(FEATURES, 2):
            key = _key(x, y)
            if key in cells:
                continue
            for status, f in itertools.product(("n/a", "refused"), (x, y)):
                alone = cells.get(_key(f, f))  # refused (or meaningless) alone: the pair too
                if alone is not None and alone.status == status:
                    cells[key] = dataclasses.replace(alone, alone=f)
                    break
        for x, y in itertools.combinations_with_replacement(FEATURES, 2):
            cells.setdefault(_key(x, y), Cell("untested"))
    return table


TABLE: dict[str, dict[frozenset[str], Cell]] = {}
"""``TABLE[mode][frozenset({a, b})]``: the :class:`Cell` of features ``a`` and ``b``
(``frozenset({a})``: ``a`` alone) in ``mode``; its supported cells are those of the
coverage loaded (:data:`COVERED`)."""


def cover(rows: Iterable[tuple[tuple[str, ...], tuple[str, ...], str]], *,
          source: str = "") -> None:
    """Makes ``rows`` (``(modes, features, pytest node id)``) the coverage of
    :data:`TABLE` (rebuilt in place, replacing earlier rows); ``source`` says where they
    came from (:func:`render` names it)."""
    rows = [(tuple(m), tuple(f), str(t)) for m, f, t in rows]
    table = build(rows)
    COVERED[:] = rows
    _SOURCE[:] = [source or "rows given to sp_jax.compat.cover"]
    TABLE.clear()
    TABLE.update(table)


def _default_coverage() -> Path:
    """``tests/compat_coverage.py`` of the checkout this package lies in."""
    return _ROOT / "tests" / "compat_coverage.py"


def load_coverage(path: str | Path | None = None) -> str:
    """Reads the coverage rows (the module-level ``COVERED`` list) of the Python file
    ``path`` (None: ``tests/compat_coverage.py`` beside the package, in a checkout) into
    :data:`TABLE` (:func:`cover`); returns how :func:`render` names the source (the path
    relative to the checkout when inside it). A FileNotFoundError when there is none."""
    path = Path(path) if path is not None else _default_coverage()
    if not path.is_file():
        raise FileNotFoundError(f"sp_jax.compat: no coverage file {path} (a checkout's "
                                "tests/compat_coverage.py, or pass --coverage PATH).")
    spec = importlib.util.spec_from_file_location("_sp_jax_compat_coverage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        label = path.resolve().relative_to(_ROOT).as_posix()
    except ValueError:
        label = str(path)
    cover(module.COVERED, source=label)
    return label


def coverage_source() -> str:
    """Where :data:`COVERED` came from (``""``: no coverage loaded)."""
    return _SOURCE[0] if _SOURCE else ""


def cell(mode: str, a: str, b: str | None = None) -> Cell:
    """The cell of features ``a`` and ``b`` (``None``: ``a`` alone) in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"sp_jax.compat: unknown mode {mode!r}; use one of {list(MODES)}.")
    for name in (a, b):
        if name is not None and name not in FEATURES:
            raise ValueError(f"sp_jax.compat: unknown feature {name!r}; use one of "
                             f"{sorted(FEATURES)}.")
    return TABLE[mode][_key(a, a if b is None else b)]


def _modes_text(modes: tuple[str, ...]) -> str:
    if len(modes) == 1:
        return modes[0]
    return "every mode" if set(modes) == set(MODES) else " and ".join(modes)


def _message(modes: tuple[str, ...], found: Cell, a: str, b: str | None, where: str,
             names: Mapping[str, str], given_as: Mapping[str, str]) -> str:
    """The refusal's message; its tag names each feature as the caller gave it (an alias,
    ``fp8``, stands for whichever of its values the caller has) and the mode (or the
    modes in which the cell is refused)."""
    def name(f: str) -> str:
        return names.get(f, _NAMES[f])

    fix, mode = found.fix.format_map(_Spelled(names)), _modes_text(modes)
    if b is None:
        return f"{where}: {name(a)}: {fix} (sp_jax.compat: {given_as[a]} in {mode})"
    return (f"{where}: {name(a)} is not supported with {name(b)}; {fix} "
            f"(sp_jax.compat: {given_as[a]} x {given_as[b]} in {mode})")


class _Spelled(dict):
    """The spellings of a message's features for its fix text: ``{feature}`` in a fix
    is the caller's spelling of that feature (a flag, a value) or the default one."""

    def __missing__(self, feature: str) -> str:
        return _NAMES[feature]


def fix_text(fix: str) -> str:
    """A refusal's fix (:attr:`Cell.fix`, :attr:`Refusal.fix`) as a message says it, each
    ``{feature}`` field in its default spelling."""
    return fix.format_map(_Spelled())


def _refused(modes: tuple[str, ...], key: frozenset[str], active: set[str],
             via: bool = False) -> Cell | None:
    """The cell of ``key`` if it is refused in each of ``modes`` (and no feature of
    ``active`` lifts it), directly or (``via``) through what a feature brings along,
    else None."""
    cells = [TABLE[m][key] for m in modes]
    if all(c.status == "refused" and not set(c.unless) & active and bool(c.via) == via
           for c in cells):
        return cells[0]
    return None


def check(mode: str | tuple[str, ...] | None, features: Iterable[str], *,
          where: str) -> None:
    """Raises a :class:`CombinationError` for the first refused cell among ``features``
    in ``mode``: each feature alone first, then each pair, in the order given (a set: in
    :data:`FEATURES`' order), then each pair refused through what a feature brings along
    (:attr:`Cell.via`: a model has what its features bring, whose own pair comes first).
    ``features`` are names of :data:`FEATURES` or :data:`ALIASES` (``"pipeline"``,
    ``"fp8"``, ``"context"``); a mapping from names to how the message spells each
    (e.g. ``{"sliding_window": "sliding_window=4"}``) works too. The message starts with
    ``where`` (e.g. ``"GPT"``), names both features (or the feature and the mode) and
    ends with what to do.

    ``mode``: one of :data:`MODES`; or, where the mode is not known yet (a constructor,
    a kernel every mode runs), a tuple of modes (what is refused in each of them) or None
    (what is refused in every mode); their message names the modes of the refused cell.
    """
    modes = tuple(MODES) if mode is None else (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in MODES] or ([] if modes else [mode])
    if bad:
        raise ValueError(f"sp_jax.compat.check: unknown mode {bad[0]!r}; use one of "
                         f"{list(MODES)}, a tuple of them or None (every mode).")
    names: dict[str, str] = dict(features) if isinstance(features, Mapping) else {}
    given = list(features)
    if isinstance(features, (set, frozenset)):
        order = {f: i for i, f in enumerate((*FEATURES, *ALIASES))}
        given.sort(key=lambda f: order.get(f, len(order)))
    active: list[tuple[str, str]] = []  # (feature, the name it was given as)
    for f in given:
        for x in _expand(f):
            if x not in (a for a, _ in active):
                active.append((x, f))
    spell = {x: names.get(f, names.get(x, _NAMES.get(f, _NAMES[x]))) for x, f in active}
    spell |= {f: spell[x] for x, f in active if f not in spell}  # an alias: its value's
    spell |= {alias: spell[x] for alias, members in ALIASES.items() for x in members
              if x in spell and alias not in spell}
    given_as, present = dict(active), {x for x, _ in active}

    def tag(key: frozenset[str]) -> tuple[str, ...]:  # the modes the message names
        if isinstance(mode, str):
            return modes
        return tuple(m for m in MODES if TABLE[m][key].status == "refused")

    for x, _ in active:
        found = _refused(modes, _key(x, x), present)
        if found is not None:
            raise CombinationError(_message(tag(_key(x, x)), found, x, None, where, spell,
                                            given_as))
    for via in (False, True):
        for (x, fx), (y, fy) in itertools.combinations(active, 2):
            if fx == fy and fx in ALIASES:
                continue  # both values of one option were named by their alias
            found = _refused(modes, _key(x, y), present, via)
            if found is not None:
                a, b = (x, y) if found.first in ("", x) else (y, x)
                raise CombinationError(_message(tag(_key(x, y)), found, a, b, where, spell,
                                                given_as))


def features_of(config: Any = None, parallel: Any = None, mesh: Any = None, *,
                defaults: bool = False) -> frozenset[str]:
    """The features a model uses, from its ``GPTConfig`` and ``ParallelConfig`` (duck
    typed: their field names; a layer's ``AttentionConfig`` too), for :func:`check`.
    With ``mesh``, a context axis of size 1 is no context feature and
    ``grad_reduce_dtype`` over data axes of one device none either (no reduction). With
    ``defaults``, also the options' default values the table names (``unrolled_layers``:
    ``scan_layers=False``). Call-time features (``packed_documents``, ``custom_loss``,
    ``offload_optimizer``) are the caller's to add (:func:`check_mode` does)."""
    found: set[str] = set()
    if parallel is not None:
        found.add("tensor_sequence")
        for name in ("collective_matmul", "recompute_allgather"):
            if getattr(parallel, name, False):
                found.add(name)
        if getattr(parallel, "fsdp", False) in (True, "full"):  # not "optimizer" (ZeRO-1)
            found.add("fsdp")
        elif getattr(parallel, "fsdp", False) == "optimizer":
            found.add("zero1")
        if getattr(parallel, "grad_reduce_dtype", None) is not None and (
                mesh is None or _size(mesh, getattr(parallel, "data_axes", ())) > 1):
            found.add("grad_reduce_dtype")
        if getattr(parallel, "offload_activations", False):
            found.add("offload_activations")
        context = getattr(parallel, "context_parallel", None)
        if context is not None and (mesh is None or _size(
                mesh, (getattr(parallel, "context_axis", None),)) > 1):
            found.add(f"context_{context}")
        if getattr(parallel, "pipeline_axis", None) is not None:
            found.add(f"pipeline_{getattr(parallel, 'pipeline_schedule', 'gpipe')}")
        if getattr(parallel, "expert_axis", None) is not None:
            found.add("expert_parallel")
    if config is not None:
        if getattr(config, "num_experts", 0):
            found.add("experts")
            freq = getattr(config, "moe_layer_freq", 1)
            if isinstance(freq, int) and not isinstance(freq, bool) and freq > 1:
                found.add("interleaved_experts")
            dense = getattr(config, "num_dense_layers", 0)
            if isinstance(dense, int) and not isinstance(dense, bool) and dense > 0:
                found.add("dense_layers")
            if getattr(config, "moe_scoring", "softmax") == "sigmoid" or \
                    getattr(config, "moe_groups", 1) != 1:
                found.add("sigmoid_routing")
            for name, feature in (("moe_bias_update_rate", "aux_free_bias"),
                                  ("moe_seq_aux_loss_coef", "seq_aux_loss")):
                value = getattr(config, name, 0.0)
                if isinstance(value, int | float) and value > 0:
                    found.add(feature)
        fp8 = getattr(config, "fp8", None)
        if fp8 is not None:
            found.add(f"fp8_{getattr(fp8, 'scaling', 'current')}")
        windows = getattr(config, "layer_windows", None)
        if getattr(config, "sliding_window", None) is not None or any(
                w is not None for w in windows or ()):
            found.add("sliding_window")  # one window for every layer, or per layer
        if windows is not None or getattr(config, "window_per_layer", False):
            found.add("layer_windows")  # the window as data (a layer's, or per layer)
        if getattr(config, "attention", "mha") == "mla":
            found.add("mla_attention")
        if getattr(config, "lora", None) is not None:
            found.add("lora")
        depth = getattr(config, "mtp_depth", 0)
        if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0:
            found.add("mtp")
        if getattr(config, "attention_implementation", "xla") == "cudnn":
            found.add("cudnn_attention")
        kv_heads, heads = getattr(config, "num_kv_heads", None), getattr(config, "num_heads", 0)
        if isinstance(kv_heads, int) and isinstance(heads, int) and 0 < kv_heads < heads:
            found.add("grouped_query")  # (1: multi-query)
        if getattr(config, "attention_dropout", 0.0):
            found.add("attention_dropout")
        if getattr(config, "attention_softcap", None) is not None:
            found.add("attention_softcap")
        if getattr(config, "scan_layers", False):
            found.add("scan_layers")
        elif defaults and hasattr(config, "scan_layers"):
            found.add("unrolled_layers")
    return frozenset(found)


def _size(mesh: Any, axes: Iterable[Any]) -> int:
    shape = dict(getattr(mesh, "shape", {}))
    return math.prod(shape.get(a, 1) for a in axes)


def spelled(config: Any = None, parallel: Any = None, features: Iterable[str] = ()
            ) -> dict[str, str]:
    """``features`` (in :data:`FEATURES`' order) each with how a message spells it from
    the configuration: the value set (``attention_dropout=0.1``,
    ``ParallelConfig(pipeline_axis='stage')``), or the default spelling."""
    def value(obj: Any, name: str) -> Any:
        return getattr(obj, name, None)

    by_value = {
        "fsdp": lambda: f"fsdp={value(parallel, 'fsdp')!r}",
        "context_ring": lambda: "ring attention (context_parallel='ring')",
        "context_ulysses": lambda: "Ulysses attention (context_parallel='ulysses')",
        **dict.fromkeys(("pipeline_gpipe", "pipeline_1f1b"), lambda: (
            f"ParallelConfig(pipeline_axis={value(parallel, 'pipeline_axis')!r})")),
        "experts": lambda: f"num_experts={value(config, 'num_experts')}",
        "expert_parallel": lambda: f"expert_axis={value(parallel, 'expert_axis')!r}",
        "interleaved_experts": lambda: f"moe_layer_freq={value(config, 'moe_layer_freq')}",
        "dense_layers": lambda: f"num_dense_layers={value(config, 'num_dense_layers')}",
        "sigmoid_routing": lambda: f"moe_scoring={value(config, 'moe_scoring')!r}",
        "aux_free_bias": lambda: f"moe_bias_update_rate={value(config, 'moe_bias_update_rate')}",
        "seq_aux_loss": lambda: f"moe_seq_aux_loss_coef="
                                f"{value(config, 'moe_seq_aux_loss_coef')}",
        "grouped_query": lambda: f"num_kv_heads={value(config, 'num_kv_heads')}",
        "sliding_window": lambda: f"sliding_window={value(config, 'sliding_window')}",
        "attention_dropout": lambda: f"attention_dropout={value(config, 'attention_dropout')}",
        "attention_softcap": lambda: f"attention_softcap={value(config, 'attention_softcap')}",
        "grad_reduce_dtype": lambda: f"ParallelConfig(grad_reduce_dtype="
                                     f"{value(parallel, 'grad_reduce_dtype')})",
    }
    wanted = set(features)
    out = {}
    for f in (f for f in FEATURES if f in wanted):
        source = parallel if f in _PARALLEL_SPELLED else config
        out[f] = by_value[f]() if f in by_value and source is not None else _NAMES[f]
    return out


_PARALLEL_SPELLED = {"fsdp", "context_ring", "context_ulysses", "pipeline_gpipe",
                     "pipeline_1f1b", "expert_parallel", "grad_reduce_dtype"}


def check_mode(mode: str | tuple[str, ...] | None, model: Any = None, *, where: str,
               config: Any = None, parallel: Any = None, mesh: Any = None,
               documents: bool = False, custom_loss: bool = False,
               offload: bool = False) -> None:
    """:func:`check` of an entry point: the features of ``model`` (its ``config`` and
    ``parallel``; or those given; :func:`features_of` with ``defaults``) on ``mesh``
    (None: not known) and of the call: ``documents`` (segment_ids given:
    ``packed_documents``), ``custom_loss`` (a loss_fn other than lm_loss), ``offload``
    (``offload_optimizer`` / ``offload_params``), each spelled from its value
    (:func:`spelled`). ``mode`` as in :func:`check` (a constructor: None)."""
    config = getattr(model, "config", None) if config is None else config
    parallel = getattr(model, "parallel", None) if parallel is None else parallel
    found = set(features_of(config, parallel, mesh, defaults=True))
    found |= {f for flag, f in ((documents, "packed_documents"), (custom_loss, "custom_loss"),
                                (offload, "offload_optimizer")) if flag}
    check(mode, spelled(config, parallel, found), where=where)


def refusals(mode: str | None = None) -> list[tuple[str, str, str | None, Cell]]:
    """``(mode, a, b or None, cell)`` of every refused cell (pairs refused because one
    feature is refused alone are left out: the alone cell names them; so are those
    refused through what a feature brings along, :attr:`Cell.via`: the pair it names
    is there)."""
    out = []
    for m in MODES if mode is None else (mode,):
        for x, y in itertools.combinations_with_replacement(FEATURES, 2):
            c = TABLE[m][_key(x, y)]
            if c.status == "refused" and not c.alone and not c.via:
                a, b = (x, y) if c.first in ("", x) else (y, x)
                out.append((m, a, None if x == y else b, c))
    return out


TABLE.update(build())
