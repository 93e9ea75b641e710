"""The target / drafter / scorer sources shared by the benchmarks: ``--model | --random-weights``,
``--drafter | --random-drafter`` and ``--scorer | --random-scorer`` (each pair mutually exclusive), and loading what
they name."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.engine.compile import enable_compile_cache
from dflash_jax.models import dense, dflash, quant, qwen36
from dflash_jax.sharding import Layout, initialize_distributed
from dflash_jax.target import Target, load_target


def add_target_arguments(p: argparse.ArgumentParser, model_help: str = "HF target checkpoint directory",
                         random_help: str = "target config.json given random weights",
                         quantization_variants: bool = False) -> None:
    """``--model CHECKPOINT`` | ``--random-weights CONFIG`` (one required), and ``--quantization none|fp8``
    (several values, one variant each, when ``quantization_variants``)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=model_help)
    src.add_argument("--random-weights", metavar="CONFIG", help=random_help)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="devices of the mesh's model axis (Megatron tensor parallelism; dflash_jax/sharding.py)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="M", help="devices of the mesh's data axis")
    p.add_argument("--no-fuse-projections", action="store_true",
                   help="keep each input projection its own matmul (EngineOptions.fuse_projections=False)")
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX persistent compilation cache directory: executables of equal shapes are compiled once "
                        "and loaded by later engines and runs (warmup_report['cache_hits'] counts them)")
    if quantization_variants:
        p.add_argument("--quantization", nargs="+", choices=quant.QUANTIZATIONS, default=["none"],
                       help="weight formats to measure, one after the other in this run (fp8: matmul weights "
                            "e4m3 with per-channel scales; int8: Q8_0 blocks; int4: packed Q4_0 blocks; quantized "
                            "on the device as they are made/loaded)")
    else:
        p.add_argument("--quantization", choices=quant.QUANTIZATIONS, default="none",
                       help="fp8: matmul weights of target (and drafter) in e4m3 with per-channel scales; int8: "
                            "Q8_0 blocks; int4: packed Q4_0 blocks")


def add_drafter_arguments(p: argparse.ArgumentParser) -> None:
    """``--drafter CHECKPOINT`` | ``--random-drafter CONFIG`` (one required)."""
    dsrc = p.add_mutually_exclusive_group(required=True)
    dsrc.add_argument("--drafter", help="DFlash drafter checkpoint directory")
    dsrc.add_argument("--random-drafter", metavar="CONFIG", help="drafter config.json given random weights")


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """Both source groups: the target's, then the drafter's."""
    add_target_arguments(p)
    add_drafter_arguments(p)


def parallel_options(args: argparse.Namespace) -> dict[str, int]:
    """``EngineOptions`` fields of ``--tensor-parallel`` / ``--data-parallel`` / ``--no-fuse-projections``."""
    return {"tensor_parallel": args.tensor_parallel, "data_parallel": args.data_parallel,
            "fuse_projections": not getattr(args, "no_fuse_projections", False)}


def add_kv_calibration_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-calibration", default="auto", metavar="auto|none|measure|PATH",
                   help="key calibration of fp8 / int8 pages (EngineOptions.kv_calibration); measure: one measured on "
                        "the spot from 4 rows of 256 random token ids, which prices the path on random weights (they "
                        "have nothing to calibrate on: its quality means nothing there)")


def resolve_kv_calibration(args: argparse.Namespace, target: Target) -> str | None:
    """``--kv-calibration`` as ``EngineOptions.kv_calibration``: ``measure`` becomes the file of a calibration measured
    now on random token ids (once per process and target); other values pass through."""
    option = getattr(args, "kv_calibration", "auto")
    if option != "measure" or getattr(args, "kv_dtype", None) not in ("fp8", "int8"):
        return None if option == "measure" else option
    import os
    import tempfile

    import numpy as np

    from dflash_jax.kv import calibration as kv_calibration

    rows = np.random.default_rng(0).integers(0, target.config.vocab_size, (4, 256)).astype(np.int32)
    path = os.path.join(tempfile.mkdtemp(prefix="dflash-kv-calibration-"), kv_calibration.FILE_NAME)
    return kv_calibration.measure(target.params, target.config, rows).save(path)


def load_target_source(args: argparse.Namespace, quantization: str | None = None) -> Target:
    """The target ``--model`` names, or the ``--random-weights`` config with random weights (key 0), with its
    matmul weights in ``quantization`` (default ``args.quantization``; random weights are quantized as each is
    generated, so the full-precision model never sits on the device); with ``--tensor-parallel`` /
    ``--data-parallel`` > 1, laid out over that mesh (each tensor straight to its shards; unquantized only); on one
    device its input projections fused in place unless ``--no-fuse-projections`` (``Target.fuse_projections``)."""
    dtype = jnp.dtype(args.dtype)
    q = quant.check_quantization(quantization if quantization is not None else getattr(args, "quantization", None))
    tp, dp = args.tensor_parallel, args.data_parallel
    if getattr(args, "compile_cache", None):
        enable_compile_cache(args.compile_cache)
    initialize_distributed()
    fuse = not getattr(args, "no_fuse_projections", False)
    if args.model:
        t = load_target(args.model, dtype=args.dtype, tensor_parallel=tp, data_parallel=dp, quantization=q)
        return t.fuse_projections() if fuse else t
    cfg = TargetConfig.from_file(args.random_weights)
    if tp == dp == 1:
        t = Target(cfg, qwen36.init_params(cfg, jax.random.key(0), dtype, quantization=q), ())
        return t.fuse_projections() if fuse else t
    lay = Layout.build(cfg, tp, dp)
    params = qwen36.init_params(cfg, jax.random.key(0), dtype, place=lay.reshard(cfg), quantization=q)
    return Target(lay.plan.model_config(cfg), params, (), layout=lay)


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


def add_scorer_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--scorer CHECKPOINT`` | ``--random-scorer CONFIG`` (one required when ``required``), the PFlash scorer."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--scorer", help="PFlash dense scorer checkpoint directory")
    src.add_argument("--random-scorer", metavar="CONFIG", help="dense scorer config.json given random weights "
                     "(its vocabulary is widened to the target's when smaller)")


def load_scorer_source(args: argparse.Namespace, vocab: int, prefill_chunk: int = 512, attention: str = "auto"):
    """The ``DenseScorer`` of ``--scorer``, or of the ``--random-scorer`` config with random weights (key 2, its
    vocabulary widened to ``vocab`` when smaller); None when neither is given."""
    from dflash_jax.prefill.pflash import DenseScorer

    dtype = jnp.dtype(args.dtype)
    if getattr(args, "scorer", None):
        return DenseScorer.from_pretrained(args.scorer, dtype=dtype, prefill_chunk=prefill_chunk, attention=attention)
    if not getattr(args, "random_scorer", None):
        return None
    import json

    with open(args.random_scorer) as fh:
        raw = json.load(fh)
    raw["vocab_size"] = max(int(raw["vocab_size"]), vocab)
    cfg = dense.DenseConfig.from_hf_dict(raw)
    return DenseScorer(dense.init_params(cfg, jax.random.key(2), dtype), cfg, prefill_chunk=prefill_chunk,
                       attention=attention)
