import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TINY = ("qwen36_tiny_a", "qwen36_tiny_b")


@pytest.fixture(scope="session")
def fixtures_dir() -> str:
    return FIXTURES


# scipy's OpenBLAS backs XLA:CPU's LAPACK custom calls (e.g. the triangular solves of the chunked Gated DeltaNet
# used in every prefill). Left multi-threaded, its worker threads fight XLA's own thread pool: on a 2-core machine a
# tiny batched trsm then takes ~50 ms instead of ~50 us, making a tiny-model prefill chunk cost ~0.3 s. It reads
# this variable when it is first loaded, which is after this file (nothing above imports jax or scipy).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
