"""sp_jax.xla_flags: recommended XLA GPU flags, their filtering against jaxlib, the warning."""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import pytest
from conftest import requires_cuda_plugin

import sp_jax
from sp_jax import xla_flags

UNKNOWN = "--xla_gpu_this_flag_does_not_exist=true"


def _run(code: str, xla_flags_env: str | None, timeout: int = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter on CPU with ``XLA_FLAGS`` = ``xla_flags_env``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if xla_flags_env is not None:
        env["XLA_FLAGS"] = xla_flags_env
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def _jax_starts(flags: str) -> subprocess.CompletedProcess:
    return _run("import jax; print(jax.devices())", flags)


@pytest.fixture
def clean_warning_state():
    xla_flags._warn_gpu_flags_missing_once.cache_clear()
    yield
    xla_flags._warn_gpu_flags_missing_once.cache_clear()


def test_module_exported():
    assert sp_jax.xla_flags is xla_flags
    assert "xla_flags" in sp_jax.__all__
    names = [f.name for f in xla_flags.RECOMMENDED_GPU_FLAGS]
    assert "xla_gpu_enable_latency_hiding_scheduler" in names
    assert len(set(names)) == len(names)
    for f in xla_flags.RECOMMENDED_GPU_FLAGS:
        assert f.flag == f"--{f.name}={f.value}" and f.why


def test_recommended_flags_are_accepted_by_jaxlib():
    flags = xla_flags.recommended_xla_flags()
    # jaxlib 0.10.2 knows all of them; a future jaxlib may drop some, never all.
    assert flags and set(flags) <= {f.flag for f in xla_flags.RECOMMENDED_GPU_FLAGS}
    proc = _jax_starts(" ".join(flags))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_unknown_flag_aborts_jax_and_is_filtered_out():
    proc = _jax_starts(UNKNOWN)
    assert proc.returncode != 0
    assert "Unknown flag" in proc.stderr
    good = xla_flags.recommended_xla_flags()[:2]
    assert xla_flags.supported_xla_flags([good[0], UNKNOWN, good[1]]) == good
    assert xla_flags.supported_xla_flags([UNKNOWN]) == []


def test_flag_with_unparsable_value_is_filtered_out():
    good = "--xla_gpu_enable_latency_hiding_scheduler=true"
    bad = "--xla_gpu_all_gather_combine_threshold_bytes=lots"
    assert xla_flags.supported_xla_flags([bad, good]) == [good]


def test_supported_xla_flags_rejects_malformed_flags():
    with pytest.raises(ValueError, match="not an XLA flag"):
        xla_flags.supported_xla_flags(["xla_gpu_enable_latency_hiding_scheduler=true"])


def test_apply_xla_flags_before_jax_starts():
    code = """
        import os, sys
        from sp_jax import xla_flags
        value = xla_flags.apply_xla_flags()
        assert os.environ["XLA_FLAGS"] == value, value
        import jax
        jax.devices()  # the backend starts with the flags
        assert xla_flags.missing_xla_flags() == [], xla_flags.missing_xla_flags()
        try:
            xla_flags.apply_xla_flags()
        except RuntimeError:
            pass
        else:
            sys.exit("no RuntimeError after the backend started")
        print(value)
    """
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_hlo_as_text"
    proc = _run(code, user)
    assert proc.returncode == 0, proc.stderr[-2000:]
    value = proc.stdout.strip().splitlines()[-1]
    assert value.startswith(user)  # the user's flags come first, unchanged
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in value
    assert value.count("xla_gpu_enable_latency_hiding_scheduler") == 1
    for flag in xla_flags.recommended_xla_flags()[1:]:
        assert value.count(flag) == 1, (flag, value)


def test_apply_xla_flags_keeps_user_values_and_does_not_duplicate(monkeypatch):
    monkeypatch.setattr(xla_flags, "_backend_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_all_gather=false")
    first = xla_flags.apply_xla_flags()
    assert first.startswith("--xla_gpu_enable_pipelined_all_gather=false ")
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in first
    assert xla_flags.apply_xla_flags() == first  # idempotent
    given = xla_flags.apply_xla_flags(["--xla_dump_to=/tmp/x", "--xla_dump_to=/tmp/y"])
    assert given == first + " --xla_dump_to=/tmp/x"
    with pytest.raises(ValueError, match="not an XLA flag"):
        xla_flags.apply_xla_flags(["dump_to"])


def test_apply_xla_flags_after_backend_init_raises(monkeypatch):
    jax.devices()  # tests/conftest.py has started the CPU backend; make sure
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match="before the first JAX computation"):
        xla_flags.apply_xla_flags()
    assert os.environ.get("XLA_FLAGS") == before


def test_missing_xla_flags(monkeypatch):
    flags = xla_flags.recommended_xla_flags()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_flags.missing_xla_flags() == flags
    # A user-chosen value counts as present.
    name = flags[0].split("=")[0]
    monkeypatch.setenv("XLA_FLAGS", f"{name}=false {' '.join(flags[2:])}")
    assert xla_flags.missing_xla_flags() == [flags[1]]


def test_recommended_compiler_options_compile():
    opts = xla_flags.recommended_compiler_options()
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert jax.jit(lambda x: x + 1, compiler_options=opts)(1) == 2
    with pytest.raises(Exception, match="xla_gpu_this_flag_does_not_exist"):
        jax.jit(lambda x: x + 2, compiler_options={"xla_gpu_this_flag_does_not_exist": "true"})(1)


def test_gpu_flags_not_set_compares_names_only(monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed jaxlib"))
    flags = [f.flag for f in xla_flags.RECOMMENDED_GPU_FLAGS]
    monkeypatch.setenv("XLA_FLAGS", f"{flags[0].split('=')[0]}=false")
    assert xla_flags.gpu_flags_not_set() == flags[1:]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    assert xla_flags.gpu_flags_not_set() == []


def test_no_warning_on_cpu(clean_warning_state, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    called = []
    monkeypatch.setattr(xla_flags, "gpu_flags_not_set", lambda: called.append(1) or ["--x=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xla_flags.warn_if_gpu_flags_missing()
    assert not called  # nothing looked at off GPU


def test_warns_once_on_gpu_naming_missing_flags(clean_warning_state, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    with pytest.warns(UserWarning, match="xla_gpu_enable_while_loop_double_buffering") as rec:
        xla_flags.warn_if_gpu_flags_missing()
    message = str(rec[0].message)
    assert "apply_xla_flags()" in message and "XLA_FLAGS" in message
    assert "xla_gpu_enable_latency_hiding_scheduler" not in message  # user set it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xla_flags.warn_if_gpu_flags_missing()  # once per process


def test_no_warning_on_gpu_with_flags(clean_warning_state, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", " ".join(xla_flags.recommended_xla_flags()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xla_flags.warn_if_gpu_flags_missing()


def test_train_step_warns_on_gpu_and_layers_do_not(clean_warning_state, monkeypatch,
                                                   mesh_2x4):
    """The check runs where a program is set up (TrainStep), never inside a layer call;
    neither starts a subprocess."""
    import subprocess

    import optax
    from flax import nnx

    from sp_jax.training import TrainStep

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("started a subprocess"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started a subprocess"))
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            layer(jax.numpy.ones((2, 8, 16)))
        with pytest.warns(UserWarning, match="apply_xla_flags"):
            TrainStep(layer, optax.sgd(0.1))


@requires_cuda_plugin
def test_flags_reach_xla_gpu_in_a_deviceless_compile():
    """XLA:GPU (the CUDA plugin's own XLA) accepts the flags from XLA_FLAGS and uses them.

    A scan over 4 layers is double-buffered (trip count 2) with the flags; turning them
    off for one compilation through compiler_options gives the plain loop back.
    """
    code = """
        import re
        from importlib import resources
        import jax, jax.numpy as jnp
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from sp_jax import xla_flags

        target = resources.files("sp_jax.analysis").joinpath("targets", "h100_sxm.txtpb")
        topo = topologies.get_topology_desc(
            platform="cuda", topology="1x1x2", target_config=target.read_text())
        mesh = Mesh(topo.devices, ("tensor",))

        def body(x, w):
            x = jax.lax.all_gather(x, "tensor", axis=0, tiled=True) @ w
            return jax.lax.psum_scatter(x, "tensor", scatter_dimension=0, tiled=True), None

        def f(x, ws):
            step = jax.shard_map(lambda x, w: body(x, w)[0], mesh=mesh,
                                 in_specs=(P("tensor"), P()), out_specs=P("tensor"))
            return jax.lax.scan(lambda x, w: (step(x, w), None), x, ws)[0]

        spec = lambda shape, p: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                     sharding=NamedSharding(mesh, p))
        lowered = jax.jit(f).lower(spec((64, 64), P("tensor")), spec((4, 64, 64), P()))
        off = {k: v if not isinstance(v, bool) else False
               for k, v in xla_flags.recommended_compiler_options().items()}
        for hlo in (lowered.compile().as_text(), lowered.compile(off).as_text()):
            print(sorted(re.findall(r'"known_trip_count":{"n":"(\\d+)"', hlo)))
    """
    proc = _run(code, " ".join(xla_flags.recommended_xla_flags()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_flags, without = proc.stdout.strip().splitlines()[-2:]
    assert with_flags == "['2']", proc.stdout
    assert without == "['4']", proc.stdout


def test_cpu_simulation_flags():
    assert xla_flags.cpu_simulation_flags(4) == [
        "--xla_force_host_platform_device_count=4",
        "--xla_disable_hlo_passes=cse_barrier_expander",
    ]
    with pytest.raises(ValueError, match="num_devices=0 must be a positive int"):
        xla_flags.cpu_simulation_flags(0)


def test_simulated_cpu_devices_only_without_an_accelerator(monkeypatch):
    """JAX_PLATFORMS decides first; without it, device nodes do. Nothing changes on an
    accelerator (XLA:GPU must keep the pass the CPU flags turn off), nor once the backend
    runs with enough devices (this process: 8); fewer is an error."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dummy=1")
    for platforms, present in (("cuda", True), ("cpu", False), ("cpu,tpu", True)):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert xla_flags.accelerator_present() is present
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert xla_flags.simulate_cpu_devices(16) is False  # the backend runs: no flag added
    assert os.environ["XLA_FLAGS"] == "--xla_dummy=1"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert xla_flags.simulate_cpu_devices(8) is False  # 8 devices already
    with pytest.raises(RuntimeError, match="after JAX initialised its backend"):
        xla_flags.simulate_cpu_devices(16)
    assert os.environ["XLA_FLAGS"] == "--xla_dummy=1"


def test_simulated_cpu_devices_in_a_fresh_process():
    """Before JAX starts, on a CPU: the flags are added and JAX sees the devices."""
    code = ("import sp_jax, jax\n"
            "assert sp_jax.xla_flags.simulate_cpu_devices(3)\n"
            "assert jax.device_count() == 3, jax.devices()\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
