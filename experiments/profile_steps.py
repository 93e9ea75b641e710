"""Per-op device time of the engine's steps, AR vs DDTree, from a JAX profiler trace.

    python experiments/profile_steps.py [--model DIR --drafter DIR] [--dtype bfloat16] [--concurrency 8]
                                        [--prompts random|held-out]
                                        [--out-dir experiments/results]
    python experiments/profile_steps.py --random-weights configs/qwen36_27b.json \
        [--random-drafter configs/qwen36_27b_dflash.json] --concurrency 1 --prompt-len-min 4096 --prompt-len-max 4096

For each mode, a fresh engine (one batch bucket = the concurrency) serves one warm batch of prompts (``bench
concurrency``'s ``prompt_set``, or ``text_prompt_set`` with ``--prompts held-out``; seed 0), then a second batch
under ``jax.profiler.trace`` (by default from its first token on: decode steps / speculative rounds only,
``--no-decode-only`` for prefill too); the trace's device events are summed by name. Writes
``profile_steps_<device>_<time>.json``: figures ``<mode>.<kind>_step_ms`` / ``<mode>.host_ms`` (wall time per engine
step of that kind and of the host loop, ``bench.concurrency.step_time_figures``), ``<mode>.device_ms`` (device
time of the traced batch), ``<mode>.device_ms_per_step`` (of a traced step, decode-only traces) and, in ``extra``, the top
device ops of each mode with their total milliseconds and counts. On CPU the trace holds no device events (only
the step times are then meaningful).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import results  # noqa: E402
from dflash_jax.device_memory import set_memory_fraction  # noqa: E402
from dflash_jax.bench.concurrency import prompt_set, prompt_text_ids, step_time_figures, text_prompt_set  # noqa: E402
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams  # noqa: E402
from dflash_jax.engine.spec_steps import SpecConfig  # noqa: E402
from dflash_jax.spec import draft_vocab  # noqa: E402
from dflash_jax.bench.sources import load_drafter_source, load_target_source  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_jax", "assets", "tiny")


def device_ops(trace_dir: str, top: int | None) -> tuple[float, list[tuple[str, float, int]]]:
    """(total device ms, [(op name, ms, count)] largest first) of the trace's device-stream events."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return 0.0, []
    data = json.load(gzip.open(files[0], "rt"))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot: collections.Counter = collections.Counter()
    cnt: collections.Counter = collections.Counter()
    for e in events:
        proc = names.get(e.get("pid"), "").lower()
        if e.get("ph") == "X" and "dur" in e and ("/device:" in proc or "gpu" in proc or "stream" in proc):
            tot[e["name"][:120]] += e["dur"]
            cnt[e["name"][:120]] += 1
    return sum(tot.values()) / 1e3, [(k, v / 1e3, cnt[k]) for k, v in tot.most_common(top)]


def families(ops: list[tuple[str, float, int]], top: int) -> list[tuple[str, float, int]]:
    """``ops`` summed by family: the name without XLA's numeric suffix (``gemm_fusion_dot_962`` ->
    ``gemm_fusion_dot``), so the same op of every unrolled layer counts together."""
    tot: collections.Counter = collections.Counter()
    cnt: collections.Counter = collections.Counter()
    for name, ms, c in ops:
        fam = re.sub(r"([._]\d+)+$", "", name)
        tot[fam] += ms
        cnt[fam] += c
    return [(k, v, cnt[k]) for k, v in tot.most_common(top)]


def traced_batch(eng: Engine, prompts, sp: SamplingParams, trace_dir: str, decode_only: bool) -> collections.Counter:
    """Serve ``prompts`` under ``jax.profiler.trace``; with ``decode_only`` the trace starts once every request has
    its first token (prefill done), so it holds only decode steps / speculative rounds. Returns the engine's step
    counters over the traced part (its ``step_seconds`` cover the same steps)."""
    for p in prompts:
        eng.submit(p, sp)
    if decode_only:
        started: set = set()
        while len(started) < len(prompts) and eng.has_work():
            started.update(o.request_id for o in eng.step() if o.token_ids)
    eng.step_seconds.clear()
    steps0 = collections.Counter(eng.counters)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        while eng.has_work():
            eng.step()
    return eng.counters - steps0


def main(argv: list[str] | None = None) -> int:
    set_memory_fraction()  # as the benches: 0.9 of the accelerator (JAX alone takes 0.75: too little for the 27B)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(TINY, "target"))
    ap.add_argument("--drafter", default=os.path.join(TINY, "drafter"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len-min", type=int, default=256)
    ap.add_argument("--prompt-len-max", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--random-weights", metavar="CONFIG", help="a target config given random weights (not --model)")
    ap.add_argument("--random-drafter", metavar="CONFIG", help="a drafter config given random weights (not --drafter)")
    ap.add_argument("--modes", nargs="+", choices=("ar", "ddtree"), default=["ar", "ddtree"])
    ap.add_argument("--prompts", choices=("random", "held-out"), default="random",
                    help="random ids, or windows of the --model set's held-out text (as bench concurrency's)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--decode-only", action=argparse.BooleanOptionalAction, default=True,
                    help="trace only after every prompt has prefilled (figures <mode>.device_ms_per_step); "
                         "--no-decode-only traces the whole batch, prefill included")
    draft_vocab.add_argument(ap)
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args(argv)
    if args.prompts == "held-out" and args.random_weights:
        ap.error("--prompts held-out needs --model (random weights have no text)")
    src = argparse.Namespace(model=None if args.random_weights else args.model, random_weights=args.random_weights,
                             drafter=None if args.random_drafter else args.drafter,
                             random_drafter=args.random_drafter, dtype=args.dtype, tensor_parallel=1,
                             data_parallel=1, quantization=None)
    target = load_target_source(src)
    drafter = load_drafter_source(src) if "ddtree" in args.modes else None
    if args.prompts == "held-out":
        text, _ = prompt_text_ids(args.model)
        prompts = text_prompt_set(text, args.concurrency, args.prompt_len_min, args.prompt_len_max, seed=0)
    else:
        prompts = prompt_set(args.concurrency, args.prompt_len_min, args.prompt_len_max, target.config.vocab_size, 0)
    lens = np.array([len(p) for p in prompts])
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    max_len = int(lens.max()) + args.output_len + 64
    figures: dict[str, float] = {}
    extra: dict = {"model": args.random_weights or args.model, "drafter": args.random_drafter or args.drafter,
                   "dtype": args.dtype, "prompts": args.prompts, "prompt_lens": lens.tolist(),
                   "draft_vocab": args.draft_vocab}
    for mode in args.modes:
        eng = Engine(target, None, EngineOptions(
            max_batch=args.concurrency, max_model_len=max_len, prefill_chunk=args.prefill_chunk,
            prefill_batch=min(4, args.concurrency), batch_buckets=(args.concurrency,), cohort_yield_min=0.0,
            spec=SpecConfig(draft_vocab=args.draft_vocab) if mode == "ddtree" else None),
            drafter=drafter if mode == "ddtree" else None)
        eng.warmup()
        eng.generate(prompts, sp)  # warm: every executable has run once
        with tempfile.TemporaryDirectory() as d:
            steps = traced_batch(eng, prompts, sp, d, args.decode_only)
            dev_ms, ops = device_ops(d, None)
        times = step_time_figures(eng.step_seconds, steps, repeats=1)
        figures.update({f"{mode}.{k}": v for k, v in times.items()})
        figures[f"{mode}.step_wall_ms"] = 1e3 * eng.step_seconds["step"]
        figures[f"{mode}.device_ms"] = dev_ms
        if args.decode_only:  # every traced step is a decode step / speculative round
            n = max(1, sum(v for k, v in steps.items() if k in ("decode_steps", "spec_steps")))
            figures[f"{mode}.device_ms_per_step"] = dev_ms / n
        fams = families(ops, args.top)
        extra[f"{mode}.top_device_ops"] = [{"op": k, "ms": ms, "count": c} for k, ms, c in ops[:args.top]]
        extra[f"{mode}.top_device_families"] = [{"op": k, "ms": ms, "count": c} for k, ms, c in fams]
        print(f"== {mode}: device {dev_ms:.1f} ms of {figures[f'{mode}.step_wall_ms']:.1f} ms in steps; by family:")
        for k, ms, c in fams:
            print(f"   {ms:9.3f} ms {c:6d}x  {k}")
        del eng
    results.print_table(figures)
    command = results.script_command(__file__, argv)
    print("wrote", results.write_result("profile_steps", figures, command, extra, out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
