"""The backward of the linear rules as an input-gradient part and a weight-gradient part
(``bwd_input`` / ``bwd_weight``): their composition equals the fused ``bwd`` for every
rule and form (GEMM in the compute dtype or FP8, whole collectives or rings, recompute,
offload, FSDP); and a stage's backward split the same way
(:func:`sp_jax.layers.backward_input` / :func:`sp_jax.layers.backward_weight`, the
weight gradients deferred through the layers' taps) equals ``jax.vjp``'s, the B pass
holding no weight-gradient GEMM of a deferring op and the W pass no other GEMM."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import slow_except
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.layers import MLPActivation
from sp_jax.ops.fp8 import Fp8Gemm, Fp8Spec
from sp_jax.ops.fsdp import Fsdp
from sp_jax.ops.gemm import ComputeGemm
from sp_jax.ops.primitives import vary
from sp_jax.ops.rules import (
    Column,
    ColumnSequence,
    Grouped,
    Matmul,
    Offloaded,
    Row,
    RowSequence,
    linear_op,
)
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
    "row": ((B, S, OUT), P("data", None, "tensor"), (OUT, IN), ("tensor", None), 1, P(),
            P("data")),
}


def _rule(kind, gemm, ring, recompute):
    transport = (Ring if ring else Collectives)("tensor", 1)
    return {"matmul": lambda: Matmul(gemm), "row": lambda: Matmul(gemm),
            "column": lambda: Column(gemm, "tensor"),
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
         ("row_seq", "current", True, False, True, False),
         ("row", "bf16", False, False, False, True),
         ("row", "delayed", False, False, True, False)]


@pytest.mark.parametrize("kind, gemm, ring, recompute, offload, fsdp", slow_except(
    CASES, ("column_seq", "delayed", True, False, True, False)))
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
    if kind == "row":  # the sum and the bias around the local product
        rule = Row(rule, "tensor")
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
            return op(x, vary(kernel, axes), (bias if kind == "row" else vary(bias, axes),
                                              history), rule)

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


@pytest.mark.parametrize("gemm, groups", slow_except(
    [("bf16", 4), ("current", 1), ("delayed", 4)]))  # fast: the stage case
def test_grouped_input_then_weight_parts_equal_the_fused_backward(gemm, groups):
    """The experts' grouped GEMM (the tile loops, or FP8 with one or several groups):
    ``bwd_input`` then ``bwd_weight`` give the fused backward's dx, dW and amax
    cotangent (the dx-only loop's arithmetic is the fused loop's)."""
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([5, 0, 9, 6][:groups] if groups > 1 else [17], jnp.int32)
    x = jnp.asarray(rng.normal(size=(24, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(groups, 8, 16)) / 4, jnp.float32)
    history = jnp.ones((3, 4), jnp.float32) if gemm == "delayed" else None
    rule = Grouped(_gemm(gemm).bound(None, jnp.float32), 8, jnp.dtype(jnp.float32))

    def grads(op):
        loss = lambda x, w, h: jnp.sum(jnp.sin(op(x, w, (sizes, h), rule)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, history)

    for name, a, b in zip(("dx", "dw", "dhistory"), grads(linear_op), grads(_split_op),
                          strict=True):
        if a is not None:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6,
                                       err_msg=name)


# --- a stage's backward: input-gradient pass, weight-gradient pass ------------------------

MODEL = dict(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=8, hidden=32,
             num_kv_heads=2, scan_layers=True)
STAGES = {
    "gqa": (dict(), dict()),
    "fp8_delayed_fsdp_ring_recompute": (
        dict(fp8=sp_jax.Fp8Recipe("delayed", 4), qkv_bias=True, mlp_activation="swiglu"),
        dict(fsdp=True, recompute_allgather=True, collective_matmul=True)),
    "moe_fp8_delayed": (dict(num_experts=4, experts_per_token=2, moe_mlp_hidden=16,
                             num_shared_experts=1, fp8=sp_jax.Fp8Recipe("delayed", 4)), dict()),
    "moe_remat_offload": (dict(num_experts=4, experts_per_token=2, moe_mlp_hidden=16,
                               remat=True, mlp_bias=True),
                          dict(offload_activations=True, wgrad_dtype=jnp.float32)),
}


def _stage(name, mesh):
    """A stacked Block stack with taps as a stage: ``(fn, params, x, gy)``, ``fn(params, x)
    -> (y, aux)`` (aux: the routers' token counts of a mixture of experts)."""
    from sp_jax.layers import WeightGradTap, enable_weight_grad_taps
    from sp_jax.models import GPT, GPTConfig
    from sp_jax.models.blocks import scan_blocks

    cfg, par = STAGES[name]
    model = GPT(GPTConfig(**MODEL, **cfg), parallel=sp_jax.ParallelConfig(**par),
                rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(enable_weight_grad_taps(model.blocks),
                                       (nnx.Param, WeightGradTap), ...)

    def fn(params, x):
        y, stats = scan_blocks(nnx.merge(graphdef, params, rest), x, None, model.config.remat)
        aux = jnp.zeros((), jnp.float32) if stats is None else jnp.sum(stats["router_z"])
        return y, aux

    x, gy = (jax.device_put(jax.random.normal(jax.random.key(i), (4, 16, 32)),
                            NamedSharding(mesh, P("data", "tensor"))) for i in (1, 2))
    return fn, nnx.to_pure_dict(params), x, (gy, jnp.float32(0.25))


def _dots(hlo: str) -> list[str]:
    return re.findall(r"= (\S+) dot\(", hlo)


@pytest.mark.parametrize("name", slow_except(STAGES, "gqa"))
def test_stage_input_then_weight_pass_equal_the_vjp(name):
    """``backward_input`` then ``backward_weight`` of a stack of Blocks (grouped-query
    attention, MLP or experts with shared experts; FP8 delayed scaling, fsdp,
    recompute, collective matmul, remat with offloaded inputs; an auxiliary output):
    ``dx`` and ``dparams_now + dparams_later`` are the fused ``jax.vjp``'s (1e-5
    relative), the parameters the taps cover get zeros from the B pass; the B pass holds
    every GEMM of the fused backward but the deferred weight gradients, which are the W
    pass's only GEMMs (no attention, no routing)."""
    from sp_jax.layers import backward_input, backward_weight

    mesh = make_mesh(2, 4)
    with jax.set_mesh(mesh):
        fn, params, x, gy = _stage(name, mesh)

        def fused(params, x, gy):
            dparams, dx = jax.vjp(fn, params, x)[1](gy)
            return dx, dparams

        def split(params, x, gy):
            dx, now, wres = backward_input(fn, params, x, gy)
            return dx, now, backward_weight(fn, params, wres)

        dx_f, d_f = jax.jit(fused)(params, x, gy)
        dx_s, now, later = jax.jit(split)(params, x, gy)
        hlo = {what: jax.jit(f).lower(*args).compile().as_text() for what, f, args in (
            ("fused", fused, (params, x, gy)),
            ("B", lambda p, x, gy: backward_input(fn, p, x, gy), (params, x, gy)),
            ("W", lambda p, w: backward_weight(fn, p, w),
             (params, jax.jit(lambda p, x, gy: backward_input(fn, p, x, gy)[2])(
                 params, x, gy))))}

    def close(a, b, what):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-30), what

    close(dx_f, dx_s, "dx")
    covered = 0
    for path, ref in jax.tree_util.tree_flatten_with_path(d_f)[0]:
        where = jax.tree_util.keystr(path)
        got_now = dict(jax.tree_util.tree_flatten_with_path(now)[0])[path]
        got_later = dict(jax.tree_util.tree_flatten_with_path(later)[0])[path]
        close(ref, np.asarray(got_now) + np.asarray(got_later), where)
        if not np.any(np.asarray(got_now)):
            covered += 1
            assert np.any(np.asarray(got_later)), where
        else:
            assert not np.any(np.asarray(got_later)), where
    assert covered >= 4, covered
    fused_dots, b_dots, w_dots = (_dots(hlo[k]) for k in ("fused", "B", "W"))
    assert sorted(b_dots + w_dots) == sorted(fused_dots)
    assert 4 <= len(w_dots) <= 8, w_dots  # per scanned layer: qkv, out, up / experts, down
    assert "exponential(" not in hlo["W"] and "all-to-all" not in hlo["W"]


def test_norm_input_then_weight_parts_equal_the_fused_backward():
    """The norms' backward in two parts (``norm_bwd_input``, then ``norm_bwd_weight`` on
    its ``wres``) equals their fused custom VJP, bitwise (LayerNorm with bias, RMSNorm
    with Gemma's offset)."""
    from sp_jax.layers.norm import layer_norm, norm_bwd_input, norm_bwd_weight, rms_norm

    x = jax.random.normal(jax.random.key(0), (2, 8, 16), jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(1), (16,))
    g = jax.random.normal(jax.random.key(3), (2, 8, 16), jnp.float32)
    for center, offset in ((True, 0.0), (False, 1.0)):
        bias = 0.1 * jax.random.normal(jax.random.key(2), (16,)) if center else None

        def norm(x, scale, bias, center=center, offset=offset):
            if center:
                return layer_norm(x, scale, bias, offset=offset, dtype=jnp.float32)
            return rms_norm(x, scale, offset=offset, dtype=jnp.float32)

        fused = jax.vjp(norm, x, scale, bias)[1](g)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, -1, keepdims=True) if center else jnp.zeros((), jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), -1, keepdims=True) + 1e-6)
        dx, wres = norm_bwd_input(center, offset, (x, mean, rstd, scale, bias), g)
        d_scale, d_bias = norm_bwd_weight(wres)
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(fused[0]))
        np.testing.assert_array_equal(np.asarray(d_scale), np.asarray(fused[1]))
        if center:
            np.testing.assert_array_equal(np.asarray(d_bias), np.asarray(fused[2]))
