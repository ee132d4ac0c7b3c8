"""Feature sets of the covering array (``covering.cases``) run through the harness in
each of their modes against the unsharded model: the feature tier (each feature in each
mode where it has a meaning at least once) in ``make test``, the whole array (every
compatible pair of features together in some set, per mode, and the risky triples) in
``make test-combinations`` (marker ``combinations``; it records what passed in
tests/combinations/ran.json, which ``python -m sp_jax.compat`` reads)."""

import pytest

from combinations import covering, harness

pytestmark = pytest.mark.slow  # each case compiles two models (seconds to a minute)


@pytest.mark.parametrize("mode, combo", covering.params())
def test_combination(mode, combo):
    harness.run(combo.features, mode)
