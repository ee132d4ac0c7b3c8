"""Learning-rate schedule: optax's linear warmup and cosine decay, counted in optimizer steps.

optax calls a schedule with the number of updates already applied, so the first update
sees ``count = 0`` and optax's warmup (``init_value`` at count 0) would spend it on a
learning rate of zero when ``init_value = 0``. :func:`warmup_cosine_schedule` instead
evaluates optax's :func:`optax.warmup_cosine_decay_schedule` (``init_value = 0``) at
``count + 1``, the 1-based number of the step being taken: step ``k <= W`` of a warmup of
``W`` steps uses ``lr * k / W`` (the first step ``lr / W``, step ``W`` the peak), and the
last step ``T`` uses exactly ``final_fraction * lr``. The warmup does not depend on ``T``.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

__all__ = ["warmup_cosine_schedule"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"warmup_cosine_schedule: {name}={value!r} must be an int >= "
                         f"{minimum}.")


def warmup_cosine_schedule(lr: float, warmup_steps: int, total_steps: int,
                           final_fraction: float = 0.1) -> optax.Schedule:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to
    ``final_fraction * lr`` at ``total_steps`` (optax's warmup-cosine, shifted by one).

    Step ``k`` (1-based; optax passes ``count = k - 1``) uses
    ``optax.warmup_cosine_decay_schedule(0, lr, W, T, final_fraction * lr)(k)``, so no
    step trains with a zero learning rate. Edge cases optax itself rejects or warns about:

    * ``warmup_steps == 0``: no warmup; the cosine decay starts at ``lr`` (step 1 uses
      the decay's value at 1).
    * ``total_steps <= warmup_steps``: the run ends inside the warmup; the schedule is
      the linear warmup alone (``lr * k / W``, held at ``lr`` past ``W``).

    Args:
      lr: peak learning rate (> 0).
      warmup_steps: ``W >= 0`` steps of linear warmup.
      total_steps: ``T >= 1``, the step at which the decay reaches its end value.
      final_fraction: end value as a fraction of ``lr``, in ``[0, 1]``.
    Returns:
      an optax schedule ``count -> learning rate`` (for e.g. ``optax.adamw``).
    Raises:
      ValueError: a non-positive ``lr`` or ``total_steps``, a negative ``warmup_steps``,
        or ``final_fraction`` outside ``[0, 1]``.
    """
    if not lr > 0:
        raise ValueError(f"warmup_cosine_schedule: lr={lr!r} must be positive.")
    _check_int("warmup_steps", warmup_steps, 0)
    _check_int("total_steps", total_steps, 1)
    if not 0 <= final_fraction <= 1:
        raise ValueError(f"warmup_cosine_schedule: final_fraction={final_fraction!r} must "
                         "be in [0, 1].")
    if warmup_steps == 0:
        base = optax.cosine_decay_schedule(lr, total_steps, alpha=final_fraction)
    elif total_steps <= warmup_steps:
        base = optax.linear_schedule(0.0, lr, warmup_steps)
    else:
        base = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps,
                                                  end_value=final_fraction * lr)

    def schedule(count):
        return base(jnp.asarray(count) + 1)

    return schedule
