"""What the attention kernels compile to on the current GPU: time, PTX instruction mix and ptxas resources.

For each case (paged decode, tree attention; bf16 pages and fp8 pages at the 27B's head shapes) the kernel is
timed as ``bench kernels`` times it, and the PTX that XLA produced for it (``--xla_dump_to``, set by this script
before JAX starts) is read back: per kernel entry the count of each instruction family that decides where such a
kernel loses bandwidth (asynchronous copies into shared memory, plain global / shared loads and stores, warp-level
``mma.sync`` against Hopper's ``wgmma``, fp8 conversions, barriers, local-memory traffic), and, when a ``ptxas`` is
installed beside jax (the CUDA wheels ship one), its register count and spill bytes. Figures
``<case>.kernel_us`` and ``<case>.<family>``; the kernels' PTX is packed into one ``kernel_ptx_<device>.tar.gz``.

    PYTHONPATH=. python experiments/kernel_ptx.py --out-dir experiments/results
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # triton_offline, a sibling script
DUMP = tempfile.mkdtemp(prefix="kernel_ptx_dump_")
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}").strip()

import numpy as np  # noqa: E402

# instruction family -> PTX mnemonic prefixes (counted at the start of a statement)
FAMILIES = {
    "cp_async": ("cp.async.ca", "cp.async.cg"),
    "cp_async_bulk": ("cp.async.bulk",),
    "ld_global": ("ld.global",),
    "ld_shared": ("ld.shared", "ldmatrix"),
    "st_shared": ("st.shared", "stmatrix"),
    "ld_local": ("ld.local",),
    "st_local": ("st.local",),
    "mma_sync": ("mma.sync",),
    "wgmma": ("wgmma.mma_async",),
    "cvt_fp8": ("cvt.rn.f16x2.e4m3x2", "cvt.rn.bf16x2.e4m3x2", "cvt.f16x2.e4m3x2"),
    "bar": ("bar.sync", "barrier.sync", "bar.arrive", "mbarrier"),
}
ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")


def ptx_entries(text: str) -> dict[str, str]:
    """PTX module text -> {entry name: its body} (from one ``.entry`` to the next)."""
    marks = [(m.start(), m.group(1)) for m in ENTRY.finditer(text)]
    return {name: text[s: marks[i + 1][0] if i + 1 < len(marks) else len(text)] for i, (s, name) in enumerate(marks)}


def instruction_mix(body: str) -> dict[str, int]:
    counts = collections.Counter()
    for line in body.splitlines():
        stmt = line.strip()
        if stmt.startswith("@"):  # predicated: "@%p1 ld.global..."
            stmt = stmt.split(None, 1)[-1] if " " in stmt else ""
        for fam, prefixes in FAMILIES.items():
            if stmt.startswith(prefixes):
                counts[fam] += 1
    return {f: counts.get(f, 0) for f in FAMILIES}


def find_ptxas() -> str | None:
    found = shutil.which("ptxas")
    if found:
        return found
    import site

    for root in site.getsitepackages():
        hits = glob.glob(os.path.join(root, "nvidia", "**", "bin", "ptxas"), recursive=True)
        if hits:
            return hits[0]
    return None


def ptxas_resources(ptxas: str, ptx_path: str, arch: str) -> dict[str, dict[str, int]]:
    """{entry: {registers, spill_stores, spill_loads}} from ``ptxas -v`` (empty if it fails)."""
    try:
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx_path, "-o", os.devnull], capture_output=True,
                             text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        print("ptxas failed:", e, file=sys.stderr)
        return {}
    from triton_offline import ptxas_report  # the same per-kernel reader as the offline tool

    text = out.stderr + out.stdout
    parts = re.split(r"Compiling entry function '(\w+)'", text)  # [head, name, body, name, body, ...]
    res = {name: ptxas_report(body) for name, body in zip(parts[1::2], parts[2::2])}
    if out.returncode and not res:
        print("ptxas:", out.stderr[-2000:], file=sys.stderr)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["paged_decode:16:0:16384", "tree_attention:16:16:16384"],
                   help="op:batch:tree:prefix (tree 0 for paged decode)")
    p.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", default="experiments/results")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    # an executable loaded from the persistent compilation cache is not compiled, so it dumps no PTX
    jax.config.update("jax_enable_compilation_cache", False)
    from dflash_jax.bench import kernels as bk
    from dflash_jax.bench import results

    arch = "sm_90a"
    kind = jax.devices()[0].device_kind
    figures: dict[str, float] = {}
    names: dict[str, str] = {}
    rng = np.random.default_rng(0)
    for case in a.cases:
        op, b, n, prefix = case.split(":")
        b, n, prefix = int(b), int(n), int(prefix)
        key = jax.random.PRNGKey(0)
        if op == "paged_decode":
            prob = bk.decode_problem(rng, key, b, 24, 4, 256, 16, [prefix] * b, jnp.bfloat16, n_sets=2)
            tag = f"paged_decode.b{b}.p{prefix}"
        else:
            prob = bk.tree_problem(rng, key, b, n, 24, 4, 256, 16, [prefix] * b, jnp.bfloat16, n_sets=2)
            tag = f"tree_attention.b{b}.t{n}.p{prefix}"
        pallas_fn = bk.implementations(op)[0]
        for kv in a.kv_dtypes:
            pr = prob if kv == "bf16" else bk.quantized_problem(prob, kv)
            t = bk.time_call(pallas_fn, pr, a.repeats)
            figures[f"{tag}.{kv}.kernel_us"] = t * 1e6
            figures[f"{tag}.{kv}.bytes_per_s"] = pr.nbytes / t
            names[f"{tag}.{kv}"] = op
            print(f"{tag} {kv}: {t * 1e6:.1f} us, {pr.nbytes / t / 1e12:.2f} TB/s", flush=True)
        if "bf16" in a.kv_dtypes and len(a.kv_dtypes) > 1:
            for kv in a.kv_dtypes[1:]:
                figures[f"{tag}.{kv}.speedup"] = figures[f"{tag}.bf16.kernel_us"] / figures[f"{tag}.{kv}.kernel_us"]

    ptxs = sorted(glob.glob(os.path.join(DUMP, "*.ptx")))
    ptxas = find_ptxas()
    print(f"{len(ptxs)} PTX files in the dump; ptxas: {ptxas}", flush=True)
    kept: dict[str, str] = {}
    for path in ptxs:
        text = open(path).read()
        ours = {e: body for e, body in ptx_entries(text).items()
                if e.startswith(("paged_decode", "tree_attention"))}
        if not ours:
            continue
        res = ptxas_resources(ptxas, path, arch) if ptxas else {}
        for entry, body in ours.items():
            if entry in kept:
                continue
            kept[entry] = path
            mix = instruction_mix(body)
            line = ", ".join(f"{k} {v}" for k, v in mix.items() if v)
            print(f"{entry}: {line}; ptxas {res.get(entry, {})}", flush=True)
            for k, v in {**mix, **res.get(entry, {})}.items():
                figures[f"ptx.{entry}.{k}"] = v
    os.makedirs(a.out_dir, exist_ok=True)
    tar = os.path.join(a.out_dir, f"kernel_ptx_{results.device_slug(kind)}.tar.gz")
    with tarfile.open(tar, "w:gz") as tf:
        for path in sorted(set(kept.values())):
            tf.add(path, arcname=os.path.basename(path))
    print("wrote", tar)
    command = "PYTHONPATH=. python experiments/kernel_ptx.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print("wrote", results.write_result("kernel_ptx", figures, command, {"ptx_files": sorted(set(kept.values()))},
                                        out_dir=a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
