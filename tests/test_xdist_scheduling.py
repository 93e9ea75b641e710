"""The suite's ``--dist loadgroup`` scheduler: a test whose worker dies runs again on a fresh worker, without the
persistent compilation cache, up to twice; a third crash fails it; the run always goes on to the end."""

import collections
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
    @pytest.mark.xdist_group("flaky")
    def test_crashes_once(tmp_path_factory):
        import jax
        mark = tmp_path_factory.getbasetemp().parent / "crashed_once"
        if not mark.exists():
            assert os.environ["JAX_COMPILATION_CACHE_DIR"] and jax.config.jax_enable_compilation_cache
            mark.write_text("")
            os.abort()
        # the rerun: no persistent cache here, nor in the processes it starts
        assert "JAX_COMPILATION_CACHE_DIR" not in os.environ and not jax.config.jax_enable_compilation_cache
    @pytest.mark.xdist_group("flaky")
    def test_after_the_flaky_one():
        import jax
        assert os.environ["JAX_COMPILATION_CACHE_DIR"] and jax.config.jax_enable_compilation_cache
    def test_plain_1(): time.sleep(0.3)
    def test_plain_2(): pass
""")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_crashed_test_runs_again_uncached_and_fails_only_on_a_third_crash(tmp_path, workers):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {HERE!r})
        spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(HERE, "conftest.py")!r})
        suite_conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite_conftest)
        pytest_xdist_make_scheduler = suite_conftest.pytest_xdist_make_scheduler
        pytest_handlecrashitem = suite_conftest.pytest_handlecrashitem
        pytest_report_teststatus = suite_conftest.pytest_report_teststatus
        pytest_runtest_protocol = suite_conftest.pytest_runtest_protocol
    """))
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "DFLASH_TESTS_RERUNS"}
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "xla_cache")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadgroup", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "-o", "timeout=0", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = run.stdout.strip().splitlines()[-1]
    assert "1 failed, 9 passed, 3 rerun" in summary, run.stdout[-3000:]
    assert "FAILED test_suite.py::test_crash" in run.stdout
    assert run.stdout.count("node down") == 4  # test_crash three times, test_crashes_once once


def test_a_worker_still_collecting_gets_no_work_until_it_has_collected():
    """Two crashes in a row start two replacement workers; the first to finish collecting reschedules every
    worker, the other included. That worker must be skipped, not fail the scheduler (a KeyError there, raised
    inside ``remove_node``, made xdist drop a crash report and the dead worker's tests)."""
    from xdist_scheduling import CrashSafeLoadGroupScheduling

    class Node:
        shutting_down = False

        def send_runtest_some(self, indexes):
            sent.append(indexes)

        def shutdown(self):
            sent.append("shutdown")

    sched = CrashSafeLoadGroupScheduling.__new__(CrashSafeLoadGroupScheduling)
    sched.registered_collections = {}
    sched.assigned_work = {}
    sched.workqueue = collections.OrderedDict(g={"t::a": False})
    sent = []
    node = Node()
    sched.assigned_work[node] = {}
    sched._reschedule(node)  # still collecting: nothing assigned, nothing raised
    assert sent == [] and sched.workqueue == {"g": {"t::a": False}}
    sched.registered_collections[node] = ["t::a"]
    sched._reschedule(node)
    assert sent[0] == [0]


def test_a_send_to_a_worker_that_just_died_keeps_the_work_queued():
    """A worker can die between reporting a test and its "node down" event: sending it work then raises OSError
    (xdist made that an INTERNALERROR that ended the run). The unit stays first in the queue for the next worker."""
    from xdist_scheduling import CrashSafeLoadGroupScheduling

    class Dead:
        shutting_down = False

        def send_runtest_some(self, indexes):
            raise OSError("cannot send (already closed?)")

        def shutdown(self):
            raise OSError("cannot send (already closed?)")

    sched = CrashSafeLoadGroupScheduling.__new__(CrashSafeLoadGroupScheduling)
    node = Dead()
    sched.registered_collections = {node: ["t::a", "t::b"]}
    sched.assigned_work = {node: {}}
    sched.workqueue = collections.OrderedDict(g={"t::a": False}, h={"t::b": False})
    sched._reschedule(node)
    assert list(sched.workqueue) == ["g", "h"] and sched.assigned_work[node] == {}
    sched.workqueue.clear()
    sched._reschedule(node)  # nothing left: the shutdown's OSError is ignored too
