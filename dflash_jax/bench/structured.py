"""``bench structured``: constrained requests (structured output) decoded AR against speculative rounds with tree
masks (``EngineOptions.structured_spec``), on a target with its tokenizer and a drafter.

For every concurrency C: C prompts (the ``--prompts`` texts, cycled), each constrained by ``--constraint``, greedy,
run on two engines over the same weights (compiled once each): DDTree with ``structured_spec`` off (constrained
requests decode AR) and on. Runs alternate, ``--repeats`` times each. Figures per C: ``c{C}.ar.tok_s`` /
``c{C}.spec.tok_s`` (emitted tokens over the batch's wall time, median), ``c{C}.speedup`` (spec / AR),
``c{C}.mean_accept_len`` (tokens a constrained round emits), ``c{C}.mask_ms_per_round`` (host time walking the
automata along the trees, per round), ``c{C}.draft_ms_per_round`` (the draft step and its fetch, per round),
``c{C}.matched`` (fraction of replies that match their constraint), ``c{C}.mismatches`` (requests whose tokens differ
between the two engines: 0 in float32); ``recompiles_after_warmup``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dflash_jax.bench import results
from dflash_jax.bench.sources import (add_source_arguments, load_drafter_source, load_target_source,
                                      parallel_options)
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import SpecConfig
from dflash_jax.engine.structured import Constraint
from dflash_jax.models.tokenizer import Tokenizer

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"},
                         "size": {"enum": ["small", "medium", "large"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
          "required": ["name", "ok", "size", "tags"]}
PROMPTS = ["settings = ", "config = {", "def load(path):\n    return ", "result = ", "data = json.loads("]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--constraint", default="json_schema", choices=("json_schema", "json_object"),
                   help=f"json_schema: {json.dumps(SCHEMA)}; json_object: any JSON object")
    p.add_argument("--output-len", type=int, default=96, help="max_tokens of each request")
    p.add_argument("--budget", type=int, default=22, help="DDTree node budget")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)


def _run(eng: Engine, prompts: list[list[int]], sp: SamplingParams) -> dict:
    secs0, masked0 = dict(eng.step_seconds), eng.counters["spec_masked_steps"]
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    wall = time.perf_counter() - t0
    rounds = eng.counters["spec_masked_steps"] - masked0
    per = lambda k: (eng.step_seconds[k] - secs0.get(k, 0.0)) / max(1, rounds) * 1e3  # noqa: E731
    return {"wall_s": wall, "outs": outs, "tokens": sum(len(o.token_ids) for o in outs), "rounds": rounds,
            "mask_ms": per("tree_masks"), "draft_ms": per("draft")}


def _matches(text: str, constraint: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if constraint == "json_object":
        return isinstance(obj, dict)
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]) and isinstance(obj["ok"], bool)
            and obj["size"] in SCHEMA["properties"]["size"]["enum"])


def run(args: argparse.Namespace, command: str) -> int:
    if args.model is None:
        raise SystemExit("bench structured needs --model (a checkpoint with its tokenizer: constraints are over text)")
    target = load_target_source(args)
    tok = Tokenizer.from_dir(args.model)
    drafter = load_drafter_source(args)
    rows = max(args.concurrency)
    c = Constraint("json_schema", json.dumps(SCHEMA)) if args.constraint == "json_schema" else Constraint("json_object")
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
    opts = dict(max_batch=rows, page_size=args.page_size, max_model_len=max(map(len, prompts)) + args.output_len + 1,
                prefill_chunk=64, prefill_batch=min(2, rows), spec=SpecConfig(budget=args.budget),
                cohort_yield_min=0.0, **parallel_options(args))
    engines = {mode: Engine(target, tok, EngineOptions(**opts, structured_spec=mode == "spec"), drafter=drafter)
               for mode in ("ar", "spec")}
    for e in engines.values():
        e.warmup()
    sp = SamplingParams(max_tokens=args.output_len, constraint=c)
    figures: dict[str, float] = {}
    for n in args.concurrency:
        batch = prompts[:n]
        for e in engines.values():  # the automaton and every bucket this C uses, once, before timing
            e.generate(batch, SamplingParams(max_tokens=4, constraint=c))
        runs = [{mode: _run(e, batch, sp) for mode, e in engines.items()} for _ in range(args.repeats)]
        tok_s = {m: statistics.median(r[m]["tokens"] / r[m]["wall_s"] for r in runs) for m in engines}
        last = runs[-1]["spec"]
        steps = sum(o.stats["draft_steps"] for o in last["outs"])
        emitted = sum(o.stats["mean_accept_len"] * o.stats["draft_steps"] for o in last["outs"] if o.stats["draft_steps"])
        figures.update({f"c{n}.ar.tok_s": tok_s["ar"], f"c{n}.spec.tok_s": tok_s["spec"],
                        f"c{n}.speedup": tok_s["spec"] / tok_s["ar"],
                        f"c{n}.mean_accept_len": emitted / max(1, steps),
                        f"c{n}.mask_ms_per_round": statistics.median(r["spec"]["mask_ms"] for r in runs),
                        f"c{n}.draft_ms_per_round": statistics.median(r["spec"]["draft_ms"] for r in runs),
                        f"c{n}.matched": sum(_matches(o.text, args.constraint) for o in last["outs"]) / n,
                        f"c{n}.mismatches": sum(a.token_ids != b.token_ids for r in runs
                                                for a, b in zip(r["ar"]["outs"], r["spec"]["outs"]))})
    figures["recompiles_after_warmup"] = sum(e.counters["lazy_compiles"] for e in engines.values())
    results.print_table(figures)
    if not args.no_write:
        extra = {"concurrency": args.concurrency, "repeats": args.repeats, "output_len": args.output_len,
                 "constraint": args.constraint, "budget": args.budget, "dtype": args.dtype, "model": args.model,
                 "drafter": args.drafter or args.random_drafter}
        path = results.write_result("structured", figures, command, extra, out_dir=args.out_dir)
        print(f"wrote {path}")
    return 0
