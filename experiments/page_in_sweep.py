"""KVFlash page-in bandwidth at a target's real KV page shapes (no weights needed).

    python experiments/page_in_sweep.py [--config configs/qwen36_27b.json] [--pages 16 64] [--iters 10]
                                        [--kv-dtype bf16] [--out-dir experiments/results]

A pool of ``max(--pages) + 1`` zero pages of the config's full-attention layers (page size 64) and a
``KVFlashDevice`` in the device's host memory kind: ``bandwidth(n)`` moves n pages out and back in (``page_in_gbs``,
``page_out_gbs``) against one ``device_put`` of an ``[n, slab]`` host array (``host_to_device_gbs``). Also a batched
``device_put`` of n separate per-page host slabs with no scatter (``per_page_put_gbs``), the transfer a page-in
makes without the jitted copy. Figures ``page_in.n<N>.{page_in_gbs,page_out_gbs,ratio,host_to_device_gbs,
per_page_put_gbs}``; the issue's target is ``ratio`` >= 0.7. (An earlier version also timed a page-in made of that
batched ``device_put`` and a jitted scatter: 0.72-0.77 vs 0.84-0.87 on the H200, ``page_in_nvidia-h200_20261204-1822
.json``; it was dropped.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import results  # noqa: E402
from dflash_jax.config import TargetConfig  # noqa: E402
from dflash_jax.kv.kvflash_device import KVFlashDevice  # noqa: E402
from dflash_jax.state import EngineState  # noqa: E402


def per_page_put_gbs(dev: KVFlashDevice, n: int, iters: int) -> float:
    """GB/s of one batched device_put of n separate host slabs (the transfer alone, no scatter)."""
    slabs = [jax.device_put(np.zeros(dev.slab_elems, dev.dtype), dev._host) for _ in range(n)]
    jax.block_until_ready(jax.device_put(slabs, dev._dev))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(jax.device_put(slabs, dev._dev))
    return n * dev.slab_bytes / 1e9 / ((time.perf_counter() - t0) / iters)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen36_27b.json")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8", "int8"))
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args(argv)
    cfg = TargetConfig.from_file(args.config)
    n_max = max(args.pages)
    kv_dtype = None if args.kv_dtype == "bf16" else args.kv_dtype
    state = EngineState.zeros(cfg, n_pages=n_max + 1, page_size=64, n_slots=1, dtype=jnp.bfloat16,
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
    figures["page_bytes"] = float(dev.slab_bytes)
    results.print_table(figures)
    extra = {"config": args.config, "kv_dtype": args.kv_dtype, "host_kind": dev.host_kind, "iters": args.iters}
    print("wrote", results.write_result("page_in", figures, " ".join(["python", "experiments/page_in_sweep.py"]
                                                                        + sys.argv[1:]), extra,
                                        out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
