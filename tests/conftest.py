import os
import sys

# The suite compiles hundreds of small executables and runs each a few times: XLA:CPU's LLVM at -O0 without its
# expensive passes compiles them in a fraction of the time (engine-heavy files ran 1.2-1.45x faster end to end on 2
# cores). No fast-math either way, and every golden / equality test of the suite passes under these flags.
# FAST_COMPILE is the same as per-executable ``compiler_options``, for tests that must compile fast whatever
# XLA_FLAGS says (the interpret-mode Pallas kernels are big scans, whose test time it halves).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
FAST_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items())


def xla_flags(n_devices: int) -> str:
    """``XLA_FLAGS`` for a test process (or a subprocess a test starts) with ``n_devices`` host CPU devices."""
    return f"--xla_force_host_platform_device_count={n_devices} {FAST_XLA_FLAGS}"


os.environ.setdefault("XLA_FLAGS", xla_flags(1))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

# One persistent compilation cache for the whole run, shared by the xdist workers and the processes tests start
# (servers, multi-process jobs): modules that build engines of the same shapes load each other's executables
# instead of compiling them again. Set here, in the controller, before any worker starts (they inherit it); a fresh
# directory per run unless JAX_COMPILATION_CACHE_DIR is already set.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-jax-tests-xla-")
    # Every executable is written (11532 in a run; 471 took >= 1 s to compile): writing only those made the suite
    # slower (40 % done after 18 min, against 24 min for all of it), so the sub-second ones are loaded often.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# No size limit here (unlike engine.compile.enable_compile_cache): with one, JAX locks every read and write, but
# each write also scans every entry of the directory for eviction, and this suite writes ~11500 (3000 writes took
# 161 s on this machine, 0.1 s each at the end). So entries are unlocked; _atomic_cache_writes (below) writes each
# one whole, so that no process reads it half-written.

import pytest  # noqa: E402
import xdist_scheduling  # noqa: E402

xdist_scheduling.share_reruns_file()

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TINY = ("qwen36_tiny_a", "qwen36_tiny_b")
YARN = "qwen36_tiny_yarn"  # tiny_a's shapes with YaRN over 32 positions, prompts to 130 (transformers golden)


@pytest.fixture(scope="session")
def fixtures_dir() -> str:
    return FIXTURES


# scipy's OpenBLAS backs XLA:CPU's LAPACK custom calls (e.g. the triangular solves of the chunked Gated DeltaNet
# used in every prefill). Left multi-threaded, its worker threads fight XLA's own thread pool: on a 2-core machine a
# tiny batched trsm then takes ~50 ms instead of ~50 us, making a tiny-model prefill chunk cost ~0.3 s. It reads
# this variable when it is first loaded, which is after this file (nothing above imports jax or scipy).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _atomic_cache_writes() -> None:
    """Write the shared compilation cache's entries whole: JAX's unlocked cache (no size limit, above) writes an
    entry in place, so a worker could read it half-written, or two workers compiling the same executable could
    interleave their writes into one file, and XLA:CPU then crashed deserializing it (twice in a row on one key in
    a clean-clone run, failing the test on its rerun). Each entry is now written to a temporary name and renamed
    into place; the size-limited (locked) cache of ``engine.compile.enable_compile_cache`` is unchanged."""
    import threading

    from jax._src import lru_cache

    put = lru_cache.LRUCache.put

    def atomic_put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled or not key:
            return put(self, key, value)
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(value)
        os.replace(tmp, path)

    lru_cache.LRUCache.put = atomic_put


_atomic_cache_writes()


MAPS_BEFORE_RELEASE = 40000  # of Linux's default vm.max_map_count, 65530


def mapped_regions() -> int:
    """Memory maps of this process (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def release_compiled_code(test_dir: str) -> None:
    """Drop what the ``functools`` caches of the modules in ``test_dir`` hold (engines, compiled steps) and JAX's
    jit caches, and collect the garbage, so that this process unloads those executables."""
    import gc

    test_dir = os.path.abspath(test_dir)
    for mod in list(sys.modules.values()):
        if os.path.dirname(os.path.abspath(getattr(mod, "__file__", None) or "/")) != test_dir:
            continue
        for obj in list(vars(mod).values()):
            if getattr(obj, "__module__", None) == mod.__name__ and callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Release compiled code when this process nears the kernel's limit on memory maps.

    XLA:CPU maps three regions for each compiled kernel object it loads (code, read-only data, data): one engine of
    a tiny fixture is ~6000 maps, and Linux allows 65530 a process by default. Workers that kept every module's
    cached engines reached ~61000 maps a third of the way through a run, and then crashed in XLA:CPU: the segfaults
    in ``executable.serialize()`` / deserialisation that CI reran, always near the same point of the run. Releasing
    at each module's end instead rebuilt engines whenever a worker came back to a module (1.9x the time of three
    engine-heavy files), so it is done only past ``MAPS_BEFORE_RELEASE``."""
    result = yield
    if mapped_regions() > MAPS_BEFORE_RELEASE:
        release_compiled_code(os.path.dirname(str(item.path)))
    return result


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``--dist loadgroup`` keep each ``xdist_group`` on one worker under pytest >= 9.

    pytest-xdist (3.8) tags a grouped item's node id ("...@name") by assigning ``item._nodeid``; pytest 9 keeps the
    node id in ``item._id`` and ignores that, so every group was silently spread over all workers: each worker then
    built the group's module fixtures (compiled engines, server processes) and order-dependent modules ran split.
    This applies the tag where xdist's did not take (a no-op on pytest 8, and without ``--dist loadgroup``)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        tag = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(tag):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + tag)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the crash-safe scheduler (tests/xdist_scheduling.py): a worker dying in XLA reruns
    its test on a fresh worker, up to twice, and a third crash fails it; none of it hangs the run."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return xdist_scheduling.CrashSafeLoadGroupScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test rerun after its worker crashed runs without the persistent compilation cache
    (tests/xdist_scheduling.py)."""
    if not xdist_scheduling.is_rerun(item.nodeid):
        return (yield)
    with xdist_scheduling.rerun_without_compile_cache():
        return (yield)


def pytest_handlecrashitem(crashitem, report, sched):
    xdist_scheduling.rerun_crashed(crashitem, report, sched)


def pytest_report_teststatus(report, config):
    return xdist_scheduling.rerun_status(report)


def nano_drafter_config(tmp_path, block_size: int = 8) -> str:
    """A 2-layer DFlash drafter config (sliding + full layer) over the tiny fixtures' 256-token vocabulary, written
    under ``tmp_path``, for the benchmarks' ``--random-drafter``; returns its path."""
    import json

    path = tmp_path / "drafter.json"
    path.write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e7,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "block_size": block_size,
        "dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 1, 2]}}))
    return str(path)


def load_experiment(name: str):
    """The script ``experiments/<name>.py`` imported as a module (the experiments folder is not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
