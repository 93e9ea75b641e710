"""The Mosaic GPU tree-attention kernel against the Triton kernel, the reference and paged decode on this GPU.

Checks ``pallas_kernels.tree_attention.mosaic.tree_attention_mgpu`` against the reference (ragged prefixes, a
non-resident page, one and several partitions), then times both kernels and paged decode over the same prefix
at the 27B head shapes (24 q / 4 KV heads x 256, 16-token pages) for each ``--cases`` entry ``B:N:P``.
Writes ``tree_attention_mgpu_<device>_<stamp>.json`` with figures ``<case>.{mgpu_us,triton_us,paged_decode_us,
speedup_vs_triton,mgpu_vs_paged_decode,triton_vs_paged_decode}`` (``mgpu_us.free`` etc.: the Mosaic kernel without
its ping-pong schedule), ``check.max_rel_err``; with fp8 pages (the pair kernels) ``<case>.{triton_fp8_us,
fp8_speedup,triton_fp8_keys_us,fp8_keys_speedup,paged_decode_fp8_us,paged_decode_fp8_speedup}`` (``fp8_keys``: the
pair kernel's opt-in e4m3 key products), ``<case>.{triton_fp8_products_us,fp8_products_speedup}``
(``pallas_kernels.tree_attention.fp8``: e4m3 products on both sides); and the Triton kernels re-timed with
``pallas_kernels.dot_acc`` lowered as a product into zeros plus an add (the form before it):
``<case>.<kernel>_unfolded_us`` and ``<case>.<kernel>_dot_acc_speedup`` (unfolded / folded time).

    python experiments/tree_attention_mgpu.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import kernels as kb
from dflash_jax.bench.results import script_command, write_result


def fp8_products(q, kp, vp, pt, start, kt, vt, anc, scale, *, interpret: bool):
    """``pallas_kernels.tree_attention.fp8`` on a quantized tree problem's arguments, the pair kernel's defaults."""
    from pallas_kernels import tree_attention as ta
    from pallas_kernels.tree_attention.fp8 import tree_attention_fp8

    cfg = ta.default_config(q.shape[-1], kp.shape[1], jnp.bfloat16, backend="cuda", quantized=True)
    return tree_attention_fp8(q, kp.data, vp.data, pt, start, kt, vt, anc, float(scale), kp.scale, vp.scale,
                              block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"], num_partitions=None,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                              target_programs=cfg["target_programs"], interpret=interpret)


def unfold_dot_acc() -> None:
    """Lower ``pallas_kernels.dot_acc`` from here on as Pallas' own dot does (a product into a zero tile, then an
    add), the form before it, and drop compiled kernels so the next calls lower again."""
    from jax._src.lib.mlir.dialects import arith
    from jax._src.pallas.triton import lowering as tl

    from pallas_kernels import dot_acc

    def rule(ctx, a, b, acc, **params):
        return arith.addf(acc, dot_acc._triton_rule(ctx, a, b, tl._zeros(acc.type), **params))

    tl.triton_lowering_rules[dot_acc.dot_acc_p] = rule
    jax.clear_caches()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=["16:16:2048", "16:16:8192", "16:16:16384", "16:32:2048",
                                                   "16:32:8192", "16:32:16384", "64:32:4096", "1:23:4096"])
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the fp8-page timings")
    ap.add_argument("--no-unfolded", dest="unfolded", action="store_false",
                    help="skip re-timing the Triton kernels with dot_acc as a product plus an add")
    ap.add_argument("--out-dir", default="experiments/results")
    a = ap.parse_args(argv)

    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    figures: dict[str, float] = {}
    errors: dict[str, str] = {}

    def timed(key: str, fn, prob) -> float:
        """Seconds a call (``figures[key]`` in us), or NaN with the error kept: one failing variant loses no other."""
        try:
            t = kb.time_call(fn, prob, a.repeats)
        except Exception as e:  # noqa: BLE001 - recorded and reported; the run goes on
            errors[key] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"ERROR {key}: {errors[key][:300]}", flush=True)
            return float("nan")
        figures[key] = t * 1e6
        return t

    def ratio(key: str, num: float, den: float) -> None:
        if np.isfinite(num) and np.isfinite(den) and den > 0:
            figures[key] = num / den

    try:
        try:
            run_checks(rng, figures, interpret)
        except Exception as e:  # noqa: BLE001 - recorded; the timings still run
            errors["checks"] = f"{type(e).__name__}: {str(e)[:1500]}"
            print(f"ERROR checks: {errors['checks'][:300]}", flush=True)
        run_cases(a, rng, figures, timed, ratio, interpret)
    finally:
        write_result("tree_attention_mgpu", figures, script_command(__file__, argv), {"errors": errors},
                     out_dir=a.out_dir)
    return 0


def run_checks(rng, figures, interpret) -> None:
    """The Mosaic GPU kernel (both schedules) against the reference: ragged prefixes, a non-resident page, one and
    several partitions (``check.max_rel_err``, ``check.ok``)."""
    from pallas_kernels import tree_attention as ta
    from pallas_kernels.tree_attention.mosaic import tree_attention_mgpu

    h, hkv, d, ps = 24, 4, 256, 16
    errs = []
    t0 = time.time()
    for i, (b, n, starts, nr, parts) in enumerate([(3, 17, [0, 17, 1024], [(2, 3)], None),
                                                   (2, 23, [4000, 333], [], 4), (1, 64, [96], [], 1)]):
        prob = kb.tree_problem(rng, jax.random.key(i), b, n, h, hkv, d, ps, starts, jnp.bfloat16,
                               non_resident=nr)
        ref = ta.tree_attention_reference(*prob.args).astype(jnp.float32)
        for pp in (True, False):
            out = tree_attention_mgpu(*prob.args, num_partitions=parts, pingpong=pp,
                                      interpret=interpret).astype(jnp.float32)
            err = float(jnp.abs(out - ref).max() / (jnp.abs(ref).max() + 1e-6))
            errs.append(err)
            print(f"check {i}: b={b} n={n} starts={starts} partitions={parts} pingpong={pp}: rel err {err:.2e}",
                  flush=True)
    figures["check.max_rel_err"] = max(errs)
    figures["check.ok"] = int(max(errs) < 2e-2)
    print(f"checks {time.time() - t0:.0f} s", flush=True)


def run_cases(a, rng, figures, timed, ratio, interpret) -> None:
    from pallas_kernels import paged_decode as pd
    from pallas_kernels import tree_attention as ta
    from pallas_kernels.tree_attention.mosaic import tree_attention_mgpu

    h, hkv, d, ps = 24, 4, 256, 16
    probs = {}
    for case in a.cases:
        b, n, p = (int(x) for x in case.split(":"))
        prob = kb.tree_problem(rng, jax.random.key(7), b, n, h, hkv, d, ps, [p] * b, jnp.bfloat16, n_sets=2)
        tag = f"b{b}.t{n}.p{p}"
        probs[tag] = prob
        tri = timed(f"{tag}.triton_us", ta.tree_attention_pallas, prob)
        dec = timed(f"{tag}.paged_decode_us", pd.paged_decode_pallas, kb.prefix_decode_problem(prob))
        ratio(f"{tag}.triton_vs_paged_decode", tri, dec)
        for st in a.stages:
            for pp in (True, False):
                fn = functools.partial(tree_attention_mgpu, stages=st, pingpong=pp, interpret=interpret)
                sfx = ("" if st == a.stages[0] else f".stages{st}") + ("" if pp else ".free")
                mg = timed(f"{tag}.mgpu_us{sfx}", fn, prob)
                ratio(f"{tag}.speedup_vs_triton{sfx}", tri, mg)
                ratio(f"{tag}.mgpu_vs_paged_decode{sfx}", mg, dec)
        print(f"{tag}: triton {tri * 1e6:.1f} us, mgpu {figures.get(f'{tag}.mgpu_us', np.nan):.1f} us (without the "
              f"ping-pong {figures.get(f'{tag}.mgpu_us.free', np.nan):.1f}), paged decode {dec * 1e6:.1f} us",
              flush=True)
        if a.fp8:  # the same prefix in fp8 pages (the pair kernels on CUDA)
            q8 = kb.quantized_problem(prob, "fp8")
            _, _, explicit = kb.implementations("tree_attention")
            rows = [("triton_fp8", ta.tree_attention_pallas, "fp8_speedup"),
                    ("triton_fp8_keys", functools.partial(explicit, fp8_keys=True), "fp8_keys_speedup"),
                    ("triton_fp8_products", functools.partial(fp8_products, interpret=interpret),
                     "fp8_products_speedup")]
            for name, fn, sp in rows:
                t = timed(f"{tag}.{name}_us", fn, q8)
                ratio(f"{tag}.{sp}", tri, t)
                print(f"{tag} fp8 pages, {name}: {t * 1e6:.1f} us ({tri / t:.2f}x bf16 pages)", flush=True)
            dec8 = timed(f"{tag}.paged_decode_fp8_us", pd.paged_decode_pallas, kb.prefix_decode_problem(q8))
            ratio(f"{tag}.paged_decode_fp8_speedup", dec, dec8)
            print(f"{tag} fp8 pages, paged decode: {dec8 * 1e6:.1f} us ({dec / dec8:.2f}x)", flush=True)

    if a.unfolded:  # the Triton kernels again with dot_acc lowered as a product into zeros plus an add
        unfold_dot_acc()
        for tag, prob in probs.items():
            rows = [("triton", ta.tree_attention_pallas, prob),
                    ("paged_decode", pd.paged_decode_pallas, kb.prefix_decode_problem(prob))]
            if a.fp8:
                q8 = kb.quantized_problem(prob, "fp8")
                rows += [("triton_fp8", ta.tree_attention_pallas, q8),
                         ("paged_decode_fp8", pd.paged_decode_pallas, kb.prefix_decode_problem(q8))]
            for name, fn, pr in rows:
                t = timed(f"{tag}.{name}_unfolded_us", fn, pr)
                ratio(f"{tag}.{name}_dot_acc_speedup", t * 1e6, figures.get(f"{tag}.{name}_us", np.nan))
                print(f"{tag} {name} without dot_acc: {t * 1e6:.1f} us (dot_acc "
                      f"{figures.get(f'{tag}.{name}_dot_acc_speedup', np.nan):.2f}x)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
