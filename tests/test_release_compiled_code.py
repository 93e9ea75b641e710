"""``conftest.release_compiled_code`` (run after a test once the process nears the kernel's limit on memory maps):
what the test modules' ``functools`` caches hold is dropped, and with it the memory maps of the executables XLA:CPU
loaded for them."""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

MODULE_A = textwrap.dedent("""
    import builtins, functools, os, weakref
    import jax, jax.numpy as jnp

    def maps():
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(1 for _ in f)

    class Held:
        pass

    def body(x):
        for i in range(8):
            x = jnp.sort(x * (i + 1)) + jnp.cumsum(x)
        return x * 2

    @functools.lru_cache(maxsize=None)
    def held():
        h = Held()
        lowered = jax.jit(body).lower(jnp.ones(64))
        builtins.maps_before = maps()
        h.exe = lowered.compile()
        return h

    def test_a_holds_an_executable():
        jax.jit(lambda x: jnp.sort(x) + 1).lower(jnp.ones(8)).compile()  # the compiler's own first-use maps
        h = held()
        builtins.held_ref = weakref.ref(h)
        builtins.maps_held = maps()
        assert builtins.maps_held > builtins.maps_before + 10  # the executable's kernels are mapped
""")

MODULE_B = textwrap.dedent("""
    import builtins
    from test_a import maps

    def test_b_sees_them_released():
        assert builtins.held_ref() is None
        assert maps() <= builtins.maps_before + 3, (builtins.maps_before, builtins.maps_held, maps())
""")


def test_cached_executables_are_released_past_the_maps_threshold(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {HERE!r})
        spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(HERE, "conftest.py")!r})
        suite_conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite_conftest)
        suite_conftest.MAPS_BEFORE_RELEASE = 0  # release after every test
        pytest_runtest_teardown = suite_conftest.pytest_runtest_teardown
    """))
    (tmp_path / "test_a.py").write_text(MODULE_A)
    (tmp_path / "test_b.py").write_text(MODULE_B)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "addopts=", "-o", "timeout=0", "test_a.py", "test_b.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout
