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
