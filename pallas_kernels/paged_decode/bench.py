"""GPU smoke test + timing of the paged decode kernel against the jnp reference (not run in CI).

    python -m pallas_kernels.paged_decode.bench [--out results.json]

1. Correctness on the GPU (compiled Triton, not interpret mode): fp32 and bf16, several shapes incl.
   the Qwen3.6-27B attention (H=24, Hkv=4, D=256, page 16), ragged lengths incl. 1 and page boundaries.
2. Timing (bf16, 27B attention shapes, every sequence at --ctx tokens): the XLA reference vs kernel
   variants. Each variant runs inside one jitted ``lax.scan`` over page-table sets that use disjoint
   pages (so the KV does not sit in L2 between iterations); time per call = median over repeats / steps.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.paged_decode.kernel import default_config, paged_decode
from pallas_kernels.paged_decode.reference import paged_decode_reference


def _case(rng, b, h, hkv, d, ps, width, lengths, dtype, n_pages=None):
    n_pages = n_pages or (1 + b * width + 5)
    q = jnp.asarray(rng.normal(size=(b, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(n_pages, ps, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(n_pages, ps, hkv, d)), dtype)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_pages))[: b * width].reshape(b, width), jnp.int32)
    return q, k, v, pt, jnp.asarray(lengths, jnp.int32)


def correctness(rng) -> list[dict]:
    rows = []
    shapes = [  # b, h, hkv, d, ps, width, lengths
        (4, 24, 4, 256, 16, 64, [1, 16, 17, 1024]),
        (3, 12, 2, 64, 8, 40, [320, 7, 8]),
        (2, 8, 8, 128, 16, 300, [4800, 2333]),
    ]
    for (b, h, hkv, d, ps, width, lengths) in shapes:
        for dtype in (jnp.float32, jnp.bfloat16):
            q, k, v, pt, lens = _case(rng, b, h, hkv, d, ps, width, lengths, dtype)
            scale = d ** -0.5
            # f32 oracle from the same (rounded) inputs, HIGHEST precision.
            with jax.default_matmul_precision("highest"):
                ref = paged_decode_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                             pt, lens, scale)
            cfg = default_config(d, ps, dtype)
            for parts in (1, None):
                row = dict(shape=[b, h, hkv, d, ps, width], lengths=lengths, dtype=jnp.dtype(dtype).name,
                           num_partitions=parts, cfg=cfg)
                try:
                    out = paged_decode(q, k, v, pt, lens, scale, pages_per_block=cfg["pages_per_block"],
                                       num_partitions=parts, num_warps=cfg["num_warps"],
                                       num_stages=cfg["num_stages"]).astype(jnp.float32)
                    out = np.asarray(out)
                    r = np.asarray(ref)
                    row.update(rel_l2=float(np.linalg.norm(out - r) / np.linalg.norm(r)),
                               max_abs=float(np.abs(out - r).max()), finite=bool(np.isfinite(out).all()))
                except Exception as e:  # keep the sweep going; report the lowering error
                    row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
                rows.append(row)
                print("CHECK", json.dumps(row), flush=True)
    return rows


def _timed(fn, q, k, v, pts, lens, steps: int, repeats: int = 5) -> float:
    """Median seconds per call of fn, run `steps` times inside one jitted scan over page-table sets."""
    n_sets = pts.shape[0]

    @jax.jit
    def loop(q, k, v, pts, lens):
        def body(acc, i):
            o = fn(q, k, v, pts[i % n_sets], lens)
            return acc + o[:, :1, :1].astype(jnp.float32), None
        acc, _ = lax.scan(body, jnp.zeros((q.shape[0], 1, 1), jnp.float32), jnp.arange(steps))
        return acc

    loop(q, k, v, pts, lens).block_until_ready()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        loop(q, k, v, pts, lens).block_until_ready()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / steps


def timing(rng, ctx: int, batches, steps: int, ppbs=(2, 4, 8), warps=(4, 8)) -> list[dict]:
    h, hkv, d, ps = 24, 4, 256, 16
    width = -(-ctx // ps)
    rows = []
    page_bytes = ps * hkv * d * 2 * 2  # k + v, bf16
    for b in batches:
        set_bytes = b * width * page_bytes
        n_sets = int(max(2, min(8, -(-(512 << 20) // set_bytes))))
        n_pages = 1 + n_sets * b * width
        q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.bfloat16)
        k = jax.random.normal(jax.random.key(1), (n_pages, ps, hkv, d), jnp.bfloat16)
        v = jax.random.normal(jax.random.key(2), (n_pages, ps, hkv, d), jnp.bfloat16)
        pts = jnp.asarray(rng.permutation(np.arange(1, n_pages)).reshape(n_sets, b, width), jnp.int32)
        lens = jnp.full((b,), ctx, jnp.int32)
        kv_bytes = b * ctx * hkv * d * 2 * 2
        scale = d ** -0.5
        dflt = default_config(d, ps, jnp.bfloat16)
        variants = {"reference_xla": lambda q, k, v, pt, l: paged_decode_reference(q, k, v, pt, l, scale)}
        for ppb in ppbs:
            for nw in warps:
                for parts in (1, None):
                    if parts == 1 and b < 32:
                        continue  # one partition cannot fill 132 SMs with B*Hkv < 128 programs
                    name = f"pallas ppb={ppb} warps={nw} parts={'auto' if parts is None else parts}"
                    variants[name] = (lambda ppb, nw, parts: lambda q, k, v, pt, l: paged_decode(
                        q, k, v, pt, l, scale, pages_per_block=ppb, num_partitions=parts, num_warps=nw,
                        num_stages=dflt["num_stages"]))(ppb, nw, parts)
        for name, fn in variants.items():
            row = dict(batch=b, ctx=ctx, variant=name)
            try:
                t = _timed(fn, q, k, v, pts, lens, steps)
                row.update(us=t * 1e6, gbps=kv_bytes / t / 1e9)
            except Exception as e:
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print("TIME", json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ppbs", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--skip-timing", action="store_true")
    a = ap.parse_args()
    print("devices", jax.devices(), "jax", jax.__version__, flush=True)
    rng = np.random.default_rng(0)
    res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, checks=correctness(rng))
    if not a.skip_timing:
        res["timing"] = timing(rng, a.ctx, a.batches, a.steps, a.ppbs, a.warps)
        print(f"\n{'B':>3} {'variant':<40} {'us':>9} {'GB/s':>7}")
        for r in res["timing"]:
            print(f"{r['batch']:>3} {r['variant']:<40} {r.get('us', float('nan')):>9.1f} {r.get('gbps', float('nan')):>7.0f}"
                  + (f"  {r['error'][:80]}" if "error" in r else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
