"""``python -m dflash_jax.bench quality``: what quantized weights and quantized KV pages cost in quality, on the
model set's held-out text, each format against the first (the reference: ``--quantization none``, bf16 pages).

For each weight format of ``--quantization`` (target and drafter quantized alike) and, with the reference weights,
each KV page format of ``--kv-dtypes``:

* ``{f}.ppl``: held-out perplexity, teacher-forced through the engine's own paged prefill (the prompt log-probs
  of ``--rows`` rows of ``--row-len`` tokens: quantized pages are written and read as in serving);
  ``{f}.ppl_ratio`` = ``{f}.ppl`` / the reference's;
* ``{f}.greedy_agreement``: the reference's greedy continuations (``--agree-tokens`` after each row's first
  ``--agree-prefix`` tokens) teacher-forced through the format's engine: the fraction of continuation positions
  where the format's most likely token is the reference's (1.0 = every greedy token reproduced; the reference
  itself measures the prefill vs decode agreement of one model, its floor); ``{f}.greedy_agreement_positions`` the
  positions compared, ``{f}.greedy_agreement_ci95_lo`` / ``_hi`` the Wilson 95 % interval of the fraction (at ~1000
  positions and 0.99 it is about +-0.006: whether a format meets a 0.99 target needs that many);
* weight formats also: ``{f}.chain.tau`` / ``{f}.ddtree.tau`` (``bench acceptance``'s teacher-forced acceptance:
  the format's drafter against the format's own greedy labels, ``--budget`` nodes) and ``{f}.ddtree.tau_ratio``;
* with ``--draft-quantization``, each format of the drafter alone (``SpecConfig.draft_quantization``: its matmuls and
  its drafting head) against the reference target's labels: ``draft_{f}.chain.tau`` / ``.ddtree.tau`` /
  ``.ddtree.tau_ratio``.

Format names: ``bf16`` / ``f32`` (the reference weights), ``fp8``, ``fp8_dynamic``, ``int8``, ``int4``;
``kv_fp8``, ``kv_int8`` for pages (``.calibrated`` 1 when they round keys with a key calibration,
``kv.calibration``; then also ``kv_fp8.plain`` etc. without it). Issue targets: fp8 weights perplexity within 1 % and DDTree tau within 5 %,
fp8 pages greedy agreement >= 99 %.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dflash_jax.bench import results
from dflash_jax.bench.acceptance import (add_held_out_arguments, anchor_positions, chain_tau, draft_logprobs,
                                         greedy_labels, held_out_files, held_out_rows, tree_tau)
from dflash_jax.bench.ar import variant_label
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.models import quant
from dflash_jax.models.tokenizer import Tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="trained target checkpoint (with its tokenizer)")
    p.add_argument("--drafter", help="its DFlash drafter checkpoint (tau figures; without it none)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--quantization", nargs="+", choices=quant.QUANTIZATIONS, default=["none", "fp8"],
                   help="weight formats, the first the reference")
    p.add_argument("--kv-dtypes", nargs="*", choices=("fp8", "int8"), default=["fp8"],
                   help="KV page formats measured with the reference weights")
    add_held_out_arguments(p, anchors=8)
    p.add_argument("--draft-quantization", nargs="*", choices=quant.QUANTIZATIONS[1:], default=[],
                   help="drafter-only formats (SpecConfig.draft_quantization) scored against the reference target")
    p.add_argument("--agree-prefix", type=int, default=256, help="tokens of a row before its greedy continuation")
    p.add_argument("--agree-tokens", type=int, default=64, help="greedy tokens per row compared")
    p.add_argument("--kv-calibration", default="auto",
                   help="key calibration of the quantized pages (EngineOptions.kv_calibration: auto = the one beside "
                        "the model, a path, or none); with one, the pages are also measured without it "
                        "(kv_{f}.plain)")


def _engine(target, tok, max_len: int, kv_dtype: str | None, kv_calibration: str | None = "auto") -> Engine:
    return Engine(target, tok, EngineOptions(max_batch=8, max_model_len=max_len, prefill_chunk=128,
                                             prompt_logprobs=True, kv_dtype=kv_dtype, kv_calibration=kv_calibration))


def prompt_scores(eng: Engine, prompts: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt: the log-probability ``[n - 1]`` and rank (1 = most likely) of each token after the first."""
    outs = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    return [(np.asarray(o.prompt_logprobs[1:], np.float64), np.asarray(o.prompt_ranks[1:], np.int64)) for o in outs]


def perplexity(eng: Engine, rows: np.ndarray) -> float:
    lps = [lp for lp, _ in prompt_scores(eng, [list(map(int, r)) for r in rows])]
    return float(np.exp(-np.concatenate(lps).mean()))


def continuations(eng: Engine, rows: np.ndarray, prefix: int, n: int) -> list[list[int]]:
    """Each row's first ``prefix`` tokens followed by ``eng``'s ``n`` greedy tokens."""
    heads = [list(map(int, r[:prefix])) for r in rows]
    outs = eng.generate(heads, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [h + list(o.token_ids) for h, o in zip(heads, outs)]


def agreement(eng: Engine, seqs: list[list[int]], prefix: int) -> tuple[float, int]:
    """(fraction, count) of the positions after ``prefix`` whose token is ``eng``'s most likely one (teacher-forced)."""
    ranks = np.concatenate([r[prefix - 1:] for _, r in prompt_scores(eng, seqs)])
    return float(np.mean(ranks == 1)), int(ranks.size)


def wilson_interval(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial fraction ``p`` of ``n`` trials (95 % by default)."""
    if n <= 0:
        return 0.0, 1.0
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return float(max(0.0, c - h)), float(min(1.0, c + h))


def agreement_figures(name: str, eng: Engine, seqs: list[list[int]], prefix: int) -> dict[str, float]:
    """``{name}.greedy_agreement``, its positions and its Wilson 95 % interval."""
    p, n = agreement(eng, seqs, prefix)
    lo, hi = wilson_interval(p, n)
    return {f"{name}.greedy_agreement": p, f"{name}.greedy_agreement_positions": n,
            f"{name}.greedy_agreement_ci95_lo": lo, f"{name}.greedy_agreement_ci95_hi": hi}


def run(args: argparse.Namespace, command: str) -> int:
    from dflash_jax import load_target

    if not 0 < args.agree_prefix < args.row_len:
        raise SystemExit(f"--agree-prefix must be in (0, --row-len {args.row_len})")
    if args.draft_quantization and not args.drafter:
        raise SystemExit("--draft-quantization scores the drafter: give --drafter")
    quants = list(dict.fromkeys(args.quantization))
    tok = Tokenizer.from_dir(args.model)
    files = args.files or held_out_files(args.model, args.report)
    rows = held_out_rows(tok, files, args.rows, args.row_len)
    max_len = -(-(max(args.row_len, args.agree_prefix + args.agree_tokens) + 32) // 64) * 64
    figures: dict[str, float] = {"rows": int(len(rows)), "row_len": int(rows.shape[1])}
    seconds: dict[str, float] = {}
    ref_name, ref_seqs, ref_target, ref_draft = None, None, None, None
    for q in quants:
        t0 = time.perf_counter()
        name = variant_label(args.dtype, q)
        target = load_target(args.model, dtype=args.dtype, quantization=quant.check_quantization(q))
        target.fuse_projections()
        eng = _engine(target, tok, max_len, None)
        figures[f"{name}.ppl"] = perplexity(eng, rows)
        if ref_name is None:
            ref_name, ref_target = name, target
            ref_seqs = continuations(eng, rows, args.agree_prefix, args.agree_tokens)
        figures.update(agreement_figures(name, eng, ref_seqs, args.agree_prefix))
        if args.drafter:
            from dflash_jax.models.dflash_loader import load_drafter

            dcfg, dparams = load_drafter(args.drafter, dtype=target.params["embed"].dtype,
                                         quantization=quant.check_quantization(q))
            anchors = anchor_positions(rows.shape[1], dcfg.block_size, args.anchors, args.seed, len(rows))
            labels = greedy_labels(eng, rows, anchors, dcfg.block_size)
            lp = draft_logprobs(target, dcfg, dparams, rows, anchors)
            figures[f"{name}.chain.tau"] = float(chain_tau(lp, labels).mean())
            figures[f"{name}.ddtree.tau"] = float(tree_tau(lp, labels, args.budget).mean())
            if ref_draft is None:
                ref_draft = (dcfg, dparams, anchors, labels)
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] ppl {figures[f'{name}.ppl']:.4f}, greedy agreement "
              f"{figures[f'{name}.greedy_agreement']:.4f}"
              + (f", ddtree tau {figures[f'{name}.ddtree.tau']:.3f}" if args.drafter else "")
              + f" ({seconds[name]} s)", flush=True)
        del eng
    kv_names = []
    for dt in dict.fromkeys(args.kv_dtypes):
        cases = [(f"kv_{dt}", args.kv_calibration)]
        while cases:
            name, calib = cases.pop(0)
            t0 = time.perf_counter()
            eng = _engine(ref_target, tok, max_len, dt, calib)
            figures[f"{name}.calibrated"] = int(eng.kv_calibration is not None)
            if eng.kv_calibration is not None:
                cases.append((f"kv_{dt}.plain", "none"))
            figures[f"{name}.ppl"] = perplexity(eng, rows)
            figures.update(agreement_figures(name, eng, ref_seqs, args.agree_prefix))
            seconds[name] = round(time.perf_counter() - t0, 1)
            kv_names.append(name)
            print(f"[{name}] ppl {figures[f'{name}.ppl']:.4f}, greedy agreement "
                  f"{figures[f'{name}.greedy_agreement']:.4f}"
                  + (" (key calibration)" if eng.kv_calibration else "") + f" ({seconds[name]} s)", flush=True)
            del eng
    for dq in dict.fromkeys(args.draft_quantization):
        from dflash_jax.engine.spec_steps import with_draft_quantization

        dcfg, dparams, anchors, labels = ref_draft
        name = f"draft_{dq}"
        lp = draft_logprobs(ref_target, dcfg, with_draft_quantization(dparams, ref_target.params["lm_head"], dq),
                            rows, anchors)
        figures[f"{name}.chain.tau"] = float(chain_tau(lp, labels).mean())
        figures[f"{name}.ddtree.tau"] = float(tree_tau(lp, labels, args.budget).mean())
        figures[f"{name}.ddtree.tau_ratio"] = figures[f"{name}.ddtree.tau"] / figures[f"{ref_name}.ddtree.tau"]
        print(f"[{name}] ddtree tau {figures[f'{name}.ddtree.tau']:.3f} "
              f"({figures[f'{name}.ddtree.tau_ratio']:.4f} of {ref_name}'s)", flush=True)
    for name in [variant_label(args.dtype, q) for q in quants] + kv_names:
        figures[f"{name}.ppl_ratio"] = figures[f"{name}.ppl"] / figures[f"{ref_name}.ppl"]
        if f"{name}.ddtree.tau" in figures:
            figures[f"{name}.ddtree.tau_ratio"] = figures[f"{name}.ddtree.tau"] / figures[f"{ref_name}.ddtree.tau"]
    results.print_table(figures)
    if not args.no_write:
        extra = {"model": args.model, "drafter": args.drafter, "dtype": args.dtype, "reference": ref_name,
                 "quantization": quants, "kv_dtypes": list(args.kv_dtypes), "kv_calibration": args.kv_calibration,
                 "draft_quantization": list(args.draft_quantization), "agree_prefix": args.agree_prefix,
                 "agree_tokens": args.agree_tokens, "budget": args.budget, "anchors": args.anchors,
                 "files": [f.rsplit("/", 1)[-1] for f in files], "seconds": seconds}
        print("wrote", results.write_result("quality", figures, command, extra, out_dir=args.out_dir))
    return 0
