"""Key calibration for quantized pages: keys centred, Hadamard-rotated and rounded where the queries do not look.

Rounding a key ``k`` to fp8 adds an error ``e`` that moves every score ``q . k`` of the queries reading it by
``q . e``. Plain rounding spreads ``e`` evenly over the D channels; the queries do not look evenly. With a
calibration (:class:`KVCalibration`, measured once per model by :func:`measure` on a few rows of text and shipped
beside its weights as ``kv_calibration.safetensors``), every attention layer:

* **centres** its keys by their mean ``mu [Hkv, D]``: each score of a query moves by the same ``q . mu``, which
  softmax ignores, and the rows' per-row scale then covers the part that varies;
* **rotates** keys and queries by the orthonormal Hadamard matrix ``H`` (``q . k = Hq . Hk``), spreading the few
  large channels of rotary keys over all of them;
* **rounds** each stored key one channel at a time, feeding each channel's error into the channels not yet
  rounded (``kv.quant.quantize_rows_feedback`` with ``key_feedback [Hkv, D, D]``), so as to minimise
  ``e^T M e`` instead of ``|e|^2``: ``M`` the mean of ``sum_g (H q_g)(H q_g)^T`` over the query heads ``g`` of that
  KV head, i.e. the expected squared change of their scores (GPTQ's error feedback, applied to one key vector).

The transform is in ``qwen36.attn_project`` (queries and keys, so the tree's own keys, the pages and the KVFlash
scorers all see the same space); the rounding is in the write of quantized key pages. Values are unchanged, and so
are the bytes a page holds and reads. On the shipped tiny pair, fp8 pages agree with bf16 pages on 0.991-0.992 of
greedy tokens with it and 0.976-0.977 without (``bench quality --kv-dtypes fp8``; ``experiments/kv_quant_parts.py``
holds the parts).

Measure one with ``python -m dflash_jax.kv.calibrate --model PATH [--files F ...]`` (``kv/calibrate.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.kv import quant as kv_quant

FILE_NAME = "kv_calibration.safetensors"
FORMAT = "dflash-kv-calibration-1"
DAMP = 0.01  # of M's mean diagonal, added before inverting it
PARAMS_KEY = "kv_calib"  # the attention layer's params entry that holds a layer's calibration
_PAGE = 16


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix ``[n, n]`` float32 (n a power of two; symmetric, its own inverse)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head size, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class KVCalibration:
    """``key_mean [L, Hkv, D]`` (per attention layer, in order: the mean of its post-RoPE keys) and
    ``key_feedback [L, Hkv, D, D]`` (``kv.quant.feedback_matrix`` of the rotated query moments); ``meta``: how it
    was measured (strings)."""

    key_mean: np.ndarray
    key_feedback: np.ndarray
    meta: dict[str, str] = dataclasses.field(default_factory=dict)

    def check(self, cfg: TargetConfig) -> None:
        """Raise ``ValueError`` unless this calibration fits ``cfg``'s attention layers (its KV heads may be a
        divisor of the config's: tensor parallelism repeats KV heads)."""
        n, hd = len(cfg.attn_layers), cfg.head_dim
        l, hkv, d = self.key_mean.shape
        if (l, d) != (n, hd) or cfg.num_kv_heads % hkv or self.key_feedback.shape != (l, hkv, d, d):
            raise ValueError(f"the KV calibration (key_mean {self.key_mean.shape}, key_feedback "
                             f"{self.key_feedback.shape}) does not fit this model ({n} attention layers, "
                             f"{cfg.num_kv_heads} KV heads of {hd}); measure one for it: python -m "
                             "dflash_jax.kv.calibrate --model PATH")

    def save(self, path: str) -> str:
        from safetensors.numpy import save_file

        save_file({"key_mean": np.ascontiguousarray(self.key_mean, np.float32),
                   "key_feedback": np.ascontiguousarray(self.key_feedback, np.float32)},
                  path, metadata={"format": FORMAT, **{k: str(v) for k, v in self.meta.items()}})
        return path

    @classmethod
    def load(cls, path: str) -> "KVCalibration":
        from safetensors import safe_open

        with safe_open(path, "numpy") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a KV calibration (format {meta.get('format')!r}, expected {FORMAT!r})")
            return cls(f.get_tensor("key_mean"), f.get_tensor("key_feedback"), meta)


def find(model_path: str | None) -> str | None:
    """The calibration shipped beside a checkpoint directory (``<dir>/kv_calibration.safetensors``), or None."""
    if not model_path:
        return None
    path = os.path.join(model_path if os.path.isdir(model_path) else os.path.dirname(model_path), FILE_NAME)
    return path if os.path.isfile(path) else None


def attach(params: dict, cfg: TargetConfig, calib: KVCalibration, layout: Any = None) -> dict:
    """``params`` with every attention layer's calibration as ``layers[i]["attn"]["kv_calib"]`` (``key_mean
    [Hkv, D]``, ``key_feedback [Hkv, D, D]``, KV heads repeated to ``cfg``'s); the other leaves are shared, not
    copied. With a ``sharding.Layout``, each array is placed as its layer's KV heads are."""
    calib.check(cfg)
    times = cfg.num_kv_heads // calib.key_mean.shape[1]
    layers = list(params["layers"])
    for li, i in enumerate(cfg.attn_layers):
        entry = {}
        for name, arr in (("key_mean", calib.key_mean[li]), ("key_feedback", calib.key_feedback[li])):
            arr = np.repeat(arr, times, axis=0)
            path = ("layers", i, "attn", PARAMS_KEY, name)
            entry[name] = (jnp.asarray(arr) if layout is None
                           else jax.device_put(arr, layout.param_sharding(path, arr.shape)))
        layers[i] = {**layers[i], "attn": {**layers[i]["attn"], PARAMS_KEY: entry}}
    return {**params, "layers": layers}


def detach(params: dict) -> dict:
    """``params`` without any attention layer's calibration."""
    layers = [{**p, "attn": {k: v for k, v in p["attn"].items() if k != PARAMS_KEY}} if "attn" in p else p
              for p in params["layers"]]
    return {**params, "layers": layers}


def is_attached(params: dict) -> bool:
    return any(PARAMS_KEY in p.get("attn", {}) for p in params["layers"])


def transform(q: jax.Array, k: jax.Array, calib: dict) -> tuple[jax.Array, jax.Array]:
    """Queries ``[..., H, D]`` and keys ``[..., Hkv, D]`` of one layer -> ``(H q, H (k - mu))`` in their dtypes: every
    score moves by ``q . mu`` (the same for all keys of a query: softmax ignores it)."""
    h = jnp.asarray(hadamard(q.shape[-1]))
    rot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    q2 = rot(q.astype(jnp.float32), h).astype(q.dtype)  # H is symmetric: q @ H = (H q)^T
    k2 = rot(k.astype(jnp.float32) - calib["key_mean"].astype(jnp.float32), h).astype(k.dtype)
    return q2, k2


# ---------------------------------------------------------------------------------------------
# measuring one
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg",))
def _taps(params, cfg: TargetConfig, tokens: jax.Array):
    """One row ``tokens [1, T]`` from position 0 -> (queries ``[L, T, H, D]``, keys ``[L, T, Hkv, D]``) float32 of
    every attention layer: the post-RoPE queries and the keys its pages hold."""
    from dflash_jax.models import attention, qwen36
    from dflash_jax.state import KVPages, RecurrentSlots, StepInput

    t = tokens.shape[1]
    n_pages = -(-t // _PAGE) + 1
    kv = KVPages.zeros(cfg, n_pages, _PAGE, qwen36.param_dtype(params))
    table = jnp.arange(1, n_pages, dtype=jnp.int32)[None]
    inp = StepInput(tokens=tokens, positions=jnp.arange(t, dtype=jnp.int32)[None], n_valid=jnp.asarray([t]),
                    slots=jnp.ones((1,), jnp.int32), page_table=table)
    qs: list = []
    _, kv, _, _ = qwen36.forward(params, cfg, inp, kv, RecurrentSlots.zeros(cfg, 2, qwen36.param_dtype(params)),
                                 queries=qs)
    keys = [attention.gather_pages(k, table)[0, :t] for k in kv.k]
    return jnp.stack(qs)[:, 0].astype(jnp.float32), jnp.stack(keys).astype(jnp.float32)


def error_factors(moments: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """The upper Cholesky factor of ``(M + damp mean(diag M) I)^-1`` per ``[..., D, D]`` matrix ``M``."""
    d = moments.shape[-1]
    m = moments.astype(np.float64) + damp * np.trace(moments, axis1=-2, axis2=-1)[..., None, None] / d * np.eye(d)
    return np.swapaxes(np.linalg.cholesky(np.linalg.inv(m)), -1, -2)


def measure(params: dict, cfg: TargetConfig, rows: np.ndarray, damp: float = DAMP) -> KVCalibration:
    """A calibration of the target ``params`` / ``cfg`` from ``rows [R, T]`` of token ids (each a sequence from
    position 0; one compile for the row length): per attention layer the mean of its keys and the feedback of
    ``H M H^T`` (``M``: the mean over tokens of ``sum_g q_g q_g^T`` over each KV head's query heads)."""
    params = detach(params)
    rows = np.asarray(rows, np.int32)
    n, hkv, d = len(cfg.attn_layers), cfg.num_kv_heads, cfg.head_dim
    k_sum = np.zeros((n, hkv, d))
    m_sum = np.zeros((n, hkv, d, d))
    tokens = 0
    for row in rows:
        q, k = (np.asarray(a, np.float64) for a in _taps(params, cfg, jnp.asarray(row[None])))
        q = q.reshape(n, q.shape[1], hkv, -1, d)  # [L, T, Hkv, G, D]
        k_sum += k.sum(1)
        m_sum += np.einsum("ltjgd,ltjge->ljde", q, q)
        tokens += q.shape[1]
    h = hadamard(d).astype(np.float64)
    rotated = h @ (m_sum / tokens) @ h.T
    feedback = kv_quant.feedback_matrix(error_factors(rotated, damp))
    meta = {"rows": str(len(rows)), "row_len": str(rows.shape[1]), "tokens": str(tokens), "damp": str(damp),
            "rotation": "hadamard"}
    return KVCalibration((k_sum / tokens).astype(np.float32), feedback, meta)
