"""Needle-in-a-haystack prompts, and ``python -m dflash_jax.bench needle``: retrieval accuracy at a context length,
with and without PFlash prompt compression.

A prompt hides the line ``The secret key for <name> is <value>.`` at a relative depth in stdlib code lines and asks
for the key at the end (the same template the shipped set's training corpus uses, ``experiments/corpus.py``). The
bench fills the haystack with the model set's held-out standard-library files, renders the question as a ChatML user
turn (thinking off), decodes greedily and counts a hit when the answer appears in the reply. With ``--scorer`` each
prompt is also compressed by the dense scorer (``prefill.pflash.compress``, mode always) and answered again:
``needle.<ctx>.accuracy`` vs ``needle.<ctx>.pflash.accuracy``, with the kept fraction; and, as the baseline, chunks
chosen at random under the same rule (same head/tail/structure, same budget, no anchors):
``needle.<ctx>.random_chunks.accuracy``; and the scorer alone, without the anchor neighbourhoods
(``pflash_scores_only``), to tell their shares apart.
PFlash always keeps the chunks covering ``--head-tokens`` / ``--tail-tokens`` (defaults 256 / 768, sized for long
prompts): at a few thousand tokens they alone exceed a 5 % keep, so lower them there (``kept_fraction`` says what was
kept); ``.needle_kept`` = the share of compressed prompts that still hold the key.

With ``--kvflash-fraction F`` the same prompts are also answered under KVFlash bounded residency
(``--kvflash-scoring``): a fresh engine per context, one sequence at a time, a resident pool of ``F x context`` tokens
(whole pages), greedy as the unbounded arm: ``needle.<ctx>.kvflash.accuracy``, ``.pool_tokens``, pages out / in per
prompt, ``.needle_resident`` (share of answering steps at which the key's pages were resident), ``.same_reply``
(replies equal to the unbounded arm's) and ``.score_decisions`` (the engine's total over the context's prompts).
Every prompt whose history exceeds the pool must show pages moved (its residency telemetry,
``concurrency.prove_kvflash``), else the run fails and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any, Sequence

import numpy as np

#: Rough characters per token of stdlib code for a byte-level BPE (the filler estimate without a tokenizer).
CHARS_PER_TOKEN = 3.2

_ADJ = ("amber", "silent", "crimson", "rapid", "hollow", "golden", "frozen", "lucky", "brave", "misty", "quiet",
        "velvet", "cobalt", "ancient", "bright", "distant", "electric", "gentle", "hidden", "iron")
_NOUN = ("falcon", "harbor", "orchid", "lantern", "glacier", "meadow", "compass", "river", "summit", "cipher",
         "beacon", "canyon", "ember", "forest", "galaxy", "island", "jaguar", "kernel", "lotus", "nebula")
_VALUE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
_VALUE_DIGITS = "23456789"


def count_tokens(text: str, tokenizer: Any) -> int:
    """Tokens of ``text`` by ``tokenizer`` (anything whose ``encode`` gives ids or an ``Encoding``), else estimated."""
    if tokenizer is None:
        return int(round(len(text) / CHARS_PER_TOKEN))
    enc = tokenizer.encode(text)
    return len(enc.ids) if hasattr(enc, "ids") else len(enc)


def random_name(rng: random.Random) -> str:
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}-{rng.randint(10, 99)}"


def random_value(rng: random.Random) -> str:
    """``<digit><3 chars>-<4 chars>`` (e.g. ``4MZZ-F6GL``). The leading digit makes the value the same tokens in the
    haystack (after ``is``) as in the answer (after the assistant turn's newlines): a byte-level BPE word that starts
    with a letter takes the space before it (`` J`` + ``ES`` ... vs ``J`` + ``ES`` ...), so a value starting with a
    letter would have to be re-spelled, not copied."""
    return rng.choice(_VALUE_DIGITS) + "".join(rng.choice(_VALUE_ALPHABET) for _ in range(3)) + "-" + "".join(
        rng.choice(_VALUE_ALPHABET) for _ in range(4))


def filler_lines(rng: random.Random, texts: Sequence[tuple[str, str]], n_chars: int) -> list[str]:
    """Whole lines of random files ``[(name, text)]`` (random start line), about ``n_chars`` characters in all."""
    out: list[str] = []
    total = 0
    while total < n_chars:
        _, text = texts[rng.randrange(len(texts))]
        lines = text.split("\n")
        start = rng.randrange(max(1, len(lines) - 20))
        for ln in lines[start:start + rng.randint(20, 200)]:
            out.append(ln)
            total += len(ln) + 1
            if total >= n_chars:
                break
    return out


def needle_example(rng: random.Random, n_tokens_approx: int, tokenizer: Any = None, *,
                   filler: Sequence[tuple[str, str]], n_distractors: int = 0,
                   depth: float | None = None, return_meta: bool = False):
    """A needle-in-a-haystack prompt: ``(prompt_text, answer)`` (plus a meta dict with ``return_meta``).

    Lines of ``filler`` (``[(name, text)]``) surround the line ``The secret key for <name> is <value>.`` inserted at
    relative ``depth`` (random when None); the prompt ends with the question. ``n_distractors`` other keys
    (different names and values) are mixed in; ``meta["distractor_keys"]`` lists them as ``(name, value)``. The
    answer occurs exactly once in the prompt. Lengths are measured
    with ``tokenizer`` when given, else estimated, and the filler is cut to land at or under ``n_tokens_approx``.
    """
    texts = list(filler)
    if not texts:
        raise ValueError("needle_example needs non-empty filler texts")
    used: set[str] = set()

    def fresh(gen):
        while True:
            v = gen(rng)
            if v not in used:
                used.add(v)
                return v

    name, value = fresh(random_name), fresh(random_value)
    distractors = [(fresh(random_name), fresh(random_value)) for _ in range(n_distractors)]
    needle = f"The secret key for {name} is {value}."
    question = (f"\n\nQuestion: What is the secret key for {name}? "
                f"Answer with the key only.")
    intro = "Read the following text carefully. Somewhere in it a secret key is hidden.\n\n"
    overhead = count_tokens(intro + needle + question, tokenizer)
    budget = max(0, n_tokens_approx - overhead)
    pool = filler_lines(rng, texts, int(max(budget, 16) * CHARS_PER_TOKEN * 2.0) + 200)
    if depth is None:
        depth = rng.random()
    dpos = [rng.random() for _ in distractors]

    text = "\n".join(pool)
    cuts = [0] + [k for k in range(1, len(text)) if text[k].isspace() and not text[k - 1].isspace()] + [len(text)]

    def build(n_cut: int) -> str:
        body = text[:cuts[n_cut]].split("\n") if cuts[n_cut] else []
        inserts = sorted([(depth, needle)] + [(p, f"The secret key for {n} is {v}.")
                                              for p, (n, v) in zip(dpos, distractors)], key=lambda t: t[0])
        out = list(body)
        for p, line in reversed(inserts):
            out.insert(int(round(p * len(body))), line)
        return intro + "\n".join(out) + question

    lo, hi = 0, len(cuts) - 1
    while lo < hi:  # binary search on the filler prefix (cut at word ends) that keeps the prompt within budget
        mid = (lo + hi + 1) // 2
        if count_tokens(build(mid), tokenizer) <= n_tokens_approx:
            lo = mid
        else:
            hi = mid - 1
    prompt = build(lo)
    if prompt.count(value) != 1 or prompt.count(name) != 2:
        # a value/name collision with the filler is astronomically unlikely; resample deterministically if it happens
        return needle_example(rng, n_tokens_approx, tokenizer, filler=texts, n_distractors=n_distractors,
                              depth=depth, return_meta=return_meta)
    if return_meta:
        return prompt, value, {"name": name, "depth": depth, "n_tokens": count_tokens(prompt, tokenizer),
                               "distractors": len(distractors), "distractor_keys": distractors}
    return prompt, value


# ---- the bench --------------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint directory (with tokenizer.json)")
    p.add_argument("--scorer", help="dense PFlash scorer checkpoint: also answer from the compressed prompt")
    p.add_argument("--keep-ratio", type=float, default=0.05, help="PFlash keep ratio")
    p.add_argument("--head-tokens", type=int, default=None, help="PFlash always-kept head (default: PFlashOptions')")
    p.add_argument("--tail-tokens", type=int, default=None, help="PFlash always-kept tail (default: PFlashOptions')")
    p.add_argument("--kvflash-fraction", type=float, default=None, metavar="F",
                   help="also answer under KVFlash with a resident pool of F x context tokens (one sequence at a time)")
    p.add_argument("--kvflash-scoring", choices=("keys", "bounds", "shadow", "lru"), default="shadow", help="KVFlash page ranking")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--context", type=int, nargs="+", default=[8192], help="prompt lengths in tokens")
    p.add_argument("--n", type=int, default=20, help="prompts per context length (depths spread evenly)")
    p.add_argument("--files", nargs="+", help="filler text files (default: the model set's held-out stdlib files)")
    p.add_argument("--seed", type=int, default=0)


def bench_prompts(tok, files: Sequence[str], ctx: int, n: int, seed: int) -> list[tuple[list[int], str, float]]:
    """The bench's ``n`` prompts at ``ctx`` tokens: ``(ids, answer, depth)``, depths spread evenly, filler from
    ``files``, rendered as a ChatML user turn with thinking off (ready for greedy decoding)."""
    from dflash_jax.models.chat import render_chat

    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append((f, fh.read()))
    rng = random.Random(seed * 1_000_003 + ctx)
    overhead = len(tok.encode(render_chat([{"role": "user", "content": ""}], enable_thinking=False)))
    out = []
    for i in range(n):
        depth = (i + 0.5) / n
        prompt, ans = needle_example(rng, ctx - overhead, tok, filler=texts, depth=depth)
        ids = tok.encode(render_chat([{"role": "user", "content": prompt}], enable_thinking=False))
        out.append((ids, ans, depth))
    return out


def answer_span(tok: Any, ids: Sequence[int], answer: str) -> tuple[int, int]:
    """Token range ``[start, end)`` of ``ids`` whose text holds ``answer`` (its one occurrence in the prompt): the
    shortest prefix and then the shortest suffix of it that still decode to text containing ``answer``."""
    def search(ok, hi: int) -> int:  # smallest k in [0, hi] with ok(k) (ok monotone)
        lo = 0
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return lo

    end = search(lambda k: answer in tok.decode(list(ids[:k])), len(ids))
    start = end - search(lambda k: answer in tok.decode(list(ids[end - k:end])), end)
    return start, end


def generate_tracked(eng: Any, ids: Sequence[int], sp: Any, pages: set[int]) -> tuple[Any, float]:
    """Run one request on a KVFlash engine; returns its output and the share of its answering steps (from the one
    sampling the first token on, while it runs) at which every logical page in ``pages`` was resident."""
    rid = eng.submit(list(ids), sp)
    hits = []
    while True:
        outs = {o.request_id: o for o in eng.step()}
        o = outs.get(rid)
        if o is not None and o.finish_reason is not None:
            return o, float(np.mean(hits)) if hits else 0.0
        where = (eng.kvflash_residency() or {}).get(rid)
        if o is not None and o.token_ids and where is not None:
            hits.append(pages <= set(where["resident"]))
        if not eng.has_work():
            raise RuntimeError("engine went idle with the request unfinished")


#: Prefill chunk of the KVFlash arm's engine: a step's write pages must fit the pool (a 512-token chunk needs 33
#: pages of 16, more than a quarter of 2K), and a smaller chunk also bounds what each chunk's queries see.
KVFLASH_PREFILL_CHUNK = 64


def kvflash_arm(target: Any, tok: Any, cases: Sequence[tuple[list[int], str, float]], ctx: int, max_len: int,
                fraction: float, scoring: str, sp: Any,
                reference: Sequence[str | None]) -> tuple[dict[str, float], list[dict], list[str]]:
    """Answer ``cases`` under KVFlash: a fresh engine, one sequence at a time, a pool of ``fraction x ctx`` tokens.

    Returns ``(figures, per-prompt records, proof failures)``; ``reference`` = the unbounded arm's replies (for
    ``same_reply``). A failure names a prompt whose history exceeded the pool but whose pages never moved.
    """
    from dflash_jax.bench.concurrency import prove_kvflash
    from dflash_jax.engine.loop import Engine, EngineOptions

    page = EngineOptions.page_size
    pool = int(fraction * ctx) // page * page
    eng = Engine(target, tok, EngineOptions(max_batch=1, max_model_len=max_len, prefill_chunk=KVFLASH_PREFILL_CHUNK,
                                            prefill_batch=1, kvflash=pool, kvflash_scoring=scoring))
    t0 = time.perf_counter()
    outs, resident = [], []
    for ids, ans, _ in cases:
        a, b = answer_span(tok, ids, ans)
        o, frac = generate_tracked(eng, ids, sp, set(range(a // page, (b - 1) // page + 1)))
        outs.append(o)
        resident.append(frac)
    seconds = time.perf_counter() - t0
    pool = eng.kvflash_pool_tokens
    recs, failures = [], []
    for i, ((ids, ans, _), o, frac) in enumerate(zip(cases, outs, resident)):
        st = o.stats
        history = len(ids) + len(o.token_ids)
        why = prove_kvflash(st, history > pool)
        if why:
            failures.append(f"context {ctx} prompt {i}: {why}")
        recs.append({"kvflash_reply": o.text, "kvflash_hit": ans in (o.text or ""),
                     "kvflash_pages_out": st.get("kv_pages_out"), "kvflash_pages_in": st.get("kv_pages_in"),
                     "kvflash_resident_pages": st.get("kv_resident_pages"),
                     "kvflash_logical_pages": st.get("kv_logical_pages"), "kvflash_needle_resident": frac})
    rep = eng.kvflash_report()
    pre = f"needle.{ctx}.kvflash"
    figures = {
        f"{pre}.accuracy": float(np.mean([r["kvflash_hit"] for r in recs])),
        f"{pre}.pool_tokens": float(pool),
        f"{pre}.pool_fraction": pool / float(np.mean([len(c[0]) for c in cases])),
        f"{pre}.pages_out": float(np.mean([r["kvflash_pages_out"] for r in recs])),
        f"{pre}.pages_in": float(np.mean([r["kvflash_pages_in"] for r in recs])),
        f"{pre}.resident_fraction": float(np.mean([r["kvflash_resident_pages"] / r["kvflash_logical_pages"]
                                                   for r in recs])),
        f"{pre}.needle_resident": float(np.mean(resident)),
        f"{pre}.same_reply": float(np.mean([o.text == ref for o, ref in zip(outs, reference)])),
        f"{pre}.score_decisions": float(rep["score_decisions"]),
        f"{pre}.seconds": seconds,
    }
    return figures, recs, failures


def run(args: argparse.Namespace, command: str) -> int:
    from dflash_jax.bench import results
    from dflash_jax.bench.acceptance import held_out_files
    from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
    from dflash_jax.models.tokenizer import Tokenizer
    from dflash_jax.target import load_target

    target = load_target(args.model, dtype=args.dtype)
    tok = Tokenizer.from_dir(args.model)
    files = args.files or held_out_files(args.model)
    scorer = opts = None
    if args.scorer:
        from dflash_jax.prefill.pflash import DenseScorer, PFlashOptions

        scorer = DenseScorer.from_pretrained(args.scorer, dtype=args.dtype)
        opts = PFlashOptions(mode="always", keep_ratio=args.keep_ratio, min_tokens=1,
                             **{k: v for k, v in (("head_tokens", args.head_tokens), ("tail_tokens", args.tail_tokens))
                                if v is not None})
    max_len = -(-(max(args.context) + 64) // 256) * 256
    eng = Engine(target, tok, EngineOptions(max_batch=4, max_model_len=max_len, prefill_chunk=512, prefill_batch=1))
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    figures: dict[str, float] = {}
    per_prompt = []
    failures: list[str] = []
    for ctx in args.context:
        cases = bench_prompts(tok, files, ctx, args.n, args.seed)
        t0 = time.perf_counter()
        outs = eng.generate([ids for ids, _, _ in cases], sp)
        hits = [ans in (o.text or "") for (_, ans, _), o in zip(cases, outs)]
        figures[f"needle.{ctx}.accuracy"] = float(np.mean(hits))
        figures[f"needle.{ctx}.prompt_tokens"] = float(np.mean([len(c[0]) for c in cases]))
        figures[f"needle.{ctx}.seconds"] = time.perf_counter() - t0
        rec = [{"ctx": ctx, "depth": d, "answer": a, "reply": o.text, "hit": h}
               for (_, a, d), o, h in zip(cases, outs, hits)]
        if scorer is not None:
            from dflash_jax.prefill.pflash import compress, protected_mask

            rng = np.random.default_rng(args.seed)
            no_anchors = dataclasses.replace(opts, anchor_ngram=0)
            arms = (("pflash", scorer, opts),                     # what the server runs: scores + anchors
                    ("pflash_scores_only", scorer, no_anchors),   # the scorer's share of it
                    ("random_chunks", lambda x, _: rng.random(len(x)), no_anchors))  # the baseline
            for name, score_fn, o in arms:
                comp = [compress(np.asarray(ids), score_fn, o, must_keep=protected_mask(ids, tok))
                        for ids, _, _ in cases]
                outs_a = eng.generate([c.effective_ids.tolist() for c in comp], sp)
                hits_a = [ans in (x.text or "") for (_, ans, _), x in zip(cases, outs_a)]
                kept_a = [ans in tok.decode(c.effective_ids.tolist()) for c, (_, ans, _) in zip(comp, cases)]
                figures[f"needle.{ctx}.{name}.accuracy"] = float(np.mean(hits_a))
                figures[f"needle.{ctx}.{name}.kept_fraction"] = float(np.mean([c.ratio for c in comp]))
                figures[f"needle.{ctx}.{name}.needle_kept"] = float(np.mean(kept_a))
                if score_fn is scorer:
                    figures[f"needle.{ctx}.{name}.scoring_s"] = float(np.mean([c.scoring_s for c in comp]))
                for r, x, h, k in zip(rec, outs_a, hits_a, kept_a):
                    r.update({f"{name}_reply": x.text, f"{name}_hit": h, f"{name}_needle_kept": k})
        if args.kvflash_fraction is not None:
            kv_fig, kv_rec, kv_fail = kvflash_arm(target, tok, cases, ctx, max_len, args.kvflash_fraction,
                                                  args.kvflash_scoring, sp, [o.text for o in outs])
            figures.update(kv_fig)
            failures += kv_fail
            for r, kr in zip(rec, kv_rec):
                r.update(kr)
        per_prompt += rec
        print(f"context {ctx}: accuracy {figures[f'needle.{ctx}.accuracy']:.2f}" +
              (f", with PFlash {figures[f'needle.{ctx}.pflash.accuracy']:.2f}" if scorer is not None else "") +
              (f", KVFlash {figures[f'needle.{ctx}.kvflash.accuracy']:.2f}" if args.kvflash_fraction else ""),
              flush=True)
    results.print_table(figures)
    if failures:
        print("KVFlash not proved, no result written:\n  " + "\n  ".join(failures), flush=True)
        return 1
    if not args.no_write:
        extra = {"model": args.model, "scorer": args.scorer, "keep_ratio": args.keep_ratio if scorer else None,
                 "pflash_head_tokens": opts.head_tokens if opts else None,
                 "pflash_tail_tokens": opts.tail_tokens if opts else None,
                 "kvflash_fraction": args.kvflash_fraction, "kvflash_scoring": args.kvflash_scoring,
                 "kvflash_prefill_chunk": KVFLASH_PREFILL_CHUNK if args.kvflash_fraction is not None else None,
                 "filler_files": [f.rsplit("/", 1)[-1] for f in files], "prompts": per_prompt}
        print("wrote", results.write_result("needle", figures, command, extra, out_dir=args.out_dir))
    return 0
