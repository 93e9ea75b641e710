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
