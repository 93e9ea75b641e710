"""A CPU-sized proxy of the tiny target's retrieval training: does a small target of the shipped architecture learn
to answer the ``bench needle`` question, or at least to copy (``induction_acc``), within a few minutes?

The same code paths as ``train_tiny.py`` (``corpus.retrieval_documents`` / ``drill_documents``, ``pack_rows``,
``copy_rows``, ``init_target``, ``target_hidden``, ``run_phase``, ``assistant_mask``, ``make_retrieval_eval`` on
``retrieval_eval_rows``, ``make_induction_eval``), at a smaller width, rows of ``--seq-len`` tokens, retrieval-heavy
data and the shipped tokenizer (no BPE training). Held-out: the bench's own prompts at ``--ctx`` tokens (held-out
stdlib filler, teacher forced) and copying held-out copy rows. Results: ``experiments/results/retrieval_proxy_cpu.md``.

    PYTHONPATH=. python experiments/retrieval_proxy.py --values legacy --minutes 9     # the old value format
    PYTHONPATH=. python experiments/retrieval_proxy.py --p-drill 0.5 --copy-fraction 0.3 --answer-weight 4
    PYTHONPATH=. python experiments/retrieval_proxy.py --copy-only --copy-vocab 64 --seq-len 64 --batch 16 \
        --lr 1e-2 --steps 500 --minutes 0 [--layers 2 --interval 1] [--rotary 1.0]   # does copying form at all?
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.bench import needle  # noqa: E402
from experiments import corpus, tiny_configs as tc, train_tiny as tt  # noqa: E402


def bench_value_legacy(rng: random.Random) -> str:
    """The value format before ``needle.random_value`` started with a digit (first character any of 32)."""
    return "".join(rng.choice(needle._VALUE_ALPHABET) for _ in range(4)) + "-" + "".join(
        rng.choice(needle._VALUE_ALPHABET) for _ in range(4))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", choices=("bench", "legacy"), default="bench",
                    help="legacy: the old value generator (any first character; 74 %% of values tokenise "
                         "differently in the answer than in the haystack)")
    ap.add_argument("--tokenizer", default=os.path.join(_ROOT, "dflash_jax/assets/tiny/target"))
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=448, help="held-out bench prompt length")
    ap.add_argument("--n-docs", type=int, default=3000)
    ap.add_argument("--doc-tokens", default="96,440")
    ap.add_argument("--p-drill", type=float, default=0.0, help="fraction of documents that are recall drills")
    ap.add_argument("--drill-tokens", default="40,160", help="LO,HI filler tokens of a drill")
    ap.add_argument("--drill-keys", type=int, default=5, help="most keys (and questions) of a drill")
    ap.add_argument("--copy-fraction", type=float, default=0.0,
                    help="fraction of the rows that are synthetic copy rows (train_tiny.copy_rows)")
    ap.add_argument("--qk-norm-init", type=float, default=0.0,
                    help="initial (zero-centred) q/k RMSNorm weights of the attention layers")
    ap.add_argument("--copy-vocab", type=int, default=0,
                    help="copy rows draw from ids 16..16+N (0: the tokens needle values are made of)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--interval", type=int, default=4, help="every N-th layer is full attention, the rest GDN")
    ap.add_argument("--rotary", type=float, default=0.25, help="partial rotary factor")
    ap.add_argument("--head-dim", type=int, default=64, help="attention head size (the tiny target's: 64)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (KV heads: half)")
    ap.add_argument("--lin-heads", default="1,2", help="GDN K,V heads (the tiny target's: 2,6)")
    ap.add_argument("--lin-dim", type=int, default=32, help="GDN key = value head size (the tiny target's: 64)")
    ap.add_argument("--theta", type=float, default=1e7, help="RoPE theta")
    ap.add_argument("--out-scale", type=float, default=1.0, help="output projections x this at init")
    ap.add_argument("--copy-only", action="store_true", help="train on copy rows only (induction check)")
    ap.add_argument("--stream-files", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--answer-weight", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--n-eval", type=int, default=32)
    ap.add_argument("--work", default="/tmp/retrieval_proxy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-json", default="", help="also write the run (args, eval history, final) here")
    args = ap.parse_args(argv)

    from dflash_jax.models.tokenizer import Tokenizer
    if args.values == "legacy":
        needle.random_value = bench_value_legacy  # needle_example looks it up at call time
    tok = Tokenizer.from_dir(args.tokenizer)
    sp = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    t0 = time.time()
    train_files = corpus.load_stdlib("train")
    eval_files = [os.path.join(corpus.stdlib_dir(), r) for r, _ in corpus.load_stdlib("eval")]
    lo, hi = (int(x) for x in args.doc_tokens.split(","))
    n_drill = int(round(args.p_drill * args.n_docs))
    docs = corpus.retrieval_documents(f"{args.seed}-proxy", args.n_docs - n_drill, lo, hi, train_files)
    if n_drill:
        dlo, dhi = (int(x) for x in args.drill_tokens.split(","))
        docs += corpus.drill_documents(f"{args.seed}-drill", n_drill, dlo, dhi, train_files,
                                       keys=(2, args.drill_keys), questions=args.drill_keys)
    random.Random(args.seed).shuffle(docs)
    enc = lambda texts: [tok.encode(t) for t in texts]
    whole = enc(docs)
    stream = enc([corpus.stdlib_document(r, t) for r, t in train_files[:args.stream_files]])
    rows, stats = tt.pack_rows(stream, whole, sp["<|endoftext|>"], args.seq_len, args.seed)
    rows = rows[: stats["rows_with_whole_docs"]]
    weights = np.ones(rows.shape, np.float32)
    copy_ids = (tt.value_token_ids(tok._tok) if args.copy_vocab == 0 else np.arange(16, 16 + args.copy_vocab))
    if args.copy_fraction > 0:
        n_copy = int(round(args.copy_fraction * len(rows) / (1 - args.copy_fraction)))
        c_rows, c_w = tt.copy_rows(n_copy, args.seq_len, copy_ids, args.seed)
        rows, weights = np.concatenate([rows, c_rows]), np.concatenate([weights, c_w])
    if args.copy_only:  # the copy task alone: does the induction mechanism form at all?
        rows, weights = tt.copy_rows(4000, args.seq_len, copy_ids, args.seed)
    ind_rows, ind_w = tt.copy_rows(16, args.seq_len, copy_ids, args.seed + 1)
    ev_rows = ev_mask = np.zeros((0, args.seq_len))
    if not args.copy_only:
        ev_rows, ev_mask = tt.retrieval_eval_rows(tok, eval_files, args.ctx, args.n_eval, args.seed, args.seq_len)
    print(f"data {time.time() - t0:.1f}s: {stats}; eval {ev_rows.shape}", flush=True)

    h = args.hidden
    lin_k, lin_v = (int(x) for x in args.lin_heads.split(","))
    tcfg = tc.target_config({"hidden_size": h, "num_layers": args.layers, "full_attention_interval": args.interval,
                             "num_heads": args.heads, "num_kv_heads": args.heads // 2, "head_dim": args.head_dim,
                             "lin_num_k_heads": lin_k, "lin_num_v_heads": lin_v, "lin_k_dim": args.lin_dim,
                             "lin_v_dim": args.lin_dim, "intermediate_size": 2 * h,
                             "conv_kernel": 4, "rope_theta": args.theta, "partial_rotary_factor": args.rotary,
                             "max_position_embeddings": 4096},
                            tok.vocab_size, eos_token_id=sp["<|im_end|>"], pad_token_id=sp["<|endoftext|>"])
    params = tt.init_target(tcfg, jax.random.key(args.seed), qk_norm_init=args.qk_norm_init)
    if args.out_scale != 1.0:  # output projections (o / out / down) times this at init
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x * args.out_scale if jax.tree_util.keystr(path).rsplit("[", 1)[-1].strip("'[]") in
            ("o", "out", "down") else x, params)
    assistant = tuple(tok.encode("assistant"))

    def loss_fn(p, frozen, batch, key):
        tokens, w = batch
        hid, _ = tt.target_hidden(p, tcfg, tokens)
        if args.answer_weight != 1.0:
            w = w * (1.0 + (args.answer_weight - 1.0) * tt.assistant_mask(tokens, sp["<|im_start|>"], assistant,
                                                                          sp["<|im_end|>"]))
        return tt.weighted_next_token_ce(tt.qwen36.lm_logits(p, hid), tokens, w), {}

    hidden = lambda p, x: tt.target_hidden(p, tcfg, x)[0]
    n_eval, i_eval = tt.make_retrieval_eval(hidden, {args.ctx: (ev_rows, ev_mask)}, 8), tt.make_induction_eval(
        hidden, ind_rows, ind_w, 8)
    r_eval = i_eval if args.copy_only else (lambda p: n_eval(p) | i_eval(p))
    hp = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "warmup": 0.02, "wd": 0.1, "clip": 1.0,
          "minutes": args.minutes}
    res = tt.run_phase("proxy", params, None, loss_fn, tt.Batches(rows, args.batch, args.seed, weights), hp,
                       work=args.work, resume=False, seed=args.seed, log_every=50, ckpt_every=10 ** 9, eval_fn=r_eval,
                       eval_every=args.eval_every)
    final = r_eval(res.params)
    out = {"args": vars(args), "steps": res.steps, "final": final, "evals": res.history["eval"],
           "seconds": round(time.time() - t0, 1)}
    print(json.dumps({"final": final, "steps": res.steps, "seconds": out["seconds"]}), flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
