"""The dense scorer's fast scoring pass: layer-major tail attention over a whole prompt (reference §5.6).

``tail_max_attention`` runs the (bucket-padded) prompt through the model one layer per dispatch: hidden ``[Tp, D]``
in, hidden out (donated). Each layer's causal self-attention covers the whole prompt in one call, so the work is
exactly causal (no attention over unused cache rows) and no K/V cache exists at all: a scored layer (one of the last
``n_layers``) takes its last ``nq`` queries against all its keys, ``[H, nq, Tp]`` probabilities, and folds their max
over heads into a running ``[nq, Tp]`` buffer. The last layer stops after that (its output feeds nothing).

Causal attention implementations (``ATTENTION``):

* ``"cudnn"``: ``jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")``, cuDNN flash attention
  (NVIDIA GPU, bf16/fp16). Queries and keys are the same ``Tp`` rows, so the causal mask's diagonal alignment
  (top-left vs bottom-right) cannot matter.
* ``"xla"``: ``dense._block_attention`` per query block of ``block`` rows, each walking only the key blocks up to its
  own (online softmax, bf16 operands with float32 accumulation), memory O(block^2) per head.
* ``"auto"`` (``resolve_attention``): cuDNN on a GPU when a probe compiles and runs, else XLA.

Compiled executables per prompt bucket ``Tp``: the embedding, a middle layer, a scored middle layer (only when
``n_layers`` < all), the scored last layer; layers share one executable because their parameters are arguments.

Sharing the device with decode (PFlash item 3: a running sequence's decode step may wait at most about one step's
time per scorer dispatch). On a GPU every executable of a device runs in one stream in submission order, so a decode
step dispatched while scoring runs waits for all scorer work queued before it. Two rules bound that wait:

* **pacing** (``pace=True``, the default): each dispatch is waited for before the next is issued, so at most one
  scorer dispatch is ever ahead of a decode step (unpaced, all of a prompt's dispatches are queued at once: at 128K
  on the 27B set that was seconds of device work in front of the next decode step); with ``between`` =
  ``engine.turns.DeviceTurns.background_turn`` the next dispatch also waits for the engine's next step, so no two
  scorer dispatches run between two decode steps;
* **slicing** (``max_dispatch_flops``): when one layer's causal attention over ``Tp`` rows would exceed the budget,
  the layer runs as three kinds of dispatch: q/k/v (+ the tail scores of a scored layer), the attention of
  ``dispatch_heads`` query heads at a time (written into one ``[Tp, H, hd]`` buffer), then the output projection and
  MLP. ``DISPATCH_FLOPS`` (2e12, about 5 ms of bf16 flash attention on an H200) keeps a 128K prompt's dispatches at
  one head (~11 ms there, under a 27B decode step) and leaves prompts up to ~16K (hd 128, 16 heads) unsliced.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.models import dense
from dflash_jax.models.qwen36 import acc_dtype, linear, mlp, rms_norm

ATTENTION = ("auto", "cudnn", "xla")
DISPATCH_FLOPS = 2e12


def attention_flops(n_rows: int, head_dim: int, heads: int) -> float:
    """FLOPs of causal self-attention over ``n_rows`` rows for ``heads`` query heads (QK^T and PV, half the pairs)."""
    return 2.0 * n_rows * n_rows * head_dim * heads


def dispatch_heads(cfg: dense.DenseConfig, n_rows: int, max_flops: float | None) -> int:
    """Query heads per attention dispatch for a prompt bucket of ``n_rows``: the most whose causal attention stays
    within ``max_flops`` (all heads when None), at least 1. Valid counts divide H and keep GQA groups whole (a multiple
    of the group size, or a divisor of it), so every dispatch reads whole KV heads."""
    h, group = cfg.num_heads, cfg.num_heads // cfg.num_kv_heads
    if max_flops is None:
        return h
    if not max_flops > 0:
        raise ValueError(f"max_dispatch_flops must be positive or None, got {max_flops!r}")
    valid = [d for d in range(h, 0, -1) if h % d == 0 and (d % group == 0 or group % d == 0)]
    return next((d for d in valid if attention_flops(n_rows, cfg.head_dim, d) <= max_flops), 1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str, block: int) -> jax.Array:
    """Causal GQA self-attention of one sequence: q [T, H, hd], k, v [T, Hkv, hd] -> [T, H, hd] in q's dtype.

    ``impl`` "cudnn" or "xla"; for "xla" T must be a multiple of ``block``.
    """
    t = q.shape[0]
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation="cudnn")[0]
    if impl != "xla":
        raise ValueError(f"attention implementation must be 'cudnn' or 'xla', got {impl!r}")
    if t % block:
        raise ValueError(f"sequence length {t} must be a multiple of the attention block {block}")
    nb = t // block

    def one(args):
        qb, b = args  # [block, H, hd], block index
        pos = b * block + jnp.arange(block, dtype=jnp.int32)
        return dense._block_attention(qb, k, v, pos, (b + 1) * block, block)

    o = lax.map(one, (q.reshape(nb, block, *q.shape[1:]), jnp.arange(nb, dtype=jnp.int32)))
    return o.reshape(q.shape)


def _probe_cudnn(cfg: dense.DenseConfig, dtype) -> None:
    """Compile and run cuDNN flash attention at the scorer's head shapes (raises if it cannot)."""
    n = 256
    q = jnp.zeros((n, cfg.num_heads, cfg.head_dim), dtype)
    kv = jnp.zeros((n, cfg.num_kv_heads, cfg.head_dim), dtype)
    f = jax.jit(lambda q, k, v: causal_attention(q, k, v, "cudnn", n))
    jax.block_until_ready(f(q, kv, kv))


def resolve_attention(name: str, cfg: dense.DenseConfig, dtype) -> tuple[str, str]:
    """``(implementation, why)`` for a requested ``name`` in ``ATTENTION``.

    "cudnn" is checked by a probe and raises ValueError when cuDNN flash attention cannot run here; "auto" picks
    cuDNN on a GPU with a bf16/fp16 model when the probe passes, otherwise "xla" (``why`` says which and why).
    """
    if name not in ATTENTION:
        raise ValueError(f"scorer attention must be one of {ATTENTION}, got {name!r}")
    if name == "xla":
        return "xla", "requested"
    dt = jnp.dtype(dtype)
    if name == "auto":
        if jax.default_backend() not in ("gpu", "cuda"):
            return "xla", f"backend {jax.default_backend()!r} has no cuDNN"
        if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return "xla", f"cuDNN flash attention needs bfloat16/float16, the scorer is {dt.name}"
    try:
        _probe_cudnn(cfg, dt)
    except Exception as e:  # cuDNN missing, unsupported shape/dtype, or a failed graph build
        if name == "cudnn":
            raise ValueError(f"scorer attention 'cudnn' cannot run here ({type(e).__name__}: {e}); "
                             "use 'xla' or 'auto'") from e
        return "xla", f"cuDNN probe failed ({type(e).__name__}: {str(e)[:200]})"
    return "cudnn", "requested" if name == "cudnn" else "GPU, cuDNN probe passed"


@functools.partial(jax.jit, static_argnames=("n_query",))
def _start(embed: jax.Array, ids: jax.Array, n_query: int) -> tuple[jax.Array, jax.Array]:
    """ids [Tp] -> (hidden [Tp, D], zero running max [nq, Tp])."""
    return jnp.take(embed, ids, axis=0), jnp.zeros((n_query, ids.shape[0]), acc_dtype(embed.dtype))


def _qkv_scored(p: dense.Params, cfg: dense.DenseConfig, h: jax.Array, run: jax.Array, q_start: jax.Array,
                score: bool, nope: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A layer's q [Tp, H, hd], k, v [Tp, Hkv, hd] from h [Tp, D]; a scored layer folds the max over heads of its
    tail queries' probabilities into run [nq, Tp]."""
    pos = jnp.arange(h.shape[0], dtype=jnp.int32)
    q, k, v = dense._qkv(p["attn"], cfg, rms_norm(h, p["input_norm"], cfg.rms_norm_eps), pos)
    if score:
        qt = lax.dynamic_slice_in_dim(q, q_start, run.shape[0], 0)
        run = jnp.maximum(run, dense.tail_probs(qt, k, q_start, cfg.rope_theta, nope, cfg.rope_scaling).max(axis=0))
    return q, k, v, run


def _out_mlp(p: dense.Params, cfg: dense.DenseConfig, h: jax.Array, o: jax.Array) -> jax.Array:
    """The output projection of the attention o [Tp, H, hd] and the MLP, added to h [Tp, D]."""
    h = h + linear(o.reshape(h.shape[0], -1), p["attn"]["o"])
    return h + mlp(p["mlp"], rms_norm(h, p["post_norm"], cfg.rms_norm_eps))


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "block", "score", "last", "nope"),
                   donate_argnames=("h", "run"))
def _layer(p: dense.Params, cfg: dense.DenseConfig, h: jax.Array, run: jax.Array, q_start: jax.Array, *,
           impl: str, block: int, score: bool, last: bool, nope: bool) -> tuple[jax.Array, jax.Array]:
    """One decoder layer over the whole padded prompt h [Tp, D] in one dispatch (``_qkv_scored``, attention,
    ``_out_mlp``); the ``last`` layer returns h unchanged (nothing reads it)."""
    q, k, v, run = _qkv_scored(p, cfg, h, run, q_start, score, nope)
    if last:
        return h, run
    return _out_mlp(p, cfg, h, causal_attention(q, k, v, impl, block)), run


@functools.partial(jax.jit, static_argnames=("cfg", "score", "nope"), donate_argnames=("run",))
def _layer_qkv(p: dense.Params, cfg: dense.DenseConfig, h: jax.Array, run: jax.Array, q_start: jax.Array, *,
               score: bool, nope: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A sliced layer's first dispatch (``_qkv_scored``)."""
    return _qkv_scored(p, cfg, h, run, q_start, score, nope)


@functools.partial(jax.jit, static_argnames=("heads", "group", "impl", "block"), donate_argnames=("o",))
def _layer_heads(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, h0: jax.Array, *, heads: int, group: int,
                 impl: str, block: int) -> jax.Array:
    """Causal attention of query heads [h0, h0 + heads) (KV heads h0 // group ...) written into o [Tp, H, hd]."""
    qs = lax.dynamic_slice_in_dim(q, h0, heads, 1)
    kv0, nkv = h0 // group, max(1, heads // group)
    ks = lax.dynamic_slice_in_dim(k, kv0, nkv, 1)
    vs = lax.dynamic_slice_in_dim(v, kv0, nkv, 1)
    return lax.dynamic_update_slice_in_dim(o, causal_attention(qs, ks, vs, impl, block), h0, 1)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("h",))
def _layer_out(p: dense.Params, cfg: dense.DenseConfig, h: jax.Array, o: jax.Array) -> jax.Array:
    """A sliced layer's last dispatch (``_out_mlp``)."""
    return _out_mlp(p, cfg, h, o)


def _wait(x):
    """The pacing wait (one place, so tests can watch it)."""
    return jax.block_until_ready(x)


def tail_max_attention(params: dense.Params, cfg: dense.DenseConfig, ids: Any, *, n_query: int = 8,
                       n_layers: int | None = None, nope: bool = False, attention: str = "xla", block: int = 512,
                       max_dispatch_flops: float | None = DISPATCH_FLOPS, pace: bool = True,
                       between: Callable[[], None] | None = None,
                       step_times: list[float] | None = None) -> tuple[jax.Array, int]:
    """Max over the last ``n_layers`` layers and all heads of the attention probabilities of the last ``n_query``
    prompt tokens: ``(run [nq, Tp] float32, T)`` with ``nq = min(n_query, T)`` and ``Tp = capacity_for(T, block)``.

    ``run[i, j]`` for ``j < T`` equals ``dense.tail_attention(...)[:, :, i, j].max()`` over layers and heads (zero for
    keys after query i, and for the padding rows ``j >= T``). ``attention`` is "cudnn" or "xla" (see
    ``resolve_attention``). ``max_dispatch_flops`` slices layers whose attention exceeds it (None: one dispatch per
    layer); ``pace`` waits for each dispatch before the next (see the module docstring) and then calls ``between()``
    (e.g. ``DeviceTurns.background_turn``: wait for the engine's next step). With ``step_times`` a list, every
    dispatch is waited for and its seconds appended.
    """
    dense._check_chunk(block)
    if isinstance(n_query, bool) or not isinstance(n_query, int) or n_query <= 0:
        raise ValueError(f"n_query must be a positive int, got {n_query!r}")
    if attention not in ("cudnn", "xla"):
        raise ValueError(f"attention must be 'cudnn' or 'xla' (resolve 'auto' with resolve_attention), "
                         f"got {attention!r}")
    scored = set(dense._layer_ids(cfg, n_layers))
    arr = dense._check_ids(cfg, ids)
    t = arr.shape[0]
    nq = min(n_query, t)
    tp = dense.capacity_for(t, block)
    heads = dispatch_heads(cfg, tp, max_dispatch_flops)
    group = cfg.num_heads // cfg.num_kv_heads
    padded = np.zeros(tp, np.int32)
    padded[:t] = arr
    q_start = np.int32(t - nq)

    def dispatch(f, *a, **kw):
        t0 = time.perf_counter()
        out = f(*a, **kw)
        if pace or step_times is not None:
            out = _wait(out)
            if step_times is not None:
                step_times.append(time.perf_counter() - t0)
            if pace and between is not None:
                between()
        return out

    h, run = dispatch(_start, params["embed"], padded, nq)
    n = cfg.num_layers
    o = None
    for i, p in enumerate(params["layers"]):
        score, last = i in scored, i == n - 1
        if heads == cfg.num_heads or last:
            h, run = dispatch(_layer, p, cfg, h, run, q_start, impl=attention, block=block, score=score, last=last,
                              nope=nope)
            continue
        q, k, v, run = dispatch(_layer_qkv, p, cfg, h, run, q_start, score=score, nope=nope)
        if o is None:
            o = jnp.zeros_like(q)
        for h0 in range(0, cfg.num_heads, heads):
            o = dispatch(_layer_heads, q, k, v, o, np.int32(h0), heads=heads, group=group, impl=attention,
                         block=block)
        del q, k, v
        h = dispatch(_layer_out, p, cfg, h, o)
    return run, t
