"""What an attention kernel compiles to on Hopper, without a GPU: registers, spills, shared memory and the main loop's
SASS instruction mix of the Pallas (Triton lowering) kernels at the 27B's head shapes.

JAX lowers a ``pallas_call`` to a Triton IR module on any host once it is told which GPU to target (here an H100:
sm_90, the H200's architecture too); this lowers the kernel for an abstract H100 device, compiles
the module with the ``triton`` package (``pip install triton``: its compiler and bundled ``ptxas`` / ``nvdisasm``
need no GPU), and reads the machine code back. It measures nothing: it tells where a kernel spends instructions
(the loop over key blocks is the largest backward branch), which registers spill, and what a change would remove,
before a device call times it. Caveat: XLA compiles the module with its own pinned Triton, whose layouts and
pipelining can differ from the ``triton`` package's.

    PYTHONPATH=. python experiments/triton_offline.py --op paged_decode --kv fp8
    PYTHONPATH=. python experiments/triton_offline.py --op tree_attention --kv bf16 --set prefetch=False num_warps=16
    PYTHONPATH=. python experiments/triton_offline.py --op paged_decode_pairs --kv fp8 --set dots="'bfloat16'"
    PYTHONPATH=. python experiments/triton_offline.py --op tree_attention_pairs --kv fp8 --set num_warps=16

Figures (``--out-dir``): ``<op>.<kv>.registers``, ``.spill_stores``, ``.spill_loads``, ``.shared_bytes``,
``.loop_instructions`` and ``.loop.<SASS op>`` for the loop's 12 commonest ops.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

H, HKV, D, PAGE = 24, 4, 256, 16  # the 27B's attention heads and the engine's page size

SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
SASS_LABEL = re.compile(r"^\.(L_x_\d+):")
BRANCH_TARGET = re.compile(r"`\(\.(L_x_\d+)\)")


def sass_ops(text: str) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """nvdisasm text -> ([(opcode, instruction)], {label: index of the instruction it precedes})."""
    ins, labels = [], {}
    for line in text.splitlines():
        lab = SASS_LABEL.match(line.strip())
        if lab:
            labels[lab.group(1)] = len(ins)
            continue
        m = SASS_LINE.match(line)
        if m:
            txt = re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())  # drop a predicate guard
            ins.append((txt.split()[0].split(".")[0] if txt else "?", txt))
    return ins, labels


def main_loop_mix(text: str) -> tuple[int, collections.Counter, collections.Counter]:
    """(loop length, loop op counts, whole-kernel op counts): the loop is the longest backward branch's body."""
    ins, labels = sass_ops(text)
    best = (0, 0, -1)
    for i, (op, txt) in enumerate(ins):
        tgt = BRANCH_TARGET.search(txt) if op == "BRA" else None
        if tgt and tgt.group(1) in labels and labels[tgt.group(1)] <= i:
            best = max(best, (i - labels[tgt.group(1)] + 1, labels[tgt.group(1)], i))
    size, s, e = best
    loop = collections.Counter(op for op, _ in ins[s:e + 1]) if size else collections.Counter()
    return size, loop, collections.Counter(op for op, _ in ins)


def ptxas_report(text: str) -> dict[str, int]:
    """``ptxas -v`` output -> registers, spill stores / loads (bytes)."""
    out = {}
    m = re.search(r"Used (\d+) registers", text)
    if m:
        out["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        out["spill_stores"], out["spill_loads"] = int(m.group(1)), int(m.group(2))
    return out


# ------------------------------------------------------------------------------------------------ lowering

def lower_for_h100(fn, *args) -> tuple[str, dict]:
    """The Triton IR text of the (one) ``pallas_call`` in ``jax.jit(fn)(*args)`` (ShapeDtypeStructs), lowered for an
    abstract H100 (as ``tests/test_pallas_lowering.py`` lowers), and its launch parameters (num_warps,
    num_stages), taken from the Pallas Triton lowering as it builds the custom call."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg

    modules, params = [], {}
    to_ir, custom_call = reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call

    def capture_ir(*a, **k):
        res = to_ir(*a, **k)
        modules.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    def capture_params(*a, **k):
        for name in ("num_warps", "num_stages"):
            if name in k.get("backend_config", {}):
                params[name] = int(str(k["backend_config"][name]).split(":")[0])
        return custom_call(*a, **k)

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = capture_ir, capture_params
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = to_ir, custom_call
    if len(modules) != 1:
        raise RuntimeError(f"expected one pallas_call, lowered {len(modules)}")
    return modules[0], params


def case(op: str, kv: str, *, b: int, n: int, prefix: int, overrides: dict):
    """(fn, args) for ``op`` over pages of ``kv`` (bf16 / fp8 / int8) at B = ``b``, tree ``n``, ``prefix`` tokens."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.kv.quant import KV_DTYPES, QuantizedPages

    S = jax.ShapeDtypeStruct
    width = prefix // PAGE
    n_pages = b * width + 1
    quant = kv != "bf16"
    store = jnp.dtype(KV_DTYPES[kv])
    page_args = [S((n_pages, PAGE, HKV, D), store)] + ([S((n_pages, PAGE, HKV), jnp.float32)] if quant else [])
    per = len(page_args)

    def pages(a):
        return QuantizedPages(a[0], a[1], jnp.dtype(jnp.bfloat16)) if quant else a[0]

    tables = [S((b, width), jnp.int32), S((b,), jnp.int32)]
    if op == "gdn_tree":  # the verify pass's tree delta rule: --batch rows x --tree slots, the 27B's 48 value heads
        from pallas_kernels.gdn import gdn_tree

        cfg = {"block_v": 64, "num_warps": 8, "precision": "tf32x3", **overrides}
        h, dk, dv = 48, 128, 128
        return (lambda *a: gdn_tree(*a, **cfg)), (
            S((b, n, h, dk), jnp.float32), S((b, n, h, dk), jnp.float32), S((b, n, h, dv), jnp.float32),
            S((b, n, h), jnp.float32), S((b, n, h), jnp.float32), S((b, h, dk, dv), jnp.float32),
            S((b, n, n), jnp.bool_))
    if op == "gdn_tree_gated":  # the model's call: q / k / v and the gates formed from the post-conv rows (16 key
        # heads, 48 value heads x 128, the [q | k | v] channels), state read from the slot pool in place
        from pallas_kernels.gdn import gdn_tree_gated

        cfg = {"block_v": 64, "num_warps": 8, "precision": "tf32x3", **overrides}
        hk, h, dk, dv = 16, 48, 128, 128
        return (lambda *a: gdn_tree_gated(*a, n_k_heads=hk, **cfg)), (
            S((b, n, 2 * hk * dk + h * dv), jnp.bfloat16), S((b, n, h), jnp.float32), S((b, n, h), jnp.float32),
            S((h,), jnp.float32), S((h,), jnp.float32), S((b, n), jnp.bool_), S((b + 1, h, dk, dv), jnp.float32),
            S((b, n, n), jnp.bool_), S((b,), jnp.int32))
    if op == "key_round":  # --batch rows (a decode step's keys of one layer) x Hkv 4 x D 256, fp8 / int8 grid
        from pallas_kernels.key_round import key_round_pallas

        call = functools.partial(key_round_pallas, dtype=jnp.dtype(KV_DTYPES[kv]), interpret=False, **overrides)
        return call, (S((b, HKV, D), jnp.float32), S((HKV, D, D), jnp.float32))
    if op == "skinny_matmul":  # --batch rows of x, --tree / --prefix read as N / K (the MLP down: 5120 x 17408)
        from pallas_kernels.skinny_matmul import skinny_matmul_pallas

        wdt = jnp.dtype(jnp.float8_e4m3fn) if kv == "fp8" else jnp.dtype(jnp.bfloat16)
        call = functools.partial(skinny_matmul_pallas, interpret=False, **overrides)
        scale = [S((n,), jnp.float32)] if kv == "fp8" else []
        return (lambda x, w, *sc: call(x, w, *sc)), (S((b, prefix), jnp.bfloat16), S((n, prefix), wdt), *scale)
    if op == "tree_attention":
        from pallas_kernels.tree_attention import kernel as K

        cfg = {**K.default_config(D, PAGE, jnp.bfloat16, backend="cuda", quantized=quant), **overrides}
        cfg.pop("target_programs", None)

        def fn(q, *a):
            kt, vt, anc = a[2 * per + 2:]
            return K.tree_attention(q, pages(a[:per]), pages(a[per:2 * per]), *a[2 * per:2 * per + 2], kt, vt, anc,
                                    D ** -0.5, num_partitions=None, **cfg)

        return fn, (S((b, n, H, D), jnp.bfloat16), *page_args, *page_args, *tables,
                    S((b, n, HKV, D), jnp.bfloat16), S((b, n, HKV, D), jnp.bfloat16), S((b, n, n), jnp.bool_))
    if op == "tree_attention_fp8":
        if kv != "fp8":
            raise SystemExit("tree_attention_fp8 reads fp8 pages only (--kv fp8)")
        from pallas_kernels.tree_attention import fp8 as F
        from pallas_kernels.tree_attention import kernel as K

        cfg = {**K.default_config(D, PAGE, jnp.bfloat16, backend="cuda", quantized=True), **overrides}
        for k in ("target_programs", "prefetch"):
            cfg.pop(k, None)
        call = functools.partial(F.tree_attention_fp8, num_partitions=None, **cfg)

        def fn(q, kp, vp, pt, ln, kt, vt, anc, ks, vs):
            return call(q, kp, vp, pt, ln, kt, vt, anc, D ** -0.5, ks, vs)

        return fn, (S((b, n, H, D), jnp.bfloat16), page_args[0], page_args[0], *tables,
                    S((b, n, HKV, D), jnp.bfloat16), S((b, n, HKV, D), jnp.bfloat16), S((b, n, n), jnp.bool_),
                    page_args[1], page_args[1])
    if op == "tree_attention_pairs":
        if kv != "fp8":
            raise SystemExit("tree_attention_pairs reads fp8 pages only (--kv fp8)")
        from pallas_kernels.tree_attention import kernel as K
        from pallas_kernels.tree_attention import pairs as P

        cfg = {**K.default_config(D, PAGE, jnp.bfloat16, backend="cuda", quantized=True), **overrides}
        for k in ("target_programs", "prefetch"):
            cfg.pop(k, None)
        pairs = S((n_pages, PAGE, HKV, D // 2), jnp.uint16)
        call = functools.partial(P.tree_attention_pairs, num_partitions=None, **cfg)

        def fn(q, kp, vp, pt, ln, kt, vt, anc, ks, vs):
            return call(q, kp, vp, pt, ln, kt, vt, anc, D ** -0.5, ks, vs)

        keys = S((n_pages, PAGE, HKV, D), jnp.float8_e4m3fn) if cfg.get("fp8_keys") else pairs
        return fn, (S((b, n, H, D), jnp.bfloat16), keys, pairs, *tables, S((b, n, HKV, D), jnp.bfloat16),
                    S((b, n, HKV, D), jnp.bfloat16), S((b, n, n), jnp.bool_), page_args[1], page_args[1])
    if op == "paged_decode":
        from pallas_kernels.paged_decode import kernel as K

        cfg = {**K.default_config(D, PAGE, jnp.bfloat16, backend="cuda", quantized=quant), **overrides}
        cfg.pop("target_programs", None)
        call = functools.partial(K.paged_decode, num_partitions=None, **cfg)
    elif op == "paged_decode_pairs":
        if kv != "fp8":
            raise SystemExit("paged_decode_pairs reads fp8 pages only (--kv fp8)")
        from pallas_kernels.paged_decode import pairs as P

        pairs = S((n_pages, PAGE, HKV, D // 2), jnp.uint16)
        call = functools.partial(P.paged_decode_pairs, **overrides)
        return (lambda q, kp, vp, pt, ln, ks, vs: call(q, kp, vp, pt, ln, D ** -0.5, ks, vs)), (
            S((b, H, D), jnp.bfloat16), pairs, pairs, *tables, page_args[1], page_args[1])
    else:
        raise SystemExit(f"unknown --op {op}")
    return (lambda q, *a: call(q, pages(a[:per]), pages(a[per:2 * per]), *a[2 * per:], D ** -0.5)), (
        S((b, H, D), jnp.bfloat16), *page_args, *page_args, *tables)


# ------------------------------------------------------------------------------------------------ compile

def nvidia_tools() -> tuple[str | None, str | None]:
    """(ptxas, nvdisasm) that read the PTX the ``triton`` package writes (its bundled Blackwell ptxas is the newest)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next((p for p in (os.path.join(bin_dir, "ptxas-blackwell"), os.path.join(bin_dir, "ptxas"),
                              shutil.which("ptxas") or "") if p and os.path.exists(p)), None)
    nvdisasm = next((p for p in (os.path.join(bin_dir, "nvdisasm"), shutil.which("nvdisasm") or "")
                     if p and os.path.exists(p)), None)
    return ptxas, nvdisasm


def compile_module(ttir: str, params: dict, work: str) -> dict:
    """Compile Triton IR text for sm_90a; returns ptx / ttgir / sass text and the ptxas resources."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(work, "kernel.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": params.get("num_warps", 4), "num_stages": params.get("num_stages", 3)})
    out = {"ptx": k.asm["ptx"], "ttgir": k.asm["ttgir"], "shared_bytes": int(k.metadata.shared)}
    ptxas, nvdisasm = nvidia_tools()
    ptx_path, cubin = os.path.join(work, "kernel.ptx"), os.path.join(work, "kernel.cubin")
    with open(ptx_path, "w") as f:
        f.write(out["ptx"])
    if ptxas:
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
        out.update(ptxas_report(res.stdout + res.stderr))
        if nvdisasm and os.path.exists(cubin):
            out["sass"] = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="paged_decode",
                   help="paged_decode | tree_attention | paged_decode_pairs | tree_attention_pairs | tree_attention_fp8 (--kv fp8) | "
                        "skinny_matmul (weights: --kv bf16 / fp8, --batch rows, --tree N, --prefix K) | "
                        "key_round (--batch rows, --kv fp8 / int8) | "
                        "gdn_tree (--batch rows, --tree slots; the 27B's B1 launch: block_v 64, 8 warps, tf32x3) | "
                        "gdn_tree_gated (the same from the post-conv rows, as the model calls it)")
    p.add_argument("--kv", default="fp8", help="page format: bf16 | fp8 | int8")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tree", type=int, default=16)
    p.add_argument("--prefix", type=int, default=16384)
    p.add_argument("--set", nargs="*", default=[], help="launch overrides, e.g. prefetch=False num_warps=16")
    p.add_argument("--keep", help="write kernel.ttir / .ttgir / .ptx / .sass into this folder")
    p.add_argument("--out-dir", help="write a results JSON here")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    fn, args = case(a.op, a.kv, b=a.batch, n=a.tree, prefix=a.prefix, overrides=overrides)
    ttir, params = lower_for_h100(fn, *args)
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        print("lowered; compiling needs the triton package: pip install triton", file=sys.stderr)
        return 2
    work = a.keep or tempfile.mkdtemp(prefix="triton_offline_")
    os.makedirs(work, exist_ok=True)
    res = compile_module(ttir, params, work)
    for ext in ("ttgir", "sass"):
        if a.keep and ext in res:
            with open(os.path.join(work, f"kernel.{ext}"), "w") as f:
                f.write(res[ext])
    tag = f"{a.op}.{a.kv}"
    figures = {f"{tag}.{k}": float(res[k]) for k in ("registers", "spill_stores", "spill_loads", "shared_bytes")
               if k in res}
    print(f"{tag} {params} {overrides}: registers {res.get('registers')}, spills {res.get('spill_stores')} / "
          f"{res.get('spill_loads')} B, shared {res['shared_bytes']} B")
    if "sass" in res:
        size, loop, _ = main_loop_mix(res["sass"])
        figures[f"{tag}.loop_instructions"] = float(size)
        figures.update({f"{tag}.loop.{op}": float(c) for op, c in loop.most_common(12)})
        print(f"main loop {size} instructions: " + ", ".join(f"{op} {c}" for op, c in loop.most_common(16)))
    if a.out_dir:
        from dflash_jax.bench import results

        command = "PYTHONPATH=. python experiments/triton_offline.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        print("wrote", results.write_result("triton_offline", figures, command,
                                            {"target": "sm_90a", "launch": params, "overrides": overrides},
                                            out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
