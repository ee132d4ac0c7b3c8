"""The backward of the linear rules as an input-gradient part and a weight-gradient part
(``bwd_input`` / ``bwd_weight``): their composition equals the fused ``bwd`` for every
rule and form (GEMM in the compute dtype or FP8, whole collectives or rings, recompute,
offload, FSDP)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.layers import MLPActivation
from sp_jax.ops.fp8 import Fp8Gemm, Fp8Spec
from sp_jax.ops.fsdp import Fsdp
from sp_jax.ops.gemm import ComputeGemm
from sp_jax.ops.primitives import vary
from sp_jax.ops.rules import Column, ColumnSequence, Matmul, Offloaded, RowSequence, linear_op
from sp_jax.ops.transport import Collectives, Ring

B, S, IN, OUT = 4, 16, 32, 64


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _split_op(x, kernel, aux, rule):
    """``rule`` as a custom-VJP op whose backward is ``bwd_input`` then ``bwd_weight``."""
    return rule.fwd(x, kernel, aux)[0]


def _split_bwd(rule, res, g):
    dx, w = rule.bwd_input(res, g)
    dkernel, daux = rule.bwd_weight(w)
    return dx, dkernel, daux


_split_op.defvjp(lambda x, kernel, aux, rule: rule.fwd(x, kernel, aux), _split_bwd)


def _gemm(kind):
    if kind == "bf16":
        return ComputeGemm(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    spec = Fp8Spec(sp_jax.Fp8Recipe(kind, 4), ("data", "tensor"))
    return Fp8Gemm(spec, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))


# (rule kind, x spec, kernel shape and spec, kernel fsdp dim, bias spec, out spec)
KINDS = {
    "matmul": ((B, S, IN), P("data", None, "tensor"), (IN, OUT), ("tensor", None), 1, None,
               P("data", None, "tensor")),
    "column": ((B, S, IN), P("data"), (IN, OUT), (None, "tensor"), 0, P("tensor"),
               P("data", None, "tensor")),
    "column_seq": ((B, S, IN), P("data", "tensor"), (IN, OUT), (None, "tensor"), 0,
                   P("tensor"), P("data", None, "tensor")),
    "row_seq": ((B, S, 2 * OUT), P("data", None, "tensor"), (OUT, IN), ("tensor", None), 1,
                P(), P("data", "tensor")),
}


def _rule(kind, gemm, ring, recompute):
    transport = (Ring if ring else Collectives)("tensor", 1)
    return {"matmul": lambda: Matmul(gemm), "column": lambda: Column(gemm, "tensor"),
            "column_seq": lambda: ColumnSequence(gemm, transport, recompute),
            "row_seq": lambda: RowSequence(gemm, transport, MLPActivation("swiglu"))}[kind]()


CASES = [("matmul", "bf16", False, False, False, False),
         ("matmul", "delayed", False, False, True, True),
         ("column", "current", False, False, True, False),
         ("column", "bf16", False, False, False, True),
         ("column_seq", "bf16", True, True, True, True),
         ("column_seq", "delayed", False, True, False, True),
         ("column_seq", "delayed", True, False, True, False),
         ("row_seq", "bf16", True, False, True, True),
         ("row_seq", "delayed", False, False, False, True),
         ("row_seq", "current", True, False, True, False)]


@pytest.mark.parametrize("kind, gemm, ring, recompute, offload, fsdp", CASES)
def test_input_then_weight_parts_equal_the_fused_backward(kind, gemm, ring, recompute,
                                                            offload, fsdp):
    """``bwd_input`` then ``bwd_weight`` give the fused ``bwd``'s dx, weight, bias and
    amax-history gradients, bitwise (the same arithmetic)."""
    x_shape, x_spec, k_shape, k_axes, fsdp_dim, b_spec, o_spec = KINDS[kind]
    k_axes = list(k_axes)
    if fsdp:
        k_axes[fsdp_dim] = "data"
    rule = _rule(kind, _gemm(gemm), ring, recompute)
    if offload:
        rule = Offloaded(rule)
    if fsdp:
        rule = Fsdp(rule, ("data",), fsdp_dim)
    mesh = make_mesh(2, 4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=x_shape).astype(np.float32)
    kernel = rng.normal(size=k_shape).astype(np.float32) / 8
    bias = None if b_spec is None else rng.normal(size=k_shape[1:]).astype(np.float32)
    history = jnp.ones((3, 4), jnp.float32) if gemm == "delayed" else None

    def run(op):
        def local(x, kernel, bias, history):  # typed as the ops type them
            axes = {"data", "tensor"}
            x = vary(x, axes - {"tensor"} if kind == "column" else axes)
            return op(x, vary(kernel, axes), (vary(bias, axes), history), rule)

        def loss(x, kernel, bias, history):
            y = jax.shard_map(local, in_specs=(x_spec, P(*k_axes), b_spec,
                                               None if history is None else P()),
                              out_specs=o_spec)(x, kernel, bias, history)
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))

        args = [jax.device_put(a, NamedSharding(mesh, s)) if a is not None else None
                for a, s in ((x, x_spec), (kernel, P(*k_axes)), (bias, b_spec),
                             (history, P()))]
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    with jax.set_mesh(mesh):
        fused, split = run(linear_op), run(_split_op)
    for name, a, b in zip(("dx", "dkernel", "dbias", "dhistory"), fused, split,
                          strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
