"""Integrity data of checkpoints: two 32-bit checksums per array, computed on the devices in
one jitted pass (which also tells whether each floating array is finite), and the SHA-256
digest of the JSON record.

The checksums are uint32 wrap-around sums over an array's bits read as uint32 words ``w``
at flat word index ``i``: ``sum(w * (2i + 1))`` and ``sum(fmix32(w ^ (i * 0x9E3779B1)))``.
Integer wrap-around sums do not depend on the order of the additions, so they are the same
for any sharding, mesh or number of processes (and on the host, with numpy), and a single
flipped bit always changes the first one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["CHECKSUM", "VERSION", "checksums", "dtype_name", "leaf_dtype", "record_digest"]

VERSION = 1
"""The version of the integrity data written into the JSON record."""
CHECKSUM = ("uint32 wrap-around sums over the array's bits as uint32 words w at flat word "
            "index i: [sum(w * (2i + 1)), sum(fmix32(w ^ (i * 0x9E3779B1)))]")
"""How the checksums are computed, as the JSON record states it."""


def dtype_name(dtype: Any) -> str:
    """``dtype`` as the integrity record names it (numpy's name where numpy knows it)."""
    try:
        return str(np.dtype(dtype))
    except TypeError:  # e.g. a PRNG key dtype
        return str(dtype)


def _checksummable(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` get checksums: bool and numeric dtypes (not e.g. PRNG
    keys, whose leaves are saved unverified)."""
    import jax.numpy as jnp

    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def _words(x: Any, xp: Any) -> Any:
    """The bits of ``x`` as zero-extended uint32 words: one per element, or a trailing axis
    of ``bits / 32`` words per element for 64-bit (and wider) dtypes. ``xp`` is
    ``jax.numpy`` (inside jit) or ``numpy``; both give the same words."""
    import jax.numpy as jnp

    dtype = np.dtype(x.dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    if dtype == np.bool_:
        return x.astype(xp.uint32)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _words(xp.stack([xp.real(x), xp.imag(x)], axis=-1), xp)
    if bits < 8:  # int4, float4, ...: widened exactly, value for value
        if jnp.issubdtype(dtype, jnp.floating):
            wide = xp.float32
        else:
            wide = xp.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else xp.uint8
        return _words(x.astype(wide), xp)
    if bits <= 32:
        unsigned = {8: xp.uint8, 16: xp.uint16, 32: xp.uint32}[bits]
        if xp is np:
            words = np.ascontiguousarray(x).reshape(-1).view(unsigned).reshape(np.shape(x))
        else:
            words = jax.lax.bitcast_convert_type(x, unsigned)
        return words.astype(xp.uint32)
    if xp is np:
        flat = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
        return flat.reshape((*np.shape(x), bits // 32))
    return jax.lax.bitcast_convert_type(x, xp.uint32)


def _fmix32(h: Any, xp: Any) -> Any:
    """MurmurHash3's 32-bit finaliser (every input bit affects every output bit)."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def _leaf_sums(x: Any, xp: Any) -> list[Any]:
    """``[sum(w * (2i + 1)), sum(fmix32(w ^ (i * 0x9E3779B1))), all finite]`` as uint32
    for one array (``i``: the row-major flat index of each word ``w``)."""
    import jax.numpy as jnp

    words = _words(x, xp)
    if xp is np:
        index = np.arange(words.size, dtype=np.uint64).astype(np.uint32).reshape(words.shape)
    else:  # built from iotas, so a sharded array is never reshaped (no resharding)
        index = jnp.zeros(words.shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(words.ndim)):
            iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
            index = index + iota * jnp.uint32(stride % 2**32)
            stride *= words.shape[axis]
    odd = index * xp.uint32(2) + xp.uint32(1)
    first = xp.sum(words * odd, dtype=xp.uint32)
    second = xp.sum(_fmix32(words ^ (index * xp.uint32(0x9E3779B1)), xp), dtype=xp.uint32)
    if jnp.issubdtype(np.dtype(x.dtype), jnp.inexact):
        finite = xp.all(xp.isfinite(x)).astype(xp.uint32)
    else:
        finite = xp.uint32(1)
    return [first, second, finite]


def _sums_on_device(leaves: tuple[jax.Array, ...], on_host: tuple[bool, ...]) -> jax.Array:
    import jax.numpy as jnp

    # arrays in host memory (an offloaded optimizer state: memory kind pinned_host) are
    # summed on the device, one array brought there at a time
    leaves = tuple(jax.device_put(x, jax.memory.Space.Device) if host else x
                   for x, host in zip(leaves, on_host, strict=True))
    return jnp.stack([jnp.stack(_leaf_sums(x, jnp)) for x in leaves])


@functools.lru_cache(maxsize=16)
def _sums_jit(out_sharding: jax.sharding.Sharding | None, on_host: tuple[bool, ...]) -> Any:
    """The jitted pass over a group of arrays, its (n, 3) result replicated on their
    devices (so every process reads the same values); ``on_host``: which of them are in
    host memory."""
    return jax.jit(functools.partial(_sums_on_device, on_host=on_host),
                   out_shardings=out_sharding)


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def _device_order(x: jax.Array) -> tuple[int, ...]:
    devices = getattr(x.sharding, "_device_assignment", None)
    if devices is None:
        devices = sorted(x.sharding.device_set, key=lambda d: d.id)
    return tuple(d.id for d in devices)


def checksums(leaves: Mapping[str, Any]) -> dict[str, tuple[int, int, bool] | None]:
    """``{path: (checksum_1, checksum_2, all_finite)}`` of each leaf (None for a dtype
    without checksums). ``jax.Array`` leaves are summed on their devices, in one jitted
    pass per set of devices (one for a model on one mesh), which also works on global
    arrays of multi-process runs (every process calls it); other leaves on the host."""
    found: dict[str, tuple[int, int, bool] | None] = {}
    groups: dict[tuple[int, ...], list[str]] = {}
    for path, x in leaves.items():
        if isinstance(x, jax.Array):
            if _checksummable(x.dtype):
                groups.setdefault(_device_order(x), []).append(path)
            else:
                found[path] = None
            continue
        host = np.asarray(x)
        if _checksummable(host.dtype):
            with np.errstate(all="ignore"):
                first, second, finite = _leaf_sums(host, np)
            found[path] = (int(first), int(second), bool(finite))
        else:
            found[path] = None
    for paths in groups.values():
        arrays = tuple(leaves[p] for p in paths)
        on_host = tuple(getattr(x.sharding, "memory_kind", None) not in (None, "device")
                        for x in arrays)
        sums = np.asarray(_sums_jit(_replicated(arrays[0].sharding), on_host)(arrays))
        for path, (first, second, finite) in zip(paths, sums.tolist(), strict=True):
            found[path] = (first, second, bool(finite))
    return {path: found[path] for path in leaves}


def record_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 of the JSON record's canonical text, without its ``digest`` entry."""
    body = {k: v for k, v in record.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def leaf_dtype(x: Any) -> Any:
    """The dtype of an array leaf, or of a host value (a Python or numpy scalar)."""
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
