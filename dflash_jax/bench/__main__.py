"""``python -m dflash_jax.bench <subcommand> ...``

Each subcommand is registered in ``SUBCOMMANDS`` as ``name -> (add_arguments, run, help)``:
``add_arguments(parser)`` declares its flags, ``run(args, command) -> int`` does the work, prints a
table and writes a result file through ``results.write_result`` (``command`` is the command line, for
the record). To add one, write ``add_arguments``/``run`` in its own module and add an entry here.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable

from dflash_jax.bench import results

DTYPES = ("bfloat16", "float16", "float32")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="experiments/results", help="where the result JSON goes")
    p.add_argument("--no-write", action="store_true", help="print the table only")


# ---- ceiling ---------------------------------------------------------------------------------
def _ceiling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", metavar="CONFIG", required=True,
                   help="config.json (or checkpoint dir) whose shapes get random weights")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--quantization", default="none", choices=("none", "fp8", "fp8_dynamic", "int8", "int4"),
                   help="fp8: matmul weights e4m3 with per-channel scales; int8: Q8_0 blocks (a scale per 32 inputs); "
                        "int4: packed Q4_0 blocks (two 4-bit values per byte, a float16 scale per 32 inputs)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-bw", type=float, default=None,
                   help="HBM bytes/s for bw_fraction (default: the datasheet peak of the device in use)")


def _ceiling_run(args: argparse.Namespace, command: str) -> int:
    import jax
    import jax.numpy as jnp

    from dflash_jax.bench import ceiling, roofline
    from dflash_jax.config import TargetConfig
    from dflash_jax.models import quant, qwen36

    cfg = TargetConfig.from_file(args.random_weights)
    dtype = jnp.dtype(args.dtype)
    peak = args.peak_bw or roofline.device_hbm_bytes_per_s()
    params = qwen36.init_params(cfg, jax.random.key(0), dtype, quantization=quant.check_quantization(args.quantization))
    jax.block_until_ready(params)
    fn = ceiling.make_weight_stream(cfg)
    wbytes = roofline.weight_bytes(cfg, quant.weight_itemsize(params))
    figures: dict[str, float] = {"weight_bytes": wbytes}
    compile_s = {}
    for b in args.batch:
        m = ceiling.measure_ceiling(cfg, params, b, iters=args.iters, warmup=args.warmup, fn=fn,
                                    hbm_bytes_per_s=peak)
        figures[f"b{b}.ceiling_ms_per_step"] = m["ms_per_step"]
        figures[f"b{b}.ceiling_tok_s"] = m["tok_s"]
        figures[f"b{b}.ceiling_bytes_per_s"] = m["bytes_per_s"]
        figures[f"b{b}.ceiling_bw_fraction"] = m["bw_fraction"]
        figures[f"b{b}.roofline_weights_tok_s"] = b * peak / wbytes
        compile_s[f"b{b}"] = m["compile_s"]
    results.print_table(figures)
    if not args.no_write:
        extra = {"config": args.random_weights, "dtype": args.dtype, "quantization": args.quantization,
                 "batches": args.batch,
                 "iters": args.iters, "warmup": args.warmup, "peak_bytes_per_s": peak,
                 "weights": "random", "compile_s": compile_s}
        path = results.write_result("ceiling", figures, command, extra, out_dir=args.out_dir)
        print(f"wrote {path}")
    return 0


# ---- registry --------------------------------------------------------------------------------
Runner = Callable[[argparse.Namespace, str], int]
def _module(name: str, help_: str) -> tuple[Callable[[argparse.ArgumentParser], None], Runner, str]:
    """A subcommand whose ``add_arguments``/``run`` live in ``dflash_jax.bench.<name>`` (imported when used)."""
    return (lambda p: _lazy(name).add_arguments(p), lambda a, c: _lazy(name).run(a, c), help_)


SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Runner, str]] = {
    "ceiling": (_ceiling_args, _ceiling_run, "weight-stream ceiling of a decode step (DESIGN.md §8)"),
    "ar": _module("ar", "AR decode throughput of the engine at several concurrencies"),
    "spec": _module("spec", "speculative round cost (step overhead vs AR) and oracle-draft throughput"),
    "acceptance": _module("acceptance", "drafter acceptance length (chain and DDTree tau) on held-out text, and "
                                        "through the engine"),
    "needle": _module("needle", "needle-in-a-haystack retrieval at a context length, with and without PFlash"),
    "pflash": _module("pflash", "time to first token with PFlash prompt compression vs full prefill"),
    "concurrency": _module("concurrency", "paired AR / DDTree serving at several concurrencies, fail-closed "
                                          "feature matrix"),
    "kernels": _module("kernels", "Pallas kernels vs their references on this device: check, then time "
                                  "(bandwidth, speedup)"),
    "groups": _module("groups", "n completions of one prompt as a group that prefills once vs n separate "
                                "requests"),
    "structured": _module("structured", "constrained requests (structured output): AR vs speculative rounds "
                                        "with tree masks"),
    "quality": _module("quality", "held-out perplexity, greedy agreement and DDTree tau of quantized weights and "
                                  "KV pages against the reference format"),
    "linear": _module("linear", "one 27B-shaped matmul weight: bf16 vs fp8 (per-channel, 128x128 blocks) at small "
                                "batch"),
}


def _lazy(name: str):
    import importlib

    return importlib.import_module(f"dflash_jax.bench.{name}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="subcommand", required=True)
    for name, (add_args, run, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        add_args(p)
        _add_common(p)
        p.set_defaults(_run=run)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from dflash_jax.device_memory import set_memory_fraction

    set_memory_fraction()  # XLA_PYTHON_CLIENT_MEM_FRACTION if set, else 0.9 of each accelerator (JAX alone: 0.75)
    command = shlex.join(["python", "-m", "dflash_jax.bench", *argv])
    return args._run(args, command)


if __name__ == "__main__":
    sys.exit(main())
