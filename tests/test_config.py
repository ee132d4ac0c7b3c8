import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sp_jax import ParallelConfig


def test_defaults():
    cfg = ParallelConfig()
    assert cfg.tensor_axis == "tensor"
    assert cfg.data_axis == "data"
    assert cfg.data_axes == ("data",)
    assert cfg.recompute_allgather is False
    assert cfg.wgrad_dtype is None


def test_frozen_and_hashable():
    cfg = ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.recompute_allgather = False  # type: ignore[misc]
    assert hash(cfg) == hash(ParallelConfig(recompute_allgather=True, wgrad_dtype="float32"))
    assert cfg == ParallelConfig(recompute_allgather=True, wgrad_dtype=np.float32)


def test_from_dict_round_trip():
    d = {"tensor_axis": "model", "data_axis": ["dp", "fsdp"], "recompute_allgather": True,
         "wgrad_dtype": "float32"}
    cfg = ParallelConfig.from_dict(d)
    assert cfg.tensor_axis == "model"
    assert cfg.data_axis == ("dp", "fsdp")
    assert cfg.data_axes == ("dp", "fsdp")
    assert cfg.recompute_allgather is True
    assert cfg.wgrad_dtype == jnp.float32
    assert ParallelConfig.from_dict({}) == ParallelConfig()
    assert ParallelConfig.from_dict({"data_axis": None}).data_axes == ()


def test_from_dict_rejects_unknown_keys_naming_valid_ones():
    with pytest.raises(ValueError, match=r"recompute_allgaher.*valid keys.*recompute_allgather"):
        ParallelConfig.from_dict({"recompute_allgaher": True})
    with pytest.raises(TypeError, match="mapping"):
        ParallelConfig.from_dict([("tensor_axis", "t")])  # type: ignore[arg-type]


INVALID = [  # (fields, exception, the error's words)
        ({"tensor_axis": ""}, TypeError, "tensor_axis"),
        ({"tensor_axis": 3}, TypeError, "tensor_axis=3"),
        ({"data_axis": 5}, TypeError, "data_axis=5"),
        ({"data_axis": ()}, TypeError, "data_axis"),
        ({"data_axis": ("tensor",)}, ValueError, "contains the tensor axis"),
        ({"data_axis": ("a", "a")}, ValueError, "repeats"),
        ({"recompute_allgather": "yes"}, TypeError, "recompute_allgather='yes'"),
        ({"wgrad_dtype": jnp.int32}, ValueError, "floating"),
        ({"wgrad_dtype": "not-a-dtype"}, TypeError, "not a dtype"),
        ({"fsdp": "zero"}, ValueError, "fsdp='zero' is not a known fsdp mode"),
        ({"offload_activations": "yes"}, TypeError, "offload_activations='yes'"),
]


def test_invalid_values_fail_at_construction():
    """Each of INVALID (one test: they cost no compile), built and read from a dict."""
    for kwargs, exc, match in INVALID:
        with pytest.raises(exc, match=match):
            ParallelConfig(**kwargs)
        with pytest.raises(exc, match=match):
            ParallelConfig.from_dict(kwargs)


def test_replace_validates():
    cfg = ParallelConfig().replace(recompute_allgather=True)
    assert cfg.recompute_allgather
    with pytest.raises(TypeError):
        cfg.replace(recompute_allgather=None)
