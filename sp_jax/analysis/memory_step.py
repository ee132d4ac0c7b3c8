"""The training step of a planner layout with its memory options, as
:class:`~sp_jax.training.TrainStep` builds it (:func:`sp_jax.analysis.plan.plan_one`'s
``memory=``): AdamW with the moments' dtype, ZeRO-1's update shardings and data-manual
graph, the offloaded state's arguments in ``pinned_host``; compiled deviceless."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["compile_with_memory", "memory_adamw", "zero1_step"]


def memory_adamw(memory: Any) -> Any:
    """AdamW with ``memory``'s moments (:func:`sp_jax.training.adamw`)."""
    from sp_jax.training.optimizer import MOMENTS_DTYPES, adamw

    dtype = MOMENTS_DTYPES[memory.moments]
    return adamw(1e-4, mu_dtype=dtype, nu_dtype=dtype)


def zero1_step(gpt: Any, params: Any, parallel: Any, mesh: Any) -> dict[str, Any]:
    """ZeRO-1's pieces of the step as :class:`~sp_jax.training.TrainStep` builds them
    (``fsdp="optimizer"``): the update shardings, the data-manual graph, the moments'
    parameters resharded (``state_of``); empty otherwise."""
    from sp_jax.training.step import manual_data_graphdef, optimizer_shardings

    if parallel.fsdp != "optimizer":
        return {}
    update = optimizer_shardings(params, parallel)
    manual = manual_data_graphdef(gpt, parallel, mesh)
    return {"update_shardings": update, "manual_graphdef": manual,
            "manual_axes": parallel.data_axes if manual is not None else (),
            "state_of": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=s), params, update)}


def compile_with_memory(graphdef: Any, tx: Any, params: Any, rest: Any, opt_state: Any,
                         batch_tree: Any, key: Any, mesh: Any, memory: Any,
                         compute_dtype: Any, zero1: dict[str, Any]
                         ) -> tuple[str, int, int, int]:
    """The step with ``memory``'s offloads compiled (the offloaded trees' arguments in
    ``pinned_host``): ``(hlo, device temp, device peak, host bytes)``."""
    from jax.sharding import NamedSharding, PartitionSpec

    from sp_jax.analysis.gpu import default_compiler_options
    from sp_jax.training.offload import HOST
    from sp_jax.training.step import train_step_fn

    offload_opt = memory.offload != "off"
    offload_params = memory.offload == "optimizer+params"

    def placed(tree: Any, host: bool) -> Any:  # each leaf on the mesh, in its memory
        def leaf(x: Any) -> Any:
            s = getattr(x, "sharding", None)
            spec = s if isinstance(s, PartitionSpec) else getattr(s, "spec", PartitionSpec())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
                mesh, spec).with_memory_kind(HOST if host else "device"))
        return jax.tree.map(leaf, tree)

    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
    with jax.set_mesh(mesh):  # (a bare PartitionSpec resolves against the context mesh)
        p_in, o_in = placed(params, offload_params), placed(opt_state, offload_opt)
        tokens = placed(batch_tree, False)
        step = train_step_fn(graphdef, tx, param_shardings=shard(placed(params, False)),
                             offload_optimizer=offload_opt, offload_params=offload_params,
                             compute_dtype=compute_dtype, **zero1)
        compiled = jax.jit(
            step, in_shardings=(shard(p_in), None, shard(o_in), None, None),
            out_shardings=(shard(p_in), shard(o_in), None), donate_argnums=(0, 2),
        ).lower(p_in, rest, o_in, tokens, key).compile(
            compiler_options=default_compiler_options())
    mem = compiled.memory_analysis()
    temp = int(mem.temp_size_in_bytes)
    peak = (int(mem.argument_size_in_bytes) + int(mem.output_size_in_bytes)
            - int(mem.alias_size_in_bytes) + temp)
    host = int(mem.host_argument_size_in_bytes) + int(mem.host_temp_size_in_bytes)
    return compiled.as_text(), temp, peak, host
