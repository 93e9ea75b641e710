"""The suite's ``--dist loadgroup`` scheduler: a worker that dies fails its test and the run goes on to the end."""

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# groups finished before the crash (their requeue hung stock xdist), a crash with more of its group after it,
# one-test groups (a replacement handed one item waited for a second forever), and ungrouped tests
SUITE = textwrap.dedent("""
    import os, time, pytest

    @pytest.mark.xdist_group("early")
    def test_early_1(): time.sleep(0.2)
    @pytest.mark.xdist_group("early")
    def test_early_2(): pass
    @pytest.mark.xdist_group("crashing")
    def test_before_crash(): time.sleep(0.5)
    @pytest.mark.xdist_group("crashing")
    def test_crash(): os.abort()
    @pytest.mark.xdist_group("crashing")
    def test_after_crash(): pass
    @pytest.mark.xdist_group("single")
    def test_single(): pass
    def test_plain_1(): time.sleep(0.3)
    def test_plain_2(): pass
""")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_crashed_worker_fails_one_test_and_the_rest_still_run(tmp_path, workers):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {HERE!r})
        spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(HERE, "conftest.py")!r})
        suite_conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite_conftest)
        pytest_xdist_make_scheduler = suite_conftest.pytest_xdist_make_scheduler
    """))
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadgroup", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "-o", "timeout=0", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = run.stdout.strip().splitlines()[-1]
    assert "1 failed, 7 passed" in summary, run.stdout[-3000:]
    assert "crashed while running 'test_suite.py::test_crash" in run.stdout
