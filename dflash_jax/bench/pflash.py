"""``python -m dflash_jax.bench pflash``: time to first token with PFlash prompt compression vs full prefill.

For each context length, one request at concurrency 1 through a fresh-state engine, both paths in the same run:

* full: the raw prompt is prefilled and the first token sampled (``pflash.<ctx>.full_ttft_s``);
* PFlash: the dense scorer scores the raw prompt (``compress``, mode always), then the effective prompt is prefilled
  and the first token sampled (``pflash.<ctx>.ttft_s`` = scoring + effective TTFT);
* ``pflash.<ctx>.ttft_ratio`` = PFlash TTFT / full TTFT (lower is better), with the kept fraction.

The split: ``scoring_s`` (the scorer over the raw prompt), ``effective_ttft_s`` (the target's prefill of the effective
prompt and its first token), and from one extra profiled scoring run that waits for every dispatch,
``scorer_dispatches`` / ``scorer_step_max_s`` / ``scorer_step_mean_s`` (one dispatch per scorer layer: the longest
is the most a decode step can wait behind scoring). ``compiles_timed`` counts XLA compilations inside the timed
runs (0 when warm-up covered every shape). The scorer's attention implementation (``--scorer-attention``) and why it
was chosen are in the JSON's ``extra``.

Decode stall (``--stall-concurrency C ...``, PFlash item 3: scoring must not stall running sequences' decode steps
for more than about one step's time per scorer dispatch): C requests decode on their own engine (short random
prompts, greedy, no EOS); after ``--stall-base-steps`` steps timed alone, another thread compresses the context's
prompt while the host keeps stepping. Per context, C and scorer mode (``turns``, as the server runs it: paced
dispatches that alternate with the engine's steps through ``engine.turns.DeviceTurns``; with ``--stall-compare``
also ``paced``, paced without turns, and ``unpaced``, every dispatch queued at once):
``pflash.<ctx>.stall.c<C>.<mode>.step_ms`` (median step alone), ``.max_step_ms`` / ``.median_step_ms`` (steps that
overlapped scoring), ``.stall_steps`` = (max_step - step) / step (the longest extra wait in decode steps; item 3's
bound is 1), ``.scoring_s`` (the compress call under load), ``.steps``, and the cyclic GC's passes in the window
(``.gc_passes``, ``.gc_max_ms``; start-up's objects are frozen first, as the server does); ``pflash.<ctx>.stall.c<C>.stall_steps``
repeats the ``turns`` one. ``--no-ttft`` skips the TTFT comparison.

Each path runs once untimed first (compiles), then ``--repeats`` times; medians are reported. With random weights
(``--random-weights`` / ``--random-scorer``) the prompt is random tokens: the timing does not depend on the text.
Context labels: ``32k`` = 32768 tokens.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time

import numpy as np

from dflash_jax.bench import results
from dflash_jax.bench.sources import (add_scorer_arguments, add_target_arguments, load_scorer_source,
                                      load_target_source)
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.turns import DeviceTurns
from dflash_jax.models import dense_scoring
from dflash_jax.prefill.pflash import DenseScorer, PFlashOptions, compress


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    add_scorer_arguments(p)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--context", type=int, nargs="+", default=[32768])
    p.add_argument("--keep-ratio", type=float, default=0.05)
    p.add_argument("--head-tokens", type=int, default=PFlashOptions.head_tokens, help="always-kept head")
    p.add_argument("--tail-tokens", type=int, default=PFlashOptions.tail_tokens, help="always-kept tail")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--scorer-chunk", type=int, default=2048, help="scorer prompt padding granularity and XLA "
                   "attention block")
    p.add_argument("--scorer-attention", default="auto", choices=("auto", "cudnn", "xla"),
                   help="the scorer's causal attention (auto: cuDNN flash attention on a GPU when it runs, else XLA)")
    p.add_argument("--scorer-dispatch-flops", type=float, default=dense_scoring.DISPATCH_FLOPS,
                   help="largest attention work of one scorer dispatch: longer prompts' layers are sliced by heads "
                        "(0: one dispatch per layer)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-ttft", action="store_true", help="skip the TTFT comparison (e.g. with --stall-concurrency)")
    p.add_argument("--stall-concurrency", type=int, nargs="*", default=[],
                   help="measure running decode steps while a prompt of each context is scored, at these C")
    p.add_argument("--stall-compare", action="store_true",
                   help="also measure the scorer paced without turns, and unpaced (every dispatch queued at once)")
    p.add_argument("--stall-base-steps", type=int, default=24, help="decode steps timed before scoring starts")
    p.add_argument("--stall-prompt-len", type=int, default=64)
    p.add_argument("--stall-max-tokens", type=int, default=8192,
                   help="decode budget of each running request (must outlast the scoring)")


def label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def _ttft(eng: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def run(args: argparse.Namespace, command: str) -> int:
    bad = [f"{n} {v}" for n, v in (("--stall-base-steps", args.stall_base_steps),
                                    ("--stall-prompt-len", args.stall_prompt_len),
                                    ("--stall-max-tokens", args.stall_max_tokens),
                                    *(("--stall-concurrency", c) for c in args.stall_concurrency)) if v < 1]
    if bad or args.scorer_dispatch_flops < 0:
        raise SystemExit(f"bench pflash: {', '.join(bad) or f'--scorer-dispatch-flops {args.scorer_dispatch_flops}'}: "
                         "must be positive (--scorer-dispatch-flops 0: one dispatch per layer)")
    if args.no_ttft and not args.stall_concurrency:
        raise SystemExit("bench pflash: --no-ttft leaves nothing to measure without --stall-concurrency")
    target = load_target_source(args)
    scorer = load_scorer_source(args, target.config.vocab_size, prefill_chunk=args.scorer_chunk,
                                attention=args.scorer_attention)
    scorer.max_dispatch_flops = args.scorer_dispatch_flops or None
    opts = PFlashOptions(mode="always", keep_ratio=args.keep_ratio, min_tokens=1, head_tokens=args.head_tokens,
                         tail_tokens=args.tail_tokens)
    scorer.resolve()
    print(f"scorer attention: {scorer.attention_impl} ({scorer.attention_why})", flush=True)
    rng = np.random.default_rng(0)
    prompts = {ctx: rng.integers(0, min(target.config.vocab_size, scorer.cfg.vocab_size), ctx).astype(np.int32)
               for ctx in args.context}
    figures: dict[str, float] = {"keep_ratio": args.keep_ratio}
    if not args.no_ttft:
        _ttft_cases(args, target, scorer, opts, prompts, figures)
    if args.stall_concurrency:
        _stall_cases(args, target, scorer, opts, prompts, figures)
    results.print_table(figures)
    if not args.no_write:
        extra = {"target": args.model or args.random_weights, "scorer": args.scorer or args.random_scorer,
                 "weights": "checkpoint" if args.model else "random", "dtype": args.dtype,
                 "repeats": args.repeats, "prefill_chunk": args.prefill_chunk, "scorer_chunk": args.scorer_chunk,
                 "scorer_attention": scorer.attention_impl, "scorer_attention_why": scorer.attention_why,
                 "scorer_dispatch_flops": scorer.max_dispatch_flops}
        print("wrote", results.write_result("pflash", figures, command, extra, out_dir=args.out_dir))
    return 0


def _ttft_cases(args: argparse.Namespace, target, scorer: DenseScorer, opts: PFlashOptions,
                prompts: dict[int, np.ndarray], figures: dict[str, float]) -> None:
    max_len = -(-(max(args.context) + 64) // args.prefill_chunk) * args.prefill_chunk
    eng = Engine(target, None, EngineOptions(max_batch=1, page_size=args.page_size, max_model_len=max_len,
                                             prefill_chunk=args.prefill_chunk, prefill_batch=1))
    eng.warmup()
    for ctx, ids in prompts.items():

        def pflash_once() -> tuple[float, float, float, int]:
            """(scoring s, effective-prompt TTFT s, kept fraction, effective tokens)"""
            t0 = time.perf_counter()
            c = compress(ids, scorer, opts)
            t_score = time.perf_counter() - t0
            return t_score, _ttft(eng, c.effective_ids.tolist()), c.ratio, c.effective_tokens

        _ttft(eng, ids.tolist())  # compiles / warms the full path
        pflash_once()
        with CompileWatch() as w:
            full = [_ttft(eng, ids.tolist()) for _ in range(args.repeats)]
            runs = [pflash_once() for _ in range(args.repeats)]
        steps: list[float] = []
        scorer(ids, opts, step_times=steps)
        k = f"pflash.{label(ctx)}"
        f_med = statistics.median(full)
        p_med = statistics.median(r[0] + r[1] for r in runs)
        figures.update({f"{k}.full_ttft_s": f_med, f"{k}.ttft_s": p_med, f"{k}.ttft_ratio": p_med / f_med,
                        f"{k}.scoring_s": statistics.median(r[0] for r in runs),
                        f"{k}.effective_ttft_s": statistics.median(r[1] for r in runs),
                        f"{k}.kept_fraction": runs[0][2], f"{k}.effective_tokens": runs[0][3],
                        f"{k}.scorer_dispatches": len(steps), f"{k}.scorer_step_max_s": max(steps),
                        f"{k}.scorer_step_mean_s": statistics.fmean(steps), f"{k}.compiles_timed": w.count})
        print(f"{label(ctx)}: full {f_med:.3f} s, PFlash {p_med:.3f} s (ratio {p_med / f_med:.3f}, kept "
              f"{runs[0][2]:.3f}; scoring {figures[f'{k}.scoring_s']:.3f} s in {len(steps)} dispatches of <= "
              f"{max(steps):.3f} s, effective prefill {figures[f'{k}.effective_ttft_s']:.3f} s)", flush=True)


def stall_figures(ends: list[float], n_base: int, t0: float, t1: float) -> dict[str, float]:
    """Step-time figures from the host times ``ends`` at which consecutive ``step()`` calls returned: the first
    ``n_base`` + 1 bound steps taken alone; a step overlapped scoring (wall [t0, t1]) when it ended after t0 and
    began before t1."""
    dur = np.diff(np.asarray(ends, np.float64))
    begin = np.asarray(ends[:-1])
    base = float(np.median(dur[:n_base])) * 1e3
    during = dur[(np.asarray(ends[1:]) > t0) & (begin < t1)] * 1e3
    if during.size == 0:
        raise RuntimeError("no decode step overlapped the scoring: raise --stall-max-tokens")
    mx = float(during.max())
    return {"step_ms": base, "max_step_ms": mx, "median_step_ms": float(np.median(during)),
            "stall_steps": (mx - base) / base, "steps": float(during.size)}


def _stall_cases(args: argparse.Namespace, target, scorer: DenseScorer, opts: PFlashOptions,
                 prompts: dict[int, np.ndarray], figures: dict[str, float]) -> None:
    cs = sorted(set(args.stall_concurrency))
    plen = args.stall_prompt_len
    eng = Engine(target, None, EngineOptions(max_batch=cs[-1], batch_buckets=tuple(cs), page_size=args.page_size,
                                             max_model_len=plen + args.stall_max_tokens + 1, prefill_chunk=plen,
                                             prefill_batch=cs[-1]))
    eng.warmup()
    gc.collect()
    gc.freeze()  # as the server does after start-up
    pauses: list[float] = []  # seconds of each cyclic-GC pass in the measured window
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - gc_start[0])

    modes = ("turns", "paced", "unpaced") if args.stall_compare else ("turns",)
    turns = DeviceTurns()
    rng = np.random.default_rng(1)
    for ctx, ids in prompts.items():
        scorer.pace = True
        compress(ids, scorer, opts)  # the scorer's shapes for this context compile here, not under the timer
        for c in cs:
            for mode in modes:
                scorer.pace = mode != "unpaced"
                eng.turns = scorer.turns = turns if mode == "turns" else None
                rids = [eng.submit(rng.integers(0, target.config.vocab_size, plen).tolist(),
                                   SamplingParams(max_tokens=args.stall_max_tokens, temperature=0.0,
                                                  ignore_eos=True)) for _ in range(c)]
                for _ in range(4):  # prefill and the first decode steps
                    eng.step()
                done: dict[str, float] = {}

                def score() -> None:
                    done["t0"] = time.perf_counter()
                    compress(ids, scorer, opts)
                    done["t1"] = time.perf_counter()

                ends = [time.perf_counter()]
                pauses.clear()
                gc.callbacks.append(on_gc)
                with CompileWatch() as w:
                    for _ in range(args.stall_base_steps):
                        eng.step()
                        ends.append(time.perf_counter())
                    th = threading.Thread(target=score, daemon=True)
                    th.start()
                    while th.is_alive() or len(ends) < 3:
                        eng.step()
                        ends.append(time.perf_counter())
                    th.join()
                    eng.step()
                    ends.append(time.perf_counter())
                gc.callbacks.remove(on_gc)
                for r in rids:
                    eng.abort(r)
                while eng.has_work():
                    eng.step()
                f = stall_figures(ends, args.stall_base_steps, done["t0"], done["t1"])
                f["scoring_s"] = done["t1"] - done["t0"]
                f["compiles"] = float(w.count)
                f["gc_passes"], f["gc_max_ms"] = float(len(pauses)), 1e3 * max(pauses, default=0.0)
                k = f"pflash.{label(ctx)}.stall.c{c}"
                figures.update({f"{k}.{mode}.{n}": v for n, v in f.items()})
                if mode == "turns":
                    figures[f"{k}.stall_steps"] = f["stall_steps"]
                print(f"{label(ctx)} stall C{c} {mode}: step {f['step_ms']:.2f} ms alone, max {f['max_step_ms']:.2f} "
                      f"/ median {f['median_step_ms']:.2f} ms over {int(f['steps'])} steps while scoring "
                      f"({f['scoring_s']:.3f} s): stall {f['stall_steps']:.2f} steps", flush=True)
    scorer.pace, scorer.turns = True, None
    figures.update({f"stall.turns.{k}": float(v) for k, v in turns.stats().items()})
