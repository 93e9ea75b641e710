"""``python -m dflash_jax.serve``: the OpenAI-compatible server.

    python -m dflash_jax.serve                      # the shipped tiny model set, http://127.0.0.1:8000/v1
    python -m dflash_jax.serve --ddtree             # ... with DDTree speculation by the shipped drafter
    python -m dflash_jax.serve --model PATH [--host 127.0.0.1] [--port 8000] [--max-concurrency 8]
    python -m dflash_jax.serve --config configs/h200.yaml --model PATH

Flags use the seed system's names; ``--ddtree --drafter PATH`` turns on DDTree speculation, ``--prefill-compression auto|always
--prefill-drafter PATH`` PFlash prompt compression, ``--kvflash auto|N [--kvflash-scoring shadow|bounds|keys|drafter|lru]``
bounded KV residency (a resident pool of N tokens shared by all running sequences, histories backed by pinned host
memory), ``--fast-rollback`` (one sequence) the node-selecting commit. Combinations this engine cannot run are
rejected at start-up with a message naming the flags, never silently ignored.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
import time
from typing import Callable

from dflash_jax import SHIPPED_MODELS as SHIPPED
from dflash_jax.kv.kvflash import SCORINGS
from dflash_jax.spec import draft_vocab

QUANTIZATIONS = draft_vocab.QUANTIZATIONS  # = models.quant.QUANTIZATIONS (not imported: no jax at parse time)
DEVICE_PREFIXES = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "hip": "gpu"}


class StartupError(SystemExit):
    def __init__(self, msg: str) -> None:
        super().__init__(f"dflash_jax.serve: error: {msg}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="YAML preset of flags (configs/*.yaml); command-line flags override it")
    ap.add_argument("--model", "--target", dest="model", help="target checkpoint directory (HF layout)")
    ap.add_argument("--served-model-name", help="model id reported by the API (default: the directory name)")
    ap.add_argument("--drafter", help="DFlash drafter checkpoint directory")
    ap.add_argument("--target-device", default=None, help="cpu:0, cuda:0, rocm:0 (hip:0 = rocm:0)")
    ap.add_argument("--draft-device", default=None,
                    help="must be the target's device: the drafter and scorer run next to the target")
    ap.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                    help="split the target over N devices (Megatron tensor parallelism; multi-host via "
                         "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    ap.add_argument("--data-parallel", type=int, default=None, metavar="M",
                    help="independent batch replicas over M groups of --tensor-parallel devices")
    ap.add_argument("--ddtree", action="store_true", default=None, help="DDTree speculative decoding")
    ap.add_argument("--ddtree-budget", type=int, default=None)
    ap.add_argument("--ddtree-max-verify-tokens", type=int, default=None, metavar="N",
                    help="cap on the tree tokens one round verifies over its batch bucket: a bucket of B rows gets "
                         "the node budget min(budget, N // B - 1) (default: no cap)")
    ap.add_argument("--ddtree-chain-seed", action=argparse.BooleanOptionalAction, default=None,
                    help="build each tree around the drafter's full top-1 chain (tree contains the chain), then "
                         "best-first; default off: the best-first tree of the budget's highest-scoring prefixes")
    ap.add_argument("--ddtree-level-bonus", type=float, default=None, metavar="NATS",
                    help="nats added to each tree level's draft log-prob, favouring deeper trees (a block drafter's "
                         "hits come in runs its per-position marginals do not show); default: the drafter "
                         "checkpoint's calibrated dflash_config.ddtree_level_bonus, else 0 (the paper's tree)")
    ap.add_argument("--ddtree-draft-vocab", type=draft_vocab.parse_arg, default=None, metavar="N|FILE",
                    help="draft over a reduced vocabulary (FR-Spec): the drafter's LM head over token ids 0..N-1 "
                         "(byte-level BPE ids run in merge order, roughly by frequency) or the ids in FILE (.json "
                         "list or .npy; `python -m dflash_jax.spec.draft_vocab` counts a corpus), plus the EOS ids. "
                         "Lossless; reads N / vocab of the drafter's head each round. Default: the whole vocabulary")
    draft_vocab.add_quantization_argument(ap, "--ddtree-draft-quantization")
    ap.add_argument("--draft-residency", choices=("persistent",), default=None,
                    help="persistent (the only mode): the drafter and the PFlash scorer stay loaded on the device for "
                         "the server's life, next to the target")
    ap.add_argument("--prefill-compression", choices=("off", "auto", "always"), default=None)
    ap.add_argument("--prefill-drafter", default=None, help="PFlash scorer: a dense Qwen3 checkpoint directory")
    ap.add_argument("--prefill-keep-ratio", type=float, default=None, help="fraction of a long prompt kept (0.05)")
    ap.add_argument("--prefill-min-tokens", type=int, default=None, help="shorter prompts are never compressed")
    ap.add_argument("--kvflash", default=None,
                    help="off | auto | N: resident KV pool of N tokens shared by all sequences (auto: from free "
                         "device memory); the rest of each history lives in pinned host memory")
    ap.add_argument("--kvflash-max-page-in", type=int, default=None, metavar="N",
                    help="optional page-ins (best-ranked first) per engine step under --kvflash (64); the pages a "
                         "step writes are never limited")
    ap.add_argument("--kvflash-host-prewarm-gb", type=float, default=None, metavar="GIB",
                    help="under --kvflash: GiB of pinned host slabs made ready at start-up (8; capped at what the "
                         "histories can use; 0 = pin as page-outs need it, on the serving path)")
    ap.add_argument("--kvflash-scoring", choices=SCORINGS, default=None,
                    help="what stays resident beyond the sink and recent pages: shadow (default) = the target's "
                         "attention share of each page under its latest queries, exact over a 4-bit copy of every "
                         "key kept on the device (an eighth of the history's K/V bytes); bounds = Quest-style upper "
                         "bound of those queries over each page's key min/max (a sixteenth); keys = each "
                         "page's mean keys against the latest page's mean keys; drafter (needs --ddtree) = the "
                         "DFlash drafter's attention logits of its latest queries over each page's mean context keys "
                         "(LRU for a sequence before its first round or decoding AR); lru = least recently used "
                         "leaves first")
    ap.add_argument("--fast-rollback", action="store_true", default=None,
                    help="single sequence (--ddtree, --max-concurrency 1): commit by selecting the accepted tree "
                         "node's kept recurrent state instead of the closed-form replay")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="dispatch each decode / speculative step from the device outputs of the one in flight, "
                         "before its tokens reach the host (one replica, no KVFlash); default: on for a target of "
                         "at least 16 GiB of weights on a GPU (EngineOptions.overlap)")
    ap.add_argument("--prefix-cache", type=int, default=None, metavar="N",
                    help="cache prompt prefixes at prefill-chunk boundaries: N recurrent-state snapshots, each with "
                         "its prefix's KV pages, per data-parallel replica (0 = off; not with --kvflash)")
    ap.add_argument("--enable-prompt-logprobs", action=argparse.BooleanOptionalAction, default=False,
                    help="compile a prefill step that also scores the prompt, for completions with echo + logprobs "
                         "(each prompt token's log-probability; scoring prompts prefill one at a time)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                    help="a request's tokens do not depend on what else runs (one step shape per kind: decode always "
                         "at --max-concurrency rows); costs padded rows at low load")
    ap.add_argument("--structured-spec", action=argparse.BooleanOptionalAction, default=False,
                    help="with --ddtree: requests with a response_format / guided_* constraint decode in speculative "
                         "rounds too (a draft step, the tree's allowed tokens from the automaton on the host, then a "
                         "masked verify step; two more executables per batch bucket); off: they decode AR")
    ap.add_argument("--cohort-yield-min", type=float, default=None,
                    help="a cohort whose first DDTree round emits fewer tokens per request continues AR (0 = never)")
    ap.add_argument("--cohort-reprobe-tokens", type=int, default=None,
                    help="a yielded request probes DDTree again after this many AR tokens, the wait doubling after "
                         "each failed probe (0 = never)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8", "int8"), default=None,
                    help="K/V page format (default: the model dtype); fp8/int8 pages carry a scale per token and head")
    ap.add_argument("--kv-calibration", default="auto", metavar="auto|none|PATH",
                    help="with fp8/int8 pages: keys centred, rotated and rounded where the queries do not look, by a "
                         "calibration measured once per model (python -m dflash_jax.kv.calibrate); auto = the "
                         "model's kv_calibration.safetensors if it has one")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="fp8: matmul weights of target and drafter in e4m3 with per-channel scales; fp8_dynamic: "
                         "the same weights, the MLP matmuls' inputs quantized per token to e4m3 too (W8A8: fp8 "
                         "tensor cores); int8: int8 "
                         "with one scale per 32 inputs (llama.cpp's Q8_0 layout: a Q8_0 GGUF keeps its values); "
                         "int4: packed 4-bit, two per byte, a float16 scale per 32 inputs (Q4_0's values: a Q4_0 "
                         "GGUF keeps them); quantized as they load (an FP8 checkpoint stays FP8 either way)")
    ap.add_argument("--enable-thinking", choices=("true", "false"), default=None,
                    help="server default for chat_template_kwargs.enable_thinking (true: Qwen3.6's own default)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                    help="fraction of each accelerator's memory JAX's allocator may take, weights, KV pages and "
                         "work space (default: XLA_PYTHON_CLIENT_MEM_FRACTION if set, else 0.9; JAX alone takes 0.75)")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="JAX persistent compilation cache: a restart with the same model and flags loads its "
                         "executables instead of compiling them (or set JAX_COMPILATION_CACHE_DIR)")
    ap.add_argument("--host", default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set DFLASH_API_KEY)")
    return ap


DEFAULTS = {"host": "127.0.0.1", "port": 8000, "max_concurrency": 8, "max_model_len": 4096, "page_size": 16,
            "prefill_chunk": 256, "dtype": None, "quantization": "none", "enable_thinking": "true",
            "draft_residency": "persistent",
            "ddtree_budget": 22, "ddtree_max_verify_tokens": None, "ddtree_chain_seed": False,
            "ddtree_draft_vocab": None, "ddtree_draft_quantization": None,
            "prefill_compression": "off", "kvflash": "off",
            "kvflash_scoring": "shadow", "kvflash_max_page_in": 64, "kvflash_host_prewarm_gb": 8.0,
            "cohort_yield_min": 6.0, "cohort_reprobe_tokens": 0, "tensor_parallel": 1, "data_parallel": 1,
            "prefix_cache": 0}


def read_preset(path: str, known: set[str] | None = None) -> dict:
    """The flags of a YAML preset (``configs/*.yaml``) as ``{dest: value}`` (``--ddtree-budget`` -> ``ddtree_budget``);
    every name must be one of this parser's flags (``known``: their dests, default ``build_parser()``'s)."""
    import yaml

    known = known if known is not None else set(vars(build_parser().parse_args([])))
    try:
        with open(path) as f:
            preset = yaml.safe_load(f) or {}
    except OSError as e:
        raise StartupError(f"--config {path}: {e.strerror}") from e
    if not isinstance(preset, dict):
        raise StartupError(f"--config {path}: expected a mapping of flag names to values")
    out = {}
    for k, v in preset.items():
        key = str(k).replace("-", "_")
        if key not in known or key == "config":
            raise StartupError(f"--config {path}: unknown flag {k!r}")
        out[key] = v
    return out



def _number(ns: argparse.Namespace, dest: str, kind: type, ok: Callable[[float], bool], rule: str) -> None:
    """Set ``ns.<dest>`` to its value as ``kind`` (a preset may give a string), or raise a StartupError naming the
    flag when it is not a number or ``ok`` rejects it (``rule``: what it must be)."""
    flag, raw = "--" + dest.replace("_", "-"), getattr(ns, dest)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise StartupError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if not ok(value):
        raise StartupError(f"{flag} {value}: {rule}")
    setattr(ns, dest, value)

def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Merge preset file < command line; apply defaults; reject what this build cannot do."""
    merged = dict(DEFAULTS)
    if args.config:
        merged.update(read_preset(args.config, set(vars(args))))
    for k, v in vars(args).items():
        if v is not None:
            merged[k] = v
    ns = argparse.Namespace(**{k: merged.get(k) for k in set(vars(args)) | set(merged)})

    if not ns.model:  # the shipped set: its drafter and scorer are the defaults of --ddtree / --prefill-compression
        ns.model = os.path.join(SHIPPED, "target")
        if ns.ddtree and not ns.drafter:
            ns.drafter = os.path.join(SHIPPED, "drafter")
        if ns.prefill_compression not in (None, "off") and not ns.prefill_drafter:
            ns.prefill_drafter = os.path.join(SHIPPED, "scorer")
    if ns.ddtree and not ns.drafter:
        raise StartupError("--ddtree needs --drafter PATH (a DFlash drafter checkpoint directory)")
    if ns.drafter and not ns.ddtree:
        raise StartupError("--drafter is only used with --ddtree; add --ddtree or drop --drafter")
    if ns.drafter and not os.path.isdir(ns.drafter):
        raise StartupError(f"--drafter {ns.drafter}: not a directory")
    if ns.ddtree and not 1 <= int(ns.ddtree_budget) <= 256:
        raise StartupError(f"--ddtree-budget must be in [1, 256], got {ns.ddtree_budget}")
    if ns.ddtree_max_verify_tokens is not None and not ns.ddtree:
        raise StartupError("--ddtree-max-verify-tokens caps DDTree rounds: it needs --ddtree")
    if ns.ddtree_max_verify_tokens is not None and int(ns.ddtree_max_verify_tokens) < 2:
        raise StartupError(f"--ddtree-max-verify-tokens must be >= 2, got {ns.ddtree_max_verify_tokens}")
    if not isinstance(ns.ddtree_chain_seed, bool):  # a preset bypasses argparse
        raise StartupError(f"--ddtree-chain-seed must be true or false, got {ns.ddtree_chain_seed!r}")
    if ns.ddtree_chain_seed and not ns.ddtree:
        raise StartupError("--ddtree-chain-seed shapes DDTree trees: it needs --ddtree")
    if ns.ddtree_level_bonus is not None:
        if isinstance(ns.ddtree_level_bonus, bool) or not isinstance(ns.ddtree_level_bonus, (int, float)) \
                or not math.isfinite(ns.ddtree_level_bonus):  # a preset bypasses argparse
            raise StartupError(f"--ddtree-level-bonus must be a finite number, got {ns.ddtree_level_bonus!r}")
        if not ns.ddtree:
            raise StartupError("--ddtree-level-bonus shapes DDTree trees: it needs --ddtree")
    if ns.ddtree_draft_vocab is not None:
        if not ns.ddtree:
            raise StartupError("--ddtree-draft-vocab sets what DDTree drafts: it needs --ddtree")
        if not isinstance(ns.ddtree_draft_vocab, (int, str)):  # a preset bypasses argparse
            raise StartupError(f"--ddtree-draft-vocab must be a token count or a file, got {ns.ddtree_draft_vocab!r}")
        try:
            ns.ddtree_draft_vocab = draft_vocab.normalise(ns.ddtree_draft_vocab)
        except (ValueError, FileNotFoundError) as e:
            raise StartupError(f"--ddtree-draft-vocab: {e}") from None
    if ns.ddtree_draft_quantization is not None:
        if ns.ddtree_draft_quantization not in QUANTIZATIONS:  # a preset bypasses argparse
            raise StartupError(f"--ddtree-draft-quantization must be one of {list(QUANTIZATIONS)}, got "
                               f"{ns.ddtree_draft_quantization!r}")
        if ns.ddtree_draft_quantization != "none" and not ns.ddtree:
            raise StartupError("--ddtree-draft-quantization sets the drafter's weight format: it needs --ddtree")
    if ns.fast_rollback and not ns.ddtree:
        raise StartupError("--fast-rollback selects how DDTree rounds commit: it needs --ddtree")
    if ns.fast_rollback and int(ns.max_concurrency or 0) != 1:
        raise StartupError(f"--fast-rollback keeps every tree node's recurrent state and serves a single sequence: "
                           f"use --max-concurrency 1 (got {ns.max_concurrency})")
    if int(ns.cohort_reprobe_tokens) < 0:
        raise StartupError(f"--cohort-reprobe-tokens must be >= 0, got {ns.cohort_reprobe_tokens}")
    if ns.prefill_compression not in (None, "off") and not ns.prefill_drafter:
        raise StartupError(f"--prefill-compression {ns.prefill_compression} needs --prefill-drafter PATH "
                           "(a dense Qwen3 scorer checkpoint)")
    if ns.prefill_drafter and ns.prefill_compression in (None, "off"):
        raise StartupError("--prefill-drafter is only used with --prefill-compression auto|always")
    if ns.prefill_drafter and not os.path.isdir(ns.prefill_drafter):
        raise StartupError(f"--prefill-drafter {ns.prefill_drafter}: not a directory")
    ns.kvflash = _kvflash_flag(ns.kvflash)
    if ns.kvflash_scoring not in SCORINGS:  # a preset bypasses argparse's choices
        raise StartupError(f"--kvflash-scoring must be one of {', '.join(SCORINGS)}, got {ns.kvflash_scoring!r}")
    if ns.gpu_memory_utilization is not None:
        _number(ns, "gpu_memory_utilization", float, lambda v: 0 < v <= 1, "must be in (0, 1]")
    _number(ns, "kvflash_max_page_in", int, lambda v: v >= 0, "must be >= 0 (0 = only the pages a step writes)")
    _number(ns, "kvflash_host_prewarm_gb", float, lambda v: v >= 0, "must be >= 0")
    _number(ns, "prefix_cache", int, lambda v: v >= 0, "must be >= 0 (0 = off)")
    if ns.prefix_cache and ns.kvflash is not None:
        raise StartupError("--prefix-cache and --kvflash cannot be combined (a cached prefix's pages stay resident)")
    if ns.kvflash is not None and ns.kvflash_scoring == "drafter" and not ns.ddtree:
        raise StartupError("--kvflash-scoring drafter ranks pages by the DFlash drafter's queries: it needs --ddtree "
                           "(use keys or lru without a drafter)")
    if ns.draft_residency != "persistent":  # a preset bypasses argparse's choices
        raise StartupError(f"--draft-residency {ns.draft_residency}: only 'persistent' is supported (drafter and "
                           "scorer stay on the device; the seed's swapped/snapshot-cache residencies are not built)")
    thinking = str(ns.enable_thinking).strip().lower()
    if thinking not in ("true", "false"):
        raise StartupError(f"--enable-thinking must be true or false, got {ns.enable_thinking!r}")
    ns.enable_thinking = thinking == "true"
    for spec in (ns.target_device, ns.draft_device):
        if spec:
            _platform(spec)
    if ns.draft_device and ns.target_device and _device_key(ns.draft_device) != _device_key(ns.target_device):
        raise StartupError(f"--target-device {ns.target_device} and --draft-device {ns.draft_device}: "
                           "mixed-device target/draft placement is not supported; use one device")
    if not (os.path.isdir(ns.model) or ns.model.endswith(".gguf") and os.path.isfile(ns.model)):
        raise StartupError(f"--model {ns.model}: not a directory (or a .gguf file)")
    if ns.kv_dtype not in (None, "bf16", "fp8", "int8"):
        raise StartupError(f"--kv-dtype must be bf16, fp8 or int8, got {ns.kv_dtype!r}")
    if ns.quantization not in QUANTIZATIONS:
        raise StartupError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {ns.quantization!r}")
    if ns.max_concurrency < 1:
        raise StartupError("--max-concurrency must be >= 1")
    if int(ns.tensor_parallel) < 1 or int(ns.data_parallel) < 1:
        raise StartupError("--tensor-parallel and --data-parallel must be >= 1")
    if int(ns.max_concurrency) % int(ns.data_parallel):
        raise StartupError(f"--max-concurrency {ns.max_concurrency} must be a multiple of --data-parallel "
                           f"{ns.data_parallel} (each replica serves an equal share)")
    if int(ns.tensor_parallel) * int(ns.data_parallel) > 1 and (ns.target_device or ns.draft_device):
        raise StartupError("--tensor-parallel / --data-parallel use the first N x M devices of jax.devices(); drop "
                           "--target-device / --draft-device (the drafter is replicated on every device)")
    return ns


def _kvflash_flag(value) -> int | str | None:
    """``--kvflash`` -> None (off), "auto", or a token count (int)."""
    v = str(value).strip().lower()
    if v in ("off", "none", "false", "0"):
        return None
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except ValueError:
        raise StartupError(f"--kvflash {value}: expected off, auto or a resident pool size in tokens") from None
    if n < 1:
        raise StartupError(f"--kvflash {value}: the resident pool must hold at least one token")
    return n


def _platform(spec: str) -> str:
    name, _, idx = spec.partition(":")
    if name not in DEVICE_PREFIXES or (idx and not idx.isdigit()):
        raise StartupError(f"device {spec!r} not understood; use cpu:0, cuda:0, rocm:0 or hip:0")
    return DEVICE_PREFIXES[name]


def _device_key(spec: str) -> tuple[str, int]:
    """``cuda:1`` -> ("gpu", 1); ``hip`` -> ("gpu", 0)."""
    return _platform(spec), int(spec.partition(":")[2] or 0)


def _select_device(spec: str | None, flag: str = "--target-device"):
    import jax

    if spec is None:
        return jax.devices()[0]
    plat = _platform(spec)
    idx = int(spec.partition(":")[2] or 0)
    try:
        devs = jax.devices(plat)
    except RuntimeError as e:
        raise StartupError(f"{flag} {spec}: no {plat} backend available ({e})") from e
    if idx >= len(devs):
        raise StartupError(f"{flag} {spec}: only {len(devs)} {plat} device(s) present")
    return devs[idx]


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dflash_jax.device_memory import set_memory_fraction

    set_memory_fraction(args.gpu_memory_utilization)  # before JAX touches a device
    import jax
    import uvicorn

    from dflash_jax.engine.compile import enable_compile_cache
    from dflash_jax.engine.loop import Engine, EngineOptions
    from dflash_jax.engine.spec_steps import SpecConfig
    from dflash_jax.models.dflash_loader import load_drafter
    from dflash_jax.models.tokenizer import Tokenizer
    from dflash_jax.serve.app import Server, build_app
    from dflash_jax.target import load_target

    from dflash_jax.sharding import ShardingError, initialize_distributed

    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    initialize_distributed()
    if jax.process_count() > 1:  # every process would take its own requests: their collectives would not match
        raise StartupError(f"this is process {jax.process_index()} of a {jax.process_count()}-process JAX job "
                           f"(JAX_COORDINATOR_ADDRESS is set): the server is single-controller and does not serve "
                           f"across hosts; serve from one host (--tensor-parallel / --data-parallel over its own "
                           f"devices) with JAX_COORDINATOR_ADDRESS unset")
    tp, dp = int(args.tensor_parallel), int(args.data_parallel)
    device = _select_device(args.target_device)
    if args.draft_device and _select_device(args.draft_device, "--draft-device") != device:
        raise StartupError(f"--draft-device {args.draft_device} is not the target's device ({device}): mixed-device "
                           "target/draft placement is not supported; drop --draft-device or name the same device")
    dtype = args.dtype or ("bfloat16" if device.platform == "gpu" else "float32")
    t0 = time.perf_counter()
    with jax.default_device(device):
        q = None if args.quantization == "none" else args.quantization
        try:
            target = load_target(args.model, dtype=dtype, tensor_parallel=tp, data_parallel=dp, quantization=q)
        except ShardingError as e:
            raise StartupError(str(e)) from e
        if target.layout is not None:
            print(f"sharding: data={dp} x model={tp} {device.platform} devices; {target.layout.plan.describe()}",
                  flush=True)
            for note in target.layout.plan.notes:
                print(f"sharding: {note}", flush=True)
        dq = args.ddtree_draft_quantization
        drafter = (load_drafter(args.drafter, dtype=target.params["embed"].dtype,
                                quantization=q if dq in (None, "none") else dq)
                   if args.ddtree else None)
        spec = (SpecConfig(budget=int(args.ddtree_budget), fast_rollback=bool(args.fast_rollback),
                           chain_seed=bool(args.ddtree_chain_seed), level_bonus=args.ddtree_level_bonus,
                           max_verify_tokens=args.ddtree_max_verify_tokens,
                           draft_vocab=args.ddtree_draft_vocab,
                           draft_quantization=args.ddtree_draft_quantization) if args.ddtree else None)
        target.fuse_projections()  # in place: the engine would otherwise hold a fused copy next to these matrices
        try:
            eng = Engine(target, Tokenizer.from_dir(args.model),
                         EngineOptions(max_batch=args.max_concurrency, page_size=args.page_size,
                                       max_model_len=min(args.max_model_len, target.config.max_position_embeddings),
                                       prefill_chunk=args.prefill_chunk, prefill_batch=min(2, args.max_concurrency),
                                       spec=spec, cohort_yield_min=float(args.cohort_yield_min),
                                       cohort_reprobe_tokens=int(args.cohort_reprobe_tokens),
                                       kvflash=args.kvflash, kvflash_scoring=args.kvflash_scoring,
                                       kvflash_max_page_in=int(args.kvflash_max_page_in),
                                       kvflash_host_prewarm_gb=args.kvflash_host_prewarm_gb,
                                       kv_dtype=args.kv_dtype, kv_calibration=args.kv_calibration,
                                       tensor_parallel=tp, data_parallel=dp,
                                       overlap=args.overlap, prefix_cache=args.prefix_cache,
                                       prompt_logprobs=bool(args.enable_prompt_logprobs),
                                       batch_invariant=bool(args.batch_invariant),
                                       structured_spec=bool(args.structured_spec)),
                         drafter=drafter)
        except (ValueError, FileNotFoundError) as e:  # options this model/device cannot serve (e.g. a --kvflash pool
            # below one step, a --kv-calibration file that is not there)
            raise StartupError(str(e)) from e
        n = len(eng.prefill_buckets) + len(eng.decode_buckets)
        where = device if target.layout is None else f"{dp} x {tp} devices (data x tensor parallel)"
        pages = (f", {args.kv_dtype} pages" + (" with a key calibration" if eng.kv_calibration else "")
                 if args.kv_dtype in ("fp8", "int8") else "")
        print(f"model {args.model} ({dtype}{', fp8 weights' if q else ''}{pages}) loaded on {where} in "
              f"{time.perf_counter() - t0:.1f}s; "
              f"compiling {n} buckets", flush=True)
        done = [0]

        def progress(name: str, dt: float) -> None:
            done[0] += 1
            bar = "#" * done[0] + "." * (n - done[0])
            print(f"  [{bar}] {done[0]}/{n} {name} {dt:.1f}s", flush=True)

        hits = eng.warmup(progress).get("cache_hits", 0)
        if hits:
            print(f"{hits} of {n} executables loaded from the compile cache {args.compile_cache or ''}".rstrip(),
                  flush=True)
    pflash = None
    if args.prefill_compression not in (None, "off"):
        from dflash_jax.prefill.pflash import DenseScorer, PFlashError, PFlashOptions

        kw = {"mode": args.prefill_compression}
        if args.prefill_keep_ratio is not None:
            kw["keep_ratio"] = args.prefill_keep_ratio
        if args.prefill_min_tokens is not None:
            kw["min_tokens"] = args.prefill_min_tokens
        try:
            opts = PFlashOptions(**kw)
        except PFlashError as e:
            raise StartupError(str(e)) from e
        with jax.default_device(device):  # resident for the server's life (--draft-residency persistent)
            scorer = DenseScorer.from_pretrained(args.prefill_drafter, dtype=dtype)
        if scorer.cfg.vocab_size < target.config.vocab_size:
            raise StartupError(f"--prefill-drafter vocabulary ({scorer.cfg.vocab_size}) does not cover the target's "
                               f"({target.config.vocab_size}); a scorer of another tokenizer family is not supported")
        pflash = (opts, scorer)
    # start-up's objects (traced programs, weights' pytrees, tokenizer) out of the cyclic collector's reach: a full
    # collection over them is a pause of the engine thread between two steps
    gc.collect()
    gc.freeze()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    server = Server(eng, name, api_key=args.api_key or os.environ.get("DFLASH_API_KEY"),
                    default_thinking=args.enable_thinking, pflash=pflash)
    commit = "fast-rollback" if args.fast_rollback else "replay"
    budgets = eng.spec_budgets
    shown = (args.ddtree_budget if len(set(budgets.values())) <= 1
             else "/".join(f"{v}@B{b}" for b, v in budgets.items()))
    tree = "chain-seeded" if args.ddtree_chain_seed else "best-first"
    if args.ddtree:
        tree += f", level_bonus={spec.bonus_for(drafter[0]):g}"
    mode = (f"ddtree(budget={shown}, tree={tree}, drafter={args.drafter}, mode=packed-verify-{commit}, "
            f"cohort_yield_min={args.cohort_yield_min}, cohort_reprobe_tokens={args.cohort_reprobe_tokens})"
            if args.ddtree else "ar")
    pf = (f"{pflash[0].mode}(keep_ratio={pflash[0].keep_ratio}, min_tokens={pflash[0].min_tokens}, "
          f"scorer={args.prefill_drafter})" if pflash else "off")
    kr = eng.kvflash_report()
    kvf = (f"{kr['pool_tokens']}-token resident pool ({kr['pool_pages']} pages, scoring={kr['scoring']}, "
           f"host={kr['host_memory_kind']} {kr['host_bytes'] / 2**30:.2f} GiB)" if kr else "off")
    print(f"features: spec_mode={mode}, prefill_compression={pf}, kvflash={kvf}, "
          f"draft_residency={args.draft_residency}, enable_thinking={str(args.enable_thinking).lower()}, "
          f"max_concurrency={args.max_concurrency}", flush=True)
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
