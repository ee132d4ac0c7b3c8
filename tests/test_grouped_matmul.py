"""``sp_jax.ops.moe.grouped_matmul`` (one GEMM per tile of the routed rows) against
``jax.lax.ragged_dot`` (values and gradients, fp32 and bf16, per device inside a
``shard_map``), and that its GEMMs are those of the routed rows only."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sp_jax.ops.grouped import grouped_matmul_tiles, grouped_wgrad
from sp_jax.ops.moe import grouped_matmul


def _operands(rng, m, k, n, g, dtype=jnp.float32):
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(g, k, n)), dtype)
    dy = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return x, w, dy


def _value_and_grads(f, x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
    return (y, *vjp(dy))


CASES = {  # name: (rows, group sizes)
    "empty groups, rows past the sum": (37, [0, 10, 0, 20, 0]),
    "one group holds every row": (37, [0, 0, 37, 0]),
    "one row": (1, [0, 1, 0]),
    "no row routed": (12, [0, 0, 0]),
    "random sizes": (64, list(np.random.default_rng(1).multinomial(
        59, np.ones(6) / 6))),
    "sizes one past the tile": (40, [9, 17, 1, 9]),
}


@pytest.mark.slow  # make test-fast's budget: the work test below stays fast
def test_grouped_matmul_equals_ragged_dot_values_and_gradients():
    """fp32: the result, dx and dW (and ``grouped_wgrad``'s weight gradient) equal
    ragged_dot's (1e-5) for every case, at tiles
    smaller than and larger than the groups (and the platform's default, larger than every
    buffer here), under jit and eagerly."""
    rng = np.random.default_rng(0)
    k, n = 5, 7
    for name, (m, sizes) in CASES.items():
        sizes = jnp.asarray(sizes, jnp.int32)
        x, w, dy = _operands(rng, m, k, n, len(sizes))
        want = _value_and_grads(lax.ragged_dot, x, w, sizes, dy)
        for tile in (3, 8, None):
            got = jax.jit(lambda x, w, s, dy, tile=tile: _value_and_grads(
                lambda x, w, s: grouped_matmul(x, w, s, tile=tile), x, w, s, dy))(
                    x, w, sizes, dy)
            for what, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, (name, tile, what)
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name}, tile {tile}: {what}")
        # the weight gradient alone (the FP8 experts' wgrad): ragged_dot_general's with a
        # ragged contracting dimension
        wgrad = lax.ragged_dot_general(x, dy, sizes, lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=()), preferred_element_type=jnp.float32)
        for tile in (3, None):
            np.testing.assert_allclose(jax.jit(grouped_wgrad, static_argnames="tile")(
                x, dy, sizes, tile=tile), wgrad, rtol=1e-5, atol=1e-5, err_msg=name)
    y = grouped_matmul(x, w, sizes, tile=3)  # eager
    np.testing.assert_allclose(y, lax.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tile=0"):
        grouped_matmul(x, w, sizes, tile=0)
    with pytest.raises(ValueError, match="do not agree"):
        grouped_matmul(x, w[:, :-1], sizes)


@pytest.mark.slow  # make test-fast's budget: the other tests of the file stay fast
def test_grouped_matmul_bf16_and_per_device_in_shard_map():
    """bf16 inputs with fp32 accumulation equal ragged_dot with
    ``preferred_element_type=fp32`` (values and gradients, rounded to bf16 once); and per
    device in a jitted ``shard_map`` over an 8-device expert axis (each device its own rows,
    group sizes and experts; replicated weights too, whose gradient sums the devices'), as
    the MoE layer calls it, equal to ragged_dot in the same shard_map."""
    rng = np.random.default_rng(2)
    m, k, n, g = 45, 16, 24, 4
    sizes = jnp.asarray([11, 0, 20, 9], jnp.int32)
    x, w, dy = _operands(rng, m, k, n, g, jnp.bfloat16)
    ref = _value_and_grads(lambda x, w, s: lax.ragged_dot(
        x, w, s, preferred_element_type=jnp.float32), x, w, sizes, dy.astype(jnp.float32))
    for tile in (8, None):
        got = _value_and_grads(lambda x, w, s, tile=tile: grouped_matmul(
            x, w, s, tile=tile, preferred_element_type=jnp.float32), x, w, sizes,
            dy.astype(jnp.float32))
        assert got[0].dtype == jnp.float32 and got[1].dtype == got[2].dtype == jnp.bfloat16
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-4)
        for a, b in zip(got[1:], ref[1:], strict=True):  # both rounded to bf16 once
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2, atol=1e-2)
        low = grouped_matmul(x, w, sizes, tile=tile)  # bf16 out, accumulated in fp32
        assert low.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(low), ref[0], rtol=1e-2, atol=1e-2)

    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:8])
    ep, m, g = 8, 20, 3
    x, w, dy = _operands(rng, ep * m, k, n, ep * g)
    sizes = jnp.asarray(np.concatenate([rng.multinomial(m - d, np.ones(g) / g)
                                        for d in range(ep)]), jnp.int32)
    for w_spec, w_all in ((P("expert"), w), (P(), w[:g])):
        def run(f, x, w, sizes, dy, w_spec=w_spec):
            def device(x, w, sizes, dy):
                y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
                return (y, *vjp(dy))

            return jax.jit(jax.shard_map(
                device, mesh=mesh, in_specs=(P("expert"), w_spec, P("expert"), P("expert")),
                out_specs=(P("expert"), P("expert"), w_spec)))(x, w, sizes, dy)

        want = run(lax.ragged_dot, x, w_all, sizes, dy)
        for tile in (4, None):
            got = run(lambda x, w, s, tile=tile: grouped_matmul(x, w, s, tile=tile),
                      x, w_all, sizes, dy)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=str(w_spec))


def _dots(jaxpr, inside=False):
    """(inside a while loop, operand shapes) of every dot_general in ``jaxpr``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield inside, tuple(v.aval.shape for v in eqn.invars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dots(sub, inside or eqn.primitive.name == "while")


def test_grouped_matmul_work_follows_the_routed_rows():
    """A 4096-row buffer holding 40 routed rows in 6 groups (the expert axis's receive
    buffer): the loop runs ``sum(ceil(size / tile))`` tiles (6 at tile 8, against the
    512 + 6 of the static bound; counted by running the loop), every dot of the forward
    and the backward is one tile's GEMM inside the loop (none over the 4096 rows or over
    the groups), and the values equal ragged_dot's."""
    rng = np.random.default_rng(3)
    m, k, n, tile = 4096, 4, 3, 8
    sizes = jnp.asarray([0, 9, 0, 16, 15, 0], jnp.int32)
    assert int(grouped_matmul_tiles(sizes, tile, m)) == 2 + 2 + 2  # the loop's trips
    assert int(grouped_matmul_tiles(sizes, 1, m)) == 40
    assert int(jax.jit(grouped_matmul_tiles, static_argnums=(1, 2))(
        jnp.asarray([4096, 0]), 128, m)) == 32
    x, w, dy = _operands(rng, m, k, n, len(sizes))

    def f(x, w):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, tile=tile), x, w)
        return y, vjp(dy)

    dots = list(_dots(jax.make_jaxpr(f)(x, w).jaxpr))
    assert len(dots) == 3, dots  # forward, dx, dW
    for inside, shapes in dots:
        assert inside, shapes
        assert all(m not in s and len(sizes) not in s[:1] for s in shapes), shapes
        assert any(tile in s for s in shapes), shapes  # the tile's rows
    y, (dx, dw) = jax.jit(f)(x, w)
    want = _value_and_grads(lax.ragged_dot, x, w, sizes, dy)
    for a, b in zip((y, dx, dw), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_takes_blocks_of_groups():
    """``group_sizes`` ``[blocks, groups]`` (the expert axis's received rows: source-major,
    each source's sorted by expert): y, dx and dW (and ``grouped_wgrad``) equal a NumPy
    loop over the segments, rows past the sum zero, tiles smaller and larger than the
    segments."""
    rng = np.random.default_rng(3)
    k, n, m = 4, 6, 41
    sizes = np.array([[3, 0, 5], [0, 0, 0], [7, 2, 1], [0, 9, 4]], np.int32)  # 31 rows
    x, w, dy = _operands(rng, m, k, n, sizes.shape[1])
    xs, ws, dys = (np.asarray(a, np.float64) for a in (x, w, dy))
    y_ref, dx_ref, dw_ref = np.zeros((m, n)), np.zeros((m, k)), np.zeros(ws.shape)
    at = 0
    for block in sizes:
        for g, size in enumerate(block):
            r = slice(at, at + size)
            y_ref[r] = xs[r] @ ws[g]
            dx_ref[r] = dys[r] @ ws[g].T
            dw_ref[g] += xs[r].T @ dys[r]
            at += size
    for tile in (2, 5, 64):
        y, dx, dw = jax.jit(lambda x, w, dy, tile=tile: _value_and_grads(
            lambda x, w, s: grouped_matmul(x, w, s, tile=tile), x, w,
            jnp.asarray(sizes), dy))(x, w, dy)
        for what, a, b in (("y", y, y_ref), ("dx", dx, dx_ref), ("dW", dw, dw_ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{tile} {what}")
        np.testing.assert_allclose(grouped_wgrad(x, dy, jnp.asarray(sizes), tile=tile),
                                   dw_ref, rtol=1e-5, atol=1e-5)
    assert int(grouped_matmul_tiles(jnp.asarray(sizes), 4, m)) == sum(
        -(-int(s) // 4) for s in sizes.reshape(-1))
