"""``python -m dflash_jax.bench acceptance``: how far the drafter's blocks agree with the target, on held-out text.

Teacher-forced, at fixed anchor positions of held-out rows (the context before an anchor is the real text):

* the label of an anchor is the target's own greedy continuation from the anchor (``blk - 1`` tokens, decoded by
  the engine with a KV cache);
* ``chain.tau``: 1 + the number of leading positions where the drafter's argmax block equals the label (a chain
  of the block's top-1 tokens; the 1 is the bonus token every round emits);
* ``ddtree.tau``: 1 + the depth of the deepest node on the label path of the DDTree built from the drafter's
  per-position log-probabilities with ``--budget`` nodes (``spec.ddtree.build_tree``, the engine's tree builder):
  the best path of the tree, i.e. what verification would accept. The tree is the engine's (best-first, or
  chain-seeded with ``--chain-seed``); ``ddtree.best_first.tau`` and ``ddtree.chain_seed.tau`` give both, at
  ``--budget`` and at each ``--sweep-budgets`` size (``ddtree.budgetN.*``: the node budgets a capped
  ``max_verify_tokens`` gives large batch buckets). Trees take the drafter's level bonus
  (``dflash_config.ddtree_level_bonus``) unless ``--level-bonus`` says otherwise (``ddtree.level_bonus``: the one
  used; ``ddtree.no_bonus.tau``: the paper's tree, bonus 0, when it differs); ``--sweep-level-bonus`` reports
  ``ddtree.level_bonus_<v>.tau`` at each value (``experiments/calibrate_level_bonus.py`` picks a drafter's on
  training text).

Then the real thing (``--engine-prompts`` > 0): the engine decodes held-out prompts greedily with AR and with DDTree
speculative decoding (cohort-yield off), checks the outputs are identical, and reports the mean tokens emitted per
speculative round (``engine.ddtree.tau``) and the per-position acceptance histogram.

Held-out text: by default the standard-library files held out of the training of the model set
(``train_report.json`` next to the checkpoints lists them), read from this interpreter's standard library;
``--files`` reads any text files instead.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import sysconfig
import tarfile
import tempfile
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import results
from dflash_jax.bench.sources import add_source_arguments, load_drafter_source, load_target_source
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
from dflash_jax.engine.spec_steps import SpecConfig, features
from dflash_jax.models import dflash
from dflash_jax.models.tokenizer import Tokenizer
from dflash_jax.spec import draft_vocab
from dflash_jax.spec.ddtree import build_tree


def add_held_out_arguments(p: argparse.ArgumentParser, anchors: int = 16) -> None:
    """The held-out rows and the anchors / DDTree budget of the teacher-forced tau (shared with ``bench quality``)."""
    p.add_argument("--files", nargs="+", help="held-out text files (default: the model set's held-out stdlib files)")
    p.add_argument("--report", help="train_report.json listing the held-out files (default: next to --model)")
    p.add_argument("--rows", type=int, default=16, help="held-out rows")
    p.add_argument("--row-len", type=int, default=512, help="tokens per row")
    p.add_argument("--anchors", type=int, default=anchors, help="anchor positions per row")
    p.add_argument("--budget", type=int, default=22, help="DDTree budget (nodes besides the root)")
    p.add_argument("--seed", type=int, default=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"))
    add_held_out_arguments(p)
    p.add_argument("--chain-seed", action=argparse.BooleanOptionalAction, default=False,
                   help="the engine's trees (and ddtree.tau) around the drafter's top-1 chain (SpecConfig.chain_seed)")
    p.add_argument("--level-bonus", type=float, default=None, metavar="NATS",
                   help="nats added per tree level (SpecConfig.level_bonus); default: the drafter's calibrated one")
    p.add_argument("--sweep-level-bonus", type=float, nargs="*", default=[], metavar="NATS",
                   help="also report ddtree.level_bonus_<v>.tau (best-first trees at --budget) at these bonuses")
    p.add_argument("--sweep-budgets", type=int, nargs="*", default=[3, 7, 15, 31],
                   help="also report both tree kinds at these budgets")
    p.add_argument("--sweep-draft-vocab", type=int, nargs="*", default=[], metavar="N",
                   help="also report chain / DDTree tau when drafting over token ids 0..N-1 plus EOS "
                        "(SpecConfig.draft_vocab): ddtree.draft_vocab<N>.tau, chain.draft_vocab<N>.tau")
    p.add_argument("--engine-prompts", type=int, default=8, help="prompts for the engine AR/DDTree run (0 = skip)")
    p.add_argument("--engine-tokens", type=int, default=64, help="tokens generated per engine prompt")


HELD_OUT_ARCHIVE = "held_out_stdlib.tar.gz"  # beside train_report.json: the held-out files as the set was made with


def held_out_names(model_dir: str, report: str | None = None) -> tuple[str, list[str]]:
    """(the report's path, the held-out standard-library files it lists, relative to the stdlib root)."""
    path = report or os.path.join(os.path.dirname(os.path.abspath(model_dir)), "train_report.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no train_report.json; pass --files or --report")
    with open(path) as fh:
        return path, list(json.load(fh)["data"]["held_out"]["stdlib_files"])


def held_out_files(model_dir: str, report: str | None = None) -> list[str]:
    """The held-out standard-library files recorded in the model set's ``train_report.json``, as paths.

    When the set ships them (``held_out_stdlib.tar.gz`` beside the report: the files of the Python that made the
    set), they are unpacked once into a temporary directory keyed by the archive's digest and read from there, so
    every machine benchmarks the same text (another patch release's stdlib shifts every window of the prompt
    stream). Otherwise they are read from this interpreter's standard library (files missing here are skipped)."""
    path, names = held_out_names(model_dir, report)
    archive = os.path.join(os.path.dirname(path), HELD_OUT_ARCHIVE)
    if os.path.exists(archive):
        root = _unpacked(archive)
        missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
        if missing:
            raise FileNotFoundError(f"{archive} lacks held-out files of {path}: {missing[:5]}")
        return [os.path.join(root, n) for n in names]
    root = sysconfig.get_paths()["stdlib"]
    found = [os.path.join(root, n) for n in names if os.path.exists(os.path.join(root, n))]
    if not found:
        raise FileNotFoundError(f"none of the {len(names)} held-out files of {path} exist under {root}")
    return found


def write_held_out_archive(out_dir: str, names: Sequence[str], root: str | None = None) -> str:
    """Write ``out_dir/held_out_stdlib.tar.gz``: the files ``names`` (relative to ``root``, default this interpreter's
    standard library) in that order, byte-for-byte reproducible (no timestamps, owners or gzip name); returns its path.
    ``held_out_files`` reads the set's text from it, on any machine."""
    root = root or sysconfig.get_paths()["stdlib"]
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise FileNotFoundError(f"held-out files missing under {root}: {missing[:5]}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n in names:
            with open(os.path.join(root, n), "rb") as fh:
                data = fh.read()
            info = tarfile.TarInfo(n)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tf.addfile(info, io.BytesIO(data))
    path = os.path.join(out_dir, HELD_OUT_ARCHIVE)
    with open(path, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=9) as gz:
        gz.write(buf.getvalue())
    return path


def _unpacked(archive: str) -> str:
    """The directory holding ``archive``'s files (a tar.gz of relative paths), unpacked on first use."""
    with open(archive, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()[:16]
    root = os.path.join(tempfile.gettempdir(), f"dflash_jax_held_out_{digest}")
    if not os.path.isdir(root):
        tmp = tempfile.mkdtemp(prefix=os.path.basename(root) + ".", dir=os.path.dirname(root))
        with tarfile.open(archive, "r:gz") as tf:
            tf.extractall(tmp, filter="data")
        try:
            os.rename(tmp, root)
        except OSError:  # another process unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def held_out_rows(tok: Tokenizer, files: Sequence[str], rows: int, row_len: int) -> np.ndarray:
    """``[rows, row_len]`` token rows: the files tokenised and cut into consecutive rows, spread over the files."""
    ids: list[int] = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids.extend(tok.encode(fh.read()))
    n = len(ids) // row_len
    if n == 0:
        raise ValueError(f"the held-out files give {len(ids)} tokens, fewer than one row of {row_len}")
    pick = np.unique(np.linspace(0, n - 1, min(rows, n)).astype(int))
    arr = np.asarray(ids[: n * row_len], np.int32).reshape(n, row_len)
    return arr[pick]


def anchor_positions(row_len: int, blk: int, n: int, seed: int, n_rows: int) -> np.ndarray:
    """``[n_rows, n]`` anchors in ``[row_len // 8, row_len - blk)`` (some context before, a whole block after)."""
    rng = np.random.default_rng(seed)
    lo, hi = max(1, row_len // 8), row_len - blk
    return np.sort(rng.choice(np.arange(lo, hi), size=(n_rows, n), replace=hi - lo < n), axis=1).astype(np.int32)


def greedy_labels(engine: Engine, rows: np.ndarray, anchors: np.ndarray, blk: int) -> np.ndarray:
    """``[R, N, blk]``: the anchor token, then the target's greedy continuation of ``row[:anchor + 1]``."""
    prompts = [list(map(int, r[: a + 1])) for r, aa in zip(rows, anchors) for a in aa]
    outs = engine.generate(prompts, SamplingParams(max_tokens=blk - 1, temperature=0.0, ignore_eos=True))
    lab = np.asarray([[p[-1]] + list(o.token_ids) for p, o in zip(prompts, outs)], np.int32)
    return lab.reshape(anchors.shape + (blk,))


def draft_logprobs(target, dcfg, dparams, rows: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """``[R, N, blk, V]`` log-softmax of the drafter's block at every anchor, teacher-forced on the rows (through
    the drafter's own whole-vocabulary head where it has one, ``spec_steps.with_draft_quantization``)."""
    from dflash_jax.engine.spec_steps import DRAFT_HEAD, DRAFT_IDS

    if DRAFT_IDS in dparams:
        raise ValueError("draft_logprobs scores the whole vocabulary: drop the drafting vocabulary first")
    head = dparams.get(DRAFT_HEAD, target.params["lm_head"])
    layers = tuple(dcfg.target_layer_ids)
    out = []
    fwd = jax.jit(lambda dp, f, t, a: jax.nn.log_softmax(
        dflash.train_forward(dp, dcfg, target.params["embed"], head, f, t, a), axis=-1))
    for r, a in zip(rows, anchors):
        feats = target.hidden_states(r, layers)[:, None]  # [L, 1, T, D]
        out.append(np.asarray(fwd(dparams, features(feats), jnp.asarray(r)[None], jnp.asarray(a)[None]))[0])
    return np.stack(out)


def chain_tau(lp: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """lp ``[..., blk, V]``, labels ``[..., blk]`` -> accepted length per block (bonus included)."""
    hit = np.argmax(lp[..., 1:, :], axis=-1) == labels[..., 1:]
    return 1 + np.cumprod(hit, axis=-1).sum(-1)


def label_path(tokens: np.ndarray, parent: np.ndarray, valid: np.ndarray, labels: np.ndarray) -> list[int]:
    """Slots of one tree (``[N]`` arrays of ``spec.ddtree.Tree``, slot 0 = root) on the path that follows ``labels``
    ``[blk]`` (``labels[0]`` is the root's token, ``labels[d]`` the token wanted at depth d): the root, then at each
    depth the child whose token is the next label. With the target's greedy continuation as labels this is the path
    greedy verification accepts; ``len(path)`` is the accepted length (bonus included)."""
    path, node = [0], 0
    while len(path) < len(labels):
        kids = np.nonzero(valid & (parent == node) & (tokens == labels[len(path)]))[0]
        kids = kids[kids > 0]
        if not len(kids):
            break
        node = int(kids[0])
        path.append(node)
    return path


def tree_tau(lp: np.ndarray, labels: np.ndarray, budget: int, chain_seed: bool = False,
             level_bonus: float = 0.0) -> np.ndarray:
    """The accepted length of the label path through the DDTree of each block (bonus token included)."""
    blk, v = lp.shape[-2:]
    flat_lp = lp.reshape(-1, blk, v)[:, 1:]
    flat_lab = labels.reshape(-1, blk)
    tree = jax.jit(build_tree, static_argnames=("budget", "top_k", "chain_seed", "level_bonus"))(
        jnp.asarray(flat_lp), budget=budget, chain_seed=chain_seed, level_bonus=float(level_bonus))
    tok, par, val = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid))
    out = np.asarray([len(label_path(tok[b], par[b], val[b], flat_lab[b])) for b in range(len(flat_lab))], np.int64)
    return out.reshape(labels.shape[:-1])


def restrict(lp: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drafting over the token set ``ids`` (``SpecConfig.draft_vocab``): lp ``[..., V]`` renormalised over the set
    -> (``[..., len(ids)]``, labels as set indices, -1 where a label lies outside the set: never drafted)."""
    sub = lp[..., ids]
    sub = sub - np.logaddexp.reduce(sub, axis=-1, keepdims=True)
    where = np.full(lp.shape[-1], -1, np.int64)
    where[ids] = np.arange(len(ids))
    return sub, where[labels]


def run(args: argparse.Namespace, command: str) -> int:
    target = load_target_source(args)
    dcfg, dparams = load_drafter_source(args)
    if not args.model:
        raise SystemExit("acceptance needs --model (a trained target with its tokenizer)")
    tok = Tokenizer.from_dir(args.model)
    files = args.files or held_out_files(args.model, args.report)
    blk = dcfg.block_size
    rows = held_out_rows(tok, files, args.rows, args.row_len)
    anchors = anchor_positions(rows.shape[1], blk, args.anchors, args.seed, len(rows))
    max_len = -(-(rows.shape[1] + 2 * blk + args.engine_tokens) // 64) * 64
    ar = Engine(target, tok, EngineOptions(max_batch=16, max_model_len=max_len, prefill_chunk=128))
    t0 = time.perf_counter()
    labels = greedy_labels(ar, rows, anchors, blk)
    t_labels = time.perf_counter() - t0
    t0 = time.perf_counter()
    lp = draft_logprobs(target, dcfg, dparams, rows, anchors)
    t_draft = time.perf_counter() - t0
    bonus = SpecConfig(level_bonus=args.level_bonus).bonus_for(dcfg)
    c_tau, d_tau = chain_tau(lp, labels), tree_tau(lp, labels, args.budget, args.chain_seed, bonus)
    figures: dict[str, float] = {
        "chain.tau": float(c_tau.mean()), "ddtree.tau": float(d_tau.mean()),
        "chain.first_draft_acc": float((c_tau >= 2).mean()), "ddtree.first_draft_acc": float((d_tau >= 2).mean()),
        "blocks": int(c_tau.size), "block_size": blk, "budget": args.budget, "chain_seed": int(args.chain_seed),
        "ddtree.level_bonus": float(bonus),
    }
    if bonus:
        figures["ddtree.no_bonus.tau"] = float(tree_tau(lp, labels, args.budget, args.chain_seed).mean())
    for v in args.sweep_level_bonus:
        figures[f"ddtree.level_bonus_{v:g}.tau"] = float(tree_tau(lp, labels, args.budget, False, v).mean())
    for b in [args.budget] + [b for b in args.sweep_budgets if b != args.budget]:
        name = "ddtree" if b == args.budget else f"ddtree.budget{b}"
        for kind, seeded in (("best_first", False), ("chain_seed", True)):
            t = (d_tau if (b == args.budget and seeded == args.chain_seed)
                 else tree_tau(lp, labels, b, seeded, bonus))
            figures[f"{name}.{kind}.tau"] = float(t.mean())
    for n in args.sweep_draft_vocab:
        sub, sub_labels = restrict(lp, labels, draft_vocab.resolve(n, lp.shape[-1], tok.eos_token_ids))
        figures[f"chain.draft_vocab{n}.tau"] = float(chain_tau(sub, sub_labels).mean())
        figures[f"ddtree.draft_vocab{n}.tau"] = float(tree_tau(sub, sub_labels, args.budget, args.chain_seed,
                                                               bonus).mean())
    for k in (4, 8):
        figures[f"chain.p_tau_ge{k}"] = float((c_tau >= k).mean())
        figures[f"ddtree.p_tau_ge{k}"] = float((d_tau >= k).mean())
    extra = {"files": [os.path.basename(f) for f in files], "rows": int(len(rows)), "row_len": int(rows.shape[1]),
             "seconds": {"labels": round(t_labels, 1), "drafts": round(t_draft, 1)},
             "chain_tau_hist": np.bincount(c_tau.ravel(), minlength=blk + 1).tolist(),
             "ddtree_tau_hist": np.bincount(d_tau.ravel(), minlength=blk + 1).tolist()}
    if args.engine_prompts:
        figures.update(_engine_run(args, target, tok, (dcfg, dparams), rows, max_len, ar, extra))
    results.print_table(figures)
    if not args.no_write:
        print("wrote", results.write_result("acceptance", figures, command, extra, out_dir=args.out_dir))
    return 0


def _engine_run(args, target, tok, drafter, rows, max_len, ar: Engine, extra: dict) -> dict[str, float]:
    """Greedy AR vs DDTree through the engine on held-out prompt prefixes; outputs must be identical."""
    n = min(args.engine_prompts, len(rows))
    prompts = [list(map(int, r[: rows.shape[1] // 2])) for r in rows[:n]]
    sp = SamplingParams(max_tokens=args.engine_tokens, temperature=0.0, ignore_eos=True)
    spec = Engine(target, tok, EngineOptions(max_batch=16, max_model_len=max_len, prefill_chunk=128,
                                             spec=SpecConfig(budget=args.budget, chain_seed=args.chain_seed,
                                                             level_bonus=args.level_bonus),
                                             cohort_yield_min=0.0),
                  drafter=drafter)
    out_ar = ar.generate(prompts, sp)
    out_sp = spec.generate(prompts, sp)
    same = sum(a.token_ids == b.token_ids for a, b in zip(out_ar, out_sp))
    if same != n:
        raise SystemExit(f"DDTree greedy output differs from AR on {n - same} of {n} prompts")
    modes = {o.stats["spec_mode"] for o in out_sp}
    if modes != {"ddtree"}:
        raise SystemExit(f"the speculative engine ran modes {sorted(modes)}, expected only 'ddtree'")
    steps = sum(o.stats["draft_steps"] for o in out_sp)
    emitted = steps + sum(o.stats["accepted_tokens"] for o in out_sp)
    extra["engine"] = {"prompts": n, "tokens": args.engine_tokens, "identical_to_ar": True}
    return {"engine.ddtree.tau": emitted / max(1, steps), "engine.ddtree.rounds": steps,
            "engine.identical_to_ar": 1}
