"""KVFlash page-in bandwidth at a target's real KV page shapes (no weights needed).

    python experiments/page_in_sweep.py [--config configs/qwen36_27b.json] [--pages 16 64] [--iters 10]
                                        [--kv-dtype bf16] [--out-dir experiments/results]

A pool of ``max(--pages) + 1`` zero pages of the config's full-attention layers (page size 64) and a
``KVFlashDevice`` in the device's host memory kind: ``bandwidth(n)`` moves n pages out and back in (``page_in_gbs``,
``page_out_gbs``) against one ``device_put`` of an ``[n, slab]`` host array (``host_to_device_gbs``). Also a batched
``device_put`` of n separate per-page host slabs with no scatter (``per_page_put_gbs``), the transfer a page-in
makes without the jitted copy. Figures ``page_in.n<N>.{page_in_gbs,page_out_gbs,ratio,host_to_device_gbs,
per_page_put_gbs}``; the issue's target is ``ratio`` >= 0.7. ``--dispatch``: host ms of each transfer call, idle
and behind a busy device; ``--alloc N``: host ms per page of page-outs into N fresh slabs vs into reused ones
(``alloc.{first,reuse}.host_ms_per_page``) and ``KVFlashDevice.prewarm``'s rate (``alloc.prewarm_gbs``). (An earlier version also timed a page-in made of that
batched ``device_put`` and a jitted scatter: 0.72-0.77 vs 0.84-0.87 on the H200, ``page_in_nvidia-h200_20261204-1822
.json``; it was dropped.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import results  # noqa: E402
from dflash_jax.config import TargetConfig  # noqa: E402
from dflash_jax.kv.kvflash import Transfer  # noqa: E402
from dflash_jax.kv.kvflash_device import BUCKETS, KVFlashDevice  # noqa: E402
from dflash_jax.state import EngineState  # noqa: E402


def per_page_put_gbs(dev: KVFlashDevice, n: int, iters: int) -> float:
    """GB/s of one batched device_put of n separate host slabs (the transfer alone, no scatter)."""
    slabs = [jax.device_put(np.zeros(dev.slab_elems, dev.dtype), dev._host) for _ in range(n)]
    jax.block_until_ready(jax.device_put(slabs, dev._dev))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(jax.device_put(slabs, dev._dev))
    return n * dev.slab_bytes / 1e9 / ((time.perf_counter() - t0) / iters)


def dispatch_times(dev: KVFlashDevice, state: EngineState, iters: int, busy_n: int) -> tuple[dict, EngineState]:
    """Host ms of one page_out / page_in call per bucket, idle and behind a busy device (see the module doc)."""
    @functools.partial(jax.jit, donate_argnums=(0,))
    def busy(st, x):  # ~busy_n^3 x 16 flops of matmuls, then a write into the pool that depends on them
        for _ in range(16):
            x = jnp.tanh(x @ x)
        k0 = st.kv.k[0]
        k0 = k0.at[0, 0, 0, 0].add((x[0, 0] * 0).astype(k0.dtype))
        return EngineState(kv=dataclasses.replace(st.kv, k=(k0,) + tuple(st.kv.k[1:])), rec=st.rec)

    x = jnp.full((busy_n, busy_n), 1e-3, jnp.bfloat16)
    state = jax.block_until_ready(busy(state, x))
    t0 = time.perf_counter()
    state = jax.block_until_ready(busy(state, x))
    out = {"dispatch.busy_ms": 1e3 * (time.perf_counter() - t0)}
    for b in BUCKETS:
        b = min(b, state.kv.n_pages - 1, dev.host_pages)
        ts = [Transfer(-1, i, 1 + i, i) for i in range(b)]
        dev.page_out(state, None, ts)
        state, _ = dev.page_in(state, None, ts)
        rows: dict[str, list[float]] = {k: [] for k in ("out", "in", "done", "busy_out", "busy_in")}
        for _ in range(iters):
            jax.block_until_ready(state.kv.k)
            t0 = time.perf_counter()
            dev.page_out(state, None, ts)
            t1 = time.perf_counter()
            state, _ = dev.page_in(state, None, ts)
            t2 = time.perf_counter()
            jax.block_until_ready(state.kv.k)
            t3 = time.perf_counter()
            rows["out"].append(t1 - t0)
            rows["in"].append(t2 - t1)
            rows["done"].append(t3 - t0)
            state = busy(state, x)  # not waited for: the transfers below queue behind it
            t0 = time.perf_counter()
            dev.page_out(state, None, ts)
            t1 = time.perf_counter()
            state, _ = dev.page_in(state, None, ts)
            t2 = time.perf_counter()
            rows["busy_out"].append(t1 - t0)
            rows["busy_in"].append(t2 - t1)
        jax.block_until_ready(state.kv.k)
        out.update({f"dispatch.b{b}.{k}_ms": 1e3 * float(np.median(v)) for k, v in rows.items()})
        print(f"b={b}: " + ", ".join(f"{k} {1e3 * float(np.median(v)):.2f} ms" for k, v in rows.items()), flush=True)
    return out, state


def alloc_times(state: EngineState, n_host: int) -> dict[str, float]:
    """Host ms per page of page-outs into ``n_host`` fresh host slabs (the host allocator grows: new pinned
    regions), then again into the same slabs (each replaced: the allocator reuses what the old ones free), and
    ``KVFlashDevice.prewarm`` of a larger set of slabs (its pinning rate)."""
    pool = state.kv.n_pages - 1
    out: dict[str, float] = {}
    dev = KVFlashDevice(state, None, host_pages=n_host, target_summaries=False)
    dev.warmup(state, None)
    for name in ("first", "reuse"):
        host = 0.0
        t0 = time.perf_counter()
        for lo in range(0, n_host, BUCKETS[-1]):
            ts = [Transfer(-1, i, 1 + i % pool, i) for i in range(lo, min(n_host, lo + BUCKETS[-1]))]
            t1 = time.perf_counter()
            dev.page_out(state, None, ts)
            host += time.perf_counter() - t1
        jax.block_until_ready(dev.slabs)
        out[f"alloc.{name}.host_ms_per_page"] = 1e3 * host / n_host
        out[f"alloc.{name}.done_ms_per_page"] = 1e3 * (time.perf_counter() - t0) / n_host
    out["alloc.n_pages"] = n_host
    # a device twice the size: its prewarm pins past what the passes above left in the allocator
    big = KVFlashDevice(state, None, host_pages=2 * n_host, target_summaries=False)
    big.warmup(state, None)
    pre = big.prewarm(state, None, float("inf"))
    out["alloc.prewarm_gbs"] = pre["bytes"] / 1e9 / pre["seconds"]
    out["alloc.prewarm_s"] = pre["seconds"]
    print(", ".join(f"{k} {v:.3f}" for k, v in out.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen36_27b.json")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8", "int8"))
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dispatch", action="store_true", help="also time the host side of each transfer call")
    ap.add_argument("--busy-n", type=int, default=8192, help="matrix size of the busy computation (--dispatch)")
    ap.add_argument("--alloc", type=int, default=0, metavar="N",
                    help="also time page-outs into N fresh host slabs, then into the same slabs again")
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args(argv)
    cfg = TargetConfig.from_file(args.config)
    n_max = max(args.pages)
    kv_dtype = None if args.kv_dtype == "bf16" else args.kv_dtype
    state = EngineState.zeros(cfg, n_pages=n_max + 1, page_size=args.page_size, n_slots=1, dtype=jnp.bfloat16,
                              kv_dtype=kv_dtype)
    figures: dict[str, float] = {}
    dev = KVFlashDevice(state, None, host_pages=n_max, target_summaries=False)
    dev.warmup(state, None)
    for n in args.pages:
        res, state, _ = dev.bandwidth(state, None, n=n, iters=args.iters)
        figures.update({f"page_in.n{n}.{k}": v for k, v in res.items()})
        if dev._host is not None:
            figures[f"page_in.n{n}.per_page_put_gbs"] = per_page_put_gbs(dev, n, args.iters)
        print(f"n={n}: page-in {res['page_in_gbs']:.1f} GB/s, out {res['page_out_gbs']:.1f}, host->device "
              f"{res['host_to_device_gbs']:.1f}: ratio {res['ratio']:.3f}", flush=True)
    if args.dispatch:
        disp, state = dispatch_times(dev, state, args.iters, args.busy_n)
        figures.update(disp)
    if args.alloc:
        figures.update(alloc_times(state, args.alloc))
    figures["page_bytes"] = float(dev.slab_bytes)
    results.print_table(figures)
    extra = {"config": args.config, "kv_dtype": args.kv_dtype, "host_kind": dev.host_kind, "iters": args.iters}
    print("wrote", results.write_result("page_in", figures, results.script_command(__file__, argv), extra,
                                        out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
