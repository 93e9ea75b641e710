"""Prompt compression before prefill (speculative prefill / "PFlash", reference §5)."""

from dflash_jax.prefill.pflash import (CompressionResult, DenseScorer, PFlashError, PFlashOptions, compress,
                                       protected_mask, score_tokens, select_chunks, smooth, span_mask)

__all__ = ["CompressionResult", "DenseScorer", "PFlashError", "PFlashOptions", "compress", "protected_mask",
           "score_tokens", "select_chunks", "smooth", "span_mask"]
