"""Train a sequence-parallel MLP block (ColumnSP -> gelu -> RowSP, residual) for a few steps.

On a CPU-only machine it simulates 8 devices (mesh data=2 x tensor=4); on GPUs it uses the
real ones. The same model is trained unsharded on one device from the same weights and
batches, and the two loss curves are printed side by side.

    python examples/train_mlp.py [--steps 30] [--mesh 2,4] [--recompute-allgather]
"""

from __future__ import annotations

import argparse


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mesh", default="2,4", help="DATA,TENSOR mesh shape")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--recompute-allgather", action="store_true")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="simulated devices when running on CPU (set before JAX starts)")
    return p.parse_args()


args = _parse()
# Simulated CPU devices must be configured before JAX initialises its backend (and
# XLA:CPU must keep recompute's backward re-all-gather; XLA:GPU keeps it by itself).
import sp_jax  # noqa: E402  (before jax: on a machine without a GPU, no CUDA noise)

sp_jax.xla_flags.simulate_cpu_devices(args.cpu_devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


class MLPBlock(nnx.Module):
    """Pre-LN MLP block; sequence-parallel when ``parallel`` is given, else plain nnx."""

    def __init__(self, hidden: int, *, parallel: sp_jax.ParallelConfig | None, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        if parallel is None:
            self.up = nnx.Linear(hidden, 4 * hidden, rngs=rngs)
            self.down = nnx.Linear(4 * hidden, hidden, rngs=rngs)
        else:
            self.up = sp_jax.ColumnSequenceParallelLinear(
                hidden, 4 * hidden, parallel=parallel, rngs=rngs)
            self.down = sp_jax.RowSequenceParallelLinear(
                4 * hidden, hidden, parallel=parallel, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


def batches(rng: np.random.Generator, teacher, n: int, shape):
    """Regression data: inputs and the outputs of a fixed random teacher network."""
    for _ in range(n):
        x = rng.normal(size=shape).astype(np.float32)
        yield x, np.asarray(teacher(x))


def train(model, data, lr, in_sharding=None):
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = []
    for x, y in data:
        if in_sharding is not None:
            x, y = jax.device_put(x, in_sharding), jax.device_put(y, in_sharding)
        losses.append(float(step(model, optimizer, x, y)))
    return losses


def main() -> None:
    data_size, tensor_size = (int(v) for v in args.mesh.split(","))
    mesh = jax.make_mesh((data_size, tensor_size), ("data", "tensor"),
                         devices=jax.devices()[: data_size * tensor_size])
    parallel = sp_jax.ParallelConfig(recompute_allgather=args.recompute_allgather)
    shape = (args.batch_size, args.seq_len, args.hidden)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}  mesh: {dict(mesh.shape)}"
          f"  recompute_allgather={parallel.recompute_allgather}")

    with jax.set_mesh(mesh):
        model = MLPBlock(args.hidden, parallel=parallel, rngs=nnx.Rngs(args.seed))
        for name in ("up", "down"):
            kernel = getattr(model, name).kernel
            print(f"{name}.kernel {kernel.shape} sharded {kernel[...].sharding.spec}")
    # The unsharded twin starts from the same weights (copied to host).
    reference = MLPBlock(args.hidden, parallel=None, rngs=nnx.Rngs(args.seed))
    state = nnx.state(reference)
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))))
    nnx.update(reference, state)
    teacher = MLPBlock(args.hidden, parallel=None, rngs=nnx.Rngs(args.seed + 1))

    # [batch, seq, hidden] sharded as in a sequence-parallel region: P("data", "tensor", None)
    sp_sharding = jax.sharding.NamedSharding(mesh, sp_jax.Layout.of(parallel).sp)
    with jax.set_mesh(mesh):
        sp_losses = train(model, batches(np.random.default_rng(args.seed), teacher,
                                         args.steps, shape), args.lr, sp_sharding)
    ref_losses = train(reference, batches(np.random.default_rng(args.seed), teacher,
                                          args.steps, shape), args.lr)

    print(f"{'step':>4}  {f'loss (SP, {data_size * tensor_size} devices)':>22}"
          f"  {'loss (unsharded)':>16}")
    for i, (a, b) in enumerate(zip(sp_losses, ref_losses, strict=True)):
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"{i:>4}  {a:>22.6f}  {b:>16.6f}")
    diff = max(abs(a - b) for a, b in zip(sp_losses, ref_losses, strict=True))
    print(f"loss {sp_losses[0]:.4f} -> {sp_losses[-1]:.4f}; "
          f"max |SP - unsharded| over {args.steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
