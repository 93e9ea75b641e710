"""``python -m dflash_jax.bench concurrency``: paired AR / DDTree serving at several concurrencies, fail-closed.

Method (the engine API, not the HTTP server):

* Cases: ``ar`` and ``ddtree`` at every concurrency C of ``--concurrency``. Both modes of one C get the identical
  prompts; request i has the same prompt at every C (the prompt set is one seeded list; C takes its first C).
* Prompts: lengths uniform integers in ``[--prompt-len-min, --prompt-len-max]``, request i's from its own
  ``numpy.random.default_rng([--seed, i])`` (so request i's prompt is the same whatever the largest C of a run);
  ``--prompts random`` (default): token ids uniform in ``[0, vocab)`` (the random-weight shapes' cost; a trained
  drafter accepts little on them); ``--prompts held-out``: windows of real text at uniform offsets, the held-out
  files of the ``--model`` set (its ``train_report.json``) or ``--prompt-files``, tokenised with the model's
  tokenizer, so a trained pair shows its real acceptance (printed and recorded).
* Every case gets a fresh ``Engine`` (all buckets compiled ahead by ``Engine.warmup``), then one warm-up batch of C
  requests of 8 tokens (other prompts, same length distribution), then ``--repeats`` measured batches that reuse
  that engine's executables. A batch: C requests submitted at once (or, with ``--requests N``, the same N prompts at
  every C, at most C in flight, the next submitted as one finishes: C1 then measures N prompts one after another, not
  only the first), temperature 0, seed ``--seed``, EOS ignored, exactly ``--output-len`` completion tokens each; the
  loop calls ``Engine.step`` until all finish.
* Figures are medians over the repeats: ``tok_s`` = output tokens of the batch / (last finish - first first
  token) (output-window throughput, host clock after the step that produced them); ``req_decode_tok_s`` = median
  over requests of 1 / ``tpot_s``; TTFT p50/p99 over the batch's requests (``numpy.percentile``, linear; from
  submission); ``tpot_ms`` = median request ``tpot_s``; ``accept_per_step`` (ddtree) = mean over requests of
  ``mean_accept_len`` (tokens a speculative round emitted, bonus included); ``cohort_yield_events`` = cohorts the
  yield guard switched to AR during the batch.
* Fail closed: every request of every case must prove its mode from ``RequestOutput.stats`` (ddtree:
  ``spec_mode`` in {ddtree, yielded}, ``draft_steps >= 1``, ``accepted_tokens`` and ``mean_accept_len`` reported;
  ar: ``spec_mode == "ar"`` and ``draft_steps == 0``) and exact token accounting (each request
  ``--output-len`` tokens, finish ``length``; case total = the sum = C * output-len). A requested feature that
  cannot run (PFlash without a scorer, a recipe flag the benchmark cannot map) is reported "not run: feature not
  available" before any work. Any of these makes the exit status non-zero and no result file is written.
* PFlash (``--pflash``, scorer ``--scorer PATH | --random-scorer CONFIG``): every case compresses each request's
  prompt once, just before submitting it (``prefill.pflash.compress``, mode ``--pflash-mode``, ``--pflash-keep-ratio``,
  ``--pflash-min-tokens``, ``--pflash-chunk``, ``--pflash-head-tokens``, ``--pflash-tail-tokens``; no
  ``must_keep``: the prompts are random ids without chat structure), as the server does before admission; the
  engine gets the effective prompt.
  Before the first case every distinct prompt is scored once untimed (compiles the scorer's shapes). Per request the
  proof is: raw -> effective tokens recorded, the engine prefilled exactly the effective prompt, and a prompt of at
  least ``--pflash-min-tokens`` was compressed (effective < raw), a shorter one passed through unchanged; per batch
  at least one prompt was compressed. Billing stays on the raw prompt: ``prompt_tokens_billed`` (raw, what the
  server's usage reports) and ``prompt_tokens_effective`` are both recorded and checked per case; ``pflash_scoring_s``
  is the median scorer time per request (TTFT counts from submission, after scoring).
* Recipes (``--recipe``): ``full`` = DDTree + PFlash + KVFlash (``--kvflash`` N, else ``auto``); a server preset
  (``strix_halo`` = ``configs/strix_halo.yaml``, or a YAML path) is read by the server's own preset reader and its
  flags mapped onto the benchmark's (``map_preset``: ddtree, budget, prefill compression and its scorer / ratio /
  minimum, kvflash and its scoring, cohort yield, page size, prefill chunk, dtype, max model len, parallelism).
  Device and server-only flags are recorded as not applied (the benchmark runs on JAX's default backend); flags of
  features the benchmark cannot run (fast rollback, re-probing) fail closed. A flag given on
  the command line wins over the recipe.
* KVFlash (``--kvflash N``): every ar/ddtree case runs with a resident pool of N tokens (``--kvflash-scoring``).
  Per request, the proof is its residency telemetry (``kvflash`` set, pages in/out, wait, decisions) and, when the
  request was under pressure (the batch's histories exceed the pool and its own history exceeds its fair share
  N / C), pages actually moved for it (pages in + out + clean evictions > 0). Per case under pressure, pages out > 0
  (pages in are reported: LRU never brings a page back unless the pool frees up; keys scoring does when an old
  page outscores a resident one). ``--kvflash-compare`` adds an unbounded AR case per C (mode ``ar_unbounded``) for the
  ``kvflash_vs_unbounded`` figure. Page-in bandwidth through the engine's page-in path and a plain pinned
  host->device copy are measured once per case on the idle engine (``kv_page_in_gbs``, ``kv_page_in_ratio``).
* Prefix caching (``--prefix-cache N``): every case runs with N cached-prefix snapshots; ``--shared-prefix L`` puts
  the same L random tokens (default_rng(seed + 7)) in front of every prompt, warm-up prompts included, so the
  measured requests find the shared head cached, as a common system prompt would be. Per request, when L >=
  ``--prefill-chunk``, the proof is ``cached_tokens`` > 0; ``prefix_cached_tokens`` is the mean per request.
  ``--prefix-cache-compare`` adds an AR case without the cache per C (mode ``ar_uncached``, meant to give the same
  tokens) for ``prefix_cache_speedup`` (tok/s) and ``prefix_cache_ttft_ratio`` (TTFT p50, cached / uncached).
* Oracle draft (``--oracle-tau T``, FORCED ACCEPTANCE, labelled so in every table and the JSON): for shapes without
  a trained pair (random weights), every ddtree round verifies, instead of the drafter's tree, the target's own greedy
  continuation as recorded by the same concurrency's ar case (same prompts), each position kept with the probability q
  that makes a chain of ``block_size - 1`` expect T tokens per round (``bench.spec.chain_keep_prob``), else a random
  id (``EngineOptions.spec_oracle`` -> ``spec_steps.oracle_step``; seeded per request and position). Verification,
  acceptance and commit are the engine's real ones; the ar vs ddtree hash comparison still checks losslessness. Where
  the output leaves the recorded continuation (near-tied logits in low precision, KVFlash pressure) the proposals
  stop matching and the measured ``accept_per_step`` says so. With ``--random-weights`` the oracle run peaks the
  target by default (``bench/peaked.py``: a confident bigram target at an unchanged cost, so bf16 ar and ddtree
  greedy agree; ``--no-peaked-random-weights`` keeps the plain random target).
* Progress: a line on stderr per case (repeat, tokens done of requested), unless ``--no-progress``.
* Reproducibility: sha256 of each request's greedy token ids (decimal ids joined by ``,``, UTF-8), compared
  across repeats, across concurrencies (same prompt) and between ar and ddtree (lossless). Reported as the
  ``reproducible`` figure and a mismatch list; it fails the run only with ``--require-reproducible``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import os
import sys
import time
import traceback
import zlib
from typing import Callable, Sequence

import jax
import numpy as np

from dflash_jax.bench import results
from dflash_jax.bench.peaked import add_peaked_argument, describe, peak_target, peaked_wanted
from dflash_jax.bench.sources import (add_kv_calibration_argument, add_scorer_arguments, add_source_arguments,
                                      load_drafter_source, load_scorer_source, load_target_source, parallel_options,
                                      resolve_kv_calibration)
from dflash_jax.engine.compile import compile_count
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams, replica_buckets
from dflash_jax.engine.spec_steps import SpecConfig
from dflash_jax.prefill.pflash import PFlashError, PFlashOptions, compress
from dflash_jax.spec import draft_vocab
from dflash_jax.target import Target

MODES = ("ar", "ddtree")
WARMUP_TOKENS = 8
NOT_AVAILABLE = "not run: feature not available"
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
RECIPES = ("full", "strix_halo")
KV_KEYS = ("kv_pages_in", "kv_pages_out", "kv_bytes_in", "kv_bytes_out", "kv_wait_s", "kv_deferred_steps",
           "kv_score_decisions", "kv_lru_decisions", "kv_score_fallbacks", "kv_clean_evictions",
           "kv_resident_pages", "kv_logical_pages")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--output-len", type=int, default=64, help="completion tokens per request (exactly)")
    p.add_argument("--prompt-len-min", type=int, default=256)
    p.add_argument("--prompt-len-max", type=int, default=1024)
    p.add_argument("--prompts", choices=("random", "held-out"), default="random",
                   help="random token ids, or windows of held-out text (needs --model with a tokenizer.json)")
    p.add_argument("--prompt-files", nargs="+", default=None, metavar="FILE",
                   help="text files for --prompts held-out (default: the model set's held-out files)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests per batch at every concurrency (request i = prompt i; at most C in flight, the next "
                        "submitted as one finishes); default C, all at once")
    p.add_argument("--seed", type=int, default=1, help="prompt RNG and sampling seed")
    p.add_argument("--budget", type=int, default=22, help="DDTree node budget")
    p.add_argument("--chain-seed", action=argparse.BooleanOptionalAction, default=False,
                   help="DDTree trees around the drafter's full top-1 chain (SpecConfig.chain_seed); default best-first")
    p.add_argument("--level-bonus", type=float, default=None, metavar="NATS",
                   help="nats added per DDTree level (SpecConfig.level_bonus); default: the drafter's calibrated one")
    draft_vocab.add_argument(p)
    draft_vocab.add_quantization_argument(p)
    p.add_argument("--max-verify-tokens", type=int, default=None,
                   help="cap on tree tokens verified per round over a batch bucket (SpecConfig.max_verify_tokens)")
    p.add_argument("--cohort-yield-min", type=float, default=6.0,
                   help="a cohort whose first round emits fewer tokens per request goes AR (0 = never)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="chain decode / speculative steps on the device ahead of the host (EngineOptions.overlap; "
                        "default: the engine's, on for a target of at least 16 GiB of weights on a GPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt-len-max + output-len")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--pflash", action="store_true",
                   help="every case compresses each prompt with PFlash before submitting it (needs a scorer)")
    add_scorer_arguments(p, required=False)
    p.add_argument("--pflash-mode", choices=("always", "auto"), default="always")
    p.add_argument("--pflash-keep-ratio", type=float, default=PFlashOptions.keep_ratio,
                   help="fraction of a compressed prompt kept (the server's --prefill-keep-ratio)")
    p.add_argument("--pflash-min-tokens", type=int, default=PFlashOptions.min_tokens,
                   help="shorter prompts are never compressed (the server's --prefill-min-tokens)")
    p.add_argument("--pflash-chunk", type=int, default=PFlashOptions.chunk, help="selection granularity in tokens")
    p.add_argument("--pflash-head-tokens", type=int, default=PFlashOptions.head_tokens, help="always-kept head")
    p.add_argument("--pflash-tail-tokens", type=int, default=PFlashOptions.tail_tokens, help="always-kept tail")
    p.add_argument("--recipe", default=None, metavar="full|strix_halo|PRESET.yaml",
                   help="feature recipe: full = DDTree + PFlash + KVFlash; strix_halo (or a server preset path) = "
                        "that preset's flags mapped onto this benchmark")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--oracle-tau", type=float, default=0.0, metavar="T",
                   help="FORCED ACCEPTANCE: ddtree rounds verify the ar case's greedy continuation, corrupted to an "
                        "expected T tokens per round, instead of the drafter's tree (0 = off; needs both modes)")
    add_peaked_argument(p)
    p.add_argument("--kvflash", type=_kvflash_arg, default=None, metavar="N|auto",
                   help="run every case with KVFlash: a resident KV pool of N tokens shared by all requests (auto: "
                        "80%% of free device memory)")
    p.add_argument("--kvflash-scoring", choices=("keys", "bounds", "shadow", "drafter", "lru"), default="shadow",
                   help="drafter: ranks pages by the drafter's queries, so only ddtree cases can run it (--modes ddtree)")
    p.add_argument("--kvflash-max-page-in", type=int, default=64, metavar="N",
                   help="optional KVFlash page-ins (best-ranked first) per step; a step's write pages are not limited")
    p.add_argument("--kvflash-host-prewarm-gb", type=float, default=8.0, metavar="GIB",
                   help="GiB of pinned host slabs each KVFlash engine makes ready at warm-up (0 = none)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8", "int8"), default=None,
                   help="KV page dtype of every case (default: the model dtype); fp8/int8 pages also page in/out "
                        "at about half the bytes under --kvflash")
    add_kv_calibration_argument(p)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="decoding modes to run per concurrency (default both; speedup figures need both)")
    p.add_argument("--all-buckets", action="store_true",
                   help="compile every serving batch bucket per case (default: only the case's concurrency, which "
                        "every batch of the case runs in)")
    p.add_argument("--prefix-cache", type=int, default=0, metavar="N",
                   help="cached prompt prefixes (recurrent-state snapshots) per engine; 0 = off")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="L",
                   help="the same L random tokens in front of every prompt (a shared system prompt)")
    p.add_argument("--prefix-cache-compare", action="store_true",
                   help="with --prefix-cache: also run an AR case without it per concurrency (mode ar_uncached)")
    p.add_argument("--kvflash-compare", action="store_true",
                   help="with --kvflash: also run an unbounded AR case per concurrency (mode ar_unbounded)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every case's engine runs one shape per step kind, at the largest concurrency's batch "
                        "(EngineOptions.batch_invariant): a request's tokens must then agree across concurrencies")
    p.add_argument("--require-reproducible", action="store_true",
                   help="fail unless every greedy hash agrees across repeats, concurrencies and modes")


def _kvflash_arg(v: str) -> int | str:
    return "auto" if str(v).lower() == "auto" else int(v)


# ---- recipes ---------------------------------------------------------------------------------------------------------
# server preset flags that say where or how to serve, not what runs: recorded, not applied
PRESET_NOT_APPLIED = ("target_device", "draft_device", "host", "port", "api_key", "served_model_name",
                      "enable_thinking", "max_concurrency", "model", "drafter", "gpu_memory_utilization")
# server preset flag -> the benchmark's dest, copied as is
PRESET_COPIED = {"ddtree_budget": "budget", "ddtree_max_verify_tokens": "max_verify_tokens",
                 "ddtree_chain_seed": "chain_seed", "ddtree_level_bonus": "level_bonus",
                 "ddtree_draft_vocab": "draft_vocab", "ddtree_draft_quantization": "draft_quantization",
                 "prefill_keep_ratio": "pflash_keep_ratio",
                 "prefill_min_tokens": "pflash_min_tokens", "kvflash_scoring": "kvflash_scoring",
                 "kvflash_max_page_in": "kvflash_max_page_in", "kvflash_host_prewarm_gb": "kvflash_host_prewarm_gb",
                 "cohort_yield_min": "cohort_yield_min", "page_size": "page_size", "prefill_chunk": "prefill_chunk",
                 "dtype": "dtype", "max_model_len": "max_model_len", "quantization": "quantization",
                 "tensor_parallel": "tensor_parallel", "data_parallel": "data_parallel", "kv_dtype": "kv_dtype",
                 "compile_cache": "compile_cache"}


def map_preset(preset: dict) -> tuple[dict, list[str], list[str]]:
    """A server preset (``serve.__main__.read_preset``) -> (benchmark settings ``{dest: value}``, notes, failures).

    A failure names a flag whose feature this benchmark cannot run; a note names one recorded but not applied."""
    out: dict = {}
    notes, bad = [], []
    for k, v in preset.items():
        if v is None:
            continue
        if k in PRESET_COPIED:
            out[PRESET_COPIED[k]] = v
        elif k in PRESET_NOT_APPLIED:
            notes.append(f"{k.replace('_', '-')}: {v} recorded, not applied (the benchmark runs on JAX's default "
                         f"backend with the engine API; its --concurrency sweep sets the batch)")
        elif k == "ddtree":
            if not v:
                out["modes"] = ["ar"]
        elif k == "draft_residency":
            if v != "persistent":
                bad.append(f"draft-residency {v!r}: only 'persistent' exists")
            notes.append("draft-residency: persistent (the drafter stays resident for each engine's life: the only "
                         "mode the engine has)")
        elif k == "prefill_compression":
            if v in ("auto", "always"):
                out["pflash"], out["pflash_mode"] = True, v
            elif v != "off":
                bad.append(f"prefill-compression {v!r}: want off, auto or always")
        elif k == "prefill_drafter":
            out["scorer"] = v
        elif k == "kvflash":
            s = str(v).strip().lower()
            if s not in ("off", "none", "false", "0"):
                try:
                    out["kvflash"] = _kvflash_arg(s)
                except ValueError:
                    bad.append(f"kvflash {v!r}: want off, auto or a pool size in tokens")
        elif k == "fast_rollback":
            if v:
                bad.append("fast-rollback: the benchmark runs replay commits only (fast rollback serves one "
                           "sequence, the sweep many)")
        elif k == "cohort_reprobe_tokens":
            if int(v):
                bad.append(f"cohort-reprobe-tokens {v}: not run by this benchmark")
        else:
            bad.append(f"{k.replace('_', '-')}: no mapping onto this benchmark")
    return out, notes, bad


def apply_recipe(args: argparse.Namespace, defaults: dict) -> tuple[list[str], list[str]]:
    """Set ``args`` from ``--recipe`` where the command line left the default (``defaults``: dest -> parser default).
    Returns (notes, failures)."""
    if args.recipe is None:
        return [], []
    if args.recipe == "full":
        want = {"pflash": True, "kvflash": "auto"}
        notes, bad = ["recipe full: DDTree + PFlash + KVFlash (AR cases, if run, are the paired baseline with the "
                      "same PFlash / KVFlash)"], []
        if "ddtree" not in args.modes:
            bad.append("recipe full needs the ddtree mode (drop --modes or include ddtree)")
    else:
        from dflash_jax.serve.__main__ import read_preset

        path = os.path.join(CONFIGS, f"{args.recipe}.yaml") if args.recipe in RECIPES else args.recipe
        if not os.path.isfile(path):
            return [], [f"--recipe {args.recipe}: no preset file {path} (known: {', '.join(RECIPES)} or a YAML path)"]
        try:
            preset = read_preset(path)
        except SystemExit as e:
            return [], [str(e.code)]
        want, notes, bad = map_preset(preset)
        notes = [f"recipe {args.recipe} ({path}): {n}" for n in notes]
        args.recipe_preset = {k.replace("_", "-"): v for k, v in preset.items()}
    for k, v in want.items():
        if k == "scorer" and (args.scorer or args.random_scorer):
            continue
        if getattr(args, k) == defaults.get(k):
            setattr(args, k, v)
    return notes, bad


# ---- prompts, hashes, proofs ---------------------------------------------------------------------------------
def _request_rng(seed: int, i: int) -> np.random.Generator:
    """Request i's own stream, so prompt i does not depend on how many prompts are drawn (a run's grid)."""
    return np.random.default_rng([seed, i])


def prompt_set(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts: prompt i's length uniform in [lo, hi], then its ids uniform in [0, vocab), from
    ``default_rng([seed, i])``; the first k prompts of any ``n >= k`` are the same."""
    out = []
    for i in range(n):
        rng = _request_rng(seed, i)
        out.append(rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist())
    return out


def text_prompt_set(ids: Sequence[int], n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` windows of the token stream ``ids``: window i's length uniform in [lo, hi] (drawn exactly as
    :func:`prompt_set` draws it), then its start uniform, from ``default_rng([seed, i])``; prefix-stable in ``n``."""
    if len(ids) < hi:
        raise ValueError(f"the prompt text gives {len(ids)} tokens, fewer than --prompt-len-max {hi}")
    out = []
    for i in range(n):
        rng = _request_rng(seed, i)
        k = int(rng.integers(lo, hi + 1))
        s0 = int(rng.integers(0, len(ids) - k + 1))
        out.append(list(map(int, ids[s0:s0 + k])))
    return out


def prompt_text_ids(model: str | None, files: Sequence[str] | None = None) -> tuple[list[int], list[str]]:
    """The token stream of ``--prompts held-out``: ``files`` (``--prompt-files``) or the ``model`` set's held-out
    files, tokenised with ``model``'s tokenizer; and the files' names."""
    from dflash_jax.bench.acceptance import held_out_files
    from dflash_jax.models.tokenizer import Tokenizer

    if not model or not os.path.exists(os.path.join(model, "tokenizer.json")):
        raise ValueError("--prompts held-out needs --model DIR with a tokenizer.json (random weights have no text)")
    files = files or held_out_files(model)
    tok = Tokenizer.from_dir(model)
    ids: list[int] = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids.extend(tok.encode(fh.read()))
    return ids, [os.path.basename(f) for f in files]


def token_hash(ids) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def prove_kvflash(stats: dict, pressured: bool) -> str | None:
    """None if ``stats`` prove that bounded residency served this request (and moved its pages under pressure)."""
    if stats.get("kvflash") is not True:
        return "KVFlash not proved: stats lack kvflash telemetry"
    missing = [k for k in KV_KEYS if not isinstance(stats.get(k), (int, float)) or stats[k] < 0]
    if missing:
        return f"KVFlash not proved: telemetry {missing} missing or negative"
    moved = stats["kv_pages_in"] + stats["kv_pages_out"] + stats["kv_clean_evictions"]
    if pressured and moved == 0:
        return (f"KVFlash not proved: the request was under residency pressure ({stats['kv_logical_pages']} pages "
                "of history) but none of its pages moved")
    return None


def prove_pflash(r: dict, min_tokens: int) -> str | None:
    """None if request ``r`` (``run_batch``'s record) proves PFlash ran for it: its compression record is present, the
    engine prefilled exactly the effective prompt, and a prompt of >= ``min_tokens`` raw tokens was compressed
    (effective < raw) while a shorter one passed through whole."""
    pf = r.get("pflash")
    if not pf:
        return "PFlash not proved: no compression record"
    raw, eff = pf.get("raw_prompt_tokens"), pf.get("effective_prompt_tokens")
    if not isinstance(raw, int) or not isinstance(eff, int):
        return f"PFlash not proved: raw -> effective tokens not recorded ({raw!r} -> {eff!r})"
    if raw != r["prompt_len"]:
        return f"PFlash not proved: raw_prompt_tokens {raw} != the prompt's {r['prompt_len']} tokens"
    if r.get("engine_prompt_tokens") != eff:
        return f"PFlash not proved: the engine prefilled {r.get('engine_prompt_tokens')} tokens, effective is {eff}"
    if raw >= min_tokens:
        if pf.get("pflash") != "compressed" or eff >= raw:
            return (f"PFlash not proved: a {raw}-token prompt (>= --pflash-min-tokens {min_tokens}) was not compressed "
                    f"(reason {pf.get('pflash')!r}, {raw} -> {eff} tokens; lower --pflash-keep-ratio, --pflash-chunk "
                    "or the head/tail tokens, or use --pflash-mode always)")
    elif pf.get("pflash") != "short" or eff != raw:
        return f"PFlash not proved: a {raw}-token prompt below the minimum went {raw} -> {eff} ({pf.get('pflash')!r})"
    return None


def prove(mode: str, stats: dict) -> str | None:
    """None if ``stats`` prove that ``mode`` ran for this request, else why not."""
    need = ("spec_mode", "draft_steps", "accepted_tokens", "mean_accept_len")
    missing = [k for k in need if k not in stats]
    if missing:
        return f"stats lack {missing}"
    sm, ds = stats["spec_mode"], stats["draft_steps"]
    if mode in ("ar", "ar_unbounded", "ar_uncached"):
        if sm != "ar" or ds != 0:
            return f"AR not proved: spec_mode={sm!r}, draft_steps={ds!r} (want 'ar', 0)"
        return None
    if sm not in ("ddtree", "yielded"):
        return f"DDTree not proved: spec_mode={sm!r} (want 'ddtree' or 'yielded')"
    if not isinstance(ds, int) or ds < 1:
        return f"DDTree not proved: draft_steps={ds!r} (want >= 1)"
    acc = stats["accepted_tokens"]
    if not isinstance(acc, int) or acc < 0:
        return f"DDTree not proved: accepted_tokens={acc!r} not reported"
    if stats["mean_accept_len"] is None:
        return "DDTree not proved: mean_accept_len not reported"
    return None


def account(outs: list[dict], c: int, output_len: int) -> list[str]:
    """Exact token accounting of one batch (completion tokens; with PFlash, billed = raw prompt tokens and the
    effective total = what the engine prefilled); returns the failures."""
    bad = []
    if outs and "pflash" in outs[0]:
        billed = sum(o["prompt_tokens_billed"] for o in outs)
        if billed != sum(o["prompt_len"] for o in outs):
            bad.append(f"billed {billed} prompt tokens, raw prompts hold {sum(o['prompt_len'] for o in outs)}")
        eff = sum(o["pflash"].get("effective_prompt_tokens") or 0 for o in outs)
        if eff != sum(o["engine_prompt_tokens"] for o in outs):
            bad.append(f"effective prompt tokens {eff} != {sum(o['engine_prompt_tokens'] for o in outs)} prefilled")
    if len(outs) != c:
        bad.append(f"{len(outs)} requests finished, {c} submitted")
    for o in outs:
        if o["n_tokens"] != output_len or o["finish"] != "length":
            bad.append(f"request {o['index']}: {o['n_tokens']} tokens (finish {o['finish']!r}), want {output_len}")
    total = sum(o["n_tokens"] for o in outs)
    if total != c * output_len:
        bad.append(f"total {total} tokens, want {c} x {output_len} = {c * output_len}")
    return bad


# ---- one batch, one case -------------------------------------------------------------------------------------
class Progress:
    """One updating line on stderr: ``[case k/n c4.ddtree] repeat 2/3 [####....] 96/256 tokens``."""

    def __init__(self, n_cases: int, enabled: bool = True) -> None:
        self.n, self.k, self.enabled, self.name, self.last = n_cases, 0, enabled, "", 0.0

    def case(self, name: str) -> None:
        self.k, self.name = self.k + 1, name

    def update(self, phase: str, done: int, total: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < 0.2):
            return
        self.last = now
        w = 20
        fill = w * done // max(total, 1)
        sys.stderr.write(f"\r[case {self.k}/{self.n} {self.name}] {phase} [{'#' * fill}{'.' * (w - fill)}] "
                         f"{done}/{total} tokens ")
        sys.stderr.flush()

    def end(self, msg: str = "") -> None:
        if self.enabled:
            sys.stderr.write(f"\r[case {self.k}/{self.n} {self.name}] {msg}\n")
            sys.stderr.flush()


Prep = Callable[[list[int]], tuple[list[int], dict]]
"""A prompt -> (the effective prompt the engine gets, its compression record)."""


def pflash_prep(scorer, options: PFlashOptions) -> Prep:
    """PFlash compression of one prompt (``compress``, no ``must_keep``), as the server runs it before admission."""

    def prep(prompt: list[int]) -> tuple[list[int], dict]:
        res = compress(prompt, scorer, options)
        return [int(t) for t in res.effective_ids], res.telemetry()

    return prep


def run_batch(eng: Engine, prompts: list[list[int]], output_len: int, seed: int, prep: Prep | None = None,
              progress: Progress | None = None, phase: str = "", max_in_flight: int | None = None) -> dict:
    """Submit the prompts (each through ``prep`` first, if given): all at once, or ``max_in_flight`` at first and the
    next as one finishes (a closed-loop client); step to completion; per-request outputs in prompt order plus the
    window."""
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, seed=seed, ignore_eos=True)
    yields0 = eng.counters["cohort_yield"]
    ids: list[int] = []
    preps: list[dict] = []
    index: dict[int, int] = {}

    def submit_next() -> None:
        i = len(ids)
        p = prompts[i]
        if prep is not None:
            p, tel = prep(p)
            preps.append(tel)
        ids.append(eng.submit(p, sp))
        index[ids[-1]] = i

    for _ in range(min(len(prompts), max_in_flight or len(prompts))):
        submit_next()
    n_done: dict[int, int] = {}
    want = output_len * len(prompts)
    first_seen: dict[int, float] = {}
    done: dict[int, tuple[float, object]] = {}
    while len(done) < len(prompts):
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in index:
                continue
            n_done[o.request_id] = len(o.token_ids)
            if o.token_ids and o.request_id not in first_seen:
                first_seen[o.request_id] = now
            if o.finish_reason is not None:
                done[o.request_id] = (now, o)
                if len(ids) < len(prompts):
                    submit_next()
        if progress is not None:
            progress.update(phase, sum(n_done.values()), want)
        if not eng.has_work() and len(done) < len(prompts):
            raise RuntimeError("engine went idle with requests unfinished")
    if progress is not None:
        progress.update(phase, sum(n_done.values()), want, force=True)
    reqs = []
    for rid in ids:
        t_fin, o = done[rid]
        st = dict(o.stats)
        i = index[rid]
        r = {"index": i, "prompt_len": len(prompts[i]), "n_tokens": len(o.token_ids), "finish": o.finish_reason,
             "sha256": token_hash(o.token_ids), "stats": st, "engine_prompt": list(o.prompt_token_ids),
             "token_ids": list(o.token_ids)}
        if prep is not None:
            r.update(pflash=preps[i], prompt_tokens_billed=len(prompts[i]),
                     engine_prompt_tokens=len(o.prompt_token_ids))
        reqs.append(r)
    firsts = [first_seen[r] for r in ids if r in first_seen]
    window = (max(t for t, _ in done.values()) - min(firsts)) if firsts else 0.0
    return {"requests": reqs, "window_s": window, "cohort_yield_events": eng.counters["cohort_yield"] - yields0}


def batch_figures(b: dict, mode: str) -> dict[str, float | None]:
    reqs = b["requests"]
    total = sum(r["n_tokens"] for r in reqs)
    ttft = [r["stats"]["ttft_s"] for r in reqs if r["stats"].get("ttft_s") is not None]
    tpot = [r["stats"]["tpot_s"] for r in reqs if r["stats"].get("tpot_s")]
    f: dict[str, float | None] = {
        "tok_s": total / b["window_s"] if b["window_s"] > 0 else None,
        "req_decode_tok_s": float(np.median([1 / t for t in tpot])) if tpot else None,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
        "tpot_ms": 1e3 * float(np.median(tpot)) if tpot else None,
        "cohort_yield_events": b["cohort_yield_events"],
        "output_tokens": total,
    }
    if mode == "ddtree":
        acc = [r["stats"]["mean_accept_len"] for r in reqs if r["stats"].get("mean_accept_len") is not None]
        f["accept_per_step"] = float(np.mean(acc)) if acc else None
    if reqs and "pflash" in reqs[0]:
        raw = sum(r["prompt_tokens_billed"] for r in reqs)
        eff = sum(r["pflash"]["effective_prompt_tokens"] for r in reqs)
        f.update(prompt_tokens_billed=raw, prompt_tokens_effective=eff, pflash_kept_fraction=eff / raw,
                 pflash_compressed=sum(r["pflash"]["pflash"] == "compressed" for r in reqs),
                 pflash_scoring_s=float(np.median([r["pflash"]["pflash_scoring_s"] for r in reqs])))
    return f


def _median(vals):
    vals = [v for v in vals if v is not None]
    return float(np.median(vals)) if vals else None


def make_oracle(truth: dict[tuple[int, ...], list[int]], keep: float, depth: int, vocab: int, seed: int):
    """``EngineOptions.spec_oracle``: the recorded greedy continuation ``truth[prompt]`` after the tokens so far,
    ``depth`` ids, each kept with probability ``keep`` else uniform in [0, vocab) (also past the recording, and for
    prompts without one); seeded by (seed, position, prompt) so every repeat proposes the same."""

    def oracle(prompt: list[int], tokens: list[int]) -> list[int]:
        t, pos = truth.get(tuple(prompt), []), len(tokens)
        rng = np.random.default_rng([seed, pos, zlib.crc32(np.asarray(prompt, np.int32).tobytes())])
        return [t[pos + d] if pos + d < len(t) and rng.random() < keep else int(rng.integers(0, vocab))
                for d in range(depth)]

    return oracle


def step_time_figures(seconds: collections.Counter, counters: collections.Counter, repeats: int) -> dict:
    """Where the measured batches' time went: ``<kind>_step_ms`` (mean wall time of one engine step of that kind,
    dispatch to outputs on the host) and ``host_ms`` (per repeat, the host loop's own time outside the steps), of it
    with KVFlash ``kv_summaries_ms`` (page summaries / key bounds fetched from the device), ``kv_plan_ms`` (the
    residency plan, ranking included), ``kv_transfer_ms`` (dispatching page-outs / page-ins; of it
    ``kv_page_out_ms`` and ``kv_page_in_ms``) and ``kv_query_ms`` (handing step queries to the residency), per
    repeat."""
    out = {}
    for kind in ("prefill", "decode", "spec"):
        n = counters[f"{kind}_steps"]
        if n:
            out[f"{kind}_step_ms"] = 1e3 * seconds[kind] / n
            out[f"{kind}_steps"] = n / repeats
    out["host_ms"] = 1e3 * max(0.0, seconds["step"] - sum(seconds[k] for k in ("prefill", "decode", "spec"))) / repeats
    for k in ("kv_summaries", "kv_plan", "kv_transfer", "kv_page_out", "kv_page_in", "kv_query"):
        if seconds[k]:
            out[f"{k}_ms"] = 1e3 * seconds[k] / repeats
    return out


def run_case(target: Target, drafter, mode: str, c: int, prompts, warm_prompts, args, max_len: int,
             prep: Prep | None = None, progress: Progress | None = None, oracle=None) -> dict:
    """Fresh engine; compile; 8-token warm-up at concurrency C; ``repeats`` measured batches (each prompt through
    ``prep`` before it is submitted, if given)."""
    spec = (SpecConfig(budget=args.budget, max_verify_tokens=args.max_verify_tokens, chain_seed=args.chain_seed,
                       level_bonus=args.level_bonus, draft_vocab=args.draft_vocab,
                       draft_quantization=args.draft_quantization) if mode == "ddtree" else None)
    kvflash = args.kvflash if mode != "ar_unbounded" else None
    inv = bool(getattr(args, "batch_invariant", False))
    rows = max(args.concurrency) if inv else c  # batch-invariant: every case at the same shapes
    buckets = None if args.all_buckets or inv else replica_buckets([c], args.data_parallel)
    opts = EngineOptions(max_batch=rows, page_size=args.page_size, max_model_len=max_len,
                         prefill_chunk=args.prefill_chunk, prefill_batch=min(args.prefill_batch, rows), spec=spec,
                         cohort_yield_min=args.cohort_yield_min, kvflash=kvflash,
                         kvflash_scoring=args.kvflash_scoring, kvflash_max_page_in=args.kvflash_max_page_in,
                         kvflash_host_prewarm_gb=args.kvflash_host_prewarm_gb, kv_dtype=args.kv_dtype, kv_calibration=args.kv_calibration,
                         batch_buckets=buckets, batch_invariant=inv,
                         spec_oracle=oracle if mode == "ddtree" else None, overlap=args.overlap,
                         prefix_cache=args.prefix_cache if mode != "ar_uncached" else 0, **parallel_options(args))
    eng = Engine(target, None, opts, drafter=drafter if mode == "ddtree" else None)
    t0 = time.perf_counter()
    eng.warmup()
    compile_s = time.perf_counter() - t0
    case = {"mode": mode, "c": c, "compile_s": compile_s, "batches": [], "accounting": [], "proof": [],
            "spec_budgets": eng.spec_budgets,
            "kvflash_pool_tokens": eng.kvflash_pool_tokens}
    if eng.kvf is not None:
        bw, eng.state, eng.dkv = eng.kvf.bandwidth(eng.state, eng.dkv)
        case["kv_bandwidth"] = bw
    warm = run_batch(eng, warm_prompts, WARMUP_TOKENS, args.seed, prep, progress, "warm-up")
    case["accounting"] += [f"warm-up: {m}" for m in account(warm["requests"], c, WARMUP_TOKENS)]
    compiles0, lazy0 = compile_count(), eng.counters["lazy_compiles"]
    seconds0, counters0 = collections.Counter(eng.step_seconds), collections.Counter(eng.counters)
    for rep in range(args.repeats):
        b = run_batch(eng, prompts, args.output_len, args.seed, prep, progress, f"repeat {rep + 1}/{args.repeats}",
                      max_in_flight=c)
        case["accounting"] += [f"repeat {rep}: {m}" for m in account(b["requests"], len(prompts), args.output_len)]
        for r in b["requests"]:
            why = prove(mode, r["stats"])
            if why:
                case["proof"].append(f"repeat {rep} request {r['index']}: {why}")
            why = prove_pflash(r, args.pflash_min_tokens) if prep is not None else None
            if why:
                case["proof"].append(f"repeat {rep} request {r['index']}: {why}")
            if (eng.prefix_caches and args.shared_prefix >= args.prefill_chunk
                    and not r["stats"].get("cached_tokens")):
                case["proof"].append(f"repeat {rep} request {r['index']}: prefix cache not proved: no cached tokens "
                                     f"under a shared {args.shared_prefix}-token head")
        if prep is not None and not any(r["pflash"].get("pflash") == "compressed" for r in b["requests"]):
            case["proof"].append(f"repeat {rep}: PFlash not proved: no prompt of the batch was compressed (lengths "
                                 f"{[r['prompt_len'] for r in b['requests']]}, --pflash-min-tokens "
                                 f"{args.pflash_min_tokens})")
        if eng.kvf is not None:
            hist = [r.get("engine_prompt_tokens", r["prompt_len"]) + r["n_tokens"] for r in b["requests"]]
            pressured = sum(hist) > eng.kvflash_pool_tokens
            b["kvflash_pressure"] = pressured
            for r, h in zip(b["requests"], hist):
                why = prove_kvflash(r["stats"], pressured and h > eng.kvflash_pool_tokens // c)
                if why:
                    case["proof"].append(f"repeat {rep} request {r['index']}: {why}")
            moved_in = sum(r["stats"].get("kv_pages_in", 0) for r in b["requests"])
            moved_out = sum(r["stats"].get("kv_pages_out", 0) for r in b["requests"])
            if pressured and moved_out == 0:
                case["proof"].append(f"repeat {rep}: KVFlash not proved: histories of {sum(hist)} tokens exceed the "
                                     f"{eng.kvflash_pool_tokens}-token pool but pages in/out = {moved_in}/{moved_out}")
            b["kvflash"] = {"pages_in": moved_in, "pages_out": moved_out, "pressure": pressured}
        b["figures"] = batch_figures(b, mode)
        case["batches"].append(b)
    case["recompiles"] = compile_count() - compiles0 + eng.counters["lazy_compiles"] - lazy0
    keys = case["batches"][0]["figures"].keys()
    case["figures"] = {k: _median([b["figures"][k] for b in case["batches"]]) for k in keys}
    case["figures"]["output_tokens"] = case["batches"][0]["figures"]["output_tokens"]  # every repeat: accounted
    ev = case["figures"]["cohort_yield_events"]
    case["figures"]["cohort_yield_events"] = int(ev) if ev is not None and float(ev).is_integer() else ev
    case["n_requests"] = len(prompts) * args.repeats
    case["figures"].update(step_time_figures(eng.step_seconds - seconds0, eng.counters - counters0, args.repeats))
    if eng.prefix_caches:
        case["figures"]["prefix_cached_tokens"] = _median(
            [float(np.mean([r["stats"].get("cached_tokens", 0) for r in b["requests"]])) for b in case["batches"]])
    if eng.kvf is not None:
        rep_ = eng.kvflash_report()
        case["kvflash"] = rep_
        f = case["figures"]
        f["kv_pages_in"] = _median([b["kvflash"]["pages_in"] for b in case["batches"]])
        f["kv_pages_out"] = _median([b["kvflash"]["pages_out"] for b in case["batches"]])
        f["kv_page_in_gbs"] = case["kv_bandwidth"]["page_in_gbs"]
        f["kv_host_to_device_gbs"] = case["kv_bandwidth"]["host_to_device_gbs"]
        f["kv_page_in_ratio"] = case["kv_bandwidth"]["ratio"]
        f["kv_deferred_steps"] = rep_["deferred_steps"]
        f["kv_prewarm_s"], f["kv_prewarm_gb"] = rep_["prewarm_s"], rep_["prewarm_bytes"] / 1e9
        f["kv_score_fallbacks"] = rep_["score_fallbacks"]
    del eng
    gc.collect()
    return case


# ---- reproducibility -------------------------------------------------------------------------------------------
def reproducibility(cases: list[dict]) -> dict[str, list[dict]]:
    """Mismatching greedy hashes: across repeats (same case), across concurrencies (same mode, repeat, prompt), and
    between ar and ddtree (same C, repeat, prompt)."""
    h: dict[tuple[int, str, int, int], str] = {}
    for cs in cases:
        for rep, b in enumerate(cs.get("batches", [])):
            for r in b["requests"]:
                h[(cs["c"], cs["mode"], rep, r["index"])] = r["sha256"]
    out: dict[str, list[dict]] = {"repeats": [], "concurrency": [], "modes": []}
    groups: dict[str, dict[tuple, dict]] = {"repeats": {}, "concurrency": {}, "modes": {}}
    for (c, mode, rep, i), v in h.items():
        groups["repeats"].setdefault((f"c{c}.{mode}", i), {})[f"repeat {rep}"] = v
        groups["concurrency"].setdefault((f"{mode} repeat {rep}", i), {})[f"c{c}"] = v
        if mode != "ar_unbounded":  # bounded vs unbounded residency is not meant to be token-identical
            groups["modes"].setdefault((f"c{c} repeat {rep}", i), {})[mode] = v
    for kind, g in groups.items():
        for (where, i), vals in sorted(g.items()):
            if len(set(vals.values())) > 1:
                out[kind].append({"where": where, "request": i, "hashes": {k: v[:16] for k, v in vals.items()}})
    return out


# ---- reports -----------------------------------------------------------------------------------------------------
def feature_matrix(plan: list[tuple[int, str]], cases: dict, unavailable: dict[str, str] | None = None,
                   kvflash: int | str | None = None, pflash: bool = False, oracle_tau: float = 0.0) -> list[str]:
    """Markdown: one row per case; a cell per feature (requested or not) and for token accounting.
    ``unavailable``: requested features that cannot run (feature -> why): their cells say so."""
    unavailable = unavailable or {}
    lines = ["| case | requests | ar | ddtree | kvflash | pflash | accounting |", "|---|---|---|---|---|---|---|"]
    for c, mode in plan:
        cs = cases.get((c, mode))
        ar_like = mode in ("ar", "ar_unbounded", "ar_uncached")
        kv_on = kvflash is not None and mode != "ar_unbounded"
        if cs is None or "error" in cs:
            run_cell = "not run" if cs is None else "ERROR"
            cells = [run_cell if ar_like else "off", run_cell if mode == "ddtree" else "off",
                     run_cell if kv_on else "off", run_cell if pflash else "off"]
            acc, n = run_cell, "-"
        else:
            n = cs["n_requests"]
            ok = f"FAILED ({len(cs['proof'])} proofs missing)" if cs["proof"] else f"proved {n}/{n}"
            cells = [ok, "off"] if ar_like else ["off", ok]
            if oracle_tau and mode == "ddtree":
                cells[1] += f" (ORACLE DRAFT: forced acceptance, tau {oracle_tau:g})"
            if kv_on:
                kv = [b.get("kvflash", {}) for b in cs["batches"]]
                moved = "/".join(f"{k.get('pages_in', 0)}:{k.get('pages_out', 0)}" for k in kv)
                cells.append(f"{ok}, {cs.get('kvflash_pool_tokens')}-token pool, pages in:out per repeat {moved}")
            else:
                cells.append("off")
            if pflash:
                f = cs["figures"]
                cells.append(f"{ok}, raw {int(f['prompt_tokens_billed'])} -> effective "
                             f"{int(f['prompt_tokens_effective'])} tokens per repeat, "
                             f"{int(f['pflash_compressed'])}/{len(cs['batches'][0]['requests'])} compressed")
            else:
                cells.append("off")
            acc = f"FAILED ({len(cs['accounting'])})" if cs["accounting"] else "passed"
        for i, feat in ((2, "kvflash"), (3, "pflash")):
            if feat in unavailable:
                cells[i] = NOT_AVAILABLE
        lines.append(f"| c{c}.{mode} | {n} | " + " | ".join(cells) + f" | {acc} |")
    return lines


def summary_table(conc: list[int], figures: dict, oracle_tau: float = 0.0) -> list[str]:
    g = lambda k: figures.get(k)
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    dd = f"DDTree (ORACLE DRAFT, tau {oracle_tau:g})" if oracle_tau else "DDTree"
    lines = [f"| C | AR output-window tok/s | {dd} output-window tok/s | DDTree goodput vs AR | Accepted/step "
             "| AR TTFT p50 s | DDTree TTFT p50 s | AR TPOT ms | DDTree TPOT ms | yield events |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in conc:
        sp = g(f"c{c}.ddtree.speedup_vs_ar")
        lines.append(f"| {c} | {f(g(f'c{c}.ar.tok_s'))} | {f(g(f'c{c}.ddtree.tok_s'))} | "
                     f"{'-' if sp is None else f'{100 * (sp - 1):+.1f}%'} | {f(g(f'c{c}.ddtree.accept_per_step'))} | "
                     f"{f(g(f'c{c}.ar.ttft_p50_s'), 3)} | {f(g(f'c{c}.ddtree.ttft_p50_s'), 3)} | "
                     f"{f(g(f'c{c}.ar.tpot_ms'))} | {f(g(f'c{c}.ddtree.tpot_ms'))} | "
                     f"{f(g(f'c{c}.ddtree.cohort_yield_events'), 0)} |")
    return lines


def plots(stem: str, conc: list[int], figures: dict, cases: list[dict]) -> list[str]:
    """PNG plots next to the result file (if matplotlib is importable); returns the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: plots skipped")
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("ar", "AR"), ("ddtree", "DDTree")):
        xs = [c for c in conc if figures.get(f"c{c}.{mode}.tok_s") is not None]
        ax.plot(xs, [figures[f"c{c}.{mode}.tok_s"] for c in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output-window tok/s")
    ax.set_title("throughput vs concurrency")
    ax.legend()
    fig.tight_layout()
    paths.append(stem + ".throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for cs in cases:
        if not cs.get("batches"):
            continue
        pts = {}
        for b in cs["batches"]:
            for r in b["requests"]:
                if r["stats"].get("ttft_s") is not None:
                    pts.setdefault(r["index"], (r["prompt_len"], []))[1].append(r["stats"]["ttft_s"])
        xs = [p for p, _ in pts.values()]
        ys = [float(np.median(v)) for _, v in pts.values()]
        ax.scatter(xs, ys, s=12, marker="o" if cs["mode"] == "ar" else "x", label=f"c{cs['c']} {cs['mode']}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT s (median over repeats)")
    ax.set_title("TTFT vs prompt length")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(stem + ".ttft.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


# ---- the command ---------------------------------------------------------------------------------------------------
def _check_args(args) -> str | None:
    if args.output_len < 2:
        return "--output-len must be >= 2 (the output window needs a first token and a later finish)"
    if not 1 <= args.prompt_len_min <= args.prompt_len_max:
        return "need 1 <= --prompt-len-min <= --prompt-len-max"
    if args.prompts == "held-out" and not args.model:
        return "--prompts held-out needs --model DIR (a checkpoint with a tokenizer.json): random weights have no text"
    if args.prompt_files and args.prompts != "held-out":
        return "--prompt-files applies to --prompts held-out"
    if args.repeats < 1 or min(args.concurrency) < 1:
        return "--repeats and every --concurrency must be >= 1"
    if args.requests is not None and args.requests < max(args.concurrency):
        return (f"--requests {args.requests}: fewer than the largest --concurrency ({max(args.concurrency)}), whose "
                "batch would never fill")
    if args.requests is not None and args.kvflash is not None:
        return ("--requests with --kvflash: the residency proof reads a batch's histories as concurrent; run KVFlash "
                "cases with C requests each (drop --requests)")
    if isinstance(args.kvflash, int) and args.kvflash < args.page_size:
        return f"--kvflash {args.kvflash}: the resident pool must hold at least one page ({args.page_size} tokens)"
    if args.kvflash_compare and args.kvflash is None:
        return "--kvflash-compare needs --kvflash N"
    if args.prefix_cache_compare and not args.prefix_cache:
        return "--prefix-cache-compare needs --prefix-cache N"
    if args.prefix_cache < 0 or args.shared_prefix < 0:
        return "--prefix-cache and --shared-prefix must be >= 0"
    if args.prefix_cache and args.kvflash is not None:
        return "--prefix-cache cannot be combined with --kvflash (the engine refuses it)"
    if args.kvflash_max_page_in < 0:
        return f"--kvflash-max-page-in {args.kvflash_max_page_in}: must be >= 0 (0 = only the pages a step writes)"
    if args.kvflash_host_prewarm_gb < 0:
        return f"--kvflash-host-prewarm-gb {args.kvflash_host_prewarm_gb}: must be >= 0"
    if args.kvflash is not None and args.kvflash_scoring == "drafter" and set(args.modes) != {"ddtree"}:
        return ("--kvflash-scoring drafter ranks pages by the drafter's queries: ar cases have no drafter, run it with "
                "--modes ddtree")
    if args.oracle_tau and not {"ar", "ddtree"} <= set(args.modes):
        return "--oracle-tau needs both modes: the ar case records the greedy continuation the ddtree case is given"
    return None


def _pflash_options(args) -> PFlashOptions:
    return PFlashOptions(mode=args.pflash_mode, keep_ratio=args.pflash_keep_ratio, min_tokens=args.pflash_min_tokens,
                         chunk=args.pflash_chunk, head_tokens=args.pflash_head_tokens,
                         tail_tokens=args.pflash_tail_tokens)


def _unavailable(args) -> dict[str, str]:
    """Requested features that cannot run (feature -> why), found before any work."""
    out = {}
    if args.pflash:
        if not (args.scorer or args.random_scorer):
            out["pflash"] = "PFlash needs a scorer: --scorer PATH or --random-scorer CONFIG"
        else:
            try:
                _pflash_options(args)
            except PFlashError as e:
                out["pflash"] = str(e)
    return out


def run(args: argparse.Namespace, command: str) -> int:
    defaults_parser = argparse.ArgumentParser()
    add_arguments(defaults_parser)
    notes, recipe_bad = apply_recipe(args, {k: defaults_parser.get_default(k) for k in vars(args)})
    for n in notes:
        print(n)
    conc = sorted(dict.fromkeys(args.concurrency))
    modes = tuple(m for m in MODES if m in args.modes)
    modes += ("ar_unbounded",) if args.kvflash is not None and args.kvflash_compare else ()
    modes += ("ar_uncached",) if args.prefix_cache and args.prefix_cache_compare else ()
    plan = [(c, m) for c in conc for m in modes]
    bad = _check_args(args)
    if bad:
        print(f"FAIL: {bad}")
        return 2
    unavailable = _unavailable(args)
    if unavailable or recipe_bad:  # fail closed before any work: nothing is reported as passed
        print("feature matrix:")
        print("\n".join(feature_matrix(plan, {}, unavailable, args.kvflash, args.pflash)))
        for f, why in unavailable.items():
            print(f"FAIL: --{f} requested: {NOT_AVAILABLE} ({why})")
        for why in recipe_bad:
            print(f"FAIL: --recipe {args.recipe}: {NOT_AVAILABLE} ({why})")
        return 2
    if args.pflash and args.prompt_len_max < args.pflash_min_tokens:
        print(f"FAIL: --pflash: every prompt is shorter than --pflash-min-tokens {args.pflash_min_tokens} "
              f"(--prompt-len-max {args.prompt_len_max}), so none would be compressed and every case's PFlash proof "
              f"would fail; lower --pflash-min-tokens or raise the prompt lengths")
        return 2

    peaked = peaked_wanted(args)
    t0 = time.perf_counter()
    target = load_target_source(args)
    if peaked:
        target, _ = peak_target(target)
    drafter = load_drafter_source(args)
    jax.block_until_ready((target.params, drafter[1]))
    args.kv_calibration = resolve_kv_calibration(args, target)  # measured once, shared by every case's engine
    load_s = time.perf_counter() - t0
    cfg = target.config
    max_len = args.max_model_len or args.prompt_len_max + args.shared_prefix + args.output_len
    if args.prompts == "held-out":
        text, names = prompt_text_ids(args.model, args.prompt_files)
        prompts = text_prompt_set(text, args.requests or max(conc), args.prompt_len_min, args.prompt_len_max,
                                  args.seed)
        warm_prompts = text_prompt_set(text, max(conc), args.prompt_len_min, args.prompt_len_max, args.seed + 1)
        dist = (f"prompt lengths ~ uniform integers in [{args.prompt_len_min}, {args.prompt_len_max}], windows at "
                f"uniform offsets of {len(text)} tokens of held-out text ({len(names)} files: {', '.join(names)}), "
                f"request i from numpy default_rng([{args.seed}, i]); "
                f"warm-up prompts: default_rng([{args.seed + 1}, i])")
    else:
        prompts = prompt_set(args.requests or max(conc), args.prompt_len_min, args.prompt_len_max, cfg.vocab_size,
                             args.seed)
        warm_prompts = prompt_set(max(conc), args.prompt_len_min, args.prompt_len_max, cfg.vocab_size, args.seed + 1)
        dist = (f"prompt lengths ~ uniform integers in [{args.prompt_len_min}, {args.prompt_len_max}], token ids ~ "
                f"uniform in [0, {cfg.vocab_size}), request i from numpy default_rng([{args.seed}, i]); "
                f"warm-up prompts: default_rng([{args.seed + 1}, i])")
    if args.shared_prefix:
        head = np.random.default_rng(args.seed + 7).integers(0, cfg.vocab_size, args.shared_prefix).tolist()
        prompts = [head + p for p in prompts]
        warm_prompts = [head + p for p in warm_prompts]
        dist += f"; every prompt after the same {args.shared_prefix} tokens (default_rng({args.seed + 7}))"
    print(f"loaded in {load_s:.1f}s; {dist}")
    print(f"prompt lengths (request i at every C): {[len(p) for p in prompts]}", flush=True)
    prep = None
    if args.pflash:
        scorer = load_scorer_source(args, cfg.vocab_size)
        if scorer.cfg.vocab_size < cfg.vocab_size:
            print(f"FAIL: --pflash: {NOT_AVAILABLE} (the scorer's vocabulary ({scorer.cfg.vocab_size}) does not cover "
                  f"the target's ({cfg.vocab_size}); use a scorer of the target's tokenizer family)")
            return 2
        popts = _pflash_options(args)
        prep = pflash_prep(scorer, popts)
        t0 = time.perf_counter()
        for p in {tuple(p): None for p in prompts + warm_prompts}:  # compiles the scorer's shapes, untimed
            prep(list(p))
        print(f"PFlash: mode {popts.mode}, keep_ratio {popts.keep_ratio}, min_tokens {popts.min_tokens}, chunk "
              f"{popts.chunk}, head "
              f"{popts.head_tokens}, tail {popts.tail_tokens}; scorer {args.scorer or args.random_scorer} warmed on "
              f"every prompt in {time.perf_counter() - t0:.1f}s", flush=True)
    progress = Progress(len(plan), enabled=not args.no_progress)
    keep = None
    if args.oracle_tau:
        from dflash_jax.bench.spec import chain_keep_prob

        depth = drafter[0].block_size - 1
        try:
            keep = chain_keep_prob(args.oracle_tau, min(depth, args.budget))
        except ValueError as e:
            print(f"FAIL: --oracle-tau: {e}")
            return 2
        print(f"ORACLE DRAFT (forced acceptance): ddtree rounds verify the ar case's greedy continuation, each of "
              f"{depth} positions kept with probability {keep:.3f} (expected {args.oracle_tau:g} tokens per round)",
              flush=True)
    truth: dict[int, dict[tuple[int, ...], list[int]]] = {}  # C -> engine prompt -> ar greedy tokens

    cases: dict[tuple[int, str], dict] = {}
    n_req = lambda c: args.requests or c  # noqa: E731  (requests per batch of concurrency c)
    for c, mode in plan:
        t0 = time.perf_counter()
        progress.case(f"c{c}.{mode}")
        oracle = None
        if keep is not None and mode == "ddtree":
            oracle = make_oracle(truth.get(c, {}), keep, drafter[0].block_size - 1, cfg.vocab_size, args.seed)
        try:
            if oracle is not None and len(truth.get(c, {})) < n_req(c):
                raise RuntimeError(f"--oracle-tau: the c{c}.ar case recorded no greedy continuation for "
                                   f"{n_req(c) - len(truth.get(c, {}))} of the {n_req(c)} prompts")
            cs = run_case(target, drafter, mode, c, prompts[:n_req(c)], warm_prompts[:c], args, max_len, prep,
                          progress, oracle)
            progress.end(f"done in {time.perf_counter() - t0:.1f}s")
        except Exception as e:  # recorded; the run fails closed at the end
            progress.end("ERROR")
            cs = {"mode": mode, "c": c, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            print(f"c{c} {mode}: ERROR {cs['error']}", flush=True)
            cases[(c, mode)] = cs
            continue
        cases[(c, mode)] = cs
        if mode == "ar" and cs["batches"]:
            truth[c] = {tuple(r["engine_prompt"]): r["token_ids"] for r in cs["batches"][-1]["requests"]}
        fg = cs["figures"]
        status = "ok" if not cs["proof"] and not cs["accounting"] else "FAILED"
        acc = "" if mode == "ar" or fg.get("accept_per_step") is None else f", accept/step {fg['accept_per_step']:.2f}"
        n = lambda k, p: "-" if fg.get(k) is None else f"{fg[k]:.{p}f}"
        print(f"c{c} {mode}: {n('tok_s', 1)} tok/s, TTFT p50 {n('ttft_p50_s', 3)}s, TPOT {n('tpot_ms', 2)} ms{acc}, "
              f"{int(fg['output_tokens'])}/{n_req(c) * args.output_len} tokens, proof {status} "
              f"(compile {cs['compile_s']:.1f}s, case {time.perf_counter() - t0:.1f}s)", flush=True)

    figures: dict[str, float | None] = {"load_s": load_s}
    for (c, mode), cs in cases.items():
        for k, v in cs.get("figures", {}).items():
            if k != "output_tokens":
                figures[f"c{c}.{mode}.{k}"] = v
        if "figures" in cs:
            figures[f"c{c}.{mode}.output_tokens"] = cs["figures"]["output_tokens"]
    for c in conc:
        a, d = figures.get(f"c{c}.ar.tok_s"), figures.get(f"c{c}.ddtree.tok_s")
        figures[f"c{c}.ddtree.speedup_vs_ar"] = d / a if a and d is not None else None
        u = figures.get(f"c{c}.ar_unbounded.tok_s")
        if u:
            figures[f"c{c}.ar.kvflash_vs_unbounded"] = a / u if a is not None else None
        nc = figures.get(f"c{c}.ar_uncached.tok_s")
        if nc:
            figures[f"c{c}.ar.prefix_cache_speedup"] = a / nc if a is not None else None
            t_c, t_u = figures.get(f"c{c}.ar.ttft_p50_s"), figures.get(f"c{c}.ar_uncached.ttft_p50_s")
            figures[f"c{c}.ar.prefix_cache_ttft_ratio"] = t_c / t_u if t_c is not None and t_u else None
    case_list = [cases[k] for k in plan]
    repro = reproducibility(case_list)
    n_mis = {k: len(v) for k, v in repro.items()}
    figures["reproducible"] = int(not any(n_mis.values()))
    for k, v in n_mis.items():
        figures[f"repro.{k}_mismatches"] = v
    figures["recompiles_after_warmup"] = sum(cs.get("recompiles", 0) for cs in case_list)

    print("\nfeature matrix:")
    print("\n".join(feature_matrix(plan, cases, {}, args.kvflash, args.pflash, args.oracle_tau)))
    print()
    print("\n".join(summary_table(conc, figures, args.oracle_tau)))
    print()
    results.print_table(figures)
    if figures["reproducible"]:
        print("reproducibility: all greedy hashes equal across repeats, concurrencies and ar/ddtree")
    else:
        print(f"reproducibility: mismatches {n_mis}")
        for kind, lst in repro.items():
            for m in lst:
                print(f"  {'LOSSLESSNESS ' if kind == 'modes' else ''}{kind}: {m['where']} request {m['request']}: "
                      f"{m['hashes']}")

    failures = []
    for cs in case_list:
        name = f"c{cs['c']}.{cs['mode']}"
        if "error" in cs:
            failures.append(f"{name}: {cs['error']}")
        failures += [f"{name}: proof: {m}" for m in cs.get("proof", [])]
        failures += [f"{name}: accounting: {m}" for m in cs.get("accounting", [])]
    if args.require_reproducible and not figures["reproducible"]:
        failures.append(f"reproducibility required: mismatches {n_mis}")
    if failures:
        print(f"\nFAIL: {len(failures)} problem(s); no result written")
        for m in failures:
            print(f"  {m}")
        return 1
    print(f"\nPASS: {len(case_list)} cases, {sum(cs['n_requests'] for cs in case_list)} requests, "
          f"{sum(int(cs['figures']['output_tokens']) * args.repeats for cs in case_list)} completion tokens: "
          "exact token accounting and per-request feature proof")
    if not args.no_write:
        extra = {
            "target": args.model or args.random_weights, "drafter": args.drafter or args.random_drafter,
            "weights": "checkpoint" if args.model else "peaked random" if peaked else "random",
            "peaked_random_weights": peaked, "peaked_random_weights_detail": describe() if peaked else None,
            "dtype": args.dtype, "concurrency": conc,
            "output_len": args.output_len, "repeats": args.repeats, "seed": args.seed, "budget": args.budget, "max_verify_tokens": args.max_verify_tokens,
            "chain_seed": args.chain_seed, "level_bonus": args.level_bonus, "draft_vocab": args.draft_vocab,
            "draft_quantization": args.draft_quantization,
            "cohort_yield_min": args.cohort_yield_min, "max_model_len": max_len, "page_size": args.page_size,
            "prefill_chunk": args.prefill_chunk, "prefill_batch": args.prefill_batch,
            "warmup_tokens": WARMUP_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "prompt_distribution": dist, "prompt_lens": [len(p) for p in prompts],
            # one digest of every prompt's token ids: runs on two machines compare only where it is the same
            "prompts_hash": hashlib.sha256(";".join(token_hash(p) for p in prompts).encode()).hexdigest(),
            "hash": "sha256 of the decimal token ids joined by ',' (UTF-8)",
            "feature_matrix": feature_matrix(plan, cases, {}, args.kvflash, args.pflash, args.oracle_tau),
            "oracle": {"tau": args.oracle_tau, "keep_prob": keep,
                       "label": "FORCED ACCEPTANCE: ddtree rounds verified the ar case's greedy continuation "
                                "(corrupted to the expected tau), not the drafter's tree"}
            if keep is not None else None,
            "recipe": {"name": args.recipe, "preset": getattr(args, "recipe_preset", None), "notes": notes}
            if args.recipe else None,
            "pflash": {"mode": args.pflash_mode, "keep_ratio": args.pflash_keep_ratio,
                       "min_tokens": args.pflash_min_tokens, "chunk": args.pflash_chunk,
                       "head_tokens": args.pflash_head_tokens,
                       "tail_tokens": args.pflash_tail_tokens, "scorer": args.scorer or args.random_scorer,
                       "billing": "raw prompt tokens (prompt_tokens_billed); prompt_tokens_effective = prefilled"}
            if args.pflash else None,
            "kv_dtype": args.kv_dtype, "kv_calibration": args.kv_calibration,
            "kvflash": {"pool_tokens": args.kvflash, "scoring": args.kvflash_scoring,
                        "max_page_in": args.kvflash_max_page_in,
                        "host_prewarm_gb": args.kvflash_host_prewarm_gb,
                        "compare_unbounded": args.kvflash_compare} if args.kvflash is not None else None,
            "accounting": "passed", "reproducibility": repro,
            "cases": [{"case": f"c{cs['c']}.{cs['mode']}", "compile_s": cs["compile_s"],
                       "kvflash": cs.get("kvflash"), "kv_bandwidth": cs.get("kv_bandwidth"),
                       "recompiles": cs["recompiles"], "cohort_yield_events": [b["cohort_yield_events"]
                                                                               for b in cs["batches"]],
                       "repeats": [{"figures": b["figures"], "window_s": b["window_s"],
                                    "requests": [{"i": r["index"], "prompt_len": r["prompt_len"],
                                                  "tokens": r["n_tokens"], "sha256": r["sha256"],
                                                  **({"prompt_tokens_billed": r["prompt_tokens_billed"],
                                                      "engine_prompt_tokens": r["engine_prompt_tokens"],
                                                      **r["pflash"]} if "pflash" in r else {}),
                                                  **{k: r["stats"].get(k) for k in (
                                                      "ttft_s", "tpot_s", "spec_mode", "draft_steps",
                                                      "draft_nodes", "accepted_tokens", "mean_accept_len",
                                                      "cohort_yield_mean", "prefill_chunks", "decode_steps",
                                                      *KV_KEYS)}}
                                                 for r in b["requests"]]} for b in cs["batches"]]}
                      for cs in case_list],
        }
        path = results.write_result("concurrency", figures, command, extra, out_dir=args.out_dir)
        print("wrote", path)
        try:  # plots are a convenience: the measured result is already written
            for p in plots(os.path.splitext(path)[0], conc, figures, case_list):
                print("wrote", p)
        except Exception as e:  # noqa: BLE001
            print(f"plots skipped: {type(e).__name__}: {e}")
    return 0
