"""Host cost of dispatching one engine step: its packed input buffer from the host vs already on the device, a
synchronous step (dispatch + fetch), and a trivial executable's call cost against its number of argument leaves.

    python experiments/dispatch_cost.py [--model DIR] [--dtype bfloat16] [--concurrency 8] [--iters 300]
                                        [--out-dir experiments/results]

A fresh engine (one batch bucket = the concurrency, AR) serves one batch of random prompts; the packed buffer of
its first decode step is kept, and the compiled decode executable is then called ``--iters`` times back to back
with (a) that buffer as a numpy array (one host-to-device copy a call), (b) the same buffer placed on the device
once, (c) the device buffer with the step's outputs fetched after every call. The engine's state and drafter
cache are donated and threaded through as the engine does. Figures ``cN.decode.{host,device}_buffer.dispatch_ms``
(time inside the call: what the host loop pays before it can do anything else), ``...wall_ms`` (per call, the
device finishing included), ``cN.decode.sync_ms``, and ``leavesL.call_ms`` for a trivial AOT-compiled add whose
argument is a list of L arrays (the per-leaf cost that a 27B model's ~1000 parameter leaves pay every step).
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
from dflash_jax.device_memory import set_memory_fraction  # noqa: E402
from dflash_jax.bench.concurrency import prompt_set  # noqa: E402
from dflash_jax.bench.sources import load_target_source  # noqa: E402
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dflash_jax", "assets", "tiny")


def time_calls(call, iters: int, warm: int = 5) -> tuple[float, float]:
    """(ms inside ``call()`` per call, wall ms per call with the device finishing) over ``iters`` calls."""
    for _ in range(warm):
        out = call()
    jax.block_until_ready(out)
    inside = 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        t1 = time.perf_counter()
        out = call()
        inside += time.perf_counter() - t1
    jax.block_until_ready(out)
    return 1e3 * inside / iters, 1e3 * (time.perf_counter() - t0) / iters


def leaf_call_ms(n: int, iters: int) -> float:
    """ms per call of an AOT-compiled ``xs[0] + y`` whose ``xs`` is a list of ``n`` small arrays."""
    xs = [jnp.ones((4,), jnp.float32) for _ in range(n)]
    y = jnp.ones((4,), jnp.float32)
    f = jax.jit(lambda xs, y: xs[0] + y).lower(xs, y).compile()
    return time_calls(lambda: f(xs, y), iters)[0]


def main(argv: list[str] | None = None) -> int:
    set_memory_fraction()  # as the benches: 0.9 of the accelerator (JAX alone takes 0.75: too little for the 27B)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(TINY, "target"))
    ap.add_argument("--random-weights", metavar="CONFIG", help="a target config given random weights (not --model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--leaves", type=int, nargs="+", default=[16, 128, 1024])
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args(argv)
    if min(args.concurrency, args.prompt_len, args.iters, *args.leaves) < 1:
        ap.error("--concurrency, --prompt-len, --iters and every --leaves must be >= 1")
    src = argparse.Namespace(model=None if args.random_weights else args.model, random_weights=args.random_weights,
                             dtype=args.dtype, tensor_parallel=1, data_parallel=1, quantization=None)
    target = load_target_source(src)
    c = args.concurrency
    prompts = prompt_set(c, args.prompt_len, args.prompt_len, target.config.vocab_size, seed=0)
    eng = Engine(target, None, EngineOptions(max_batch=c, max_model_len=args.prompt_len + 64,
                                             prefill_chunk=args.prompt_len, prefill_batch=min(4, c),
                                             batch_buckets=(c,), cohort_yield_min=0.0))
    eng.warmup()
    captured: dict = {}
    dispatch = eng._dispatch_packed

    def keep_first_decode(kind, b, rows, buf, start, step, take=None):
        if kind == "decode" and "buf" not in captured:
            captured["buf"] = np.array(buf)
        return dispatch(kind, b, rows, buf, start, step, take)

    eng._dispatch_packed = keep_first_decode
    eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    eng._dispatch_packed = dispatch
    if "buf" not in captured:
        raise RuntimeError("no decode step ran: raise --concurrency or the prompt length")
    fn = eng._exec[("decode", c)]
    host_buf = captured["buf"]
    dev_buf = jax.device_put(host_buf)

    def call(buf, fetch=False):
        eng.state, eng.dkv, out = fn(eng.target.params, eng.dparams, eng.state, eng.dkv, buf)
        if fetch:
            jax.device_get(out)
        return out

    figures: dict[str, float] = {}
    for name, buf in (("host_buffer", host_buf), ("device_buffer", dev_buf)):
        d, w = time_calls(lambda: call(buf), args.iters)
        figures[f"c{c}.decode.{name}.dispatch_ms"] = d
        figures[f"c{c}.decode.{name}.wall_ms"] = w
    figures[f"c{c}.decode.sync_ms"] = time_calls(lambda: call(dev_buf, fetch=True), args.iters)[1]
    figures["param_leaves"] = len(jax.tree.leaves(eng.target.params))
    for n in args.leaves:
        figures[f"leaves{n}.call_ms"] = leaf_call_ms(n, args.iters)
    results.print_table(figures)
    command = results.script_command(__file__, argv)
    extra = {"model": args.random_weights or args.model, "dtype": args.dtype, "buffer_words": int(host_buf.size)}
    print("wrote", results.write_result("dispatch_cost", figures, command, extra, out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
