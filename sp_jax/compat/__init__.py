"""What combines with what: one table, as data, of the features of sp_jax in each mode.

A *feature* is one option of :class:`~sp_jax.ParallelConfig`, :class:`~sp_jax.models.GPTConfig`
or of the call (:data:`FEATURES`); a *mode* is what the model is asked to do
(:data:`MODES`: ``"train"``, ``"eval"``, ``"generate"``). For each mode and each pair of
features (the diagonal: the feature alone) :data:`TABLE` holds a :class:`Cell`:
``supported`` (with the pytest node ids of the tests that run that combination),
``refused`` (with what to do instead), ``exclusive`` (two values of one option), ``n/a``
(the feature has no meaning in that mode) or ``untested`` (nothing refuses it, and no
test runs it yet).

Every refusal of a combination in sp_jax is raised here, by :func:`check`, as one
:class:`CombinationError` (a ``ValueError``) that names both features, the mode and what
to do. Each entry point checks its mode once (:func:`check_mode`): a training step
(``TrainStep``, ``GPT.loss``) ``"train"``, ``GPT.__call__`` / ``hidden_states`` /
``padded_logits`` ``"eval"``, ``generate`` ``"generate"``; constructors (``GPTConfig``,
``GPT``, the layers) and kernels check what is refused in every mode.

Which tests run which cell is the test suite's to say (``tests/compat_coverage.py``):
the library's table holds the refusals, and :func:`load_coverage` (or :func:`cover`) adds
the supported cells. ``python -m sp_jax.compat [--coverage PATH]`` prints the table (with
the coverage found beside the package in a checkout); ``docs/api.md`` shows
:func:`markdown`'s output.

The package imports nothing from sp_jax outside it (every floor may ask it): ``table``
holds the data, :func:`check` and the coverage, ``printing`` the text.
"""

from sp_jax.compat.printing import describe, main, markdown, render
from sp_jax.compat.table import (
    ALIASES,
    COVERED,
    FEATURES,
    IMPLIES,
    MODES,
    REFUSALS,
    STATUSES,
    TABLE,
    Cell,
    CombinationError,
    Refusal,
    build,
    cell,
    check,
    check_mode,
    cover,
    coverage_source,
    features_of,
    fix_text,
    load_coverage,
    refusals,
    spelled,
)

__all__ = ["ALIASES", "COVERED", "FEATURES", "IMPLIES", "MODES", "REFUSALS", "STATUSES",
           "TABLE", "Cell", "CombinationError", "Refusal", "build", "cell", "check",
           "check_mode", "cover", "coverage_source", "describe", "features_of", "fix_text",
           "load_coverage", "main", "markdown", "refusals", "render", "spelled"]
