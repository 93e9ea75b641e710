"""``python -m dflash_jax.bench spec``: the cost of a speculative round and forced-acceptance throughput.

1. Step overhead (``bN.step_overhead``): device time of one draft + DDTree + verify + commit round divided by one
   AR decode step, same batch B, same context, both the engine's compiled executables run back to back.
2. Oracle draft (``oracle_tau{T}.b1.*``, clearly forced acceptance): the target's own greedy continuation is
   recorded by AR decoding, then a B=1 speculative loop proposes it as the tree's chain, right up to a length drawn
   per round from the distribution of a chain whose positions are each right with the probability that makes the
   expected tokens per round T (``accepted_lengths``), then a wrong token. Verification, acceptance and commit are
   the real ones; the emitted tokens must equal the AR continuation (checked). With ``--random-weights`` the target
   is peaked by default (``bench/peaked.py``: a confident bigram target at an unchanged cost), so that the bf16
   verify pass and the AR decode step pick the same tokens and the run meets T; ``--no-peaked-random-weights``
   measures the plain random target. ``tok_s`` = tokens emitted / time of the timed rounds (at ``tau_measured``, a
   sample mean over the run's rounds); ``tok_s_at_tau`` = T / ``round_ms``: a round's cost does not depend on how
   much of it is accepted (fixed shapes), so this is the rate at exactly T. ``oracle_tau{T}.b1.*`` chains each round
   on the device from the previous one's outputs, as the engine does (``EngineOptions.overlap``);
   ``oracle_tau{T}.b1.sync.*`` waits for every round's tokens on the host before dispatching the next.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import results
from dflash_jax.bench.ar import device_step_ms
from dflash_jax.bench.peaked import add_peaked_argument, describe, peak_target, peaked_wanted
from dflash_jax.bench.sources import add_source_arguments, load_drafter_source, load_target_source, parallel_options
from dflash_jax.engine.compile import compile_count
from dflash_jax.engine.hostpack import Packing
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams, replica_buckets
from dflash_jax.engine.sampling import SamplingArrays
from dflash_jax.engine.spec_steps import SpecConfig, SpecInput, oracle_step
from dflash_jax.spec import draft_vocab


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="batch sizes timed; only these (and 1, for the oracle run) are compiled")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--chain-seed", action=argparse.BooleanOptionalAction, default=False,
                   help="trees around the drafter's top-1 chain (SpecConfig.chain_seed); default best-first")
    p.add_argument("--level-bonus", type=float, default=None, metavar="NATS",
                   help="nats added per DDTree level (SpecConfig.level_bonus); default: the drafter's calibrated one")
    draft_vocab.add_argument(p)
    draft_vocab.add_quantization_argument(p)
    p.add_argument("--max-verify-tokens", type=int, default=None,
                   help="cap on tree tokens verified per round over a bucket (lowers the budget at large batch)")
    p.add_argument("--context", type=int, default=4096, help="tokens in the cache when steps are timed")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--oracle-tau", type=float, default=6.5, help="0 skips the oracle-draft run")
    p.add_argument("--oracle-tokens", type=int, default=128)
    add_peaked_argument(p)


def chain_keep_prob(tau: float, depth: int) -> float:
    """q such that 1 + sum_{k=1..depth} q^k = tau (expected tokens per round of a chain whose positions are
    independently right with probability q; the bonus token counts)."""
    if not 1.0 <= tau <= depth + 1:
        raise ValueError(f"tau must be in [1, {depth + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        if 1 + sum(q ** k for k in range(1, depth + 1)) < tau:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


def accepted_lengths(tau: float, depth: int, seed: int = 0) -> Iterator[int]:
    """Per round, how many leading proposals are right (0..depth): distributed as in a chain whose positions are
    independently right with ``chain_keep_prob(tau, depth)`` (so 1 + the mean is ``tau``), drawn by inverse CDF at
    the golden-ratio sequence (offset by ``seed``) instead of at random, so that the mean over n rounds is within
    O(log n / n) of its expectation (random draws: ~0.75 tau / sqrt(n) at tau 6.5, 17 % over 128 tokens)."""
    q = chain_keep_prob(tau, depth)
    p = np.array([q ** k * (1 - q) for k in range(depth)] + [q ** depth])
    cdf = np.cumsum(p)
    u = np.random.default_rng(seed).random()
    while True:
        u = (u + 0.6180339887498949) % 1.0
        yield min(int(np.searchsorted(cdf, u, side="right")), depth)


def spec_step_ms(eng: Engine, b: int, context: int, iters: int, sync: bool = False) -> float:
    """Back-to-back speculative rounds of bucket ``b`` at ``context`` (device time per round); ``sync``: each round's
    outputs copied to the host before the next is dispatched, as the engine's loop does (dispatch and launch not
    hidden behind the previous round)."""
    w = eng.width
    inp = SpecInput(root=np.zeros(b, np.int32), start=np.full(b, context, np.int32),
                    slots=np.arange(1, b + 1, dtype=np.int32), active=np.ones(b, bool),
                    page_table=np.tile(np.arange(1, w + 1, dtype=np.int32), (b, 1)) % eng.pages.n_pages)
    samp = SamplingArrays.from_rows([], b)
    buf = eng.put(eng.pack("spec", b, inp, samp))  # device-resident: no host transfer in the timed loop
    fn = eng._exec[("spec", b)]
    args = lambda: (eng.target.params, eng.dparams, eng.state, eng.dkv, buf)
    eng.state, eng.dkv, out = fn(*args())
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        eng.state, eng.dkv, out = fn(*args())
        if sync:
            jax.device_get(out)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / iters


# engine -> (spec, (packing, executable)): one compiled oracle round per live engine, dropped with it
_ORACLE_EXECUTABLES: "weakref.WeakKeyDictionary[Engine, tuple]" = weakref.WeakKeyDictionary()


def oracle_executable(eng: Engine, spec: SpecConfig) -> tuple[Packing, Callable]:
    """The B=1 oracle round compiled ahead of time (once per engine), taking its host inputs ``(SpecInput,
    SamplingArrays, proposal [1, depth])`` as one packed buffer, as the engine's steps do: a host buffer and a
    device one (chained rounds) run the same executable."""
    cached = _ORACLE_EXECUTABLES.get(eng)
    if cached is not None and cached[0] == spec:
        return cached[1]
    i32 = lambda *sh: np.zeros(sh, np.int32)
    depth = eng.dcfg.block_size - 1
    packing = Packing.of((SpecInput(root=i32(1), start=i32(1), slots=i32(1), active=np.ones(1, bool),
                                    page_table=i32(1, eng.width)), SamplingArrays.from_rows([], 1), i32(1, depth)))
    body = functools.partial(oracle_step, eng.cfg, eng.dcfg, spec.for_batch(1))
    step = eng.compile_step(lambda p, dp, st, dkv, buf: body(p, dp, st, dkv, *packing.unpack(buf)), inputs=1)
    exe = step.lower(eng.target.params, eng.dparams, eng.state, eng.dkv,
                     jax.ShapeDtypeStruct((packing.size,), jnp.int32)).compile()
    _ORACLE_EXECUTABLES[eng] = (spec, (packing, exe))
    return packing, exe


def oracle_run(eng: Engine, spec: SpecConfig, prompt_len: int, n_tokens: int, tau: float, seed: int = 0,
               max_resyncs: int = 32, overlap: bool = True) -> dict:
    """B=1 loop with proposals from the recorded greedy continuation, corrupted to expected ``tau`` (per round,
    ``accepted_lengths`` right proposals, then random tokens, the first of them wrong).

    The continuation is recorded by AR decoding. In low precision the tree-verify pass and the AR decode step can
    pick different argmaxes where the top logits nearly tie (random weights make that common); the speculative
    output is then still the target's own choice, but the recorded continuation no longer predicts it. So on the
    first difference the run re-records the continuation from the tokens emitted so far and goes on (``resyncs``),
    and only the rounds themselves are timed. Every resync ends a round's acceptance early, so with many of them the
    measured tau falls well short of ``tau``: peaked random weights (``bench/peaked.py``) remove them. In float32
    any difference is an error.

    ``overlap`` (as the engine runs by default): each round is dispatched before the previous round's tokens reach
    the host, its root, position and proposals computed on the device from that round's outputs (the proposals
    from the recorded continuation held on the device); otherwise every round waits for its outputs on the host.
    """
    cfg, dcfg = eng.cfg, eng.dcfg
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    depth = dcfg.block_size - 1
    lengths = accepted_lengths(tau, min(depth, spec.budget_for(1)), seed)  # the tree's chain holds at most `budget` nodes
    samp = SamplingArrays.from_rows([], 1)
    i32 = lambda *sh: np.zeros(sh, np.int32)
    packing, step = oracle_executable(eng, spec)
    exact = eng.target.params["embed"].dtype == np.float32
    slack = 3 * dcfg.block_size  # an overlapped round may run past the last one needed

    @jax.jit
    def chain(bonus, n_acc, start, truth, k, tail, ctx_len, fixed):
        """The next round's packed inputs (root, start and proposals ``[1, depth]`` from this round's outputs, slots
        and page table from ``fixed``) and its start, on the device."""
        nxt = start + n_acc
        j = jnp.arange(depth)
        t = truth[jnp.clip(nxt[0] - ctx_len + 1 + j, 0, truth.shape[0] - 1)]
        prop = jnp.where(j < k, t, tail)
        prop = jnp.where((j == k) & (prop == t), (prop + 1) % cfg.vocab_size, prop)
        inp, smp, _ = packing.unpack(fixed)
        inp = dataclasses.replace(inp, root=bonus, start=nxt)
        return packing.pack_jnp((inp, smp, prop[None].astype(jnp.int32))), nxt

    def draw() -> tuple[int, np.ndarray]:
        return next(lengths), rng.integers(0, cfg.vocab_size, depth, dtype=np.int32)

    history: list[int] = []  # tokens emitted after the prompt
    rounds, emitted, t_total, resyncs, compiled = 0, 0, 0.0, -1, False
    phase = {"chain": 0.0, "dispatch": 0.0, "fetch": 0.0}  # host seconds inside the timed rounds, by call
    timing = False

    def timed(name: str, f, *a):
        t = time.perf_counter()
        r = f(*a)
        if timing:
            phase[name] += time.perf_counter() - t
        return r
    compiles0 = None
    while len(history) < n_tokens:
        resyncs += 1
        if resyncs > max_resyncs:
            raise RuntimeError(f"oracle run: more than {max_resyncs} resyncs of the recorded continuation")
        ctx = prompt + history
        left = n_tokens - len(history)
        # min_tokens keeps the request on the AR decode path (the engine otherwise decodes it speculatively); with
        # ignore_eos and no stop ids it bans nothing
        rec = eng.generate([ctx], SamplingParams(max_tokens=left + slack, ignore_eos=True, min_tokens=1))[0]
        if rec.stats["spec_mode"] != "ar" or rec.stats["draft_steps"]:
            raise RuntimeError(f"oracle run: the continuation was not recorded by AR decoding ({rec.stats})")
        truth = rec.token_ids
        # prefill through the engine, then drive rounds by hand on that request's slot and pages
        rid = eng.submit(ctx, SamplingParams(max_tokens=left + slack + 1, ignore_eos=True))
        while not eng.running.get(rid) or not eng.running[rid].tokens:
            eng.step()
        r = eng.running[rid]
        seg = list(r.tokens)
        start = r.n_cached
        eng.pages.grow(rid, len(ctx) + left + slack)
        table = eng.pages.page_tables([rid], eng.width)
        slots, active = np.array([r.slot], np.int32), np.ones(1, bool)
        truth_dev = jnp.asarray(np.pad(np.asarray(truth, np.int32), (0, n_tokens + 2 * slack - len(truth))))
        fixed = jnp.asarray(packing.pack((SpecInput(root=i32(1), start=i32(1), slots=slots, active=active,
                                                    page_table=table), samp, i32(1, depth))))

        def dispatch(inp, prop):
            buf = inp if prop is None else packing.pack((inp, samp, prop))  # chained rounds come packed

            def call():
                eng.state, eng.dkv, o = step(eng.target.params, eng.dparams, eng.state, eng.dkv, buf)
                return o
            return timed("dispatch", call)

        def apply(o) -> int:
            o = timed("fetch", jax.device_get, o)
            n = int(o.n_accepted[0])
            seg.extend([int(t) for t in o.accepted[0, 1:n]] + [int(o.bonus[0])])
            return n

        def on_track() -> bool:
            return len(seg) < left and seg == truth[:len(seg)]

        def first_chained():
            """A zero-advance chain from the host state: the round's root, start and proposals as device arrays,
            exactly as every chained round passes them (a jit called with other argument kinds compiles again)."""
            buf, st = chain(jnp.asarray([seg[-1]], jnp.int32), jnp.zeros(1, jnp.int32),
                            jnp.asarray([start], jnp.int32), truth_dev, *draw(), len(ctx), fixed)
            return dispatch(buf, None), st

        if not compiled:  # the first round warms the rounds (and compiles the chain): not timed, still applied
            if overlap:
                o, st = first_chained()
                # compile the chain on device arrays without drawing (the rounds' draws stay those of the sync loop)
                jax.block_until_ready(chain(o.bonus, o.n_accepted, st, truth_dev, 0, np.zeros(depth, np.int32),
                                            len(ctx), fixed))
            else:
                k, tail = draw()
                prop = tail[None].copy()
                prop[0, :k] = truth[len(seg):len(seg) + k]
                if k < depth and prop[0, k] == truth[len(seg) + k]:
                    prop[0, k] = (prop[0, k] + 1) % cfg.vocab_size
                o = dispatch(SpecInput(root=np.array([seg[-1]], np.int32), start=np.array([start], np.int32),
                                       slots=slots, active=active, page_table=table), prop)
            start += apply(o)
            compiled = True
        if compiles0 is None:
            compiles0, timing = compile_count(), True
        if overlap and on_track():
            t0 = time.perf_counter()
            pending = first_chained()
            while pending is not None:
                o, st = pending
                pending = None
                if on_track():  # the next round may be needed: dispatch it before reading this one
                    buf, st2 = timed("chain", chain, o.bonus, o.n_accepted, st, truth_dev, *draw(), len(ctx), fixed)
                    pending = (dispatch(buf, None), st2)
                n = apply(o)
                rounds += 1
                emitted += n
                start += n
                if not on_track() and pending is not None:  # done or off track: the round in flight still counts
                    n = apply(pending[0])
                    rounds += 1
                    emitted += n
                    start += n
                    pending = None
            t_total += time.perf_counter() - t0
        while on_track():
            pos = len(seg)  # proposals for depths 1..L: the continuation after the root
            k, tail = draw()
            prop = tail[None].copy()
            prop[0, :k] = truth[pos:pos + k]
            if k < depth and prop[0, k] == truth[pos + k]:
                prop[0, k] = (prop[0, k] + 1) % cfg.vocab_size
            inp = SpecInput(root=np.array([seg[-1]], np.int32), start=np.array([start], np.int32), slots=slots,
                            active=active, page_table=table)
            t0 = time.perf_counter()
            n = apply(dispatch(inp, prop))
            t_total += time.perf_counter() - t0
            start += n
            rounds += 1
            emitted += n
        eng.abort(rid)
        if seg[:left] != truth[:min(len(seg), left)] and exact:
            raise RuntimeError("oracle speculative output differs from AR greedy in float32: losslessness broken")
        history += seg
    return {"tok_s": emitted / t_total, "tau_measured": emitted / rounds, "round_ms": 1e3 * t_total / rounds,
            "rounds": rounds, "resyncs": resyncs, "compiles": compile_count() - compiles0,
            **{f"{k}_ms": 1e3 * v / rounds for k, v in phase.items()}}


def run(args: argparse.Namespace, command: str) -> int:
    if args.data_parallel != 1:
        raise SystemExit("bench spec drives single rounds by hand on one replica: use --data-parallel 1 "
                         "(--tensor-parallel works)")
    peaked = peaked_wanted(args)
    target = load_target_source(args)
    if peaked:
        target, _ = peak_target(target)
    dcfg, dparams = load_drafter_source(args)
    jax.block_until_ready((target.params, dparams))
    spec = SpecConfig(budget=args.budget, max_verify_tokens=args.max_verify_tokens, chain_seed=args.chain_seed,
                      level_bonus=args.level_bonus, draft_vocab=args.draft_vocab,
                      draft_quantization=args.draft_quantization)
    max_len = args.context + args.oracle_tokens + 4 * dcfg.block_size + 8  # oracle_run: 3 blocks of slack
    eng = Engine(target, None, EngineOptions(max_batch=max(args.batch), page_size=args.page_size, max_model_len=max_len,
                                             prefill_chunk=args.prefill_chunk, prefill_batch=1, spec=spec,
                                             cohort_yield_min=0.0, batch_buckets=replica_buckets({1, *args.batch}),
                                             **parallel_options(args)),
                 drafter=(dcfg, dparams))
    t0 = time.perf_counter()
    eng.warmup(lambda name, dt: print(f"  compiled {name} in {dt:.1f}s", flush=True))
    figures: dict[str, float] = {"startup_compile_s": time.perf_counter() - t0, "budget": args.budget,
                                 "block_size": dcfg.block_size}
    for b in args.batch:
        ar_ms = device_step_ms(eng, b, args.context, args.iters)
        sp_ms = spec_step_ms(eng, b, args.context, args.iters)
        sync_ms = spec_step_ms(eng, b, args.context, args.iters, sync=True)
        figures.update({f"b{b}.ar_step_ms": ar_ms, f"b{b}.spec_step_ms": sp_ms, f"b{b}.step_overhead": sp_ms / ar_ms,
                        f"b{b}.spec_round_sync_ms": sync_ms, f"b{b}.budget": spec.budget_for(b)})
        print(f"b{b}: AR {ar_ms:.2f} ms, DDTree round {sp_ms:.2f} ms (budget {spec.budget_for(b)}), overhead "
              f"{sp_ms / ar_ms:.3f}; one round with its outputs on the host {sync_ms:.2f} ms", flush=True)
    if args.oracle_tau > 0:
        key = f"oracle_tau{args.oracle_tau:g}.b1"
        for overlap in (True, False):  # rounds chained on the device (the engine's default), then synchronous
            m = oracle_run(eng, spec, args.context, args.oracle_tokens, args.oracle_tau, overlap=overlap)
            k = key if overlap else f"{key}.sync"
            figures.update({f"{k}.tok_s": m["tok_s"], f"{k}.tok_s_at_tau": 1e3 * args.oracle_tau / m["round_ms"],
                            f"{k}.tau_measured": m["tau_measured"],
                            f"{k}.round_ms": m["round_ms"], f"{k}.resyncs": m["resyncs"],
                            f"{k}.compiles": m["compiles"], f"{k}.dispatch_ms": m["dispatch_ms"],
                            f"{k}.fetch_ms": m["fetch_ms"], **({f"{k}.chain_ms": m["chain_ms"]} if overlap else {})})
            print(f"oracle draft (forced acceptance, tau {args.oracle_tau}{', peaked random weights' if peaked else ''}"
                  f", {'overlapped' if overlap else 'synchronous'} rounds): {m['tok_s']:.1f} tok/s, measured tau "
                  f"{m['tau_measured']:.2f}, {m['round_ms']:.2f} ms a round, {m['resyncs']} resyncs", flush=True)
    results.print_table(figures)
    if not args.no_write:
        extra = {"target": args.model or args.random_weights, "drafter": args.drafter or args.random_drafter,
                 "weights": "checkpoint" if args.model else "peaked random" if peaked else "random",
                 "peaked_random_weights": peaked, "peaked_random_weights_detail": describe() if peaked else None,
                 "dtype": args.dtype, "context": args.context, "draft_vocab": args.draft_vocab,
                 "draft_quantization": args.draft_quantization,
                 "tree": "chain-seeded" if args.chain_seed else "best-first (the oracle's rounds: chain-seeded)",
                 "oracle": "forced acceptance: proposals are the target's own greedy continuation, right up to a "
                           "length drawn per round (golden-ratio inverse CDF) from the chain distribution of the "
                           "requested expected tokens per round, then wrong"}
        print("wrote", results.write_result("spec", figures, command, extra, out_dir=args.out_dir))
    return 0
