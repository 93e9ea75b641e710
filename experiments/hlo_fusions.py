"""What the top device ops of a profile are: each op's fused computation, from an XLA dump of the same run.

    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" python experiments/profile_steps.py ... --out-dir D
    python experiments/hlo_fusions.py /tmp/hlo D/profile_steps_<device>_<time>.json [--mode ddtree] [--top 40]

A profile names ops as the GPU runs them (``loop_convert_fusion_3``, ``gemm_fusion_dot_360``); this finds each
instruction in the optimised HLO module that holds most of them, and prints its share of the step, the opcodes of
its fused computation, and the JAX source lines they came from (``metadata``), so a glue kernel can be traced to the
line of model code that made it. Prints text; nothing is written.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+(?:\{[^}]*\})?)\s+([\w\-]+)\((.*)$")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
FRAME = re.compile(r"stack_frame_id=(\d+)")
OP_NAME = re.compile(r'op_name="([^"]+)"')
TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
FIELD = re.compile(r"(\w+)=(\d+)")
OURS = ("dflash_jax", "pallas_kernels")


def norm(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


class Module:
    """One optimised HLO text module: its instructions, computations and source-location tables."""

    def __init__(self, path: str):
        self.instrs, self.comps = {}, collections.defaultdict(list)
        tables = collections.defaultdict(dict)
        table = cur = None
        with open(path) as f:
            for line in f:
                stripped = line.strip()
                if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                    table = stripped
                    continue
                if table and TABLE_ROW.match(stripped):
                    i, rest = TABLE_ROW.match(stripped).groups()
                    tables[table][int(i)] = rest.strip('"') if table.endswith("Names") else dict(
                        (k, int(v)) for k, v in FIELD.findall(rest))
                    continue
                if not stripped:
                    table = None
                    continue
                if not line.startswith(" ") and stripped.endswith("{"):
                    words = stripped.split()
                    cur = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
                    continue
                m = INSTR.match(line)
                if m:
                    name, shape, opcode, _ = m.groups()
                    self.instrs[norm(name)] = (opcode, shape, line)
                    if cur is not None:
                        self.comps[cur].append(line)
        self.tables = tables

    def source(self, frame_id: int) -> str | None:
        """The innermost frame of the project's own code on a stack (``file.py:line function``)."""
        frames, locs = self.tables.get("StackFrames", {}), self.tables.get("FileLocations", {})
        files, funcs = self.tables.get("FileNames", {}), self.tables.get("FunctionNames", {})
        seen = set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            fr = frames[frame_id]
            loc = locs.get(fr.get("file_location_id"), {})
            fname = files.get(loc.get("file_name_id"), "")
            if any(o in fname for o in OURS):
                return f"{fname.split('/')[-2]}/{os.path.basename(fname)}:{loc.get('line')} " \
                       f"{funcs.get(loc.get('function_name_id'), '')}"
            frame_id = fr.get("parent_frame_id")
        return None

    def describe(self, line: str) -> list[str]:
        """The opcodes and source lines of a fusion's computation (or of the instruction itself)."""
        m = CALLS.search(line)
        body = self.comps.get(m.group(1), []) if m else [line]
        ops, sources = collections.Counter(), collections.Counter()
        for b in body:
            im = INSTR.match(b)
            if not im or im.group(3) in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                continue
            ops[im.group(3)] += 1
            fm, om = FRAME.search(b), OP_NAME.search(b)
            src = self.source(int(fm.group(1))) if fm else None
            if src or om:
                sources[f"{src or '?'} ({om.group(1).split('/')[-1] if om else ''})"] += 1
        out = ["    ops: " + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.most_common(12))]
        return out + [f"    from {s}" + (f" x{n}" if n > 1 else "") for s, n in sources.most_common(6)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump_dir")
    ap.add_argument("profile_json")
    ap.add_argument("--mode", default="ddtree")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    prof = json.load(open(args.profile_json))
    per_step = prof["figures"].get(f"{args.mode}.decode_steps") or prof["figures"].get(f"{args.mode}.spec_steps") or 1
    key = f"{args.mode}.top_device_ops"
    if key not in prof.get("extra", {}):
        raise SystemExit(f"{args.profile_json} has no {key!r}: run profile_steps.py with --modes {args.mode}, "
                         "on a GPU (a CPU trace holds no device ops)")
    ops = prof["extra"][key][:args.top]
    names = {norm(o["op"]) for o in ops}
    files = sorted(glob.glob(os.path.join(args.dump_dir, "*after_optimizations.txt")), key=os.path.getsize,
                   reverse=True)[:12]
    best = None
    for path in files:
        mod = Module(path)
        hits = len(names & set(mod.instrs))
        if best is None or hits > best[0]:
            best = (hits, path, mod)
    if best is None:
        raise SystemExit(f"no *after_optimizations.txt under {args.dump_dir}")
    hits, path, mod = best
    print(f"module {os.path.basename(path)}: {hits} of the top {len(ops)} ops")
    for o in ops:
        us = 1000 * o["ms"] / o["count"]
        print(f"{o['op']}: {us:.1f} us x {o['count'] / per_step:g} a step = {o['ms'] / per_step:.3f} ms")
        entry = mod.instrs.get(norm(o["op"]))
        if entry is None:
            print("    (not in the module: a custom call's kernel or another module)")
            continue
        opcode, shape, line = entry
        print(f"    {opcode} -> {shape[:80]}")
        print("\n".join(mod.describe(line)))


if __name__ == "__main__":
    main()
