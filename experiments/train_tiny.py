"""Train the shipped tiny model set (hybrid target, DFlash drafter, dense PFlash scorer) in one fixed-seed command.

    python experiments/train_tiny.py --out dflash_jax/assets/tiny                  # the real run (H200, preset tiny)
    python experiments/train_tiny.py --out /tmp/tiny --smoke                       # CPU, about a minute
    python experiments/train_tiny.py --out OUT --resume                            # continue from the checkpoints
    python experiments/train_tiny.py --out OUT --max-minutes 9 [--resume]          # stop in time (exit 3), resume
    python experiments/train_tiny.py --out OUT --init-target T --init-drafter D     # continue a shipped drafter
    python experiments/train_tiny.py --out OUT --init-target T --extend-target ...  # the long phase on T

Fixed seeds everywhere (init, batch order, anchors, corpus, eval anchors); on GPU ``--xla_gpu_deterministic_ops`` is
set unless ``--no-deterministic``, and a resumed run gives the same weights as an uninterrupted one.

Phases (each checkpointed with orbax every ``ckpt_every`` steps under ``--work-dir``; ``--resume`` continues the
latest checkpoint of a phase, a finished phase is not re-run):

1. data: ``experiments/corpus.py`` (stdlib sources split by the fixed sha1 rule, chat, retrieval documents) and
   the BPE of ``experiments/train_tokenizer.py`` trained on the corpus' train split; documents are tokenised, joined
   with ``<|endoftext|>`` and packed into ``seq_len`` rows (``pack_rows``: every retrieval document whole inside
   one row, the stdlib + chat stream around it and in the plain rows), long retrieval documents into rows of the
   long phase's length; eval rows per kind (stdlib / chat / needle) and the ``bench needle`` prompts with their
   answers at ``data.retrieval_eval`` lengths. Cached in the work dir, keyed by the data settings.
2. target: the real Qwen3.5/3.6 hybrid (``qwen36.forward`` with a fresh paged state per batch, so training runs the
   same code that serves) trained with next-token CE, AdamW + warmup + cosine + global-norm clipping; fp32 master
   weights, matrices cast to ``--compute-dtype`` (bf16 on GPU by default) inside the step. First ``target_copy``
   (when configured): short synthetic copy rows alone, where the induction mechanism forms; then text, where
   ``copy_fraction`` of its
   rows are synthetic copy rows (``copy_rows`` over the needle values' token ids, loss only on the repeated half:
   a dense signal for the copy mechanism retrieval needs); then ``target_long``
   continues it on the long rows (8448 tokens in ``tiny``: the 8K bench prompt and its answer fit a row), with
   the phase's ``rope_scaling`` (YaRN x4 over the 2048 positions the earlier phases saw, in ``tiny``) from its
   first step on: the context extension, which the exported config.json carries. ``--init-target DIR
   --extend-target`` runs this phase on a loaded target (before or after an earlier extension).
   Held-out perplexity, and held-out needle accuracy (``make_retrieval_eval``: the bench's prompts, teacher forced)
   with ``induction_acc`` (``make_induction_eval``: copying held-out copy rows) after each of the two.
3. drafter: DFlash objective (§3.3) on the frozen target's features of the default ``target_layer_ids``: random
   anchors, blocks of ``block_size``, decayed CE (gamma 7); labels are the target's teacher-forced argmax
   (``--drafter-labels target``, default) or the text (``data``). Held-out chain acceptance length tau: the
   drafter's argmax block at fixed anchors against the target's exact greedy continuation from the anchor.
   ``--init-drafter DIR`` (with ``--init-target``) starts from an exported drafter instead of a fresh init (its
   config must be the preset's): the phase continues it, with its own batch order and anchors
   (``CONTINUE_SEED_OFFSET``; ``--drafter-seed N`` for a drafter continued before), under the schedule of
   ``train.drafter``.
4. scorer: a tiny plain Qwen3 dense LM (``tiny_configs.dense_*``) with the same recipe as the target.
5. export (HF layout) to ``--out/{target,drafter,scorer}`` + ``train_report.json`` (+ ``loss_curves.png`` when
   matplotlib is installed); a target over ``--max-file-bytes`` (15 MiB) is written as index + shards, and any
   other file over it is an error; the exported target is reloaded with ``dflash_jax.load_target`` and checked
   against the trained parameters.

Python API: ``main(argv) -> report dict``; ``save_target(path, cfg, params, dtype=None)``; ``target_hidden``;
``init_target``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from typing import Any, Callable, Sequence

_T_START = time.time()  # before importing JAX: --time-budget counts the whole process
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see dflash_jax/__init__.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dflash_jax.bench import acceptance  # noqa: E402
from dflash_jax.config import FULL, DrafterConfig, TargetConfig  # noqa: E402
from dflash_jax.engine.compile import enable_compile_cache  # noqa: E402
from dflash_jax.engine.spec_steps import features  # noqa: E402
from dflash_jax.models import dense  # noqa: E402
from dflash_jax.models import dflash, loader, qwen36  # noqa: E402
from dflash_jax.models.dflash_loader import load_drafter, save_drafter  # noqa: E402
from dflash_jax.state import KVPages, RecurrentSlots, StepInput  # noqa: E402
from experiments import tiny_configs as tc  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
F32 = jnp.float32


def log(msg: str) -> None:
    print(msg, flush=True)


# =====================================================================================================================
# data
# =====================================================================================================================

@dataclasses.dataclass
class Data:
    tokenizer_dir: str
    vocab_size: int
    special_ids: dict[str, int]
    train: np.ndarray                 # [N, T]
    eval: dict[str, np.ndarray]       # kind -> [M, T]
    meta: dict[str, Any]
    train_long: np.ndarray | None = None                                     # [N2, T2] (the long phase's rows)
    retrieval_eval: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    # context length -> (tokens [M, L], answer mask [M, L]): held-out ``bench needle`` prompts with their answers


def _pack(docs: list[list[int]], sep: int, seq_len: int) -> np.ndarray:
    flat = np.fromiter((t for d in docs for t in (*d, sep)), dtype=np.int32)
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


def pack_rows(stream: list[list[int]], whole: list[list[int]], sep: int, seq_len: int, seed: int
              ) -> tuple[np.ndarray, dict[str, int]]:
    """Rows of ``seq_len`` tokens in which every document of ``whole`` (each followed by ``sep``) lies entire inside
    one row, at a random offset, the rest of the row filled with the next tokens of the ``stream`` documents
    (joined with ``sep``, cut anywhere); then the rest of the stream in plain rows. A retrieval document cut at a
    row boundary would ask for a key the row does not hold and teach guessing. Documents of ``whole`` longer
    than a row are dropped (counted). Returns (rows [N, seq_len] int32, counts)."""
    rng = np.random.default_rng([seed, 11])
    flat = np.fromiter((t for d in stream for t in (*d, sep)), dtype=np.int32)
    rows: list[np.ndarray] = []
    pos, dropped, n_whole_tokens = 0, 0, 0
    bins: list[list[list[int]]] = []
    room = 0
    for d in whole:  # first fit in order: documents share a row while they fit
        n = len(d) + 1
        if n > seq_len:
            dropped += 1
            continue
        if not bins or n > room:
            bins.append([])
            room = seq_len
        bins[-1].append(d)
        room -= n
        n_whole_tokens += n
    for docs in bins:
        used = sum(len(d) + 1 for d in docs)
        free = seq_len - used
        if not len(flat):
            fill = np.full(free, sep, np.int32)
        else:  # the stream cycles when it runs out (pos then passes its end: no plain rows follow)
            fill = flat[np.arange(pos, pos + free) % len(flat)]
        pos += free
        cut = int(rng.integers(0, free + 1))
        parts = [fill[:cut]] + [np.asarray([*d, sep], np.int32) for d in docs] + [fill[cut:]]
        rows.append(np.concatenate(parts))
    rest = flat[pos:] if pos < len(flat) else flat[:0]
    n = len(rest) // seq_len
    if n:
        rows.extend(rest[: n * seq_len].reshape(n, seq_len))
    if not rows:
        return np.zeros((0, seq_len), np.int32), {"rows": 0, "rows_with_whole_docs": 0, "whole_docs": 0,
                                                  "whole_dropped": dropped, "whole_token_fraction": 0.0}
    out = np.stack(rows).astype(np.int32)
    return out, {"rows": int(len(out)), "rows_with_whole_docs": len(bins), "whole_docs": sum(map(len, bins)),
                 "whole_dropped": dropped, "whole_token_fraction": round(n_whole_tokens / out.size, 4)}


def retrieval_eval_rows(tok, files: Sequence[str], ctx: int, n: int, seed: int, row_len: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The ``bench needle`` prompts at ``ctx`` tokens (``needle.bench_prompts``: held-out filler, evenly spread
    depths, ChatML with thinking off), each followed by its answer: (tokens [n, row_len] padded with 0, mask
    [n, row_len] True at the positions whose next token is an answer token). A prompt is answered (teacher
    forced) iff the argmax at every masked position is the next token - then greedy decoding writes the answer."""
    from dflash_jax.bench import needle

    rows = np.zeros((n, row_len), np.int32)
    mask = np.zeros((n, row_len), bool)
    for i, (ids, ans, _) in enumerate(needle.bench_prompts(tok, files, ctx, n, seed)):
        a = tok.encode(ans)
        if len(ids) + len(a) > row_len:
            raise ValueError(f"needle prompt of {len(ids)} tokens + answer do not fit a row of {row_len}")
        rows[i, :len(ids)] = ids
        rows[i, len(ids):len(ids) + len(a)] = a
        mask[i, len(ids) - 1:len(ids) + len(a) - 1] = True
    return rows, mask


def copy_rows(n: int, seq_len: int, ids: np.ndarray, seed: int, span: tuple[int, int] = (4, 24)
              ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` synthetic associative-recall rows: spans of ``span[0]..span[1]`` ids drawn uniformly from ``ids``
    fill the first half; the second half repeats them, whole, in a random order (cycling until the row is full).
    Returns (tokens [n, seq_len] int32, loss weights [n, seq_len] float32): 1 on each repeated token except a
    span's first one (which span comes next is random), 0 on the first half (noise that cannot be predicted).
    Only a token-matching copy from earlier in the row predicts the weighted tokens: the induction mechanism the
    needle answer needs, which the LM data alone did not form within the target's budget."""
    rng = np.random.default_rng([seed, 13])
    rows = np.zeros((n, seq_len), np.int32)
    weights = np.zeros((n, seq_len), np.float32)
    for r in range(n):
        spans, used = [], 0
        while used < seq_len // 2:
            k = int(rng.integers(span[0], span[1] + 1))
            spans.append(np.asarray(ids, np.int32)[rng.integers(0, len(ids), size=k)])
            used += k
        first = np.concatenate(spans)[: seq_len // 2]
        spans[-1] = spans[-1][: len(spans[-1]) - (used - len(first))]
        toks, wts = [first], [np.zeros(len(first), np.float32)]
        pos = len(first)
        while pos < seq_len:
            for i in rng.permutation(len(spans)):
                sp = spans[i]
                if not len(sp):
                    continue
                toks.append(sp)
                wts.append(np.concatenate([[0.0], np.ones(len(sp) - 1, np.float32)]))
                pos += len(sp)
        rows[r] = np.concatenate(toks)[:seq_len]
        weights[r] = np.concatenate(wts)[:seq_len]
    return rows, weights


def value_token_ids(tok, n: int = 4000, seed: int = 0) -> np.ndarray:
    """The sorted ids that ``bench needle`` values (``needle.random_value``) tokenise into under ``tok`` (an HF
    ``tokenizers.Tokenizer``): the alphabet the copy rows draw from, so the copy mechanism they train works on
    exactly the tokens a needle answer copies."""
    from dflash_jax.bench import needle

    rng = random.Random(seed)
    out: set[int] = set()
    for _ in range(n):
        out.update(tok.encode(needle.random_value(rng), add_special_tokens=False).ids)
    return np.asarray(sorted(out), np.int32)


def _encode_all(tok, texts: list[str], batch: int = 2048) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), batch):
        out.extend(e.ids for e in tok.encode_batch(texts[i:i + batch], add_special_tokens=False))
    return out


def prepare_data(d: dict[str, Any], seq_len: int, seed: int, work: str, long_seq_len: int | None = None) -> Data:
    """Corpus + tokenizer + packed token arrays, cached under ``work/data-<hash>``.

    ``train``: rows of ``seq_len`` (stdlib + chat stream, each retrieval document whole in a row, ``pack_rows``);
    ``train_long`` (with ``long_seq_len``): rows of ``long_seq_len``, each long retrieval document whole in a row,
    filled with the stream; ``retrieval_eval``: the ``bench needle`` prompts at ``d["retrieval_eval"]`` lengths
    with their answers (``retrieval_eval_rows``)."""
    from tokenizers import Tokenizer as HFTokenizer

    from dflash_jax.models.tokenizer import Tokenizer
    from experiments import corpus
    from experiments.train_tokenizer import SPECIAL_TOKENS, train_bpe

    key = {"data": d, "seq_len": seq_len, "seed": seed, "stdlib": corpus.stdlib_dir(),
           "python": platform.python_version()}
    if long_seq_len:
        key["long_seq_len"] = long_seq_len
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    ddir = os.path.join(work, f"data-{h}")
    done = os.path.join(ddir, "data.json")
    cdir, tdir = os.path.join(ddir, "corpus"), os.path.join(ddir, "tokenizer")
    if not os.path.exists(done):
        t0 = time.time()
        shutil.rmtree(ddir, ignore_errors=True)
        argv = ["--out", cdir, "--seed", str(seed), "--n-chat", str(d["n_chat"]), "--n-eval-chat",
                str(d["n_eval_chat"]), "--n-needle", str(d["n_needle"]), "--n-eval-needle", str(d["n_eval_needle"]),
                "--needle-tokens", str(d["needle_tokens"])]
        if d.get("max_files") is not None:
            argv += ["--max-files", str(d["max_files"])]
        argv += ["--n-retrieval", str(d.get("n_retrieval", 0)),
                 "--retrieval-tokens", str(d.get("retrieval_tokens", "128,1800")),
                 "--n-retrieval-long", str(d.get("n_retrieval_long", 0) if long_seq_len else 0),
                 "--retrieval-long-tokens", str(d.get("retrieval_long_tokens", "1024,8000"))]
        if d.get("n_drill"):
            argv += ["--n-drill", str(d["n_drill"]), "--drill-tokens", str(d.get("drill_tokens", "32,256")),
                     "--drill-keys", str(d.get("drill_keys", 6))]
        log(f"[data] corpus: {' '.join(argv)}")
        stats = corpus.main(argv)
        t1 = time.time()
        train_txt = os.path.join(cdir, "train.txt")
        train_bpe(corpus.read_train_docs(train_txt), tdir, vocab_size=d["vocab_size"],
                  max_bytes=int(d["tok_max_mb"] * 1e6))
        t2 = time.time()
        tok = HFTokenizer.from_file(os.path.join(tdir, "tokenizer.json"))
        sep = tok.token_to_id(corpus.DOC_SEP)
        stream = _encode_all(tok, list(corpus.read_train_docs(train_txt)))
        whole = _encode_all(tok, list(corpus.read_train_docs(os.path.join(cdir, "retrieval.txt"))))
        train, pack_stats = pack_rows(stream, whole, sep, seq_len, seed)
        pack_stats = {"train": pack_stats}
        if long_seq_len:
            whole_long = _encode_all(tok, list(corpus.read_train_docs(os.path.join(cdir, "retrieval_long.txt"))))
            # the stream from its middle, so the long rows do not repeat the first rows' filler
            half = len(stream) // 2
            train_long, pack_stats["train_long"] = pack_rows(stream[half:] + stream[:half], whole_long, sep,
                                                             long_seq_len, seed + 1)
            train_long = train_long[: pack_stats["train_long"]["rows_with_whole_docs"]]  # only rows with retrieval
            np.save(os.path.join(ddir, "train_long.npy"), train_long.astype(np.uint16 if tok.get_vocab_size()
                                                                            < 65536 else np.int32))
        with open(os.path.join(cdir, "split.json")) as fh:
            split = json.load(fh)
        rtok = Tokenizer.from_dir(tdir)
        files = [os.path.join(split["stdlib_dir"], f) for f in split["eval_files"]]
        r_eval = {}
        for ctx in (int(x) for x in str(d.get("retrieval_eval", "")).split(",") if x.strip()):
            row_len = seq_len if ctx + 64 <= seq_len else (long_seq_len or ctx + 64)
            rows, mask = retrieval_eval_rows(rtok, files, ctx, d.get("n_retrieval_eval", 16), seed, row_len)
            np.save(os.path.join(ddir, f"retrieval_eval_{ctx}.npy"), rows)
            np.save(os.path.join(ddir, f"retrieval_eval_{ctx}_mask.npy"), mask)
            r_eval[ctx] = int(len(rows))
        ev: dict[str, list[str]] = {}
        with open(os.path.join(cdir, "eval.jsonl"), encoding="utf-8") as fh:
            for line in fh:
                r = json.loads(line)
                ev.setdefault(r["kind"], []).append(r["text"])
        evals = {k: _pack(_encode_all(tok, v), sep, seq_len) for k, v in sorted(ev.items())}
        t3 = time.time()
        dtype = np.uint16 if tok.get_vocab_size() < 65536 else np.int32
        np.save(os.path.join(ddir, "train.npy"), train.astype(dtype))
        for k, v in evals.items():
            np.save(os.path.join(ddir, f"eval_{k}.npy"), v.astype(dtype))
        meta = {"key": key, "corpus_stats": stats, "split_rule": split["rule"], "stdlib_dir": split["stdlib_dir"],
                "packing": pack_stats, "retrieval_eval": r_eval,
                "train_long_seqs": int(len(train_long)) if long_seq_len else 0,
                "eval_files": split["eval_files"], "n_train_files": split["n_train_files"],
                "train_seqs": int(train.shape[0]), "train_tokens": int(train.size),
                "eval_seqs": {k: int(v.shape[0]) for k, v in evals.items()},
                "vocab_size": tok.get_vocab_size(), "special_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
                "seconds": {"corpus": round(t1 - t0, 1), "tokenizer": round(t2 - t1, 1),
                            "encode": round(t3 - t2, 1)}}
        with open(done, "w") as fh:
            json.dump(meta, fh, indent=1)
        log(f"[data] {meta['train_tokens']:,} train tokens in {meta['train_seqs']} rows of {seq_len}; "
            f"{meta['train_long_seqs']} long rows of {long_seq_len}; packing {json.dumps(pack_stats)}; eval rows "
            f"{meta['eval_seqs']}; retrieval eval {r_eval}; vocab {meta['vocab_size']}; "
            f"{sum(meta['seconds'].values()):.1f}s")
    else:
        log(f"[data] cached: {ddir}")
    with open(done) as fh:
        meta = json.load(fh)
    train = np.load(os.path.join(ddir, "train.npy")).astype(np.int32)
    evals = {k: np.load(os.path.join(ddir, f"eval_{k}.npy")).astype(np.int32) for k in meta["eval_seqs"]}
    long_path = os.path.join(ddir, "train_long.npy")
    train_long = np.load(long_path).astype(np.int32) if os.path.exists(long_path) else None
    r_eval = {int(c): (np.load(os.path.join(ddir, f"retrieval_eval_{c}.npy")),
                       np.load(os.path.join(ddir, f"retrieval_eval_{c}_mask.npy"))) for c in meta["retrieval_eval"]}
    meta["dir"] = ddir
    return Data(tdir, meta["vocab_size"], meta["special_ids"], train, evals, meta, train_long, r_eval)


def _spread(n: int, k: int) -> np.ndarray:
    """``k`` evenly spaced indices of ``range(n)`` (all when k >= n)."""
    if k >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def eval_sets(data: Data, total: int) -> dict[str, np.ndarray]:
    """The fixed held-out rows per kind: ``total`` split evenly over the kinds present, evenly spaced."""
    kinds = [k for k, v in data.eval.items() if len(v)]
    per = max(1, total // max(1, len(kinds)))
    return {k: data.eval[k][_spread(len(data.eval[k]), per)] for k in kinds}


class Batches:
    """Deterministic batches: sample ``step*B + j`` is row ``perm_epoch[i % N]``, ``perm_epoch`` seeded by the
    epoch, so a resumed run sees exactly the batches of an uninterrupted one."""

    def __init__(self, rows: np.ndarray, batch: int, seed: int, weights: np.ndarray | None = None) -> None:
        if len(rows) < 1:
            raise ValueError("no training rows: the corpus is smaller than one sequence")
        if weights is not None and weights.shape != rows.shape:
            raise ValueError(f"weights {weights.shape} do not match rows {rows.shape}")
        self.rows, self.batch, self.seed, self.weights = rows, batch, seed, weights
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))}
        return self._perms[epoch]

    def __call__(self, step: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Rows [B, T]; with ``weights``, (rows [B, T], their loss weights [B, T])."""
        n = len(self.rows)
        idx = np.asarray([self._perm(i // n)[i % n] for i in range(step * self.batch, (step + 1) * self.batch)])
        return self.rows[idx] if self.weights is None else (self.rows[idx], self.weights[idx])


# =====================================================================================================================
# models
# =====================================================================================================================

def compute_params(params: Any, dtype) -> Any:
    """Matrices cast to the compute dtype; norm weights, A_log and dt_bias stay float32 (as the loader does)."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if x.ndim >= 2 else x, params)


def init_target(cfg: TargetConfig, key: jax.Array, std: float = 0.02, qk_norm_init: float = 0.0) -> qwen36.Params:
    """HF-style float32 init (reference §6.2): linears and embeddings normal(0, std) (output projections
    o / out / down scaled by 1/sqrt(2 L)), zero-centred norms 0, GDN output norm 1, dt_bias 1,
    A_log = log U(0.01, 16), depthwise conv kaiming-uniform U(-1/sqrt(K), 1/sqrt(K)).

    ``qk_norm_init``: the attention layers' zero-centred q/k norm weights start there instead of 0. With q/k
    RMS-normed, an attention logit is at most ``sqrt(head_dim) * (1 + w_q) * (1 + w_k)`` (8 at head_dim 64 and
    w = 0): too flat to single out one key among thousands (ln 8192 = 9) until the weights grow."""
    shapes = qwen36.param_shapes(cfg, F32)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, s), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        last = name.rsplit("[", 1)[-1].strip("'[]")
        if last == "A_log":
            out.append(jnp.log(jax.random.uniform(k, s.shape, F32, 0.01, 16.0)))
        elif last == "dt_bias" or name.endswith("['gdn']['norm']"):
            out.append(jnp.ones(s.shape, F32))
        elif last in ("q_norm", "k_norm"):
            out.append(jnp.full(s.shape, qk_norm_init, F32))
        elif len(s.shape) == 1:
            out.append(jnp.zeros(s.shape, F32))  # zero-centred RMSNorm weights
        elif last == "conv":
            b = s.shape[1] ** -0.5
            out.append(jax.random.uniform(k, s.shape, F32, -b, b))
        else:
            scale = std / (2 * cfg.num_layers) ** 0.5 if last in ("o", "out", "down") else std
            out.append(scale * jax.random.normal(k, s.shape, F32))
    return jax.tree_util.tree_unflatten(treedef, out)


def target_hidden(params: qwen36.Params, cfg: TargetConfig, tokens: jax.Array,
                  return_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array | None]:
    """Training-mode full-sequence forward of B rows from position 0 through ``qwen36.forward`` (the serving code):
    a fresh paged KV (each row owns its pages) and fresh recurrent slots per call.
    tokens [B, T] -> (final-normed hidden [B, T, D], feats [len(return_layers), B, T, D] | None)."""
    b, t = tokens.shape
    dtype = params["layers"][0]["mlp"]["gate"].dtype
    ps = min(64, t)
    w = -(-t // ps)
    kv = KVPages.zeros(cfg, b * w + 1, ps, dtype)
    rec = RecurrentSlots.zeros(cfg, b + 1, dtype)
    inp = StepInput(tokens=tokens.astype(jnp.int32),
                    positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                    n_valid=jnp.full((b,), t, jnp.int32), slots=jnp.arange(1, b + 1, dtype=jnp.int32),
                    page_table=1 + jnp.arange(b * w, dtype=jnp.int32).reshape(b, w))
    h, _, _, feats = qwen36.forward(params, cfg, inp, kv, rec, return_layers)
    return h, feats


def next_token_ce(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per-position CE of predicting tokens[:, 1:] from logits[:, :-1] -> [B, T-1] float32."""
    lg = logits[:, :-1].astype(F32)
    tgt = tokens[:, 1:]
    return jax.nn.logsumexp(lg, axis=-1) - jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0]


def assistant_mask(tokens: jax.Array, im_start: int, assistant: Sequence[int], im_end: int) -> jax.Array:
    """[B, T] bool: the tokens of assistant turns' content - after ``<|im_start|>`` + the ``assistant`` role's
    token ids, up to and including the turn's ``<|im_end|>`` (a row that starts inside a turn counts it only from
    the next turn on)."""
    b, t = tokens.shape
    k = len(assistant)
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    padded = jnp.concatenate([tokens, jnp.full((b, k), -1, tokens.dtype)], axis=1)
    start = tokens == im_start
    for j, a in enumerate(assistant):
        start &= padded[:, j + 1:j + 1 + t] == a
    last_start = jax.lax.cummax(jnp.where(start, idx, -1), axis=1)
    last_end = jax.lax.cummax(jnp.where(tokens == im_end, idx, -1), axis=1)
    end_before = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), last_end[:, :-1]], axis=1)
    return (last_start >= 0) & (last_start > end_before) & (idx > last_start + k)


def weighted_next_token_ce(logits: jax.Array, tokens: jax.Array, weights: jax.Array | None) -> jax.Array:
    """Mean next-token CE, each target token weighted by ``weights`` [B, T] (None: the plain mean)."""
    ce = next_token_ce(logits, tokens)
    if weights is None:
        return jnp.mean(ce)
    w = weights[:, 1:].astype(F32)
    return jnp.sum(ce * w) / jnp.sum(w)


def n_params(tree: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


# =====================================================================================================================
# export
# =====================================================================================================================

#: Seconds --time-budget keeps per remaining phase for its compile, probe, evals (and the export at the end).
PHASE_RESERVE_S = 30.0
#: A drafter continued from ``--init-drafter`` draws its batch order and anchors from seed + this offset: the base
#: seed's streams would repeat, step for step, the rows and anchors the exported drafter was trained on.
CONTINUE_SEED_OFFSET = 1000
#: Largest exported file (bytes): bigger checkpoints are written as shards + ``model.safetensors.index.json``.
MAX_FILE_BYTES = 15 * 2 ** 20


def save_target(path: str, cfg: TargetConfig, params: qwen36.Params, dtype=None,
                max_shard_bytes: int = MAX_FILE_BYTES) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the Qwen3.5/3.6 HF layout (what ``loader.load_params``
    reads): ``model.language_model.*`` + top-level ``lm_head.weight``; conv weights as ``[C, 1, K]``. ``dtype``
    casts the matrices (default: their own dtype); norm weights, A_log and dt_bias are written in float32.
    Tensors over ``max_shard_bytes`` in all go to ``model-0000i-of-0000n.safetensors`` shards (each under the
    limit, tensors in name order) listed by ``model.safetensors.index.json``, as HF writes large checkpoints."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    shapes = qwen36.param_shapes(cfg, F32)
    tensors: dict[str, np.ndarray] = {}
    for name, p in loader.hf_name_map(cfg).items():
        arr = jnp.asarray(loader._get(params, p))
        want = loader._get(shapes, p).shape
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"parameter {'/'.join(map(str, p))} has shape {list(arr.shape)}, "
                             f"config wants {list(want)}")
        arr = arr.astype(F32 if arr.ndim == 1 else (dtype or arr.dtype))
        if p[-1] == "conv":
            arr = arr[:, None, :]
        full = name if name == "lm_head.weight" else f"model.language_model.{name}"
        tensors[full] = np.ascontiguousarray(np.asarray(jax.device_get(arr)))
    mdt = str(jnp.dtype(dtype or params["embed"].dtype))
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(tc.target_hf_dict_from_config(cfg, mdt), fh, indent=2)
    for f in os.listdir(path):  # a previous export's weights
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".safetensors.index.json")):
            os.remove(os.path.join(path, f))
    total = sum(a.nbytes for a in tensors.values())
    if total + 8192 <= max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        a = tensors[name]
        if a.nbytes + 8192 > max_shard_bytes:
            raise ValueError(f"tensor {name} ({a.nbytes} bytes) alone exceeds the shard limit {max_shard_bytes}")
        if shards[-1] and size + a.nbytes + 8192 > max_shard_bytes:  # 8 KiB for the header
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    weight_map = {}
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in sh})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, fh, indent=2)


def _token_ids(tokenizer_dir: str, text: str) -> tuple[int, ...]:
    from tokenizers import Tokenizer as HFTokenizer

    return tuple(HFTokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).encode(
        text, add_special_tokens=False).ids)


def _copy_tokenizer(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))


def _readable(root: str) -> None:
    """safetensors writes 0600 files; shipped assets should be world-readable."""
    for dp, _, fns in os.walk(root):
        for f in fns:
            os.chmod(os.path.join(dp, f), 0o644)


# =====================================================================================================================
# training loop
# =====================================================================================================================

def _global_norm(tree: Any) -> jax.Array:
    tree_mod = getattr(optax, "tree", None)
    return tree_mod.norm(tree) if tree_mod is not None and hasattr(tree_mod, "norm") else optax.global_norm(tree)


def _device_batch(batch: Any) -> Any:
    """A batch (an array, or a tuple of arrays) as device arrays."""
    return jax.tree_util.tree_map(jnp.asarray, batch)


def make_schedule(hp: dict[str, Any], steps: int) -> Callable:
    """Warm-up + cosine learning rate over ``steps`` steps (a host-side function of the step)."""
    steps = max(1, steps)
    warm = max(1, int(round(hp["warmup"] * steps)))
    return optax.warmup_cosine_decay_schedule(0.0, hp["lr"], warm, max(steps, warm + 1), end_value=0.1 * hp["lr"])


def make_optimizer(hp: dict[str, Any]) -> optax.GradientTransformation:
    """Clipped AdamW at unit learning rate: the step function scales its updates by the scheduled rate, passed in
    as an argument, so the schedule's length can be fitted to a time budget without recompiling. (AdamW's weight
    decay is scaled by the learning rate too, so this equals ``adamw(schedule)``.)"""
    decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)
    return optax.chain(optax.clip_by_global_norm(hp["clip"]),
                       optax.adamw(1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=hp["wd"], mask=decay_mask))


class OutOfTime(RuntimeError):
    """The --max-minutes budget ran out; every phase so far is checkpointed."""


@dataclasses.dataclass
class PhaseResult:
    params: Any
    history: dict[str, list]
    timing: dict[str, float]
    resumed_from: int | None
    steps: int


def run_phase(name: str, params: Any, frozen: Any, loss_fn: Callable, batches: Batches, hp: dict[str, Any], *,
              work: str, resume: bool, seed: int, log_every: int, ckpt_every: int, eval_fn: Callable | None = None,
              eval_every: int = 0, tokens_per_step: int = 0, deadline: float | None = None,
              max_seconds: float | None = None) -> PhaseResult:
    """AdamW over ``loss_fn(params, frozen, batch, key) -> (loss, aux dict)`` for ``hp['steps']`` steps, with orbax
    checkpoints (params, optimizer state) every ``ckpt_every`` steps and at the end, and a JSON loss history.
    Past ``deadline`` (``time.time()``) it checkpoints and raises ``OutOfTime`` (continue with ``--resume``).

    With ``hp["minutes"]``, the step count is fitted to that time budget: a few probe steps (on copies; the first
    one compiles) time a step, and the phase runs ``min(hp["steps"], what fits)`` steps with the schedule laid
    over that count. The fitted count is recorded (``PhaseResult.steps``, the history file) and reused on resume;
    passing it as the phase's steps without ``minutes`` reproduces the run exactly. ``max_seconds`` (what the run's
    ``--time-budget`` leaves this phase) caps that budget further."""
    import orbax.checkpoint as ocp

    steps = hp["steps"]
    tx = make_optimizer(hp)
    opt_state = tx.init(params)
    ckdir = os.path.abspath(os.path.join(work, "ckpt", name))
    hist_path = os.path.join(work, "ckpt", f"{name}_history.json")
    if not resume:
        shutil.rmtree(ckdir, ignore_errors=True)
    mngr = ocp.CheckpointManager(ckdir, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False))
    history: dict[str, list] = {"step": [], "loss": [], "grad_norm": [], "lr": [], "eval": []}
    start, resumed = 0, None
    if resume and mngr.latest_step() is not None:
        start = resumed = int(mngr.latest_step())
        state = mngr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state = state["params"], state["opt_state"]
        if os.path.exists(hist_path):
            with open(hist_path) as fh:
                old = json.load(fh)
            keep = [i for i, s in enumerate(old["step"]) if s <= start]
            history = {k: [old[k][i] for i in keep] for k in ("step", "loss", "grad_norm", "lr")}
            history["eval"] = [e for e in old.get("eval", []) if e["step"] <= start]
            steps = old.get("steps_total", steps)
        log(f"[{name}] resumed from step {start}")

    base_key = jax.random.fold_in(jax.random.key(seed), int(hashlib.sha1(name.encode()).hexdigest()[:7], 16))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, frozen, batch, step, lr):
        key = jax.random.fold_in(base_key, step)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree_util.tree_map(lambda u: (lr * u).astype(u.dtype), updates)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, _global_norm(grads), aux

    if hp.get("minutes") and resumed is None:
        # the median of single blocked steps after two warm ones: a step that recompiles (the probe's copies
        # may arrive with another placement than the step's outputs) must not set the phase's length
        p_, o_ = jax.tree_util.tree_map(jnp.copy, (params, opt_state))
        times = []
        for i in range(8):
            t = time.perf_counter()
            p_, o_, l_, *_ = train_step(p_, o_, frozen, _device_batch(batches(i)), jnp.int32(i), jnp.float32(0.0))
            jax.block_until_ready(l_)
            times.append(time.perf_counter() - t)
        t_compile = times[0]
        step_s = float(np.median(times[2:]))
        del p_, o_
        budget = 60 * hp["minutes"] * 0.9
        capped = max_seconds is not None and max_seconds < budget
        fit = int(max(0.0, min(budget, max_seconds) if capped else budget) / step_s)
        steps = max(1, min(steps, fit))
        log(f"[{name}] {step_s * 1e3:.1f} ms/step: {steps} steps fit {hp['minutes']} min (configured {hp['steps']}; "
            f"compile + first step {t_compile:.1f}s)" +
            (f"; capped to {max(0.0, max_seconds):.0f}s by --time-budget" if capped else ""))
    sched = make_schedule(hp, steps)

    def save(step: int) -> None:
        mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)
        mngr.wait_until_finished()
        with open(hist_path, "w") as fh:
            json.dump({**history, "steps_total": steps}, fh)

    t_start = time.perf_counter()
    t_first = None
    pending: list[tuple[int, Any, Any, Any]] = []
    t_last, s_last = time.perf_counter(), start
    for step in range(start, steps):
        batch = _device_batch(batches(step))
        params, opt_state, loss, gnorm, aux = train_step(params, opt_state, frozen, batch, jnp.int32(step),
                                                         jnp.float32(sched(step)))
        pending.append((step, loss, gnorm, aux))
        if t_first is None:
            jax.block_until_ready(loss)
            t_first = time.perf_counter() - t_start
            t_last, s_last = time.perf_counter(), step + 1
        last = step + 1 == steps
        if (step + 1) % log_every == 0 or last:
            got = jax.device_get(pending)
            for s, l_, g, a in got:
                history["step"].append(s + 1)
                history["loss"].append(float(l_))
                history["grad_norm"].append(float(g))
                history["lr"].append(float(sched(s)))
            pending = []
            now = time.perf_counter()
            rate = (step + 1 - s_last) / max(now - t_last, 1e-9)
            s_, l_, g_, a_ = got[-1]
            extra = " ".join(f"{k} {float(v):.3f}" for k, v in a_.items())
            tok = f" {rate * tokens_per_step / 1e3:,.0f}k tok/s" if tokens_per_step and step + 1 > s_last else ""
            log(f"[{name}] step {step + 1}/{steps} loss {float(l_):.4f} gnorm {float(g_):.3f} "
                f"lr {float(sched(step)):.2e} {extra} {rate:.2f} step/s{tok}".replace("  ", " "))
            t_last, s_last = now, step + 1
        if eval_fn is not None and eval_every and (step + 1) % eval_every == 0 and not last:
            ev = eval_fn(params)
            history["eval"].append({"step": step + 1, **ev})
            log(f"[{name}] eval @ {step + 1}: " + " ".join(f"{k} {v:.4g}" for k, v in ev.items()))
        if (step + 1) % ckpt_every == 0 or last:
            save(step + 1)
        elif deadline is not None and time.time() > deadline:
            for s, l_, g, a in jax.device_get(pending):
                history["step"].append(s + 1)
                history["loss"].append(float(l_))
                history["grad_norm"].append(float(g))
                history["lr"].append(float(sched(s)))
            save(step + 1)
            mngr.close()
            raise OutOfTime(f"[{name}] out of time at step {step + 1}/{steps}: checkpointed; rerun with --resume")
    total = time.perf_counter() - t_start
    n_run = steps - start
    steady = (total - (t_first or 0.0)) / max(1, n_run - 1)
    timing = {"seconds": round(total, 2), "first_step_seconds (compile)": round(t_first or 0.0, 2),
              "steps_run": n_run, "step_seconds": round(steady, 4),
              "tokens_per_second": round(tokens_per_step / steady, 1) if tokens_per_step and n_run > 1 else None}
    mngr.close()
    return PhaseResult(params, history, timing, resumed, steps)


# =====================================================================================================================
# evaluation
# =====================================================================================================================

def make_lm_eval(hidden_fn: Callable, sets: dict[str, np.ndarray], batch: int) -> Callable[[Any], dict[str, float]]:
    """``evaluate(params)``: held-out perplexity per kind and overall (token-weighted) of a causal LM given
    ``hidden_fn(params, tokens) -> [B, T, D]`` (compiled once)."""

    @jax.jit
    def ce_sum(params, tokens, rows):
        h = hidden_fn(params, tokens)
        logits = jnp.einsum("btd,vd->btv", h, params["lm_head"].astype(h.dtype), preferred_element_type=F32)
        ce = next_token_ce(logits, tokens) * rows[:, None]
        return jnp.sum(ce), jnp.sum(rows) * (tokens.shape[1] - 1)

    def evaluate(params) -> dict[str, float]:
        out: dict[str, float] = {}
        tot, cnt = 0.0, 0.0
        for kind, rows in sets.items():
            s = c = 0.0
            for i in range(0, len(rows), batch):
                chunk = rows[i:i + batch]
                m = np.ones(batch, np.float32)
                if len(chunk) < batch:
                    m[len(chunk):] = 0
                    chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - len(chunk), 0)])
                a, b = jax.device_get(ce_sum(params, jnp.asarray(chunk), jnp.asarray(m)))
                s, c = s + float(a), c + float(b)
            out[f"ppl_{kind}"] = math.exp(s / max(c, 1))
            tot, cnt = tot + s, cnt + c
        out["ppl"] = math.exp(tot / max(cnt, 1))
        out["loss"] = tot / max(cnt, 1)
        return out

    return evaluate


def make_retrieval_eval(hidden_fn: Callable, sets: dict[int, tuple[np.ndarray, np.ndarray]], batch: int
                        ) -> Callable[[Any], dict[str, float]]:
    """``evaluate(params)``: per context length, the fraction of held-out ``bench needle`` prompts answered
    (``needle_acc_<ctx>``: the argmax is the answer's next token at every answer position, teacher forced, i.e.
    greedy decoding writes the answer) and the fraction of answer tokens right (``needle_tok_<ctx>``)."""

    @jax.jit
    def hits(params, tokens, mask):
        h = hidden_fn(params, tokens)
        pred = jnp.argmax(jnp.einsum("btd,vd->btv", h[:, :-1], params["lm_head"].astype(h.dtype),
                                     preferred_element_type=F32), axis=-1)
        ok = (pred == tokens[:, 1:]) | ~mask[:, :-1]
        return jnp.all(ok, axis=1), jnp.sum(ok & mask[:, :-1], axis=1)

    def evaluate(params) -> dict[str, float]:
        out: dict[str, float] = {}
        for ctx, (rows, mask) in sorted(sets.items()):
            n = len(rows)
            pad = -n % batch
            rows_p = np.concatenate([rows, np.repeat(rows[:1], pad, 0)]) if pad else rows
            mask_p = np.concatenate([mask, np.repeat(mask[:1], pad, 0)]) if pad else mask
            full, tok_ok = [], []
            for i in range(0, len(rows_p), batch):
                a, b = jax.device_get(hits(params, jnp.asarray(rows_p[i:i + batch]), jnp.asarray(mask_p[i:i + batch])))
                full.append(a)
                tok_ok.append(b)
            full, tok_ok = np.concatenate(full)[:n], np.concatenate(tok_ok)[:n]
            out[f"needle_acc_{ctx}"] = float(np.mean(full))
            out[f"needle_tok_{ctx}"] = float(np.sum(tok_ok) / max(1, int(mask.sum())))
        return out

    return evaluate


def make_induction_eval(hidden_fn: Callable, rows: np.ndarray, weights: np.ndarray, batch: int
                        ) -> Callable[[Any], dict[str, float]]:
    """``evaluate(params)``: ``induction_acc``, the argmax accuracy on the repeated tokens of held-out
    ``copy_rows`` (weights > 0): near 0 without an induction (copy) mechanism, near 1 with one."""

    @jax.jit
    def hits(params, tokens, w):
        h = hidden_fn(params, tokens)
        pred = jnp.argmax(jnp.einsum("btd,vd->btv", h[:, :-1], params["lm_head"].astype(h.dtype),
                                     preferred_element_type=F32), axis=-1)
        return jnp.sum((pred == tokens[:, 1:]) * w[:, 1:]), jnp.sum(w[:, 1:])

    def evaluate(params) -> dict[str, float]:
        a = c = 0.0
        for i in range(0, len(rows), batch):
            x, y = jax.device_get(hits(params, jnp.asarray(rows[i:i + batch]), jnp.asarray(weights[i:i + batch])))
            a, c = a + float(x), c + float(y)
        return {"induction_acc": a / max(c, 1.0)}

    return evaluate


def tau_anchors(n_rows: int, seq_len: int, per_row: int, seed: int, blk: int) -> np.ndarray:
    """Fixed eval anchors ``[n_rows, per_row]``: distinct sorted positions in [blk, T-2] (each with context)."""
    rng = np.random.default_rng([seed, 7])
    lo, hi = min(blk, seq_len - 2), seq_len - 2
    return np.stack([np.sort(rng.choice(np.arange(lo, hi + 1), size=min(per_row, hi - lo + 1), replace=False))
                     for _ in range(n_rows)]).astype(np.int32)


def greedy_labels(tparams: Any, tcfg: TargetConfig, rows: np.ndarray, anchors: np.ndarray, blk: int,
                  chunk: int = 64) -> np.ndarray:
    """The target's exact greedy continuation from every anchor: ``[M, N, blk]`` with entry 0 the anchor token
    and entry k the k-th greedy token after the prefix ``x[0..a]`` (blk-1 full passes over ``[chunk, T+blk]``)."""
    m, t = rows.shape
    n = anchors.shape[1]
    buf_rows = np.repeat(rows, n, axis=0)
    a_flat = anchors.reshape(-1)
    buf = np.concatenate([buf_rows, np.zeros((len(buf_rows), blk), np.int32)], axis=1)

    @jax.jit
    def rollout(params, buf, a):
        r = jnp.arange(buf.shape[0])

        def body(i, buf):
            h, _ = target_hidden(params, tcfg, buf)
            nxt = jnp.argmax(qwen36.lm_logits(params, h[r, a + i]), axis=-1).astype(buf.dtype)
            return buf.at[r, a + i + 1].set(nxt)

        return jax.lax.fori_loop(0, blk - 1, body, buf)

    out = []
    for i in range(0, len(buf), chunk):
        b, aa = buf[i:i + chunk], a_flat[i:i + chunk]
        pad = chunk - len(b) if len(buf) > chunk else 0
        if pad:
            b, aa = np.concatenate([b, np.repeat(b[:1], pad, 0)]), np.concatenate([aa, np.repeat(aa[:1], pad)])
        res = np.asarray(jax.device_get(rollout(tparams, jnp.asarray(b), jnp.asarray(aa))))
        res = res[: len(res) - pad]
        out.append(np.stack([r_[a_:a_ + blk] for r_, a_ in zip(res, aa)]))
    return np.concatenate(out).reshape(m, n, blk)


def make_tau_eval(dcfg: DrafterConfig, tcfg: TargetConfig, tparams: Any, rows: np.ndarray, anchors: np.ndarray,
                  labels_greedy: np.ndarray) -> Callable[[Any], dict[str, float]]:
    """``evaluate(drafter_params)``: teacher-forced chain acceptance length at fixed anchors - the drafter's argmax
    block (context = target features of positions < anchor) against the target's greedy continuation (``tau``) and
    against the held-out text (``tau_text``); ``p_accept_k`` = fraction of blocks whose first k drafts all match."""
    layers = tuple(dcfg.target_layer_ids)
    blk = dcfg.block_size
    tokens, anc = jnp.asarray(rows), jnp.asarray(anchors)

    @jax.jit
    def drafts(dparams, tparams):
        _, feats = target_hidden(tparams, tcfg, tokens, layers)
        logits = dflash.train_forward(dparams, dcfg, tparams["embed"], tparams["lm_head"], features(feats), tokens,
                                      anc)
        return jnp.argmax(logits, axis=-1)

    pos = anchors[..., None] + np.arange(blk)
    inside = pos < rows.shape[1]
    text = np.take_along_axis(rows, np.clip(pos, 0, rows.shape[1] - 1).reshape(rows.shape[0], -1), 1).reshape(pos.shape)

    def evaluate(dparams) -> dict[str, float]:
        pred = np.asarray(jax.device_get(drafts(dparams, tparams)))

        def accept(labels, valid=None):
            hit = pred == labels
            if valid is not None:
                hit &= valid
            pref = np.cumprod(hit[..., 1:], axis=-1)
            return 1 + pref.sum(-1), pref

        tau, pref = accept(labels_greedy)
        tau_text, _ = accept(text, inside)
        out = {"tau": float(tau.mean()), "tau_text": float(tau_text.mean()),
               "first_draft_acc": float(pref[..., 0].mean())}
        for k in (3, 7, 15):
            if k < blk:
                out[f"p_accept_{k}"] = float(pref[..., k - 1].mean())
        return out

    return evaluate


# =====================================================================================================================
# main
# =====================================================================================================================

def _set(cfg: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise SystemExit(f"--set wants KEY.PATH=VALUE, got {assignment!r}")
    k, v = assignment.split("=", 1)
    try:
        val = json.loads(v)
    except json.JSONDecodeError:
        val = v
    node = cfg
    parts = k.split(".")
    for p in parts[:-1]:
        if p not in node or not isinstance(node[p], dict):
            raise SystemExit(f"--set {k}: no section {p!r}")
        node = node[p]
    if parts[-1] not in node:
        raise SystemExit(f"--set {k}: unknown key {parts[-1]!r} (known: {sorted(node)})")
    node[parts[-1]] = val


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output dir: target/, drafter/, scorer/, train_report.json")
    ap.add_argument("--preset", default="tiny", choices=sorted(tc.PRESETS))
    ap.add_argument("--smoke", action="store_true", help="= --preset smoke (CPU, tiny sizes, a few steps)")
    ap.add_argument("--work-dir", default=None,
                    help="corpus, tokenizer, token arrays, orbax checkpoints (default build/train_tiny/<preset>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue each phase from its latest checkpoint")
    ap.add_argument("--steps", type=int, help="target steps")
    ap.add_argument("--drafter-steps", type=int)
    ap.add_argument("--scorer-steps", type=int)
    ap.add_argument("--batch", type=int, help="target batch (sequences)")
    ap.add_argument("--drafter-batch", type=int)
    ap.add_argument("--scorer-batch", type=int)
    ap.add_argument("--lr", type=float, help="target peak lr")
    ap.add_argument("--drafter-lr", type=float)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="matmul dtype inside the step (master weights stay float32); auto = bf16 on GPU/TPU")
    ap.add_argument("--export-dtype", default=None, choices=("float32", "bfloat16"),
                    help="dtype of exported matrices (default: bfloat16, float32 for --smoke)")
    ap.add_argument("--drafter-labels", default="target", choices=("target", "data"),
                    help="drafter labels: the target's teacher-forced argmax (default) or the text")
    ap.add_argument("--no-scorer", action="store_true", help="skip the dense scorer")
    ap.add_argument("--init-target", default=None, metavar="DIR",
                    help="take the target from this exported checkpoint (same preset, same tokenizer) instead of "
                         "training it: only the drafter and the scorer are trained")
    ap.add_argument("--extend-target", action="store_true",
                    help="with --init-target: run the target_long phase (the context extension, YaRN from its "
                         "rope_scaling) on the loaded target before the drafter, and export the extended target")
    ap.add_argument("--init-drafter", default=None, metavar="DIR",
                    help="start the drafter from this exported drafter (config.json + safetensors, e.g. "
                         "dflash_jax/assets/tiny/drafter; its config must be this preset's) instead of a fresh init "
                         "and continue training it; needs --init-target (the target it was trained on)")
    ap.add_argument("--drafter-seed", type=int, default=None,
                    help="seed of the drafter's batch order and anchors (default: --seed, or --seed + "
                         f"{CONTINUE_SEED_OFFSET} with --init-drafter); give a new one to continue a drafter that was "
                         "itself continued, so its rows and anchors are not the ones it last saw")
    ap.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                    help="allow non-deterministic GPU reductions (default: XLA_FLAGS --xla_gpu_deterministic_ops, "
                         "so a rerun with the same seed reproduces the weights)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="wall-clock budget of the whole process: each timed phase's step budget is cut to what is "
                         "left after the later phases' budgets and a reserve for compiles, evals and the export, so "
                         "the run ends (with its export) within it")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="wall-clock budget: past it the running phase checkpoints and the script exits with code 3 "
                         "(continue with --resume)")
    ap.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES,
                    help="largest exported file: the target is sharded above it, anything else over it is an error")
    ap.add_argument("--eval-every", type=int, help="held-out eval every N steps (0 = only at the end)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any preset value, e.g. --set target.hidden_size=512 --set data.n_chat=5000")
    args = ap.parse_args(argv)
    if args.init_drafter and not args.init_target:
        ap.error("--init-drafter needs --init-target: a drafter continues on the target it was trained against")
    if args.extend_target and not args.init_target:
        ap.error("--extend-target needs --init-target (without it the target_long phase runs anyway)")
    if args.smoke:
        args.preset = "smoke"
    cfg = tc.preset(args.preset)
    for a in args.set:
        _set(cfg, a)
    tr = cfg["train"]
    for flag, sec, key in (("steps", "target", "steps"), ("drafter_steps", "drafter", "steps"),
                           ("scorer_steps", "scorer", "steps"), ("batch", "target", "batch"),
                           ("drafter_batch", "drafter", "batch"), ("scorer_batch", "scorer", "batch"),
                           ("lr", "target", "lr"), ("drafter_lr", "drafter", "lr")):
        if getattr(args, flag) is not None:
            tr[sec][key] = getattr(args, flag)
    if args.seq_len is not None:
        cfg["seq_len"] = args.seq_len
    if args.eval_every is not None:
        cfg["eval"]["every"] = args.eval_every
    if args.export_dtype is None:
        args.export_dtype = "float32" if args.preset == "smoke" else "bfloat16"
    if args.work_dir is None:
        args.work_dir = os.path.join(_ROOT, "build", "train_tiny", args.preset)
    return args, cfg


def _plot(path: str, curves: dict[str, dict[str, list]]) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("[report] matplotlib is not installed: skipping loss_curves.png (curves are in train_report.json)")
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (name, h) in zip(axes[0], curves.items()):
        ax.plot(h["step"], h["loss"], lw=0.8, label="train")
        ev = h.get("eval") or []
        if ev and "loss" in ev[0]:
            ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", label="held-out")
        if ev and "tau" in ev[0]:
            ax2 = ax.twinx()
            ax2.plot([e["step"] for e in ev], [e["tau"] for e in ev], "s-", color="C2", label="held-out tau")
            ax2.set_ylabel("tau (acceptance length)")
            ax2.legend(loc="upper center")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _thin(h: dict[str, list], n: int = 400) -> dict[str, list]:
    idx = _spread(len(h["step"]), n)
    return {k: ([h[k][i] for i in idx] if k != "eval" else h[k]) for k in h}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every phase; returns the report (also written to ``--out/train_report.json``). With ``--max-minutes``,
    a run that runs out of time returns ``{"incomplete": True, "message": ...}`` after checkpointing."""
    args, cfg = parse_args(argv)
    if args.deterministic and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        # read when the backend starts (the first device use below); a no-op on CPU
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    try:
        return _main(args, cfg, deadline, argv)
    except OutOfTime as e:
        log(str(e))
        return {"incomplete": True, "message": str(e)}


def _main(args: argparse.Namespace, cfg: dict[str, Any], deadline: float | None,
          argv: Sequence[str] | None) -> dict[str, Any]:
    t_all = time.perf_counter()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    work, out = os.path.abspath(args.work_dir), os.path.abspath(args.out)
    os.makedirs(work, exist_ok=True)
    platform_name = jax.default_backend()
    if platform_name != "cpu":  # resumed / repeated runs skip recompiling
        enable_compile_cache(os.path.join(work, "jax_cache"))
    cdt = {"auto": "bfloat16" if platform_name in ("gpu", "cuda", "rocm", "tpu") else "float32"}.get(
        args.compute_dtype, args.compute_dtype)
    cdtype, edtype = jnp.dtype(cdt), jnp.dtype(args.export_dtype)
    T = cfg["seq_len"]
    log(f"[setup] preset {args.preset}, backend {platform_name} ({jax.devices()[0].device_kind}), compute {cdt}, "
        f"export {args.export_dtype}, seq_len {T}, work {work}, out {out}")
    seed = args.seed
    settings = {"preset": args.preset, "config": cfg, "seed": seed, "compute_dtype": cdt,
                "export_dtype": args.export_dtype, "drafter_labels": args.drafter_labels,
                "scorer": not args.no_scorer, "deterministic": args.deterministic,
                "init_target": args.init_target and os.path.abspath(args.init_target),
                "extend_target": args.extend_target,
                "init_drafter": args.init_drafter and os.path.abspath(args.init_drafter)}
    run_cfg_path = os.path.join(work, "run_config.json")
    if args.resume and os.path.exists(run_cfg_path):
        with open(run_cfg_path) as fh:
            prev = json.load(fh)
        if prev != json.loads(json.dumps(settings)):
            raise SystemExit(f"--resume: the settings differ from the run in {work} (see {run_cfg_path}); "
                             "rerun without --resume, or pass another --work-dir")
    with open(run_cfg_path, "w") as fh:
        json.dump(settings, fh, indent=1)

    # ---- data ----------------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    hp_l = cfg["train"].get("target_long")
    long_T = hp_l["seq_len"] if hp_l and hp_l.get("steps") else None
    data = prepare_data(cfg["data"], T, seed, work, long_T)
    hp_c = cfg["train"].get("target_copy")
    copy_warmup = bool(hp_c and hp_c.get("steps")) and not args.init_target
    scorer_copy = not args.no_scorer and bool((cfg["train"].get("scorer_copy") or {}).get("steps"))
    if args.extend_target and not long_T:
        raise SystemExit("--extend-target: the preset has no target_long phase (train.target_long.steps)")
    trained_target = (["target"] + (["target_long"] if long_T else []) if not args.init_target else
                      ["target_long"] if args.extend_target else [])
    order = (["target_copy"] if copy_warmup else []) + trained_target + \
        ["drafter"] + (["scorer_copy"] if scorer_copy else []) + ([] if args.no_scorer else ["scorer"])

    def time_cap(name: str) -> float | None:
        """Seconds of steps the --time-budget leaves phase ``name``: the rest of the budget less the later phases'
        step budgets and PHASE_RESERVE_S for each phase's compile / eval / labels and the export."""
        if args.time_budget is None:
            return None
        later = order[order.index(name) + 1:]
        reserve = sum(0.9 * 60 * (cfg["train"][n].get("minutes") or 0) for n in later)
        return _T_START + args.time_budget - time.time() - reserve - PHASE_RESERVE_S * (len(later) + 1)

    t_data = time.perf_counter() - t0
    sp = data.special_ids
    ev_sets = eval_sets(data, cfg["eval"]["seqs"])
    tau_pool = np.concatenate([data.eval[k] for k in ("chat", "stdlib") if k in data.eval and len(data.eval[k])])
    tau_rows = tau_pool[_spread(len(tau_pool), cfg["eval"]["tau_seqs"])]

    # ---- target --------------------------------------------------------------------------------------------------
    tcfg = tc.target_config(cfg["target"], data.vocab_size, eos_token_id=sp["<|im_end|>"],
                            pad_token_id=sp["<|endoftext|>"])
    # the long phase extends the context: with its rope_scaling (YaRN over the rows the target phases saw) it
    # trains, and the exported target serves, at tcfg_long; without one tcfg_long is tcfg
    long_scaling = (hp_l or {}).get("rope_scaling") if long_T else None
    tcfg_long = tcfg if not long_scaling else tc.target_config(
        {**cfg["target"], "rope_scaling": long_scaling}, data.vocab_size, eos_token_id=sp["<|im_end|>"],
        pad_token_id=sp["<|endoftext|>"])
    tp = init_target(tcfg, jax.random.key(seed),
                     qk_norm_init=float(cfg["train"]["target"].get("qk_norm_init", 0.0)))
    log(f"[target] {n_params(tp):,} parameters; layers {''.join('A' if t == FULL else 'G' for t in tcfg.layer_types)}")
    hp_t = cfg["train"]["target"]

    # assistant turns (the answers: retrieved keys, chat replies) weigh answer_weight times a text token in the
    # target's loss: a retrieval document holds a handful of answer tokens among ~1000 haystack tokens
    asst_ids = {"im_start": sp["<|im_start|>"], "im_end": sp["<|im_end|>"],
                "assistant": _token_ids(data.tokenizer_dir, "assistant")}

    def make_lm_loss(logits_fn: Callable, answer_weight: float) -> Callable:
        """Next-token CE of ``logits_fn(compute params, tokens [B, T]) -> [B, T, V]`` on a batch of rows or of
        (rows, weights) (copy rows weigh only their repeated halves); assistant answers weigh ``answer_weight``."""
        def lm_loss(params, frozen, batch, key):
            tokens, w = batch if isinstance(batch, tuple) else (batch, None)
            if answer_weight != 1.0:
                a = 1.0 + (answer_weight - 1.0) * assistant_mask(tokens, asst_ids["im_start"], asst_ids["assistant"],
                                                                 asst_ids["im_end"])
                w = a if w is None else w * a
            return weighted_next_token_ce(logits_fn(compute_params(params, cdtype), tokens), tokens, w), {}
        return lm_loss

    def t_hidden_at(c: TargetConfig) -> Callable:
        return lambda p, tok: target_hidden(p, c, tok)[0]

    def make_target_loss(answer_weight: float, c: TargetConfig = tcfg) -> Callable:
        return make_lm_loss(lambda p, tok: qwen36.lm_logits(p, t_hidden_at(c)(p, tok)), answer_weight)

    target_loss = make_target_loss(float(hp_t.get("answer_weight", 1.0)))
    t_hidden = t_hidden_at(tcfg)
    ev_batch = max(1, min(hp_t["batch"], 16))
    lm_evals: dict[TargetConfig, Callable] = {}

    def target_eval(p, c: TargetConfig = tcfg) -> dict[str, float]:
        """Held-out LM eval of target params ``p`` run at config ``c`` (one jitted eval per config)."""
        if c not in lm_evals:
            lm_evals[c] = make_lm_eval(t_hidden_at(c), ev_sets, ev_batch)
        return lm_evals[c](compute_params(p, cdtype))
    # synthetic copy rows (copy_rows) mixed into the target's rows from step 0: a dense signal for the induction
    # (copy) mechanism that retrieving a needle needs; only their repeated halves carry loss
    from tokenizers import Tokenizer as HFTokenizer

    copy_ids = value_token_ids(HFTokenizer.from_file(os.path.join(data.tokenizer_dir, "tokenizer.json")))
    ind_rows, ind_w = copy_rows(16, min(T, 512), copy_ids, seed + 5)
    def copy_phase(name: str, params: Any, loss_fn: Callable, hidden_fn: Callable, hp: dict[str, Any],
                   row_seed: int) -> tuple[Any, PhaseResult, dict[str, float]]:
        """Copy rows alone (short, cheap): the induction mechanism forms here within ~1-2K steps, where mixed into
        text from step 0 it had not formed in a whole target phase (experiments/results/retrieval_proxy_*); the
        text phase then keeps it with its own copy rows. Returns (params, result, induction eval)."""
        rows, w = copy_rows(hp["rows"], hp["seq_len"], copy_ids, row_seed)
        log(f"[{name}] {len(rows)} copy rows of {hp['seq_len']} ({len(copy_ids)} value token ids)")
        res = run_phase(name, params, None, loss_fn, Batches(rows, hp["batch"], row_seed, w), hp, work=work,
                        resume=args.resume, seed=seed, log_every=cfg["log_every"], ckpt_every=cfg["ckpt_every"],
                        tokens_per_step=hp["batch"] * hp["seq_len"], deadline=deadline, max_seconds=time_cap(name))
        t0 = time.perf_counter()
        ind = make_induction_eval(hidden_fn, ind_rows, ind_w, 4)(compute_params(res.params, cdtype))
        log(f"[{name}] induction_acc {ind['induction_acc']:.3f} on held-out copy rows of {ind_rows.shape[1]} "
            f"({time.perf_counter() - t0:.1f}s)")
        return res.params, res, ind

    def text_batches(name: str, hp: dict[str, Any], batch_seed: int, copy_seed: int) -> Batches:
        """The training rows, with ``hp["copy_fraction"]`` of synthetic copy rows mixed in (weighted rows)."""
        frac = float(hp.get("copy_fraction", 0.0))
        if frac <= 0:
            return Batches(data.train, hp["batch"], batch_seed)
        n_copy = max(1, int(round(frac * len(data.train) / (1.0 - frac))))
        c_rows, c_w = copy_rows(n_copy, T, copy_ids, copy_seed)
        log(f"[{name}] {n_copy} copy rows ({len(copy_ids)} value token ids) mixed into {len(data.train)} text rows "
            f"({frac:.0%})")
        return Batches(np.concatenate([data.train, c_rows]), hp["batch"], batch_seed,
                       np.concatenate([np.ones(data.train.shape, np.float32), c_w]))

    retrieval: dict[str, dict[str, float]] = {}
    res_c = res_t = res_l = None
    r_evals: dict[TargetConfig, Callable] = {}

    def eval_retrieval(stage: str, tag: str, c: TargetConfig) -> None:
        """``retrieval[stage]`` = the needle / induction eval of the target as it is now (run at config ``c``),
        logged under ``tag``."""
        if not data.retrieval_eval:
            return
        if c not in r_evals:
            needle_fn = make_retrieval_eval(t_hidden_at(c), data.retrieval_eval, 4)
            induction_fn = make_induction_eval(t_hidden_at(c), ind_rows, ind_w, 4)
            r_evals[c] = lambda p: needle_fn(p) | induction_fn(p)
        t0 = time.perf_counter()
        retrieval[stage] = r_evals[c](compute_params(tp, cdtype))
        log(f"[{tag}] held-out retrieval: " + " ".join(f"{k} {v:.3f}" for k, v in retrieval[stage].items()) +
            f" ({time.perf_counter() - t0:.1f}s)")

    dcfg = tc.drafter_config(cfg["drafter"], tcfg, sp["<|mask|>"])
    dp_init = None
    if args.init_target:
        tp, tcfg = load_trained_target(args.init_target, (tcfg, tcfg_long), data.tokenizer_dir)
        log(f"[target] loaded from {args.init_target} " + ("(its context is extended below)" if args.extend_target
                                                           else "(not trained)"))
        if args.init_drafter:  # before any evaluation: a mismatched drafter is refused at once
            dp_init = load_trained_drafter(args.init_drafter, dcfg)
            log(f"[drafter] loaded from {args.init_drafter} (training continues from it)")
        eval_retrieval("loaded", "target", tcfg)
    else:
        if copy_warmup:
            tp, res_c, retrieval["after_copy"] = copy_phase("target_copy", tp, make_target_loss(1.0), t_hidden,
                                                            hp_c, seed + 6)
        t_batches = text_batches("target", hp_t, seed, seed + 4)
        res_t = run_phase("target", tp, None, target_loss, t_batches, hp_t, work=work,
                          resume=args.resume, seed=seed, log_every=cfg["log_every"], ckpt_every=cfg["ckpt_every"],
                          eval_fn=target_eval, eval_every=cfg["eval"]["every"], tokens_per_step=hp_t["batch"] * T,
                          deadline=deadline, max_seconds=time_cap("target"))
        tp = res_t.params
        eval_retrieval("after_target", "target", tcfg)
    if "target_long" in trained_target:
        if data.train_long is None or not len(data.train_long):
            raise SystemExit("target_long: no long training rows (data.n_retrieval_long is 0?)")
        if long_scaling:
            eval_retrieval("extended_untrained", "target_long", tcfg_long)
        log(f"[target_long] {len(data.train_long)} rows of {long_T}, each holding a whole retrieval document" +
            (f"; rotary scaling {tcfg_long.rope_scaling}" if long_scaling else ""))
        res_l = run_phase("target_long", tp, None, make_target_loss(float(hp_l.get("answer_weight", 1.0)), tcfg_long),
                          Batches(data.train_long, hp_l["batch"], seed + 3), hp_l, work=work, resume=args.resume,
                          seed=seed, log_every=cfg["log_every"], ckpt_every=cfg["ckpt_every"],
                          tokens_per_step=hp_l["batch"] * long_T, deadline=deadline,
                          max_seconds=time_cap("target_long"))
        tp, tcfg = res_l.params, tcfg_long
        eval_retrieval("after_target_long", "target_long", tcfg)
    t0 = time.perf_counter()
    t_eval = target_eval(tp, tcfg)
    if res_l or res_t:
        (res_l or res_t).history["eval"].append({"step": (res_l or res_t).steps, **t_eval})
    log("[target] held-out: " + " ".join(f"{k} {v:.4g}" for k, v in t_eval.items()) +
        f" ({time.perf_counter() - t0:.1f}s)")

    # ---- drafter -------------------------------------------------------------------------------------------------
    dp = dp_init if dp_init is not None else dflash.init_params(dcfg, jax.random.fold_in(jax.random.key(seed), 1),
                                                                 F32)
    d_seed = args.drafter_seed if args.drafter_seed is not None else (
        seed + CONTINUE_SEED_OFFSET if dp_init is not None else seed)
    hp_d = cfg["train"]["drafter"]
    frozen_t = compute_params(tp, cdtype)
    layers = tuple(dcfg.target_layer_ids)
    blk = dcfg.block_size
    log(f"[drafter] {n_params(dp):,} parameters; {dcfg.num_layers} layers {dcfg.layer_types}; target layers "
        f"{layers}; block {blk}; mask id {dcfg.mask_token_id}; labels = {args.drafter_labels}")

    def drafter_loss(params, tparams, tokens, key):
        p = compute_params(params, cdtype)
        h, feats = target_hidden(tparams, tcfg, tokens, layers)
        feats = jax.lax.stop_gradient(features(feats))
        if args.drafter_labels == "target":
            am = jnp.argmax(qwen36.lm_logits(tparams, h[:, :-1]), axis=-1).astype(tokens.dtype)
            seq = jnp.concatenate([tokens[:, :1], am], axis=1)  # seq[t] = the target's prediction for position t
        else:
            seq = tokens
        mask = jnp.ones(tokens.shape, bool).at[:, 0].set(False)  # anchors need context (position >= 1)
        anchors, av = dflash.sample_anchors(key, mask, hp_d["anchors"])
        logits = dflash.train_forward(p, dcfg, tparams["embed"], tparams["lm_head"], feats, tokens, anchors)
        labels, valid = dflash.block_labels(dcfg, seq, anchors, None, av)
        loss = dflash.dflash_loss(logits, labels, valid, hp_d["gamma"])
        acc = dflash.acceptance_length(logits, labels, valid)
        return loss, {"accept_len": jnp.sum(acc * av) / jnp.maximum(jnp.sum(av), 1)}

    t0 = time.perf_counter()
    anchors = tau_anchors(len(tau_rows), T, cfg["eval"]["tau_anchors"], seed, blk)
    labels_g = greedy_labels(frozen_t, tcfg, tau_rows, anchors, blk)
    t_labels = time.perf_counter() - t0
    d_eval_fn = make_tau_eval(dcfg, tcfg, frozen_t, tau_rows, anchors, labels_g)
    drafter_eval = lambda p: d_eval_fn(compute_params(p, cdtype))
    tau_init = drafter_eval(dp)
    log(f"[drafter] tau at init {tau_init['tau']:.3f} ({len(tau_rows)}x{anchors.shape[1]} anchors; greedy "
        f"labels {t_labels:.1f}s)")
    res_d = run_phase("drafter", dp, frozen_t, drafter_loss, Batches(data.train, hp_d["batch"], d_seed + 1), hp_d,
                      work=work, resume=args.resume, seed=d_seed, log_every=cfg["log_every"],
                      ckpt_every=cfg["ckpt_every"], eval_fn=drafter_eval, eval_every=cfg["eval"]["every"],
                      tokens_per_step=hp_d["batch"] * T, deadline=deadline, max_seconds=time_cap("drafter"))
    dp = res_d.params
    d_eval = drafter_eval(dp)
    res_d.history["eval"].append({"step": res_d.steps, **d_eval})
    log("[drafter] held-out: " + " ".join(f"{k} {v:.4g}" for k, v in d_eval.items()))

    # ---- scorer --------------------------------------------------------------------------------------------------
    res_s, s_eval, scfg, res_sc, s_retrieval = None, None, None, None, {}
    if not args.no_scorer:
        scfg = tc.dense_config(cfg["scorer"], data.vocab_size, eos_token_id=sp["<|im_end|>"],
                               pad_token_id=sp["<|endoftext|>"])
        sparams = dense.init_params(scfg, jax.random.fold_in(jax.random.key(seed), 2), F32)
        hp_s = cfg["train"]["scorer"]
        log(f"[scorer] {n_params(sparams):,} parameters (plain Qwen3 dense, {scfg.num_layers} layers)")

        s_hidden = lambda p, tok: dense.hidden_states(p, scfg, tok)  # noqa: E731

        def s_logits(p, tok):
            h = s_hidden(p, tok)
            return jnp.einsum("btd,vd->btv", h, p["lm_head"].astype(h.dtype), preferred_element_type=F32)

        scorer_loss = make_lm_loss(s_logits, float(hp_s.get("answer_weight", 1.0)))
        s_eval_fn = make_lm_eval(s_hidden, ev_sets, ev_batch)
        scorer_eval = lambda p: s_eval_fn(compute_params(p, cdtype))  # noqa: E731
        hp_sc = cfg["train"].get("scorer_copy")
        if hp_sc and hp_sc.get("steps"):
            # PFlash ranks chunks by the scorer's attention from the prompt's last tokens: the chunk a question is
            # about is found by a model that retrieves, i.e. one with the copy mechanism the target needs too
            sparams, res_sc, s_retrieval["after_copy"] = copy_phase("scorer_copy", sparams, make_lm_loss(s_logits, 1.0),
                                                                    s_hidden, hp_sc, seed + 7)
        res_s = run_phase("scorer", sparams, None, scorer_loss, text_batches("scorer", hp_s, seed + 2, seed + 8),
                          hp_s, work=work, resume=args.resume, seed=seed, log_every=cfg["log_every"],
                          ckpt_every=cfg["ckpt_every"], eval_fn=scorer_eval, eval_every=cfg["eval"]["every"],
                          tokens_per_step=hp_s["batch"] * T, deadline=deadline, max_seconds=time_cap("scorer"))
        s_eval = scorer_eval(res_s.params)
        res_s.history["eval"].append({"step": res_s.steps, **s_eval})
        log("[scorer] held-out: " + " ".join(f"{k} {v:.4g}" for k, v in s_eval.items()))
        if data.retrieval_eval:
            s_retrieval["after_scorer"] = (make_retrieval_eval(s_hidden, data.retrieval_eval, 4)(
                compute_params(res_s.params, cdtype)) | make_induction_eval(s_hidden, ind_rows, ind_w, 4)(
                compute_params(res_s.params, cdtype)))
            log("[scorer] held-out retrieval: " + " ".join(
                f"{k} {v:.3f}" for k, v in s_retrieval["after_scorer"].items()))

    # ---- export --------------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    save_target(os.path.join(out, "target"), tcfg, tp, edtype, args.max_file_bytes)
    _copy_tokenizer(data.tokenizer_dir, os.path.join(out, "target"))
    save_drafter(os.path.join(out, "drafter"), dcfg, jax.tree_util.tree_map(
        lambda x: x.astype(edtype) if x.ndim >= 2 else x, dp))
    if res_s is not None:
        dense.save_dense(os.path.join(out, "scorer"), scfg, jax.tree_util.tree_map(
            lambda x: x.astype(edtype) if x.ndim >= 2 else x.astype(F32), res_s.params))
        _copy_tokenizer(data.tokenizer_dir, os.path.join(out, "scorer"))
    _readable(out)
    too_big = [f"{os.path.relpath(os.path.join(d, f), out)} ({os.path.getsize(os.path.join(d, f))} bytes)"
               for d, _, fs in os.walk(out) for f in fs if os.path.getsize(os.path.join(d, f)) > args.max_file_bytes]
    if too_big:
        raise RuntimeError(f"exported files over {args.max_file_bytes} bytes: {too_big}")
    check = verify_export(out, tcfg, tp, dcfg, dp, tau_rows[0, : min(T, 128)], edtype)
    t_export = time.perf_counter() - t0
    log(f"[export] {out}: " + " ".join(f"{k} {v}" for k, v in check.items()))

    # ---- report --------------------------------------------------------------------------------------------------
    curves = ({"target_copy": res_c.history} if res_c else {}) | ({"target": res_t.history} if res_t else {}) | (
        {"target_long": res_l.history} if res_l else {}) | {"drafter": res_d.history}
    if res_s is not None:
        curves["scorer"] = res_s.history
    try:
        png = _plot(os.path.join(out, "loss_curves.png"), curves)
    except Exception as e:  # never lose the report to a plotting problem
        log(f"[report] loss_curves.png failed: {e!r}")
        png = None

    def first_last(h):
        k = max(1, min(10, len(h["loss"]) // 10))
        return {"first": float(np.mean(h["loss"][:k])) if h["loss"] else None,
                "last": float(np.mean(h["loss"][-k:])) if h["loss"] else None}

    report = {
        "command": "python experiments/train_tiny.py " + " ".join(argv_list),
        "argv": argv_list, "settings": settings,
        "seeds": {"base": seed, "target_init": f"key({seed})",
                  "drafter_init": (f"loaded from {args.init_drafter}" if dp_init is not None
                                   else f"fold_in(key({seed}), 1)"),
                  "drafter_anchors": f"fold_in(key({d_seed}), sha1('drafter')) per step",
                  "scorer_init": f"fold_in(key({seed}), 2)", "batch_order": {"target": seed, "drafter": d_seed + 1,
                                                                              "scorer": seed + 2},
                  "corpus": seed, "eval_anchors": [seed, 7]},
        "environment": {"python": platform.python_version(), "jax": jax.__version__, "optax": optax.__version__,
                        "backend": platform_name, "device": jax.devices()[0].device_kind,
                        "n_devices": jax.device_count()},
        "data": {k: v for k, v in data.meta.items() if k not in ("key", "dir")} | {
            "held_out": {"stdlib_files": data.meta["eval_files"], "rule": data.meta["split_rule"],
                         "eval_rows_used": {k: int(len(v)) for k, v in ev_sets.items()},
                         "tau_rows": int(len(tau_rows)), "tau_anchors_per_row": int(anchors.shape[1])},
            "work_dir": data.meta["dir"]},
        "target": {"config": tc.target_hf_dict_from_config(tcfg, args.export_dtype)["text_config"],
                   "parameters": n_params(tp), "held_out": t_eval, "retrieval": retrieval,
                   "loaded_from": args.init_target,
                   "train_loss": res_t and first_last(res_t.history), "timing": res_t and res_t.timing,
                   "resumed_from": res_t and res_t.resumed_from, "hparams": res_t and hp_t,
                   "copy": None if res_c is None else {
                       "train_loss": first_last(res_c.history), "timing": res_c.timing,
                       "resumed_from": res_c.resumed_from, "hparams": hp_c},
                   "long": None if res_l is None else {
                       "train_loss": first_last(res_l.history), "timing": res_l.timing,
                       "resumed_from": res_l.resumed_from, "hparams": hp_l}},
        "drafter": {"config": dcfg.to_hf_dict(), "parameters": n_params(dp), "held_out": d_eval,
                    "held_out_at_init": tau_init, "train_loss": first_last(res_d.history), "timing": res_d.timing,
                    "resumed_from": res_d.resumed_from, "hparams": hp_d,
                    "greedy_label_seconds": round(t_labels, 2), "loaded_from": args.init_drafter},
        "scorer": None if res_s is None else {
            "config": scfg.to_hf_dict(), "parameters": n_params(res_s.params), "held_out": s_eval,
            "train_loss": first_last(res_s.history), "timing": res_s.timing, "resumed_from": res_s.resumed_from,
            "hparams": cfg["train"]["scorer"], "retrieval": s_retrieval,
            "copy": None if res_sc is None else {"train_loss": first_last(res_sc.history), "timing": res_sc.timing,
                                                 "hparams": cfg["train"]["scorer_copy"]}},
        "export": {"dir": out, "dtype": args.export_dtype, "check": check, "loss_curves_png": png,
                   "seconds": round(t_export, 2)},
        "timing": {"data_seconds": round(t_data, 2), "total_seconds": round(time.perf_counter() - t_all, 2)},
        "curves": {k: _thin(v) for k, v in curves.items()},
    }
    with open(os.path.join(out, "train_report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    acceptance.write_held_out_archive(out, data.meta["eval_files"], data.meta["stdlib_dir"])
    last_r = retrieval.get("after_target_long") or retrieval.get("after_target") or retrieval.get("loaded") or {}
    log(f"[done] {report['timing']['total_seconds']:.1f}s; target ppl {t_eval['ppl']:.3f}" +
        "".join(f", {k} {v:.2f}" for k, v in last_r.items() if k.startswith("needle_acc")) + ", drafter tau "
        f"{d_eval['tau']:.3f} (init {tau_init['tau']:.3f})" +
        (f", scorer ppl {s_eval['ppl']:.3f}" if s_eval else "") + f"; report {out}/train_report.json")
    return report


def load_trained_target(path: str, configs: Sequence[TargetConfig], tokenizer_dir: str
                        ) -> tuple[Any, TargetConfig]:
    """``(float32 parameters, config)`` of an exported target (``--init-target``), refused unless its config is
    one of ``configs`` (this preset's target before and after its context extension) and its tokenizer is this
    run's (the drafter and scorer learn from this run's token ids)."""
    from dflash_jax import load_target

    tcfg = load_target(path, dtype="float32").config
    if tcfg not in configs:
        raise SystemExit(f"--init-target {path}: its config.json is not this preset's target config; train the "
                         "target (drop --init-target) or pass the matching --preset / --set values")
    with open(os.path.join(path, "tokenizer.json"), "rb") as fh, \
            open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb") as fh2:
        if fh.read() != fh2.read():
            raise SystemExit(f"--init-target {path}: its tokenizer.json differs from this run's ({tokenizer_dir}); "
                             "the corpus or the tokenizer settings changed since it was trained")
    return loader.load_params(path, tcfg, dtype=F32), tcfg


def load_trained_drafter(path: str, dcfg: DrafterConfig) -> Any:
    """The float32 parameters of an exported drafter (``--init-drafter``, read with ``load_drafter``), refused
    unless its config.json is the drafter config this run would train (same preset, same target, same mask id). Its
    DDTree level bonus is an inference setting calibrated for those weights: not compared, and not carried over
    (calibrate the continued drafter again, ``experiments/calibrate_level_bonus.py``)."""
    got, params = load_drafter(path, dtype=F32)
    if dataclasses.replace(got, ddtree_level_bonus=dcfg.ddtree_level_bonus) != dcfg:
        diff = {k: (v, getattr(dcfg, k)) for k, v in dataclasses.asdict(got).items()
                if v != getattr(dcfg, k, None)} if dataclasses.is_dataclass(got) else {}
        raise SystemExit(f"--init-drafter {path}: its config.json is not this preset's drafter config"
                         + (f" (checkpoint vs preset: {diff})" if diff else "") +
                         "; pass the matching --preset / --set drafter.* values, or drop --init-drafter")
    return params


def verify_export(out: str, tcfg: TargetConfig, tp: Any, dcfg: DrafterConfig, dp: Any, ids: np.ndarray,
                  edtype) -> dict[str, Any]:
    """Reload the exported target with ``dflash_jax.load_target`` and the drafter with ``load_drafter``; compare
    logits with the trained parameters (rounded to the export dtype) and the drafter tensors."""
    from dflash_jax import load_target

    target = load_target(os.path.join(out, "target"), dtype="float32")
    if target.config != tcfg:
        raise RuntimeError("exported target config.json does not parse back to the trained config")
    got = np.asarray(target.logits([int(i) for i in ids]))
    rounded = jax.tree_util.tree_map(lambda x: x.astype(edtype).astype(F32) if x.ndim >= 2 else x, tp)
    ref = jax.jit(lambda p, t: qwen36.lm_logits(p, target_hidden(p, tcfg, t)[0][0]))
    want = np.asarray(ref(rounded, jnp.asarray(ids, jnp.int32)[None]))
    dcfg2, dp2 = load_drafter(os.path.join(out, "drafter"), dtype=F32)
    if dcfg2 != dcfg:
        raise RuntimeError("exported drafter config.json does not parse back to the trained config")
    ddiff = max(float(jnp.max(jnp.abs(a - (b.astype(edtype).astype(F32) if b.ndim >= 2 else b))))
                for a, b in zip(jax.tree_util.tree_leaves(dp2), jax.tree_util.tree_leaves(dp)))
    return {"target_max_abs_logit_diff": float(np.max(np.abs(got - want))),
            "target_greedy_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
            "drafter_max_abs_param_diff": ddiff}


if __name__ == "__main__":
    sys.exit(3 if main().get("incomplete") else 0)
