"""KVFlash's host-side residency work, replayed without a model: C sequences prefill their prompts in chunks and
decode, and ``Residency`` plans every step as the engine would (summaries, queries, ``prepare``, ``finish_step``).

It times the host's share of a step (what the GPU never hides), at any scale, on any machine:

* ``--scoring device``: bounds scoring as the engine runs it, the page scores coming from a batch scorer (here
  random numbers, as a random-weight model's would be: every re-rank reshuffles, which is also the page churn the
  27B benchmark sees); the residency's own bookkeeping is all that is timed.
* ``--scoring host``: bounds scoring on the host (``kvflash.bound_scores`` over host-held queries ``[Q, L, H, D]``
  and key bounds ``[2, L, Hkv, D]`` of the given shapes), as the engine did before scoring moved to the device.

Writes ``residency_replay_<device>_<yyyymmdd-hhmm>.json`` (the device is JAX's, though nothing runs on it) (figures ``decode_ms_per_step``, ``host_s``, ``prefill_s``,
``pages_in``, ``pages_out``, ``score_decisions``) under ``--out-dir``.

    python experiments/residency_replay.py --concurrency 16 --prompt-len 1536 2560 --pool 8192 --scoring host
    python experiments/residency_replay.py --concurrency 64 --prompt-len 6144 8192 --pool 65536
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash_jax.kv.kvflash import KVFlashOptions, Residency  # noqa: E402

QUERY_TAIL = 16  # the engine's KVFLASH_QUERY_TAIL


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(1536, 2560), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--pool", type=int, default=8192, help="resident pool tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--scoring", choices=("device", "host"), default="device")
    p.add_argument("--shapes", type=int, nargs=4, default=(16, 24, 4, 256), metavar=("L", "H", "HKV", "D"),
                   help="attention layers, query heads, KV heads, head dim (host scoring; default: the 27B's)")
    p.add_argument("--hysteresis", type=float, default=KVFlashOptions.hysteresis)
    p.add_argument("--max-page-in", type=int, default=KVFlashOptions.max_page_in)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="experiments/results")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def replay(args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(args.seed)
    n_layers, n_heads, n_kv, d = args.shapes
    c, ps = args.concurrency, args.page_size
    device = args.scoring == "device"
    scores = np.random.default_rng(args.seed + 1)
    batch = (lambda items: [scores.normal(size=len(ids)) for _, _, ids, _ in items]) if device else None
    plens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, c)
    host_pages = int(sum(-(-(int(n) + args.output_len) // ps) for n in plens))
    opts = KVFlashOptions(pool_tokens=args.pool, scoring="bounds", hysteresis=args.hysteresis,
                          max_page_in=args.max_page_in)
    res = Residency(args.pool // ps, host_pages, ps, opts, floor_pages=2, batch_scorer=batch)
    for i, n in enumerate(plens):
        res.admit(i, int(n) + args.output_len)
    bounds = None if device else rng.standard_normal((64, 2, n_layers, n_kv, d)).astype(np.float32)
    queries = None if device else rng.standard_normal((QUERY_TAIL, n_layers, n_heads, d)).astype(np.float32)
    t = collections.Counter()

    def step(rows: list[tuple[int, int, int]], n_query: int, kind: str) -> list[tuple[int, int, int]]:
        """Plan one step of ``rows`` (sid, from, to); returns the rows that ran (the others were deferred)."""
        t0 = time.perf_counter()
        need = res.summaries_needed()
        if need:
            keys = [(sid, lp) for sid, lp, _ in need]
            res.set_summaries(keys, None if device else bounds[np.arange(len(need)) % len(bounds)])
        plan = res.prepare(rows)
        res.finish_step(plan.step_id)
        rows = [r for r in rows if r[0] not in plan.deferred]
        res.page_tables([sid for sid, _, _ in rows], width)  # the block tables the engine dispatches with
        if not rows:
            raise SystemExit(f"a {kind} step fits none of its rows: the pool ({args.pool} tokens) is too small for "
                             f"--prefill-chunk {args.prefill_chunk} x --prefill-batch {args.prefill_batch}")
        for sid, lo, hi in rows:
            n = min(n_query, hi - lo)
            if device:
                res.count_query(sid, n, QUERY_TAIL, rescore=n_query > 1)
            else:
                res.push_query(sid, queries[:n], QUERY_TAIL, rescore=n_query > 1)
        t[kind] += time.perf_counter() - t0
        t[kind + "_steps"] += 1
        return rows

    width = max(res.pages_needed(int(n) + args.output_len) for n in plens)
    cur = [0] * c
    while any(cur[i] < plens[i] for i in range(c)):
        rows = []
        for i in [i for i in range(c) if cur[i] < plens[i]][: args.prefill_batch]:
            end = min(int(plens[i]), cur[i] + args.prefill_chunk)
            if end == plens[i] and end - cur[i] > 1:
                end -= 1  # the prompt's last token alone, as bounds scoring runs it
            rows.append((i, cur[i], end))
        for i, _, end in step(rows, QUERY_TAIL, "prefill"):
            cur[i] = end
    done = [0] * c
    while min(done) < args.output_len:
        for i, _, end in step([(i, cur[i], cur[i] + 1) for i in range(c) if done[i] < args.output_len], 1,
                              "decode"):
            cur[i], done[i] = end, done[i] + 1
    res.check_invariants()
    k = res.counters
    return {"decode_ms_per_step": 1000 * t["decode"] / max(1, t["decode_steps"]), "prefill_s": t["prefill"],
            "host_s": t["prefill"] + t["decode"], "pages_in": k["page_in"], "pages_out": k["page_out"],
            "score_decisions": k["score_decisions"], "logical_pages": host_pages, "pool_pages": args.pool // ps}


def main(argv=None) -> dict:
    args = parse(argv)
    figures = replay(args)
    for k, v in figures.items():
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    if not args.no_write:
        from dflash_jax.bench.results import script_command, settings, write_result

        command = script_command(__file__, argv)
        extra = {"settings": settings(args),
                 "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine()}
        print("wrote", write_result("residency_replay", figures, command, extra, out_dir=args.out_dir))
    return figures


if __name__ == "__main__":
    main()
