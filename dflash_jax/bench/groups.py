"""``bench groups``: n completions of one prompt (the API's ``n``) as a group that prefills the prompt once
(``Engine.submit_group``), against the same n requests submitted one by one.

For every group size n: C prompts of L random tokens, each asked for n sampled completions (member j's seed fixed)
of T tokens, all submitted at once, run grouped and separately (alternating, ``--repeats`` times each) on one
engine (compiled once). Figures per n: ``n{n}.grouped_s`` / ``n{n}.separate_s`` (median wall time of the batch),
``n{n}.speedup`` (separate / grouped), ``n{n}.ttft_ratio`` (median time to a member's first token, grouped /
separate), ``n{n}.prefill_tokens`` /
``n{n}.prefill_tokens_separate`` (prompt tokens each run prefilled: a member forked from its leader prefills only
the part past the fork), ``n{n}.mismatches`` (members whose tokens differ between the two runs: 0 in float32).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dflash_jax.bench import results
from dflash_jax.bench.sources import add_target_arguments, load_target_source, parallel_options
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--n", type=int, nargs="+", default=[4, 8], help="completions per prompt (group sizes)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per batch, each asked for n completions")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--prefill-batch", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)


def _run(eng: Engine, prompts: list[list[int]], sps: list[SamplingParams], grouped: bool) -> dict:
    """Submit every prompt's members (as a group or one by one), step to completion; outputs in submit order."""
    t0 = time.perf_counter()
    rids: list[int] = []
    for p in prompts:
        rids += eng.submit_group(p, sps) if grouped else [eng.submit(p, sp) for sp in sps]
    done: dict[int, object] = {}
    while eng.has_work():
        for o in eng.step():
            if o.finish_reason is not None:
                done[o.request_id] = o
    wall = time.perf_counter() - t0
    outs = [done[r] for r in rids]
    return {"wall_s": wall, "outs": outs, "ttft": statistics.median(o.stats["ttft_s"] for o in outs),
            "prefill_tokens": sum(len(o.prompt_token_ids) - o.stats["cached_tokens"] for o in outs)}


def run(args: argparse.Namespace, command: str) -> int:
    target = load_target_source(args)
    cfg = target.config
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.prompts)]
    rows = max(args.n) * args.prompts
    eng = Engine(target, None, EngineOptions(max_batch=rows, page_size=args.page_size,
                                             max_model_len=args.prompt_len + args.output_len,
                                             prefill_chunk=args.prefill_chunk,
                                             prefill_batch=min(args.prefill_batch, rows), **parallel_options(args)))
    eng.warmup()
    figures: dict[str, float] = {}
    for n in args.n:
        sps = [SamplingParams(max_tokens=args.output_len, temperature=args.temperature, seed=args.seed + 1 + j,
                              ignore_eos=True) for j in range(n)]
        short = [p[: max(2 * args.page_size + 1, args.prefill_chunk + 1)] for p in prompts]
        warm = [SamplingParams(max_tokens=2, temperature=args.temperature, seed=j, ignore_eos=True) for j in range(n)]
        _run(eng, short, warm, grouped=True)  # every bucket a run of this n uses, once, before timing
        _run(eng, short, warm, grouped=False)
        runs = [(_run(eng, prompts, sps, grouped=True), _run(eng, prompts, sps, grouped=False))
                for _ in range(args.repeats)]
        g, s = runs[-1]
        gw = statistics.median(r[0]["wall_s"] for r in runs)
        sw = statistics.median(r[1]["wall_s"] for r in runs)
        ttft = statistics.median(r[0]["ttft"] / r[1]["ttft"] for r in runs)
        figures.update({f"n{n}.grouped_s": gw, f"n{n}.separate_s": sw, f"n{n}.speedup": sw / gw,
                        f"n{n}.ttft_ratio": ttft,
                        f"n{n}.prefill_tokens": g["prefill_tokens"],
                        f"n{n}.prefill_tokens_separate": s["prefill_tokens"],
                        f"n{n}.mismatches": sum(a.token_ids != b.token_ids for r in runs
                                                for a, b in zip(r[0]["outs"], r[1]["outs"]))})
    figures["recompiles_after_warmup"] = eng.counters["lazy_compiles"]
    results.print_table(figures)
    if not args.no_write:
        extra = {"prompts": args.prompts, "repeats": args.repeats, "prompt_len": args.prompt_len, "output_len": args.output_len,
                 "n": args.n, "dtype": args.dtype, "temperature": args.temperature,
                 "weights": "random" if args.random_weights else args.model}
        path = results.write_result("groups", figures, command, extra, out_dir=args.out_dir)
        print(f"wrote {path}")
    return 0
