"""dflash-jax: a JAX/XLA serving engine for hybrid (Gated DeltaNet + gated attention) LLMs."""

from dflash_jax.config import ConfigError, TargetConfig
from dflash_jax.models.loader import CheckpointError
from dflash_jax.target import Target, load_target

__all__ = ["CheckpointError", "ConfigError", "Target", "TargetConfig", "load_target"]
__version__ = "0.1.0"
