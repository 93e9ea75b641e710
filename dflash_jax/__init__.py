"""dflash-jax: a JAX/XLA serving engine for hybrid (Gated DeltaNet + gated attention) LLMs."""

import os as _os

# On CPU the chunked GDN's small triangular solves go through LAPACK; a multithreaded OpenBLAS fights
# XLA's own threads and makes each solve ~1000x slower. Callers can still override it.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.models.loader import CheckpointError
from dflash_jax.target import Target, load_target

#: The shipped trained tiny model set (Hugging Face layout): ``target/`` (hybrid target + tokenizer), ``drafter/``
#: (its DFlash drafter), ``scorer/`` (the dense PFlash scorer) and ``train_report.json`` (how they were trained,
#: which files were held out).
SHIPPED_MODELS = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "assets", "tiny")

__all__ = ["CheckpointError", "ConfigError", "SHIPPED_MODELS", "Target", "TargetConfig", "load_target"]
__version__ = "0.1.0"
