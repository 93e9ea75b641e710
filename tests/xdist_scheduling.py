"""``--dist loadgroup`` that survives a crashed worker.

pytest-xdist 3.8's group scheduler deadlocks the whole session when a worker dies mid-run (pytest-xdist issues 1323,
1327, 1378; the fixes are not released): ``remove_node`` puts the dead worker's *entire* workload back on the queue,
completed groups included, so a replacement worker can be sent an empty batch it never reports on; and a
replacement sent a single one-test group waits forever for a second item. A CI run that should have ended with one
failed test then hung until the job's time limit. This scheduler requeues only what did not run (unfinished groups
first), never sends an empty batch, and never leaves a worker holding fewer than two pending items without telling
it to shut down.

A test whose worker died is run again on a fresh worker, up to twice (``max_reruns``); after its third crash it
counts as done and failed (stock xdist would requeue it until the worker restarts run out). Why reruns: XLA:CPU has
crashed the process a few times a run in CI, in tests that pass alone and on rerun: a segfault or abort inside
``backend_compile_and_load``, and more often in the persistent compilation cache's executable (de)serialisation
(``get_executable_and_time`` / ``put_executable_and_time``), once in the same test twice in a row; their cause was
the process's memory maps reaching ``vm.max_map_count``, which ``conftest.pytest_runtest_teardown`` now keeps away
from. A rerun runs without the persistent cache (``rerun_without_compile_cache``): before it queues a crashed test
again, the controller names it in the file ``RERUNS_ENV`` points to, where the worker that takes it reads it. A
native crash in a dependency should not fail the run when the same test then passes; each crash is reported as
``RERUN`` with the worker's message, so it stays visible in the log and the summary line.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator

import pytest
from xdist.scheduler.loadgroup import LoadGroupScheduling
from xdist.workermanage import WorkerController


class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
    max_reruns = 2

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.crashes: collections.Counter[str] = collections.Counter()
        self.rerunning: set[str] = set()  # crashed tests queued to run again

    def remove_node(self, node: WorkerController) -> str | None:
        workload = self.assigned_work.pop(node)
        pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crash_scope, crashitem = pending[0]
        self.crashes[crashitem] += 1
        if self.crashes[crashitem] > self.max_reruns:
            workload[crash_scope][crashitem] = True
            self.rerunning.discard(crashitem)
        else:
            self.rerunning.add(crashitem)
            mark_rerun(crashitem)
        # unfinished groups go first, so the replacement resumes where the dead worker stopped
        for scope, unit in reversed(list(workload.items())):
            if not all(unit.values()):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _assign_work_unit(self, node: WorkerController) -> bool:
        """Send the next unit with pending tests to ``node``; False if none was sent."""
        while self.workqueue:
            scope, unit = self.workqueue.popitem(last=False)
            indexes = [self.registered_collections[node].index(nodeid) for nodeid, done in unit.items() if not done]
            if indexes:
                try:
                    node.send_runtest_some(indexes)
                except OSError:  # the worker has died and its "node down" event is still queued: keep the unit
                    self.workqueue[scope] = unit
                    self.workqueue.move_to_end(scope, last=False)
                    return False
                self.assigned_work.setdefault(node, {})[scope] = unit
                return True
        return False

    def _reschedule(self, node: WorkerController) -> None:
        # a replacement worker that has not finished collecting gets work once it has (``schedule()``): assigning
        # it work now raised a KeyError, which xdist swallows when it comes out of ``remove_node``, losing the dead
        # worker's crash report and its pending tests
        if node.shutting_down or node not in self.registered_collections:
            return
        if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            sent = self._assign_work_unit(node)
            # a worker runs an item only once it holds the next one (or has been told to shut down)
            while sent and self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                sent = self._assign_work_unit(node)
            if not sent and self.workqueue:  # the send failed: the node is dead
                return
        if not self.workqueue:
            try:
                node.shutdown()
            except OSError:  # dead already; its "node down" event follows
                pass


RERUNS_ENV = "DFLASH_TESTS_RERUNS"  # a file naming the tests rerun after a crash, one node id a line


def share_reruns_file() -> None:
    """In the controller, before any worker starts (they inherit its environment): where it names reruns."""
    if RERUNS_ENV not in os.environ:
        import tempfile

        os.environ[RERUNS_ENV] = os.path.join(tempfile.mkdtemp(prefix="dflash-jax-tests-reruns-"), "reruns")


def mark_rerun(nodeid: str) -> None:
    """In the controller: name ``nodeid`` as a rerun, before it is queued again (any worker may take it)."""
    with open(os.environ[RERUNS_ENV], "a") as f:
        f.write(nodeid + "\n")


def is_rerun(nodeid: str) -> bool:
    """In a worker: whether ``nodeid`` runs again after its worker crashed."""
    path = os.environ.get(RERUNS_ENV)
    if not path or not os.path.exists(path):
        return False
    with open(path) as f:
        return nodeid in f.read().splitlines()


@contextlib.contextmanager
def rerun_without_compile_cache() -> Iterator[None]:
    """Run a test (its fixtures included) with JAX's persistent compilation cache off in this process, and without
    ``JAX_COMPILATION_CACHE_DIR`` for the processes it starts; both come back afterwards."""
    import jax
    from jax._src import compilation_cache

    cache_dir = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        if cache_dir is not None:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def rerun_crashed(crashitem: str, report: pytest.TestReport, sched: object) -> None:
    """``pytest_handlecrashitem``: a crash the scheduler queued to run again is reported as ``rerun``, not failed."""
    if crashitem in getattr(sched, "rerunning", ()):
        report.outcome = "rerun"  # type: ignore[assignment]
        report.longrepr = f"{report.longrepr}: running it once more on a fresh worker"


def rerun_status(report: pytest.TestReport):
    """``pytest_report_teststatus`` for ``rerun`` reports."""
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None
