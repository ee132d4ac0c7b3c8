"""Feature sets of the covering array (``covering.combinations``) run through the
harness in each of their modes against the unsharded model: the ``"feature"`` tier (one
combination per feature) in ``make test``, the whole array (``"all"``: every compatible
pair of features together in some set, per mode, and the risky triples) in ``make
test-combinations`` (marker ``combinations``)."""

import pytest

from combinations import covering, harness

pytestmark = pytest.mark.slow  # each case compiles two models (seconds to a minute)


def _cases(tier: str) -> list:
    return [pytest.param(combo.features, mode, id=f"{mode}-{combo.id}")
            for combo in covering.combinations(tier) for mode in combo.modes]


@pytest.mark.parametrize("features, mode", _cases("feature"))
def test_each_feature(features, mode):
    harness.run(features, mode)


@pytest.mark.combinations
@pytest.mark.parametrize("features, mode", _cases("all"))
def test_covering_array(features, mode):
    harness.run(features, mode)
