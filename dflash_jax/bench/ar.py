"""``python -m dflash_jax.bench ar``: AR decode throughput of the continuous-batching engine.

For each concurrency C, C requests of ``--prompt-len`` random tokens each generate exactly
``--output-len`` tokens (EOS ignored, greedy) through ``Engine.step``. Decode throughput is C divided
by the median time of the engine steps in which all C requests decode and none prefills, reported with the HBM roofline (``roofline.roofline_tok_s``) and the weight-stream
ceiling measured in the same run (``ceiling.measure_ceiling``) as denominators.

``--overlap``: the engine runs with ``EngineOptions.overlap`` (the next decode step dispatched from the device outputs of
the one in flight). ``--overlap-compare``: one engine, compiled with the overlap's executables, runs every case twice,
synchronous then overlapped; the synchronous figures keep their names, the overlapped ones are ``cN.overlap.tok_s``
/ ``.tpot_ms`` / ``.ceiling_ratio`` and ``cN.overlap_speedup`` (overlapped / synchronous tok/s).
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import ceiling, results, roofline
from dflash_jax.bench.sources import (add_kv_calibration_argument, add_target_arguments, load_target_source,
                                     parallel_options, resolve_kv_calibration)
from dflash_jax.engine.compile import compile_count
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams, replica_buckets
from dflash_jax.models import quant


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p, model_help="HF checkpoint directory",
                         random_help="config.json whose shapes get random weights", quantization_variants=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--ceiling-iters", type=int, default=20,
                   help="timed iterations of the weight-stream ceiling per concurrency; 0 skips it")
    p.add_argument("--batch-invariant", action="store_true",
                   help="one decode shape (the largest concurrency's) for every concurrency "
                        "(EngineOptions.batch_invariant): what invariance costs at low concurrency")
    p.add_argument("--all-buckets", action="store_true",
                   help="compile every serving bucket (powers of two up to the largest concurrency), as the server "
                        "does, so startup_compile_s is the server's start-up figure; default: only the measured "
                        "concurrencies")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped engine loop (EngineOptions.overlap): the next decode step is dispatched before the "
                        "one in flight is applied; default: the engine's (on for a target of at least 16 GiB of "
                        "weights on a GPU)")
    p.add_argument("--overlap-compare", action="store_true",
                   help="every case synchronous, then overlapped, on one engine (cN.overlap.*, cN.overlap_speedup)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8", "int8"), default=None,
                   help="K/V page format (default: the model dtype); fp8/int8 pages carry a scale per token and head")
    add_kv_calibration_argument(p)


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _case(eng: Engine, c: int, prompt_len: int, output_len: int, vocab: int, seed: int,
          measure: bool = True) -> dict[str, float]:
    """Run C requests to completion; time the steps in which exactly C requests decode and none prefills."""
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    t_submit = time.perf_counter()
    ids = [eng.submit(rng.integers(0, vocab, prompt_len).tolist(), sp) for _ in range(c)]
    first: dict[int, float] = {}
    step_times: list[float] = []
    n_done = 0
    while n_done < c:
        live = list(eng.running.values())
        steady = len(live) == c and all(r.cursor == len(r.prompt) for r in live)
        t0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        if steady:
            step_times.append(now - t0)
        for o in outs:
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finish_reason is not None:
                n_done += 1
                if len(o.token_ids) != output_len:
                    raise RuntimeError(f"request {o.request_id} produced {len(o.token_ids)} tokens, not {output_len}")
    if not measure:
        return {}
    if len(step_times) < 4:
        raise RuntimeError(f"only {len(step_times)} steps had all {c} requests decoding; raise --output-len or "
                           f"--prefill-batch so that prefill finishes before the first request does")
    tpot = float(np.median(step_times))
    return {"tok_s": c / tpot, "tpot_ms": 1e3 * tpot, "ttft_max_s": max(first[i] for i in ids) - t_submit,
            "steady_steps": len(step_times)}


def device_step_ms(eng: Engine, c: int, context: int, iters: int = 10) -> float:
    """Back-to-back decode steps of ``c`` rows (in the engine's bucket for them) with no host work in between
    (device time per step)."""
    from dflash_jax.engine.sampling import SamplingArrays
    from dflash_jax.state import StepInput

    w, b = eng.width, next(x for x in eng.decode_buckets if x >= c)
    live = np.arange(b) < c  # padding rows (batch_invariant) as the engine pads: no tokens, the null slot
    inp = StepInput(tokens=np.zeros((b, 1), np.int32), positions=np.full((b, 1), context, np.int32),
                    n_valid=live.astype(np.int32), slots=np.where(live, np.arange(1, b + 1), 0).astype(np.int32),
                    page_table=np.tile(np.arange(1, w + 1, dtype=np.int32), (b, 1)) % eng.pages.n_pages * live[:, None])
    samp = SamplingArrays.from_rows([], b)
    buf = eng.put(eng.pack("decode", b, inp, samp))  # device-resident: no host transfer in the timed loop
    fn = eng._exec[("decode", b)]
    eng.state, eng.dkv, out = fn(eng.target.params, eng.dparams, eng.state, eng.dkv, buf)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        eng.state, eng.dkv, out = fn(eng.target.params, eng.dparams, eng.state, eng.dkv, buf)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / iters


_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def variant_label(dtype: str, quantization: str) -> str:
    """``bf16`` (unquantized bfloat16), ``fp8``, ...: the prefix of a variant's figures."""
    return _SHORT[dtype] if quant.check_quantization(quantization) is None else quantization


def run_variant(args: argparse.Namespace, quantization: str) -> tuple[dict[str, float], dict]:
    """Load (or randomly initialise) the target with ``quantization``, compile, run every concurrency case,
    the device-only step and the same-run weight-stream ceiling. Returns ``(figures, extra)``."""
    dtype = jnp.dtype(args.dtype)
    t0 = time.perf_counter()
    target = load_target_source(args, quantization)
    jax.block_until_ready(target.params)
    cfg = target.config
    load_s = time.perf_counter() - t0
    w_itemsize = quant.weight_itemsize(target.params)
    cmax = max(args.concurrency)
    max_len = args.prompt_len + args.output_len
    eng = Engine(target, None, EngineOptions(max_batch=cmax, page_size=args.page_size, max_model_len=max_len,
                                             prefill_chunk=args.prefill_chunk,
                                             prefill_batch=args.prefill_batch, kv_dtype=args.kv_dtype,
                                             kv_calibration=resolve_kv_calibration(args, target),
                                             batch_buckets=None if args.all_buckets or args.batch_invariant else
                                             replica_buckets(args.concurrency, args.data_parallel),
                                             batch_invariant=args.batch_invariant,
                                             overlap=True if args.overlap_compare else args.overlap,
                                             **parallel_options(args)))
    modes = ((False, ""), (True, "overlap.")) if args.overlap_compare else ((eng.overlap, ""),)
    if (args.overlap or args.overlap_compare) and not eng.overlap:
        raise SystemExit("the engine cannot overlap here (data parallelism): drop --overlap / --overlap-compare")
    kv_itemsize = sum(x.nbytes for x in eng.state.kv.k) / sum(math.prod(x.shape) for x in eng.state.kv.k)
    print(f"[{quantization}] model loaded in {load_s:.1f}s ({w_itemsize:.3f} bytes/weight); compiling "
          f"{len(eng.prefill_buckets) + len(eng.decode_buckets)} buckets", flush=True)
    t0 = time.perf_counter()  # compiles run concurrently: per-bucket seconds overlap; startup_compile_s is wall time
    report = eng.warmup(lambda name, dt: print(f"  compiled {name} in {dt:.1f}s", flush=True))
    figures: dict[str, float] = {"startup_compile_s": time.perf_counter() - t0, "load_s": load_s,
                                 "startup_lower_s": report.get("lower_s", 0.0),
                                 "startup_cache_hits": report.get("cache_hits", 0),
                                 "startup_buckets": len(eng.prefill_buckets) + len(eng.decode_buckets),
                                 "weight_bytes_per_element": w_itemsize,
                                 "kv_calibrated": int(eng.kv_calibration is not None)}
    # warm-up run through the loop: every decode bucket the cases will use, up to 8 tokens, in every mode
    for on, _ in modes:
        eng.overlap = on
        for c in args.concurrency:
            _case(eng, c, min(16, args.prompt_len), min(8, args.output_len), cfg.vocab_size, 0, measure=False)
    compiles_before = compile_count()
    tp, dp = args.tensor_parallel, args.data_parallel
    single = tp * dp == 1  # the weight-stream ceiling is a one-device figure: measured only then
    fn = ceiling.make_weight_stream(cfg) if single else None
    ceil = {}
    for c in args.concurrency:
        ctx = args.prompt_len + args.output_len // 2
        # aggregate over the tp x dp devices: each replica streams its share of the weights for c / dp rows
        roof = tp * dp * roofline.roofline_tok_s(cfg, replica_buckets([c], dp)[0], ctx, itemsize=dtype.itemsize,
                                                 weight_itemsize=w_itemsize, kv_itemsize=kv_itemsize)
        for on, tag in modes:
            eng.overlap = on
            m = _case(eng, c, args.prompt_len, args.output_len, cfg.vocab_size, c)
            figures.update({f"c{c}.{tag}tok_s": m["tok_s"], f"c{c}.{tag}tpot_ms": m["tpot_ms"],
                            f"c{c}.{tag}roofline_fraction": m["tok_s"] / roof,
                            f"c{c}.{tag}ttft_max_s": m["ttft_max_s"]})
            print(f"[{quantization}] c{c}{' overlapped' if on else ''}: {m['tok_s']:.1f} tok/s, TPOT "
                  f"{m['tpot_ms']:.2f} ms, {m['tok_s'] / roof:.3f} of roofline", flush=True)
        figures.update({f"c{c}.roofline_tok_s": roof, f"c{c}.peak_mem_gb": (_peak_bytes() or 0) / 1e9})
        if args.overlap_compare:
            figures[f"c{c}.overlap_speedup"] = figures[f"c{c}.overlap.tok_s"] / figures[f"c{c}.tok_s"]
    figures["recompiles_after_warmup"] = compile_count() - compiles_before + eng.counters["lazy_compiles"]
    for c in args.concurrency if dp == 1 else ():  # device-only step: host overhead = tpot - this
        figures[f"c{c}.device_step_ms"] = device_step_ms(eng, c, args.prompt_len + args.output_len // 2)
    for c in args.concurrency if single and args.ceiling_iters > 0 else ():  # the weight-stream ceiling, last
        ceil[c] = ceiling.measure_ceiling(cfg, eng.target.params, c, iters=args.ceiling_iters, fn=fn)
        figures[f"c{c}.ceiling_tok_s"] = ceil[c]["tok_s"]
        for _, tag in modes:
            figures[f"c{c}.{tag}ceiling_ratio"] = figures[f"c{c}.{tag}tok_s"] / ceil[c]["tok_s"]
    figures["kv_bytes_per_token"] = cfg.kv_bytes_per_token(kv_itemsize)
    figures["recurrent_bytes_per_seq"] = cfg.recurrent_bytes_per_seq(dtype.itemsize)
    extra = {"compile_s": report, "kv_pool_pages": eng.pages.n_pages, "overlap": eng.overlap,
             "sharding": eng.layout.plan.describe() if eng.layout else None,
             "sharding_notes": list(eng.layout.plan.notes) if eng.layout else []}
    return figures, extra


def run(args: argparse.Namespace, command: str) -> int:
    """One variant per ``--quantization`` value, one after the other (each model freed before the next loads).
    A single unquantized variant keeps the plain figure names (``c1.tok_s``); otherwise every figure is
    prefixed by its variant (``bf16.c1.tok_s``, ``fp8.c1.tok_s``) and ``{q}_speedup.cN`` = ``q`` / unquantized
    tok/s (``fp8_speedup``, ``int8_speedup``, ``int4_speedup``) is added when both ran."""
    variants = list(dict.fromkeys(args.quantization))
    plain = variants == ["none"]
    figures: dict[str, float] = {}
    extras: dict[str, dict] = {}
    for q in variants:
        f, e = run_variant(args, q)
        label = variant_label(args.dtype, q)
        figures.update(f if plain else {f"{label}.{k}": v for k, v in f.items()})
        extras[label] = e
        gc.collect()  # the variant's engine and weights are unreferenced now; free them before the next loads
    base = variant_label(args.dtype, "none")
    for q in quant.QUANTIZATIONS[1:]:
        if "none" in variants and q in variants:
            for c in args.concurrency:
                figures[f"{q}_speedup.c{c}"] = figures[f"{q}.c{c}.tok_s"] / figures[f"{base}.c{c}.tok_s"]
    results.print_table(figures)
    if not args.no_write:
        extra = {"source": args.model or args.random_weights, "weights": "checkpoint" if args.model else "random",
                 "dtype": args.dtype, "quantization": variants, "kv_dtype": args.kv_dtype,
                 "kv_calibration": args.kv_calibration,
                 "prompt_len": args.prompt_len, "output_len": args.output_len, "page_size": args.page_size,
                 "prefill_chunk": args.prefill_chunk, "tensor_parallel": args.tensor_parallel,
                 "data_parallel": args.data_parallel, "overlap": args.overlap, "overlap_compare": args.overlap_compare}
        extra.update(extras[base] if plain else {"variants": extras})
        print("wrote", results.write_result("ar", figures, command, extra, out_dir=args.out_dir))
    return 0
