"""The per-device ops: forward and VJP of each against numpy, with check_vma on and off."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sp_jax import ops

T, N, S, H = 4, 2, 8, 3
RNG = np.random.default_rng(0)


def _chunks(a, axis):
    return np.split(a, T, axis=axis)


# For each op: (fn, x is per-device?, output is per-device?, seq-sized local input?)
# Per-device arrays travel as [T, ...] globals sharded P("tensor") on the leading dim.
def _expected(name, x, ct):
    """numpy forward and VJP; x / ct are [T, ...] per-device stacks or one replicated."""
    if name == "split_with_all_gather_grad":
        y = np.stack(_chunks(x, 1))
        dx = np.concatenate(list(ct), axis=1)
    elif name == "all_gather_with_split_grad":
        y = np.concatenate(list(x), axis=1)
        dx = np.stack(_chunks(ct, 1))
    elif name == "all_gather_with_reduce_scatter_grad":
        y = np.stack([np.concatenate(list(x), axis=1)] * T)
        dx = np.stack(_chunks(ct.sum(0), 1))
    elif name == "reduce_scatter_with_all_gather_grad":
        y = np.stack(_chunks(x.sum(0), 1))
        dx = np.stack([np.concatenate(list(ct), axis=1)] * T)
    elif name == "identity_with_all_reduce_grad":
        y = np.stack([x] * T)
        dx = ct.sum(0)
    elif name == "all_reduce_with_identity_grad":
        y = x.sum(0)
        dx = np.stack([ct] * T)
    return y, dx


# name -> (x per-device, y per-device, local seq length of x, of y)
OPS = {
    "split_with_all_gather_grad": (False, True, S, S // T),
    "all_gather_with_split_grad": (True, False, S // T, S),
    "all_gather_with_reduce_scatter_grad": (True, True, S // T, S),
    "reduce_scatter_with_all_gather_grad": (True, True, S, S // T),
    "identity_with_all_reduce_grad": (False, True, S, S),
    "all_reduce_with_identity_grad": (True, False, S, S),
}


@pytest.fixture(scope="module")
def tensor_mesh():
    return jax.make_mesh((T,), ("tensor",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:T])


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("name", list(OPS))
def test_op_forward_and_vjp(tensor_mesh, name, check_vma):
    x_dev, y_dev, s_x, s_y = OPS[name]
    x = RNG.normal(size=((T,) if x_dev else ()) + (N, s_x, H)).astype(np.float32)
    ct = RNG.normal(size=((T,) if y_dev else ()) + (N, s_y, H)).astype(np.float32)
    fn = getattr(ops, name)
    if name.startswith(("identity", "all_reduce")):
        op = functools.partial(fn, axis_name="tensor")
    else:
        op = functools.partial(fn, axis_name="tensor", dim=1)

    def body(x, ct):
        x = x[0] if x_dev else x
        ct = ct[0] if y_dev else ct
        y, vjp = jax.vjp(op, x)
        (dx,) = vjp(ct)
        return (y[None] if y_dev else y), (dx[None] if x_dev else dx)

    spec = lambda per_device: P("tensor") if per_device else P()  # noqa: E731
    with jax.set_mesh(tensor_mesh):
        f = jax.jit(jax.shard_map(
            body, in_specs=(spec(x_dev), spec(y_dev)), out_specs=(spec(y_dev), spec(x_dev)),
            check_vma=check_vma,
        ))
        y, dx = f(jax.reshard(x, spec(x_dev)), jax.reshard(ct, spec(y_dev)))
    y_exp, dx_exp = _expected(name, x, ct)
    chex.assert_trees_all_close(np.asarray(y), y_exp, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(np.asarray(dx), dx_exp, rtol=1e-6, atol=1e-6)


def test_identity_with_all_reduce_grad_rejects_varying_input(tensor_mesh):
    with jax.set_mesh(tensor_mesh):
        f = jax.shard_map(lambda x: ops.identity_with_all_reduce_grad(x, "tensor"),
                          in_specs=P("tensor"), out_specs=P("tensor"))
        with pytest.raises(TypeError, match="already varies"):
            f(jax.reshard(jnp.ones((T, 2)), P("tensor")))


def test_scatter_rejects_indivisible_sequence(tensor_mesh):
    with jax.set_mesh(tensor_mesh):
        f = jax.shard_map(lambda x: ops.split_with_all_gather_grad(x, "tensor", dim=1),
                          in_specs=P(), out_specs=P(None, "tensor"))
        with pytest.raises(ValueError, match="not divisible by the size 4"):
            f(jnp.ones((2, 6, 3)))


# --------------------------------------------------------------------------------------
# wgrad_dtype: weight gradients accumulated in fp32 from bf16 operands
# --------------------------------------------------------------------------------------


def test_matmul_wgrad_dtype_is_fp32_accumulation_of_bf16_operands():
    x = jnp.asarray(RNG.normal(size=(4, 64, 32)), jnp.bfloat16)
    g = jnp.asarray(RNG.normal(size=(4, 64, 16)), jnp.bfloat16)
    kernel = jnp.asarray(RNG.normal(size=(32, 16)), jnp.float32)

    def dkernel(wgrad_dtype):
        _, vjp = jax.vjp(lambda k: ops.matmul(x, k, wgrad_dtype=wgrad_dtype), kernel)
        return vjp(g)[0]

    plain = jax.grad(lambda k: jnp.sum((x @ k.astype(jnp.bfloat16)) * g).astype(jnp.float32))
    exact = np.einsum("bsi,bso->io", np.asarray(x, np.float64), np.asarray(g, np.float64))
    d_none, d_fp32 = dkernel(None), dkernel(jnp.float32)
    assert d_none.dtype == d_fp32.dtype == jnp.float32
    # None reproduces plain autodiff (bf16 product, then cast) up to one bf16 rounding
    # (the two dots may sum in a different order) ...
    np.testing.assert_allclose(np.asarray(d_none), np.asarray(plain(kernel)), rtol=2**-7)
    # ... fp32 accumulation is the exact product of the bf16 operands up to fp32 rounding.
    np.testing.assert_allclose(np.asarray(d_fp32), exact, rtol=1e-5, atol=1e-4)
    err = lambda d: np.abs(np.asarray(d, np.float64) - exact).max()  # noqa: E731
    assert err(d_fp32) < err(d_none) / 10


# --------------------------------------------------------------------------------------
# Backward dependency structure (what lets XLA overlap comm with compute)
# --------------------------------------------------------------------------------------


def _inner_eqns(closed_jaxpr):
    (sm,) = [e for e in closed_jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]
    return sm.params["jaxpr"].eqns


def _ancestors(eqns, eqn):
    """All equations ``eqn`` transitively depends on."""
    producer = {id(v): e for e in eqns for v in e.outvars}
    seen, stack = [], list(eqn.invars)
    while stack:
        v = stack.pop()
        e = producer.get(id(v))
        if e is not None and all(e is not s for s in seen):
            seen.append(e)
            stack.extend(e.invars)
    return seen


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_collectives_do_not_wait_for_matmuls(recompute):
    mesh = make_mesh(1, T, AxisType.Auto)
    op = functools.partial(ops.column_sequence_parallel_matmul, axis_name="tensor",
                           recompute_allgather=recompute)

    def body(x, k, dy):
        _, vjp = jax.vjp(op, x, k)
        return vjp(dy)

    with jax.set_mesh(mesh):
        f = jax.shard_map(body, in_specs=(P(None, "tensor"), P(None, "tensor"),
                                          P(None, None, "tensor")),
                          out_specs=(P(None, "tensor"), P(None, "tensor")))
        jaxpr = jax.make_jaxpr(f)(jnp.ones((2, S, H)), jnp.ones((H, 8)), jnp.ones((2, S, 8)))
    eqns = _inner_eqns(jaxpr)
    gathers = [e for e in eqns if e.primitive.name == "all_gather"]
    (rs,) = [e for e in eqns if e.primitive.name == "reduce_scatter"]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    (dw,) = [e for e in dots if e.outvars[0].aval.shape == (H, 8 // T)]
    assert len(gathers) == (2 if recompute else 1)
    rs_deps = _ancestors(eqns, rs)
    assert not any(d is dw for d in rs_deps), "dx reduce-scatter waits for the dW matmul"
    assert not any(g in rs_deps for g in gathers[1:]), "dx waits for the re-gather"
    if recompute:
        regather = gathers[1]
        assert not any(e.primitive.name == "dot_general" for e in _ancestors(eqns, regather))
        assert any(e is regather for e in _ancestors(eqns, dw))


def _hlo_ops(compiled):
    """Multiset of HLO opcodes of a compiled program (names and shapes dropped)."""
    import collections
    import re

    pattern = re.compile(r"=\s*\S+\s+([a-z][\w-]*)\(")
    return collections.Counter(m.group(1) for m in pattern.finditer(compiled.as_text()))


def test_identity_with_all_reduce_grad_adds_no_hlo(tensor_mesh):
    """mp_skip_c_identity: the identity into the TP region costs nothing in the HLO
    (forward and backward), compared with letting JAX insert the implicit cast."""
    x, k = jnp.ones((2, S, H)), jnp.ones((H, 8))

    def compiled(body):
        f = jax.shard_map(body, in_specs=(P(), P(None, "tensor")), out_specs=P())
        g = jax.grad(lambda x, k: jnp.sum(jnp.sin(f(x, k))), argnums=(0, 1))
        return jax.jit(g).lower(x, jax.reshard(k, P(None, "tensor"))).compile()

    with jax.set_mesh(tensor_mesh):
        explicit = compiled(
            lambda x, k: ops.all_reduce_with_identity_grad(
                ops.matmul(ops.identity_with_all_reduce_grad(x, "tensor"), k), "tensor"))
        # ops.matmul casts the replicated x to varying itself (transpose: psum).
        implicit = compiled(
            lambda x, k: ops.all_reduce_with_identity_grad(ops.matmul(x, k), "tensor"))
    assert _hlo_ops(explicit) == _hlo_ops(implicit)
    assert _hlo_ops(explicit)["all-reduce"] == 2  # the psum forward and the dx psum


# --------------------------------------------------------------------------------------
# The parallel linear ops' forward and VJP, with check_vma on and off
# --------------------------------------------------------------------------------------

D_IN, D_OUT = 8, 12  # the kernel is split T ways on D_OUT (column) or D_IN (row)


def _linear_expected(name, x, kernel, ct):
    """numpy forward and VJP of the op on every device: ``x``, ``ct`` as the devices
    hold them (``[T, ...]`` stacks, or one replicated array), ``kernel`` whole; the
    results as ``[T, ...]`` stacks of what each device holds."""
    ks = np.split(kernel, T, axis=1 if name.startswith("column") else 0)
    if name == "column_parallel_matmul":  # x replicated, y split on features
        y = np.stack([x @ k for k in ks])
        dx = np.stack([sum(c @ k.T for c, k in zip(ct, ks, strict=True))] * T)
        dk = np.stack([np.einsum("nsi,nso->io", x, c) for c in ct])
    elif name == "column_sequence_parallel_matmul":  # x split on the sequence
        full = np.concatenate(list(x), axis=1)
        y = np.stack([full @ k for k in ks])
        dx = np.stack(_chunks(sum(c @ k.T for c, k in zip(ct, ks, strict=True)), 1))
        dk = np.stack([np.einsum("nsi,nso->io", full, c) for c in ct])
    elif name == "row_parallel_matmul":  # x split on features, y replicated
        y = np.stack([sum(a @ k for a, k in zip(x, ks, strict=True))] * T)
        dx = np.stack([ct @ k.T for k in ks])
        dk = np.stack([np.einsum("nsi,nso->io", a, ct) for a in x])
    else:  # row_sequence_parallel_matmul: y reduce-scattered on the sequence
        y = np.stack(_chunks(sum(a @ k for a, k in zip(x, ks, strict=True)), 1))
        full = np.concatenate(list(ct), axis=1)
        dx = np.stack([full @ k.T for k in ks])
        dk = np.stack([np.einsum("nsi,nso->io", a, full) for a in x])
    return y, dx, dk


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("name", ["column_parallel_matmul", "column_sequence_parallel_matmul",
                                  "row_parallel_matmul", "row_sequence_parallel_matmul"])
def test_linear_op_forward_and_vjp(tensor_mesh, name, check_vma):
    """Each device's output and its input and kernel gradients equal numpy's, with VMA
    typing and without (the kernel's cast to vary over an axis, and its transpose, a
    psum of the kernel gradient, happen only with typing: without, a psum over the
    tensor axis would add the gradients of different columns)."""
    column, seq = name.startswith("column"), "sequence" in name
    x_dev = seq or not column  # what each device holds differs
    x = RNG.normal(size=((T,) if x_dev else ()) + (N, S // T if column and seq else S,
                                                   D_IN // T if not column else D_IN))
    kernel = RNG.normal(size=(D_IN, D_OUT))
    ct_dev = column or seq
    ct = RNG.normal(size=((T,) if ct_dev else ()) + (N, S // T if seq and not column else S,
                                                     D_OUT // T if column else D_OUT))
    x, kernel, ct = (a.astype(np.float32) for a in (x, kernel, ct))
    op = functools.partial(getattr(ops, name), axis_name="tensor")
    kernel_spec = P(None, "tensor") if column else P("tensor")

    def body(x, kernel, ct):
        x = x[0] if x_dev else x
        ct = ct[0] if ct_dev else ct
        y, vjp = jax.vjp(op, x, kernel)
        dx, dk = vjp(ct)
        return y[None], dx[None], dk[None]

    spec = lambda per_device: P("tensor") if per_device else P()  # noqa: E731
    with jax.set_mesh(tensor_mesh):
        f = jax.jit(jax.shard_map(
            body, in_specs=(spec(x_dev), kernel_spec, spec(ct_dev)),
            out_specs=(P("tensor"),) * 3, check_vma=check_vma))
        got = f(jax.reshard(x, spec(x_dev)), jax.reshard(kernel, kernel_spec),
                jax.reshard(ct, spec(ct_dev)))
    for g, e in zip(got, _linear_expected(name, x, kernel, ct), strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-5, atol=1e-5)
