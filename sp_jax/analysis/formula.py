"""Activation memory per transformer layer, after Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" (Table 2) counts the bytes
a GPT layer keeps for its backward pass with 16-bit activations and 1-byte dropout masks:

==========================  ==============================================
mode                        bytes per layer
==========================  ==============================================
``"none"`` (no parallelism) ``s*b*h * (34 + 5*a*s/h)``
``"tp"``                    ``s*b*h * (10 + 24/t + 5*a*s/(h*t))``
``"tp_sp"``                 ``s*b*h/t * (34 + 5*a*s/h)``
``"tp_selective"``          ``s*b*h * (10 + 24/t)``
``"tp_sp_selective"``       ``s*b*h/t * 34``
``"full"``                  ``2*s*b*h`` (only the layer input)
==========================  ==============================================

``s`` sequence length, ``b`` micro-batch size, ``h`` hidden size, ``a`` attention heads,
``t`` tensor-parallel size. The ``5*a*s/h`` term is the attention score/softmax/dropout
memory that selective recomputation removes.
"""

from __future__ import annotations

__all__ = ["MODES", "activation_bytes_formula"]

MODES = ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full")


def activation_bytes_formula(s: int, b: int, h: int, a: int, t: int = 1,
                             mode: str = "tp_sp") -> float:
    """Activation bytes per layer per device (Korthikanti et al. 2022, Table 2).

    Args:
      s: sequence length.
      b: micro-batch size (per data-parallel replica).
      h: hidden size.
      a: attention heads.
      t: tensor-parallel size.
      mode: one of :data:`MODES`.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"activation_bytes_formula: {name}={value!r} must be a positive int.")
    sbh = s * b * h
    attention = 5 * a * s / h
    table = {
        "none": sbh * (34 + attention),
        "tp": sbh * (10 + 24 / t + attention / t),
        "tp_sp": sbh / t * (34 + attention),
        "tp_selective": sbh * (10 + 24 / t),
        "tp_sp_selective": sbh / t * 34,
        "full": 2 * sbh,
    }
    if mode not in table:
        raise ValueError(f"activation_bytes_formula: mode={mode!r} must be one of {MODES}.")
    return float(table[mode])
