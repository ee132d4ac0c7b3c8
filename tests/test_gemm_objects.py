"""The GEMM a linear layer is given (``sp_jax.layers.gemm``): a layer built with
``gemm=`` (a GEMM object of ``sp_jax.ops``) is the layer built with the ``fp8=`` recipe
it stands for, its state at the same path; bad GEMMs are refused at construction and at
trace time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.layers.fp8 import Fp8History, fp8_spec
from sp_jax.ops.fp8 import Fp8Gemm
from sp_jax.ops.gemm import ComputeGemm


def test_layer_given_a_gemm_object_equals_the_layer_given_its_recipe():
    """``ColumnSequenceParallelLinear(gemm=Fp8Gemm(spec))`` and ``(fp8=recipe)``: the same
    output, gradients and amax-history cotangent, the history at ``fp8_history`` (the
    layer's path) and the layer's ``gemm.state``; ``gemm=ComputeGemm()`` is the default
    layer. Both ``fp8`` and ``gemm``, a GEMM that is not one, a state the GEMM does not
    take: errors naming the fix."""
    recipe = sp_jax.Fp8Recipe("delayed", 4)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)

    def run(layer):
        def loss(layer, x):
            return jnp.sum(jnp.sin(layer(x)))
        return nnx.jit(nnx.value_and_grad(loss))(layer, x)

    with jax.set_mesh(make_mesh(2, 4)):
        parallel = sp_jax.ParallelConfig()
        by_recipe = sp_jax.ColumnSequenceParallelLinear(16, 32, fp8=recipe, rngs=nnx.Rngs(0))
        by_gemm = sp_jax.ColumnSequenceParallelLinear(
            16, 32, gemm=Fp8Gemm(fp8_spec(recipe, parallel)), rngs=nnx.Rngs(0))
        plain = sp_jax.ColumnSequenceParallelLinear(16, 32, rngs=nnx.Rngs(0))
        computed = sp_jax.ColumnSequenceParallelLinear(16, 32, gemm=ComputeGemm(),
                                                       rngs=nnx.Rngs(0))
        results = [run(layer) for layer in (by_recipe, by_gemm, plain, computed)]
    assert isinstance(by_gemm.fp8_history, Fp8History)
    assert by_gemm.fp8_history is by_gemm.gemm.state
    assert set(nnx.to_pure_dict(nnx.state(by_gemm))) == {"kernel", "bias", "fp8_history"}
    for (va, ga), (vb, gb) in (results[:2], results[2:]):
        assert float(va) == float(vb)
        for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert computed.fp8_history is None
    # bad GEMMs: at construction, and at trace time in the ops
    spec = fp8_spec(recipe, parallel)
    with pytest.raises(ValueError, match="not both"):
        sp_jax.RowParallelLinear(8, 8, fp8=sp_jax.Fp8Recipe(), gemm=Fp8Gemm(spec),
                                 rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="must be a GEMM object"):
        sp_jax.RowParallelLinear(8, 8, gemm="fp8", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="must be a GEMM object"):
        sp_jax.ops.matmul(jnp.ones((2, 4)), jnp.ones((4, 4)), gemm=spec)
    with pytest.raises(ValueError, match="takes none"):
        sp_jax.ops.matmul(jnp.ones((2, 4)), jnp.ones((4, 4)), gemm_state=jnp.zeros((3, 4)))
