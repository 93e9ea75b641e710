"""The target / drafter sources shared by the benchmarks: ``--model | --random-weights`` and
``--drafter | --random-drafter`` (each pair mutually exclusive and required), and loading what they name."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models import dflash, quant, qwen36
from dflash_jax.target import Target, load_target


def add_target_arguments(p: argparse.ArgumentParser, model_help: str = "HF target checkpoint directory",
                         random_help: str = "target config.json given random weights",
                         quantization_variants: bool = False) -> None:
    """``--model CHECKPOINT`` | ``--random-weights CONFIG`` (one required), and ``--quantization none|fp8``
    (several values, one variant each, when ``quantization_variants``)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=model_help)
    src.add_argument("--random-weights", metavar="CONFIG", help=random_help)
    if quantization_variants:
        p.add_argument("--quantization", nargs="+", choices=quant.QUANTIZATIONS, default=["none"],
                       help="weight formats to measure, one after the other in this run (fp8: matmul weights "
                            "e4m3 with per-channel scales, quantized on the device as they are made/loaded)")
    else:
        p.add_argument("--quantization", choices=quant.QUANTIZATIONS, default="none",
                       help="fp8: matmul weights of target (and drafter) in e4m3 with per-channel scales")


def add_drafter_arguments(p: argparse.ArgumentParser) -> None:
    """``--drafter CHECKPOINT`` | ``--random-drafter CONFIG`` (one required)."""
    dsrc = p.add_mutually_exclusive_group(required=True)
    dsrc.add_argument("--drafter", help="DFlash drafter checkpoint directory")
    dsrc.add_argument("--random-drafter", metavar="CONFIG", help="drafter config.json given random weights")


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """Both source groups: the target's, then the drafter's."""
    add_target_arguments(p)
    add_drafter_arguments(p)


def load_target_source(args: argparse.Namespace, quantization: str | None = None) -> Target:
    """The target ``--model`` names, or the ``--random-weights`` config with random weights (key 0), with its
    matmul weights in ``quantization`` (default ``args.quantization``; random weights are quantized as each is
    generated, so the full-precision model never sits on the device)."""
    dtype = jnp.dtype(args.dtype)
    q = quant.check_quantization(quantization if quantization is not None else getattr(args, "quantization", None))
    if args.model:
        return load_target(args.model, dtype=args.dtype, quantization=q)
    cfg = TargetConfig.from_file(args.random_weights)
    return Target(cfg, qwen36.init_params(cfg, jax.random.key(0), dtype, quantization=q), ())


def load_drafter_source(args: argparse.Namespace):
    """``(DrafterConfig, params)`` of ``--drafter``, or of the ``--random-drafter`` config with random weights
    (key 1)."""
    dtype = jnp.dtype(args.dtype)
    q = quant.check_quantization(getattr(args, "quantization", None))
    if args.drafter:
        from dflash_jax.models.dflash_loader import load_drafter

        return load_drafter(args.drafter, dtype=dtype, quantization=q)
    dcfg = DrafterConfig.from_file(args.random_drafter)
    return dcfg, dflash.init_params(dcfg, jax.random.key(1), dtype, quantization=q)
