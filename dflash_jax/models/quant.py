"""FP8 (e4m3), int8 and packed int4 weights: the ``QuantizedWeight`` pytree, quantize / dequantize, and the
quantized matmul.

A quantized matrix keeps the checkpoint's ``[out, in]`` layout in ``float8_e4m3fn`` (``quantization="fp8"``) or
``int8`` (``quantization="int8"``: llama.cpp's Q8_0 layout, 32-element blocks along the input, one scale each) with
float32 scales, or packed 4-bit (``quantization="int4"``: llama.cpp's Q4_0 values, see :func:`quantize_int4`),
``w ~= values * scale``:

* per output channel: ``scale [out]`` (what on-the-fly quantization produces; the scale multiplies the matmul
  *output*, so the GEMM/GEMV only reads fp8 bytes and converts them in registers);
* per block: ``scale [ceil(out/bo), ceil(in/bi)]`` (the layout of Qwen's published FP8 checkpoints, 128x128,
  ``*.weight_scale_inv``). The matmul then reduces each ``bi``-wide input block separately and scales the
  per-(out, block) partial sums (small token counts), or dequantizes the weight in the fused operand (large).

int4 stores two values per byte, ``data uint8 [out, in/2]``: byte ``j`` of a row holds input ``2j`` in its low
nibble and ``2j + 1`` in its high nibble, both two's complement (XLA's own packing of ``int4`` arrays). The matmul
unpacks with shifts (:func:`unpack_int4`) that XLA fuses into the dot operand; whether only the packed bytes are
then read from HBM is for ``bench linear`` to show (the first H200 run, with a bitcast unpack, read them at
856 GB/s at one token: no faster than bf16).

Activations stay in the model dtype (bf16) and accumulate in float32, except with ``quantization="fp8_dynamic"``
(W8A8, the scheme vLLM's online fp8 and llm-compressor's FP8_DYNAMIC use): per-channel fp8 weights whose matmul
also quantizes the activations to e4m3, one scale per token (its largest magnitude maps to 448), computed at the
matmul, so the dot is fp8 x fp8 (on Hopper, an fp8 tensor-core GEMM) and both scales multiply the float32
output (``QuantizedWeight.act = "fp8"``). Per matrix on an H100 (``bench linear``) it beat weight-only fp8 on the
MLP matrices (1.58-1.67x bf16 at 1 and 16 tokens) but not on the narrower projections at 16 tokens (0.71-0.78x),
so ``fp8_dynamic`` quantizes the activations of the MLP matrices only (:data:`DYNAMIC_ACT_NAMES`); the other
matmuls stay weight-only fp8. ``QuantizedWeight.dtype`` is the activation dtype, so code that
reads a weight's ``.dtype`` to pick the activation dtype works unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
INT8_BLOCK = (1, 32)  # Q8_0: 32 consecutive inputs of one output row share a scale
INT4_BLOCK = (1, 32)  # Q4_0: the same blocks
INT4_MIN, INT4_MAX = -8, 7
F16_MAX = 65504.0
QUANTIZATIONS = ("none", "fp8", "fp8_dynamic", "int8", "int4")
PACKINGS = (None, "int4")
ACTS = (None, "fp8")  # QuantizedWeight.act: activations as they are, or quantized per token to e4m3 at the matmul

# Parameter names (the last key of a pytree path) of the large matmul weights, target and drafter alike.
# Not quantized: the embedding (a row gather), norms, conv taps, A_log/dt_bias and the tiny GDN b/a gates.
MATMUL_NAMES = frozenset({"q", "k", "v", "o", "qkv", "z", "out", "gate", "up", "down", "fc", "lm_head"})
# the matrices whose inputs ``fp8_dynamic`` quantizes too (H100, bench linear: W8A8 won on these only)
DYNAMIC_ACT_NAMES = frozenset({"gate", "up", "down"})

# A block-scaled matmul at few tokens reduces each input block separately and reads only the quantized weight, but
# writes float32 partial sums [tokens, out, in / bi]; once they pass a quarter of the weight's own bytes, the
# weight dequantized as the matmul operand is the better plan (H200, 16 tokens with per-block sums: int8 0.31-0.42x
# bf16, int4 0.16-0.20x, fp8 128-blocks 0.78-0.99x; one token: int8 0.94-1.28x, fp8 128-blocks 1.04-1.33x).
PARTIAL_SUM_BYTES_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """``w [out, in] ~= values * scale``. ``packing`` None: values = data, ``float8_e4m3fn`` or ``int8 [out, in]``;
    ``"int4"``: data ``uint8 [out, in/2]``, two signed 4-bit values per byte (:func:`unpack_int4`). scale:
    ``float32 [out]`` (``block`` None) or ``[ceil(out/bo), ceil(in/bi)]`` (``block = (bo, bi)``; int4: ``float16
    [out, in/32]``). ``shape`` is the logical ``[out, in]``; ``dtype`` is the activation (dequantized) dtype.
    ``act`` ``"fp8"`` (fp8 per-channel weights only): the matmul quantizes its input per token to e4m3 too."""

    data: jax.Array
    scale: jax.Array
    block: tuple[int, int] | None = None
    dtype: Any = jnp.bfloat16
    packing: str | None = None
    act: str | None = None

    def __post_init__(self):  # meta fields only: the data fields may be tracers or placeholders here
        if self.packing not in PACKINGS:
            raise ValueError(f"QuantizedWeight packing {self.packing!r} not supported; use one of {list(PACKINGS)}")
        if self.act not in ACTS:
            raise ValueError(f"QuantizedWeight act {self.act!r} not supported; use one of {list(ACTS)}")
        if self.act is not None and (self.block is not None or self.packing is not None):
            raise ValueError("quantized activations (act='fp8') go with per-channel fp8 weights only")
        if self.packing == "int4" and tuple(self.block or ()) != INT4_BLOCK:
            raise ValueError(f"int4 weights carry {INT4_BLOCK} block scales, got block {self.block!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        out, n = self.data.shape
        return (out, 2 * n) if self.packing == "int4" else (out, n)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes)


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["data", "scale"],
                                 meta_fields=["block", "dtype", "packing", "act"])


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def check_quantization(q: str | None) -> str | None:
    """``None``/``"none"`` -> None; ``"fp8"`` / ``"fp8_dynamic"`` / ``"int8"`` / ``"int4"`` unchanged; anything else
    raises naming the choices."""
    if q is None or q == "none":
        return None
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization {q!r} not supported; use one of {list(QUANTIZATIONS)}")
    return q


# ---------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------
def _to_fp8(x: jax.Array) -> jax.Array:
    # e4m3fn has no infinity: an out-of-range value would become NaN, so clip first (only rounding can exceed)
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def _amax_scale(amax: jax.Array) -> jax.Array:
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(F32)


def block_scale_full(scale: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """Block scales ``[ceil(out/bo), ceil(in/bi)]`` -> one scale per element ``[out, in]``."""
    bo, bi = block
    full = jnp.repeat(jnp.repeat(scale, bo, axis=0), bi, axis=1)
    return full[: shape[0], : shape[1]]


@jax.jit(static_argnames=("block", "dtype", "act"))
def quantize_fp8(w: jax.Array, block: tuple[int, int] | None = None, dtype=None,
                 act: str | None = None) -> QuantizedWeight:
    """``w [out, in]`` -> ``QuantizedWeight`` with per-output-channel (``block`` None) or ``(bo, bi)`` block scales
    chosen so each channel / block's largest magnitude maps to 448. ``dtype`` (default ``w.dtype``) is the
    activation dtype recorded in the result; ``act="fp8"`` (per channel only): activations quantized at the
    matmul too (``fp8_dynamic``)."""
    dtype = jnp.dtype(dtype or w.dtype)
    wf = w.astype(F32)
    if block is None:
        scale = _amax_scale(jnp.max(jnp.abs(wf), axis=1))
        return QuantizedWeight(_to_fp8(wf / scale[:, None]), scale, None, dtype, act=act)
    if act is not None:
        raise ValueError("quantized activations (act='fp8') go with per-channel fp8 weights only")
    bo, bi = block
    out, inn = wf.shape
    no, ni = -(-out // bo), -(-inn // bi)
    padded = jnp.pad(jnp.abs(wf), ((0, no * bo - out), (0, ni * bi - inn)))
    scale = _amax_scale(jnp.max(padded.reshape(no, bo, ni, bi), axis=(1, 3)))
    return QuantizedWeight(_to_fp8(wf / block_scale_full(scale, block, (out, inn))), scale, tuple(block), dtype)


@jax.jit(static_argnames=("dtype",))
def quantize_int8(w: jax.Array, dtype=None) -> QuantizedWeight:
    """``w [out, in]`` -> int8 ``QuantizedWeight`` with one scale per 32 inputs of a row (``INT8_BLOCK``, Q8_0's
    layout): ``scale = amax / 127``, ``data = round(w / scale)``. A weight dequantized from a Q8_0 GGUF comes back
    to the file's int8 values. ``dtype`` (default ``w.dtype``) is the activation dtype recorded in the result."""
    dtype = jnp.dtype(dtype or w.dtype)
    wf = w.astype(F32)
    out, inn = wf.shape
    bi = INT8_BLOCK[1]
    ni = -(-inn // bi)
    amax = jnp.max(jnp.pad(jnp.abs(wf), ((0, 0), (0, ni * bi - inn))).reshape(out, ni, bi), axis=2)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(F32)
    q = jnp.clip(jnp.round(wf / block_scale_full(scale, INT8_BLOCK, (out, inn))), -INT8_MAX, INT8_MAX)
    return QuantizedWeight(q.astype(jnp.int8), scale, INT8_BLOCK, dtype)


def pack_int4(q: jax.Array) -> jax.Array:
    """Signed 4-bit values ``q [..., n]`` (any integer dtype, each in [-8, 7], n even) -> ``uint8 [..., n/2]``:
    byte ``j`` = ``(q[2j] & 0xF) | (q[2j+1] << 4)`` (XLA's packing of an ``int4`` array)."""
    *lead, n = q.shape
    if n % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got shape {list(q.shape)}")
    return jax.lax.bitcast_convert_type(q.astype(jnp.int4).reshape(*lead, n // 2, 2), jnp.uint8)


def unpack_int4(data: jax.Array) -> jax.Array:
    """``uint8 [..., n/2]`` from :func:`pack_int4` -> ``int8 [..., n]`` by shifts (sign-extending arithmetic shifts
    of the byte as int8), elementwise work XLA fuses into the consuming matmul. Not a bitcast to ``int4``: XLA's
    GPU Triton GEMM fusion aborts the process on such an operand in the per-block matmul at 16 tokens (jax 0.11.2,
    H200: ``triton_tiling_propagation.cc`` check failure)."""
    *lead, m = data.shape
    b = jax.lax.bitcast_convert_type(data, jnp.int8)
    lo = jax.lax.shift_right_arithmetic(jax.lax.shift_left(b, jnp.int8(4)), jnp.int8(4))
    hi = jax.lax.shift_right_arithmetic(b, jnp.int8(4))
    return jnp.stack([lo, hi], axis=-1).reshape(*lead, 2 * m)


@jax.jit(static_argnames=("dtype",))
def quantize_int4(w: jax.Array, dtype=None) -> QuantizedWeight:
    """``w [out, in]`` (``in`` a multiple of 32) -> packed int4 ``QuantizedWeight`` with llama.cpp's Q4_0 values:
    per 32 inputs of a row, ``scale = m / -8`` where ``m`` is the block's element of largest magnitude (sign
    kept), ``q = clip(round(w / scale), -8, 7)``, so ``m`` itself is ``-8 * scale`` and all 16 levels are used.
    Error: at most half a step (``|scale|``) per element, except elements of the opposite sign to ``m`` beyond
    7.5 steps, clipped to 7: at most one step (``|m| / 8``); for scales in float16's normal range (``|m| >=
    2^-11``; below it the scale's own rounding adds to that). Scales are float16 as Q4_0's ``d``: a Q4_0 GGUF's
    dequantized tensor comes back to the file's own 4-bit values and scales exactly, and a block costs 18 bytes
    (float32 scales: 20). bfloat16 could not hold Q4_0's scales (3 fewer mantissa bits). A block whose scale
    underflows float16 (``|m| < 2^-22``) is stored as zeros. ``dtype`` (default ``w.dtype``) is the activation
    dtype recorded in the result."""
    dtype = jnp.dtype(dtype or w.dtype)
    out, inn = w.shape
    bi = INT4_BLOCK[1]
    if inn % bi:
        raise ValueError(f"int4 weights need the input size to be a multiple of {bi}, got shape {[out, inn]}; "
                         "use quantization='int8' for this model")
    wb = w.astype(F32).reshape(out, inn // bi, bi)
    m = jnp.take_along_axis(wb, jnp.argmax(jnp.abs(wb), axis=2)[..., None], axis=2)  # [out, nb, 1]
    scale = jnp.clip(m / -8.0, -F16_MAX, F16_MAX).astype(jnp.float16)
    s = scale.astype(F32)
    q = jnp.where(s != 0, jnp.clip(jnp.round(wb / jnp.where(s != 0, s, 1.0)), INT4_MIN, INT4_MAX), 0)
    return QuantizedWeight(pack_int4(q.astype(jnp.int8).reshape(out, inn)), scale[..., 0], INT4_BLOCK, dtype,
                           "int4")


def values(w: QuantizedWeight) -> jax.Array:
    """The quantized values as one ``[out, in]`` array: fp8 / int8 as stored, int4 unpacked (:func:`unpack_int4`)."""
    return unpack_int4(w.data) if w.packing == "int4" else w.data


def dequantize(w: QuantizedWeight, dtype=F32) -> jax.Array:
    """``values * scale`` as a dense ``[out, in]`` array in ``dtype``."""
    d = values(w).astype(F32)
    s = w.scale[:, None] if w.block is None else block_scale_full(w.scale, w.block, w.shape)
    return (d * s.astype(F32)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# the matmul
# ---------------------------------------------------------------------------------------------
def blocked_max_tokens(w: QuantizedWeight) -> int:
    """Token counts up to which ``qmatmul`` sums a block-scaled weight per input block (at least 1): the float32
    partial sums of a row, ``tokens * (in / bi) * 4`` bytes, stay within :data:`PARTIAL_SUM_BYTES_FRACTION` of the
    row's weight bytes (``in * bytes per value``). int8 32-blocks: 2, int4: 1, fp8 128-blocks: 8."""
    value_bytes = 0.5 if w.packing == "int4" else jnp.dtype(w.data.dtype).itemsize
    return max(1, int(PARTIAL_SUM_BYTES_FRACTION * w.block[1] * value_bytes / 4))


def quantize_tokens_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., in]`` -> (e4m3 values ``[..., in]``, float32 scales ``[..., 1]``): per token, its largest magnitude
    maps to 448 (an all-zero token gets scale 1)."""
    xf = x.astype(F32)
    sx = _amax_scale(jnp.max(jnp.abs(xf), axis=-1, keepdims=True))
    return _to_fp8(xf / sx), sx


def qmatmul(x: jax.Array, w: QuantizedWeight, out_dtype=None) -> jax.Array:
    """``x [..., in] @ dequant(w)^T -> [..., out]`` with fp8 / int8 / int4 weights converted to ``x.dtype`` inside the
    matmul (int4: unpacked there from its bytes), float32 accumulation, result in ``out_dtype`` (default
    ``x.dtype``). ``act="fp8"`` weights quantize ``x`` per token (:func:`quantize_tokens_fp8`) and multiply fp8 by
    fp8 with float32 accumulation, both scales on the output. Other per-channel weights at <= 64 tokens go
    through the Pallas ``skinny_matmul`` kernel when ``DFLASH_KERNELS=skinny_matmul=pallas_triton`` (read at
    trace time; ``pallas_kernels.skinny_matmul.route``), otherwise XLA's fused convert + dot."""
    out_dtype = out_dtype or x.dtype
    acc = jnp.promote_types(x.dtype, F32)
    if w.act == "fp8":
        xq, sx = quantize_tokens_fp8(x)
        y = jnp.einsum("...i,oi->...o", xq, w.data, preferred_element_type=F32)
        return (y * sx * w.scale).astype(out_dtype)
    if w.block is None:
        if acc == F32:
            from pallas_kernels import skinny_matmul

            y = skinny_matmul.route(x, w.data, w.scale)
            if y is not None:
                return y.astype(out_dtype)
        y = jnp.einsum("...i,oi->...o", x, w.data.astype(x.dtype), preferred_element_type=acc)
        return (y * w.scale.astype(acc)).astype(out_dtype)
    bo, bi = w.block
    out, inn = w.shape
    tokens = math.prod(x.shape[:-1])
    wv = values(w)
    if tokens > blocked_max_tokens(w) or inn % bi:
        wd = wv.astype(x.dtype) * block_scale_full(w.scale, w.block, w.shape).astype(x.dtype)
        return jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=acc).astype(out_dtype)
    nb = inn // bi
    xb = x.reshape(*x.shape[:-1], nb, bi)
    part = jnp.einsum("...bi,obi->...ob", xb, wv.reshape(out, nb, bi).astype(x.dtype),
                      preferred_element_type=acc)  # [..., out, nb]
    s = jnp.repeat(w.scale, bo, axis=0)[:out]  # [out, nb]
    return jnp.sum(part * s.astype(acc), axis=-1).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# whole parameter trees
# ---------------------------------------------------------------------------------------------
def path_name(path: tuple[Any, ...]) -> str:
    """The last string key of a pytree path (``('layers', 3, 'mlp', 'gate')`` -> ``'gate'``)."""
    for k in reversed(path):
        k = getattr(k, "key", k)
        if isinstance(k, str):
            return k
    return ""


def quantizable(path: tuple[Any, ...], leaf: Any) -> bool:
    """A 2-D float matmul weight named in ``MATMUL_NAMES`` that is not already quantized."""
    return (not is_quantized(leaf) and getattr(leaf, "ndim", 0) == 2 and path_name(path) in MATMUL_NAMES
            and jnp.issubdtype(leaf.dtype, jnp.floating))


LeafQuantizer = Callable[[tuple[Any, ...], Any], Any]


def leaf_quantizer(quantization: str | None, block: tuple[int, int] | None = None) -> LeafQuantizer:
    """``f(path, leaf)``: the quantized version of a quantizable leaf (fp8: per channel, or ``block`` scales;
    fp8_dynamic: per channel, the MLP matrices' activations quantized at the matmul; int8: Q8_0 blocks; int4: packed
    Q4_0 blocks),
    else the leaf."""
    q = check_quantization(quantization)

    def f(path, leaf):
        if q is None or not quantizable(path, leaf):
            return leaf
        if q == "int4":
            try:
                return quantize_int4(leaf)
            except ValueError as e:
                raise ValueError(f"{jax.tree_util.keystr(tuple(path))}: {e}") from e
        if q == "fp8_dynamic":
            if block is not None:
                raise ValueError("fp8_dynamic quantizes weights per channel: it takes no block scales")
            return quantize_fp8(leaf, act="fp8" if path_name(path) in DYNAMIC_ACT_NAMES else None)
        return quantize_int8(leaf) if q == "int8" else quantize_fp8(leaf, block)

    return f


def quantize_params(params: Any, quantization: str | None, block: tuple[int, int] | None = None) -> Any:
    """Quantize every quantizable leaf of a parameter tree, one leaf at a time (each full-precision leaf can be
    freed as soon as its quantized copy exists). Tied leaves (the same array object, e.g. a tied LM head and
    embedding) keep the embedding's full precision."""
    if check_quantization(quantization) is None:
        return params
    f = leaf_quantizer(quantization, block)
    embed = params.get("embed") if isinstance(params, dict) else None
    is_leaf = is_quantized

    def g(path, leaf):
        if embed is not None and leaf is embed:
            return leaf
        return f(path, leaf)

    return jax.tree_util.tree_map_with_path(g, params, is_leaf=is_leaf)


def weight_itemsize(params: Any) -> float:
    """Average bytes per element of the matmul weights (2 for bf16, ~1 for fp8 + scales, ~0.56 for int4)."""
    n = b = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]:
        if path_name(path) in MATMUL_NAMES and (is_quantized(leaf) or getattr(leaf, "ndim", 0) == 2):
            n += math.prod(leaf.shape)
            b += leaf.nbytes if is_quantized(leaf) else math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    return b / n if n else 2.0


# ---------------------------------------------------------------------------------------------
# FP8 checkpoints (Qwen / DeepSeek layout)
# ---------------------------------------------------------------------------------------------
def read_fp8_block(path: str) -> tuple[int, int] | None:
    """The ``weight_block_size`` of an FP8 checkpoint's ``quantization_config`` (top level or ``text_config``);
    None if the checkpoint is not FP8. Other quantization methods raise naming the method."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(p):
        return None
    with open(p) as f:
        raw = json.load(f)
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{p}: quantization_config.quant_method {method!r} is not supported (only 'fp8')")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{p}: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    bs = qc.get("weight_block_size")
    if bs is None:
        return None
    if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(v, int) and v > 0 for v in bs)):
        raise ValueError(f"{p}: quantization_config.weight_block_size must be two positive ints, got {bs!r}")
    return (bs[0], bs[1])


def fp8_from_checkpoint(data: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] | None,
                        dtype, name: str) -> QuantizedWeight:
    """A checkpoint's ``float8_e4m3fn`` weight and its ``weight_scale_inv`` (the dequantization multiplier,
    ``w = data * scale_inv``) -> a ``QuantizedWeight`` on the device. Scale shapes: ``[ceil(out/bo),
    ceil(in/bi)]`` with ``block``, ``[out]``/``[out, 1]`` per channel, ``[]``/``[1]`` per tensor."""
    out, inn = data.shape
    s = np.asarray(scale_inv, np.float32)
    want = None if block is None else (-(-out // block[0]), -(-inn // block[1]))
    if want is not None and s.ndim == 2 and (s.shape == want or s.size > 1):
        if s.shape != want:
            raise ValueError(f"tensor {name!r}: weight_scale_inv shape {list(s.shape)} != {list(want)} for a "
                             f"{[out, inn]} weight with weight_block_size {list(block)}")
        return QuantizedWeight(jax.device_put(data), jax.device_put(s), tuple(block), jnp.dtype(dtype))
    if s.size == 1:
        s = np.full((out,), s.reshape(()), np.float32)
    elif s.reshape(-1).shape == (out,):
        s = s.reshape(out)
    else:
        raise ValueError(f"tensor {name!r}: weight_scale_inv shape {list(s.shape)} fits neither per-channel "
                         f"[{out}] nor the block layout of a {[out, inn]} weight")
    return QuantizedWeight(jax.device_put(data), jax.device_put(s), None, jnp.dtype(dtype))
