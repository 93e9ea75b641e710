"""Time the fused GDN decode kernel (``pallas_kernels.gdn.decode``) against the jnp reference at one layer's shapes.

    python experiments/gdn_decode_sweep.py [--config configs/qwen36_27b.json] [--batch 1 4 16 64]
                                           [--warps 4 8 16] [--iters 200] [--out-dir experiments/results]

One layer's decode token between its projections (conv, gates, delta-rule step, gated norm, the slots' state
written in place), for a batch of rows in distinct slots of a pool of ``4 * max(batch)`` slots; device time per call
from a jitted loop of ``--iters`` calls. Figures per batch B: ``gdn_decode.bB.reference_us``, ``gdn_decode.bB.wW_us``
(the one-kernel form at W warps a program), ``.split.wW_us`` (the split form: a q / k kernel, then a program per
value head), ``.split_speedup`` (best one-kernel / best split), ``.best_us`` / ``.best_warps`` / ``.best_split`` /
``.speedup`` (reference / best), ``.state_gbps`` (the state read and written, over the best time).
Off a GPU the kernel runs in interpret mode (a check that the script works, not a timing).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import results  # noqa: E402
from dflash_jax.config import TargetConfig  # noqa: E402
from dflash_jax.models import qwen36  # noqa: E402
from pallas_kernels import registry  # noqa: E402
from pallas_kernels.gdn import decode  # noqa: E402


def layer_case(cfg: TargetConfig, b: int, n_slots: int, dtype, seed: int = 0) -> tuple:
    """Random inputs of one GDN layer's decode token: ``gdn_decode``'s positional arguments."""
    rng = np.random.default_rng(seed)
    hv, dv, c, kk = cfg.lin_num_v_heads, cfg.lin_v_dim, cfg.conv_dim, cfg.conv_kernel
    f = lambda *s, dt=dtype: jnp.asarray(rng.normal(size=s), dt)  # noqa: E731
    slots = jnp.asarray(rng.permutation(np.arange(1, n_slots))[:b], jnp.int32)
    return ((f(b, c + hv * dv + 2 * hv),), f(c, kk) * 0.5, jnp.log(jnp.asarray(rng.uniform(1, 16, hv), jnp.float32)),
            f(hv, dt=jnp.float32) * 0.1, f(dv, dt=jnp.float32), f(n_slots, kk - 1, c),
            f(n_slots, hv, cfg.lin_k_dim, dv, dt=jnp.float32) * 0.1, slots, jnp.zeros((b,), bool),
            jnp.ones((b,), bool))


def time_us(step, args: tuple, iters: int) -> float:
    """Device microseconds of one ``step(*args)``: ``iters`` calls in one jitted loop, the two state arrays threaded
    from call to call (no host dispatch between calls: at B = 1 a dispatched call costs more than the kernel), the
    loop timed once compiled (median of 3)."""
    args = list(args)
    y0 = jax.eval_shape(step, *args)[0]

    def body(_, carry):
        _, conv, ssm = carry
        return step(*args[:5], conv, ssm, *args[7:])

    loop = jax.jit(lambda conv, ssm: jax.lax.fori_loop(0, iters, body, (jnp.zeros(y0.shape, y0.dtype), conv, ssm)),
                   donate_argnums=(0, 1))
    conv, ssm = args[5], args[6]
    times = []
    for it in range(4):
        t0 = time.perf_counter()
        y, conv, ssm = loop(conv, ssm)
        jax.block_until_ready(y)
        if it:
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "configs", "qwen36_27b.json"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args(argv)
    if min(args.batch) < 1 or min(args.warps) < 1 or args.iters < 1:
        ap.error("--batch, --warps and --iters must be positive")
    cfg = TargetConfig.from_file(args.config)
    dtype = jnp.dtype(args.dtype)
    interpret = registry.current_backend() not in registry.GPU_BACKENDS
    static = dict(n_k_heads=cfg.lin_num_k_heads, eps=cfg.rms_norm_eps)
    n_slots = 4 * max(args.batch)
    ref = functools.partial(qwen36.gdn_decode_reference, **static)
    figures: dict[str, float] = {}
    for b in args.batch:
        tag = f"gdn_decode.b{b}"
        figures[f"{tag}.reference_us"] = time_us(ref, layer_case(cfg, b, n_slots, dtype), args.iters)
        best = None
        for split in (False, True):
            for w in args.warps:
                fn = functools.partial(decode.gdn_decode, **static, num_warps=w, split=split, interpret=interpret)
                us = time_us(fn, layer_case(cfg, b, n_slots, dtype), args.iters)
                figures[f"{tag}.{'split.' if split else ''}w{w}_us"] = us
                if best is None or us < best[0]:
                    best = (us, w, split)
        figures[f"{tag}.best_us"], figures[f"{tag}.best_warps"], figures[f"{tag}.best_split"] = best[0], best[1], int(best[2])
        figures[f"{tag}.split_speedup"] = (min(figures[f"{tag}.w{w}_us"] for w in args.warps)
                                           / min(figures[f"{tag}.split.w{w}_us"] for w in args.warps))
        figures[f"{tag}.speedup"] = figures[f"{tag}.reference_us"] / best[0]
        state_bytes = 2 * b * cfg.lin_num_v_heads * cfg.lin_k_dim * cfg.lin_v_dim * 4
        figures[f"{tag}.state_gbps"] = state_bytes / (best[0] * 1e-6) / 1e9
        print(f"b{b}: reference {figures[f'{tag}.reference_us']:.1f} us, kernel best {best[0]:.1f} us at {best[1]} "
              f"warps{' split' if best[2] else ''} ({figures[f'{tag}.speedup']:.2f}x), split / one kernel "
              f"{figures[f'{tag}.split_speedup']:.2f}x, state {figures[f'{tag}.state_gbps']:.0f} GB/s", flush=True)
    command = results.script_command(__file__, argv)
    extra = {"config": args.config, "dtype": args.dtype, "interpret": interpret}
    print("wrote", results.write_result("gdn_decode_sweep", figures, command, extra, out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
