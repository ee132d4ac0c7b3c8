"""sp_jax.training.warmup_cosine_schedule: optax's warmup-cosine counted in 1-based steps."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sp_jax.training import warmup_cosine_schedule

LR = 3e-3


def _values(schedule, steps: int) -> np.ndarray:
    """The learning rate of steps 1..steps (optax passes count = step - 1)."""
    return np.array([float(schedule(count)) for count in range(steps)])


def test_warmup_then_cosine_to_a_tenth():
    lr = _values(warmup_cosine_schedule(LR, 4, 20), 20)
    np.testing.assert_allclose(lr[:4], LR * np.arange(1, 5) / 4, rtol=1e-6)  # no zero step
    assert lr[-1] == pytest.approx(LR / 10, rel=1e-6)  # lr/10 at the last step
    assert np.all(np.diff(lr[3:]) < 0)  # decays after the peak
    # It is optax's warmup-cosine (init 0), evaluated at the step number.
    reference = optax.warmup_cosine_decay_schedule(0.0, LR, 4, 20, end_value=LR / 10)
    np.testing.assert_allclose(lr, [float(reference(k)) for k in range(1, 21)], rtol=1e-6)


def test_warmup_does_not_depend_on_total_steps():
    short, long = (_values(warmup_cosine_schedule(LR, 20, t), 4) for t in (4, 600))
    np.testing.assert_array_equal(short, long)


def test_first_update_uses_a_nonzero_rate():
    """optax counts updates from 0; the first one must move the parameters."""
    tx = optax.sgd(warmup_cosine_schedule(LR, 10, 100))
    params = {"w": jnp.zeros(())}
    updates, _ = tx.update({"w": jnp.ones(())}, tx.init(params), params)
    assert float(updates["w"]) == pytest.approx(-LR / 10, rel=1e-6)


def test_no_warmup():
    lr = _values(warmup_cosine_schedule(LR, 0, 10), 10)
    assert LR * 0.97 < lr[0] < LR  # the decay's value after one step
    assert lr[-1] == pytest.approx(LR / 10, rel=1e-6)
    assert np.all(np.diff(lr) < 0)


@pytest.mark.parametrize("total", [1, 5, 10])
def test_run_ends_inside_the_warmup(total):
    """total_steps <= warmup_steps: optax's cosine would get a non-positive length."""
    lr = _values(warmup_cosine_schedule(LR, 10, total), total)
    np.testing.assert_allclose(lr, LR * np.arange(1, total + 1) / 10, rtol=1e-6)


@pytest.mark.parametrize("args, message", [
    ((0.0, 1, 10), "lr=0.0 must be positive"),
    ((LR, -1, 10), "warmup_steps=-1 must be an int >= 0"),
    ((LR, 2, 0), "total_steps=0 must be an int >= 1"),
    ((LR, 2.5, 10), "warmup_steps=2.5"),
    ((LR, 2, 10, 1.5), "final_fraction=1.5 must be in"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        warmup_cosine_schedule(*args)
