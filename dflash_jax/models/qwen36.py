"""The Qwen3.5/3.6 hybrid target as pure functions over a parameter pytree.

Parameters (weights kept in the checkpoint's ``[out, in]`` layout, one dict per layer, layers unrolled):

  embed [V, D], lm_head [V, D], final_norm [D]
  layers[i]: input_norm [D], post_norm [D], mlp {gate [F, D], up [F, D], down [D, F]} and either
    attn {q [H*2*hd, D], k [Hkv*hd, D], v [Hkv*hd, D], o [D, H*hd], q_norm [hd], k_norm [hd]}  (full layers)
    gdn  {qkv [conv_dim, D], z [Hv*dv, D], b [Hv, D], a [Hv, D], conv [conv_dim, K], A_log [Hv],
          dt_bias [Hv], norm [dv], out [D, Hv*dv]}                                          (linear layers)

Norm weights, A_log and dt_bias are float32; matrices use the activation dtype. :func:`fuse_projections` rewrites a
layer's input projections that read the same activations into one matrix each (``gdn["qkv+z+b+a"]``,
``attn["q+k+v"]``, ``mlp["gate+up"]``: the parts concatenated along ``out``), one matmul instead of several; the
model code reads either layout (:func:`project`). The qkv / conv channels are
``[q | k | v]`` or, under tensor parallelism, ``cfg.gdn_qkv_groups`` groups of whole heads of each
(``sharding.qkv_permutation``); the model code is otherwise free of sharding (``dflash_jax/sharding.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.config import FULL, TargetConfig, YarnScaling
from dflash_jax.kv import calibration as kv_calibration
from dflash_jax.kv.scatter import set_rows_where
from dflash_jax.models import attention, gdn, quant, tree_ops
from dflash_jax.state import KVPages, RecurrentSlots, StepInput, TreeInput

Params = dict[str, Any]
F32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# parameter shapes and random initialisation
# ---------------------------------------------------------------------------------------------
def param_shapes(cfg: TargetConfig, dtype=jnp.bfloat16) -> Params:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves."""
    S = jax.ShapeDtypeStruct
    F32 = acc_dtype(dtype)  # small vectors: float32 (float64 for a float64 model)
    d, f = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for t in cfg.layer_types:
        layer: Params = {
            "input_norm": S((d,), F32), "post_norm": S((d,), F32),
            "mlp": {"gate": S((f, d), dtype), "up": S((f, d), dtype), "down": S((d, f), dtype)},
        }
        if t == FULL:
            hd = cfg.head_dim
            layer["attn"] = {
                "q": S((cfg.q_proj_dim, d), dtype), "k": S((cfg.num_kv_heads * hd, d), dtype),
                "v": S((cfg.num_kv_heads * hd, d), dtype), "o": S((d, cfg.num_heads * hd), dtype),
                "q_norm": S((hd,), F32), "k_norm": S((hd,), F32),
            }
        else:
            hv = cfg.lin_num_v_heads
            layer["gdn"] = {
                "qkv": S((cfg.conv_dim, d), dtype), "z": S((cfg.value_dim, d), dtype),
                "b": S((hv, d), dtype), "a": S((hv, d), dtype), "conv": S((cfg.conv_dim, cfg.conv_kernel), dtype),
                "A_log": S((hv,), F32), "dt_bias": S((hv,), F32), "norm": S((cfg.lin_v_dim,), F32),
                "out": S((d, cfg.value_dim), dtype),
            }
        layers.append(layer)
    return {"embed": S((cfg.vocab_size, d), dtype), "lm_head": S((cfg.vocab_size, d), dtype),
            "final_norm": S((d,), F32), "layers": tuple(layers)}


def init_params(cfg: TargetConfig, key: jax.Array, dtype=jnp.bfloat16, place=None,
                quantization: str | None = None) -> Params:
    """Random weights of the real shapes (for speed measurements without a checkpoint).

    Generated leaf by leaf on the default device, so a 27B tree never needs a host copy; ``place(path, leaf)``
    (e.g. ``sharding.Layout.reshard``) moves each leaf to its final placement before the next is made. With
    ``quantization="fp8"`` each matmul weight is quantized as soon as it is generated (per output channel),
    so the full-precision model never exists on the device; ``place`` then moves the ``QuantizedWeight``.
    """
    qleaf = quant.leaf_quantizer(quantization)
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))

    @jax.jit(static_argnames=("shape", "dtype", "kind"))
    def make(k, shape, dtype, kind):
        if kind == "A_log":
            return jnp.log(jax.random.uniform(k, shape, F32, 1.0, 16.0))
        if kind == "norm1":
            return jnp.ones(shape, dtype)
        if kind == "vec":
            return 0.1 * jax.random.normal(k, shape, dtype)
        return (jax.random.normal(k, shape, F32) * (shape[-1] ** -0.5)).astype(dtype)

    out = []
    for (path, s), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        kind = ("A_log" if "A_log" in name else "norm1" if name.endswith("['gdn']['norm']")
                else "vec" if len(s.shape) == 1 else "mat")
        if cfg.tie_word_embeddings and name == "['lm_head']":
            out.append(None)  # tied: the embedding (set below), never quantized
            continue
        leaf = qleaf(path, make(k, s.shape, s.dtype, kind))
        out.append(place(path, leaf) if place is not None else leaf)
    params = jax.tree_util.tree_unflatten(treedef, out)
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"]
    return params


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
def linear(x: jax.Array, w: jax.Array | quant.QuantizedWeight, out_dtype=None) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out] in ``out_dtype`` (default x.dtype). ``w`` may be an fp8
    ``QuantizedWeight`` (converted inside the matmul, float32 accumulation). At <= 64 tokens a 2-D weight goes
    through the Pallas ``skinny_matmul`` kernel when ``DFLASH_KERNELS=skinny_matmul=pallas_triton`` (split-K
    weight streaming, f32 accumulation; ``pallas_kernels.skinny_matmul.route``), otherwise XLA's dot."""
    if isinstance(w, quant.QuantizedWeight):
        return quant.qmatmul(x, w, out_dtype)
    if w.ndim == 2 and acc_dtype(x.dtype) == F32:
        from pallas_kernels import skinny_matmul

        y = skinny_matmul.route(x, w)
        if y is not None:
            return y.astype(out_dtype or x.dtype)
    if out_dtype is None:
        return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=out_dtype)


def acc_dtype(dtype) -> jnp.dtype:
    """Accumulation dtype for activations of ``dtype``: float32, or float64 for a float64 model."""
    return jnp.promote_types(dtype, F32)


def rms_norm_zc(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32."""
    a = acc_dtype(x.dtype)
    xf = x.astype(a)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(a))).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Plain RMSNorm: w * x * rsqrt(mean(x^2) + eps), in float32."""
    a = acc_dtype(x.dtype)
    xf = x.astype(a)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(a) * y).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float,
         scaling: YarnScaling | None = None) -> jax.Array:
    """Partial NEOX rotary embedding on the first ``rotary_dim`` dims. x [B,T,H,D], positions [B,T].
    ``scaling``: YaRN (each pair's frequency blended with itself / factor, cos and sin times the attention factor)."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=acc_dtype(x.dtype)) / rotary_dim))
    if scaling is not None:
        keep = jnp.asarray(scaling.keep(rotary_dim, theta), inv_freq.dtype)
        inv_freq = inv_freq * keep + inv_freq / scaling.factor * (1 - keep)
    ang = positions.astype(inv_freq.dtype)[..., None] * inv_freq  # [B,T,half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if scaling is not None:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    cos = jnp.concatenate([cos, cos], -1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], -1)[:, :, None, :].astype(x.dtype)
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    rot = jnp.concatenate([-xr[..., half:], xr[..., :half]], -1)
    return jnp.concatenate([xr * cos + rot * sin, xp], -1)


# input projections fused into one matmul by fuse_projections, in the order their outputs are concatenated
FUSED_GROUPS: dict[str, tuple[str, ...]] = {"gdn": ("qkv", "z", "b", "a"), "attn": ("q", "k", "v"),
                                            "mlp": ("gate", "up")}


def project(p: Params, x: jax.Array, sizes: dict[str, int]) -> dict[str, jax.Array]:
    """``{name: linear(x, p[name])}`` for the projections ``sizes`` names (name -> output size); those that
    :func:`fuse_projections` joined (key ``"a+b+..."``) run as one matmul whose output is split."""
    out: dict[str, jax.Array] = {}
    for key, w in p.items():
        parts = key.split("+")
        if len(parts) > 1 and parts[0] in sizes:
            y = linear(x, w)
            offsets = [0]
            for name in parts:
                offsets.append(offsets[-1] + sizes[name])
            if offsets[-1] != y.shape[-1]:
                raise ValueError(f"fused projection {key!r} has {y.shape[-1]} outputs; its parts' sizes {sizes} "
                                 f"add up to {offsets[-1]}")
            out.update({name: y[..., a:b] for name, a, b in zip(parts, offsets[:-1], offsets[1:])})
    return out | {name: linear(x, p[name]) for name in sizes if name not in out}


def fuse_projections(params: Params, *, consume: bool = False) -> Params:
    """The target's parameters with each layer's :data:`FUSED_GROUPS` concatenated along ``out`` (key
    ``"qkv+z+b+a"`` etc.): one matmul for the projections that read the same input. Only neighbours of the same kind
    join (plain matrices of one dtype, or ``QuantizedWeight`` of one format whose scale blocks do not straddle the
    seam): fp8 ``qkv`` / ``z`` with plain ``b`` / ``a`` give ``"qkv+z"`` and ``"b+a"``. Already fused layers pass
    through. ``consume=True`` deletes each part's buffers once its fused matrix exists (the model's bytes are
    not held twice; the input tree is unusable afterwards)."""
    layers = []
    for layer in params["layers"]:
        new = dict(layer)
        for block, names in FUSED_GROUPS.items():
            if block in layer:
                new[block] = _fuse_block(layer[block], names, consume)
        layers.append(new)
    return {**params, "layers": tuple(layers)}


def is_fused(params: Params) -> bool:
    """True iff some layer holds a fused projection (:func:`fuse_projections`)."""
    return any("+" in key for layer in params["layers"] for block in layer.values() if isinstance(block, dict)
               for key in block)


def fused_unquantized(params: Params) -> list[str]:
    """Fused projections in full precision that hold a matrix ``quant.quantize_params`` would quantize (it does not
    read fused names: quantize before fusing). Targets quantized at load and then fused have none."""
    return [key for layer in params["layers"] for block in layer.values() if isinstance(block, dict)
            for key, w in block.items() if "+" in key and not quant.is_quantized(w)
            and set(key.split("+")) & set(quant.MATMUL_NAMES)]


def concat_out(ws: list) -> Any:
    """Matrices ``[out_i, in]`` (plain, or ``QuantizedWeight`` of one format, :func:`joinable` pairwise) concatenated
    along ``out``: one matmul computes all their outputs."""
    if quant.is_quantized(ws[0]):
        return dataclasses.replace(ws[0], data=jnp.concatenate([w.data for w in ws]),
                                   scale=jnp.concatenate([w.scale for w in ws]))
    return jnp.concatenate(ws)


def joinable(a: Any, b: Any) -> bool:
    if quant.is_quantized(a) or quant.is_quantized(b):
        if not (quant.is_quantized(a) and quant.is_quantized(b)):
            return False
        same = (a.dtype, a.packing, a.block, a.act, a.data.dtype, a.scale.dtype) == (
            b.dtype, b.packing, b.block, b.act, b.data.dtype, b.scale.dtype)
        return same and a.shape[1] == b.shape[1] and (a.block is None or a.shape[0] % a.block[0] == 0)
    return a.ndim == b.ndim == 2 and a.dtype == b.dtype and a.shape[1] == b.shape[1]


def _fuse_block(p: Params, names: tuple[str, ...], consume: bool) -> Params:
    present = [n for n in names if n in p]
    runs: list[list[str]] = []
    for n in present:
        if runs and joinable(p[runs[-1][-1]], p[n]):
            runs[-1].append(n)
        else:
            runs.append([n])
    out = {k: v for k, v in p.items() if k not in present}
    for run in runs:
        if len(run) == 1:
            out[run[0]] = p[run[0]]
            continue
        ws = [p[n] for n in run]
        fused = concat_out(ws)
        if consume:
            for leaf in jax.tree.leaves(ws):
                leaf.delete()
        out["+".join(run)] = fused
    return out


def param_dtype(params: Params):
    """The activation dtype of a target's parameters (that of its matrices)."""
    return params["layers"][0]["mlp"]["down"].dtype


def mlp(p: Params, x: jax.Array) -> jax.Array:
    f = p["down"].shape[1]
    y = project(p, x, {"gate": f, "up": f})
    return linear(jax.nn.silu(y["gate"]) * y["up"], p["down"])


def attn_project(p: Params, cfg: TargetConfig, u: jax.Array, positions: jax.Array):
    """u [B,T,D] -> q [B,T,H,hd] (normed, rotated), gate [B,T,H,hd] | None, k, v [B,T,Hkv,hd]. With a KV calibration
    in ``p`` (``kv.calibration``), q and k are the calibration's centred, Hadamard-rotated ones."""
    b, t, _ = u.shape
    h, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    y = project(p, u, {"q": cfg.q_proj_dim, "k": hkv * hd, "v": hkv * hd})
    qg = y["q"].reshape(b, t, h, -1)
    q, gate = (qg[..., :hd], qg[..., hd:]) if cfg.attn_output_gate else (qg, None)
    k = y["k"].reshape(b, t, hkv, hd)
    v = y["v"].reshape(b, t, hkv, hd)
    q = rope(rms_norm_zc(q, p["q_norm"], cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta,
             cfg.rope_scaling)
    k = rope(rms_norm_zc(k, p["k_norm"], cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta,
             cfg.rope_scaling)
    if kv_calibration.PARAMS_KEY in p:  # quantized pages with a key calibration: queries and keys rotated alike
        q, k = kv_calibration.transform(q, k, p[kv_calibration.PARAMS_KEY])
    return q, gate, k, v


def key_feedback(p: Params) -> jax.Array | None:
    """An attention layer's key-rounding feedback ``[Hkv, hd, hd]`` (``kv.calibration``), or None without one."""
    calib = p.get(kv_calibration.PARAMS_KEY)
    return None if calib is None else calib["key_feedback"]


def attn_output(p: Params, o: jax.Array, gate: jax.Array | None) -> jax.Array:
    """Sigmoid output gate and o_proj: o [B,T,H,hd] -> [B,T,D]."""
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    b, t = o.shape[:2]
    return linear(o.reshape(b, t, -1), p["o"])


def attention_layer(p: Params, cfg: TargetConfig, u: jax.Array, inp: StepInput, valid: jax.Array,
                    k_pages: jax.Array, v_pages: jax.Array, queries: list | None = None):
    """Gated full attention over paged KV. u [B,T,D] -> ([B,T,D], k_pages, v_pages).

    queries: when a list, the layer's rotated queries ``[B,T,H,hd]`` are appended to it (KVFlash page scoring)."""
    q, gate, k, v = attn_project(p, cfg, u, inp.positions)
    if queries is not None:
        queries.append(q)
    k_pages, v_pages = attention.write_kv(k_pages, v_pages, k, v, inp.page_table, inp.positions, valid,
                                          key_feedback(p))
    o = attention.paged_attention(q, k_pages, v_pages, inp.page_table, inp.positions, cfg.head_dim ** -0.5)
    return attn_output(p, o, gate), k_pages, v_pages


def causal_conv(x: jax.Array, w: jax.Array, conv_state: jax.Array, n_valid: jax.Array):
    """Depthwise causal conv + SiLU with a carried window.

    x [B,T,C] pre-conv rows; w [C,K] (w[:, K-1] multiplies the current token); conv_state [B,K-1,C]
    the previous K-1 pre-conv rows. Returns (silu(conv) [B,T,C], new state = the last K-1 rows up to
    each row's n_valid-th token).
    """
    kk = w.shape[1]
    t = x.shape[1]
    xx = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    a = acc_dtype(x.dtype)
    acc = sum(xx[:, j:j + t].astype(a) * w[:, j].astype(a) for j in range(kk))
    new_state = jax.vmap(lambda r, n: lax.dynamic_slice_in_dim(r, n, kk - 1, axis=0))(xx, n_valid)
    return jax.nn.silu(acc).astype(x.dtype), new_state.astype(conv_state.dtype)


def gdn_project(p: Params, cfg: TargetConfig, u: jax.Array):
    """u [B,T,D] -> pre-conv rows x [B,T,conv_dim], gate z [B,T,Hv,dv], raw b and a [B,T,Hv] (accumulation dtype)."""
    b, t, _ = u.shape
    f = acc_dtype(u.dtype)
    hv = cfg.lin_num_v_heads
    y = project(p, u, {"qkv": p["conv"].shape[0], "z": hv * cfg.lin_v_dim, "b": hv, "a": hv})
    z = y["z"].reshape(b, t, hv, cfg.lin_v_dim)
    return y["qkv"], z, y["b"].astype(f), y["a"].astype(f)


def gdn_inputs(p: Params, cfg: TargetConfig, c: jax.Array, braw: jax.Array, araw: jax.Array, valid: jax.Array):
    """Post-conv rows c [B,T,conv_dim] -> the delta rule's q, k [B,T,Hv,dk], v [B,T,Hv,dv], beta, g [B,T,Hv]
    (:func:`gdn_qkv_gates` with the layer's parameters and ``cfg``'s head counts)."""
    return gdn_qkv_gates(c, braw, araw, p["A_log"], p["dt_bias"], valid, n_k_heads=cfg.lin_num_k_heads,
                         v_dim=cfg.lin_v_dim, groups=cfg.gdn_qkv_groups)


def gdn_qkv_gates(c: jax.Array, braw: jax.Array, araw: jax.Array, a_log: jax.Array, dt_bias: jax.Array,
                  valid: jax.Array, *, n_k_heads: int, v_dim: int, groups: int = 1):
    """Post-conv rows c [B,T,C] -> q, k [B,T,Hv,dk], v [B,T,Hv,dv], beta, g [B,T,Hv] (braw's dtype).

    ``C = 2 * n_k_heads * dk + Hv * v_dim`` with Hv = braw.shape[-1]. q/k are L2-normalised (q scaled by dk^-0.5)
    and expanded to the value heads (head j reads key head j // (Hv / n_k_heads)); invalid tokens get beta = g = 0
    and k = v = 0, so they leave the state unchanged. The channels are ``groups`` groups of ``[q | k | v]`` (1 = the
    checkpoint's layout; tensor parallelism groups whole heads).
    """
    b, t, ch = c.shape
    hk, hv, dv = n_k_heads, braw.shape[-1], v_dim
    key_dim = (ch - hv * dv) // 2
    dk = key_dim // hk
    f = braw.dtype
    c = c.astype(f)
    kd = key_dim // groups
    cg = c.reshape(b, t, groups, -1)
    q = gdn.l2norm(cg[..., :kd].reshape(b, t, hk, dk)) * dk ** -0.5
    k = gdn.l2norm(cg[..., kd:2 * kd].reshape(b, t, hk, dk))
    v = cg[..., 2 * kd:].reshape(b, t, hv, dv)
    m = valid.astype(f)
    beta = jax.nn.sigmoid(braw) * m[..., None]
    g = -jnp.exp(a_log.astype(f)) * jax.nn.softplus(araw + dt_bias.astype(f)) * m[..., None]
    k = k * m[..., None, None]
    v = v * m[..., None, None]
    r = hv // hk
    return jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2), v, beta, g


def gdn_tree_gated(c, braw, araw, a_log, dt_bias, valid, state, ancestors, slots=None, *, n_k_heads: int,
                   groups: int = 1):
    """:func:`gdn_tree_gated_reference`'s contract through the kernel registry's ``"gdn_tree_gated"`` op (on a GPU by
    default the tree kernel forming q, k, v and the gates itself; ``DFLASH_KERNELS=gdn_tree_gated=reference`` runs
    the unfused path)."""
    from pallas_kernels import registry

    return registry.get("gdn_tree_gated")(c, braw, araw, a_log, dt_bias, valid, state, ancestors, slots,
                                          n_k_heads=n_k_heads, groups=groups)


def gdn_tree_gated_reference(c, braw, araw, a_log, dt_bias, valid, state, ancestors, slots=None, *,
                             n_k_heads: int, groups: int = 1):
    """A GDN layer's tree delta rule from its post-conv rows: :func:`gdn_qkv_gates` then ``gdn.gdn_tree``.

    c [B,N,C] post-conv rows, braw / araw [B,N,Hv] raw gates, a_log / dt_bias [Hv], valid [B,N], state / ancestors /
    slots as ``gdn.gdn_tree``. Returns (o [B,N,Hv,dv], TreeGDNCache)."""
    q, k, v, beta, g = gdn_qkv_gates(c, braw, araw, a_log, dt_bias, valid, n_k_heads=n_k_heads,
                                     v_dim=state.shape[-1], groups=groups)
    return gdn.gdn_tree(q, k, v, beta, g, state, ancestors, slots)


def gdn_output(p: Params, cfg: TargetConfig, o: jax.Array, z: jax.Array, dtype) -> jax.Array:
    """Gated output norm and out_proj: o, z [B,T,Hv,dv] -> [B,T,D] in ``dtype``."""
    b, t = o.shape[:2]
    y = gdn_gated_norm(o, z, p["norm"], cfg.rms_norm_eps)
    return linear(y.astype(dtype).reshape(b, t, -1), p["out"])


def gdn_gated_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """rms_norm(o) * w * silu(z) per value head: o, z [..., dv] -> [..., dv] in o's dtype."""
    return rms_norm(o, w, eps) * jax.nn.silu(z.astype(o.dtype))


def gdn_layer(p: Params, cfg: TargetConfig, u: jax.Array, inp: StepInput, valid: jax.Array,
              conv_state: jax.Array, ssm_state: jax.Array):
    """Gated DeltaNet over a chunk (T > 1; decode is :func:`gdn_decode_layer`). u [B,T,D]; conv_state [B,K-1,C];
    ssm_state [B,Hv,dk,dv] -> (out, conv, ssm)."""
    x, z, braw, araw = gdn_project(p, cfg, u)
    c, conv_state = causal_conv(x, p["conv"], conv_state, inp.n_valid)
    q, k, v, beta, g = gdn_inputs(p, cfg, c, braw, araw, valid)
    o, ssm_state = gdn.gdn_chunked(q, k, v, beta, g, ssm_state.astype(braw.dtype))
    return gdn_output(p, cfg, o, z, u.dtype), conv_state, ssm_state


def gdn_decode_layer(p: Params, cfg: TargetConfig, u: jax.Array, valid: jax.Array, fresh: jax.Array,
                     slots: jax.Array, conv_all: jax.Array, ssm_all: jax.Array):
    """Gated DeltaNet for one token of every row, reading and writing the slots' state in place.

    u [B,1,D]; valid [B,1]; fresh [B] (rows that start from a zero state); slots [B] (0 = null: not written);
    conv_all [S,K-1,C], ssm_all [S,Hv,dk,dv] -> (out [B,1,D], conv_all, ssm_all). Everything between the input
    projections and out_proj is one op, ``gdn_decode`` (conv, gates, delta-rule step, gated norm, state writes),
    which reads the projections' outputs where they are (the one row ``[x | z | b | a]`` the fused in-projection
    ``"qkv+z+b+a"`` writes, or the separate matrices' outputs): no slice or concatenation of them is materialised
    (concatenating four matmul outputs made XLA rebuild their weights every step: 28 ms 27B steps instead of 18).
    """
    b = u.shape[0]
    parts = tuple(linear(u[:, 0], p[key]) for key in _gdn_in_keys(p))
    out, conv_all, ssm_all = gdn_decode(parts, p["conv"], p["A_log"], p["dt_bias"], p["norm"], conv_all, ssm_all,
                                        slots, fresh, valid[:, 0], n_k_heads=cfg.lin_num_k_heads,
                                        groups=cfg.gdn_qkv_groups, eps=cfg.rms_norm_eps)
    return linear(out.reshape(b, 1, -1), p["out"]), conv_all, ssm_all


def _gdn_in_keys(p: Params) -> list[str]:
    """A GDN layer's in-projection keys (``"qkv"``, ``"qkv+z"``, ``"qkv+z+b+a"``...) in row order."""
    order = FUSED_GROUPS["gdn"]
    keys = [k for k in p if set(k.split("+")) <= set(order)]
    return sorted(keys, key=lambda k: order.index(k.split("+")[0]))


def gdn_decode(parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid, *, n_k_heads: int,
               groups: int = 1, eps: float):
    """:func:`gdn_decode_reference`'s contract through the kernel registry's ``"gdn_decode"`` op (on a GPU the fused
    Pallas kernel ``pallas_kernels.gdn.decode``; ``DFLASH_KERNELS=gdn_decode=reference`` for the jnp path)."""
    from pallas_kernels import registry

    return registry.get("gdn_decode")(parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid,
                                      n_k_heads=n_k_heads, groups=groups, eps=eps)


def segment_locations(widths: tuple[int, ...], sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Where each segment of the row ``[x | z | b | a]`` (``sizes`` in that order) starts: ``{name: (part,
    offset)}`` for parts of ``widths`` that concatenate to the row; a segment split across two parts is an error."""
    bounds, start = [], 0
    for w in widths:
        bounds.append((start, start + w))
        start += w
    if start != sum(sizes.values()):
        raise ValueError(f"gdn_decode: in-projection parts of widths {widths} do not make a row of {sizes}")
    locs, off = {}, 0
    for name, n in sizes.items():
        part = next(k for k, (a, b) in enumerate(bounds) if a <= off < b)
        if off + n > bounds[part][1]:
            raise ValueError(f"gdn_decode: segment {name!r} straddles in-projection parts of widths {widths}")
        locs[name] = (part, off - bounds[part][0])
        off += n
    return locs


def split_gdn_proj(parts: tuple[jax.Array, ...], n_v_heads: int, v_dim: int):
    """In-projection outputs that together are the row ``[..., C + Hv*dv + 2*Hv]`` -> x [..., C], z [..., Hv, dv],
    b, a [..., Hv], each sliced from the part that holds it (no concatenation)."""
    hv, dv = n_v_heads, v_dim
    width = sum(x.shape[-1] for x in parts)
    sizes = {"x": width - hv * dv - 2 * hv, "z": hv * dv, "b": hv, "a": hv}
    locs = segment_locations(tuple(x.shape[-1] for x in parts), sizes)
    seg = {name: parts[k][..., o:o + sizes[name]] for name, (k, o) in locs.items()}
    return seg["x"], seg["z"].reshape(seg["z"].shape[:-1] + (hv, dv)), seg["b"], seg["a"]


def gdn_decode_reference(parts, conv_w, a_log, dt_bias, norm_w, conv_all, ssm_all, slots, fresh, valid, *,
                         n_k_heads: int, groups: int = 1, eps: float):
    """One decode token of a GDN layer between its projections, in jnp.

    parts: the in-projections' outputs, [B, *] each, that concatenated are the row ``[x | z | b | a]`` of
    C + Hv*dv + 2*Hv (x the pre-conv row, z the output gate, b / a the raw beta / decay gates; a segment never spans
    two parts); conv_w [C,K]; a_log, dt_bias [Hv]; norm_w [dv]; conv_all [S,K-1,C]
    and ssm_all [S,Hv,dk,dv] every slot's state; slots [B] (0 = null); fresh [B] (read a zero state); valid [B]
    (an invalid row leaves its state as read). Returns (y [B,Hv,dv] gated-normed in the parts' dtype, conv_all,
    ssm_all) with the rows of slots > 0 updated.
    """
    parts = tuple(parts)
    f = acc_dtype(parts[0].dtype)
    x, z, braw, araw = split_gdn_proj(parts, a_log.shape[0], norm_w.shape[0])
    braw, araw = braw.astype(f), araw.astype(f)
    cs = jnp.where(fresh[:, None, None], 0, conv_all[slots])
    ss = jnp.where(fresh[:, None, None, None], 0, ssm_all[slots]).astype(f)
    c, cs = causal_conv(x[:, None], conv_w, cs, valid.astype(jnp.int32))
    q, k, v, beta, g = gdn_qkv_gates(c, braw[:, None], araw[:, None], a_log, dt_bias, valid[:, None],
                                     n_k_heads=n_k_heads, v_dim=z.shape[-1], groups=groups)
    o, ss = gdn.gdn_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], ss)
    y = gdn_gated_norm(o, z, norm_w, eps).astype(parts[0].dtype)
    keep = slots > 0
    return y, set_rows_where(conv_all, (slots,), cs, keep), set_rows_where(ssm_all, (slots,), ss, keep)


# ---------------------------------------------------------------------------------------------
# the forward step
# ---------------------------------------------------------------------------------------------
def forward(params: Params, cfg: TargetConfig, inp: StepInput, kv: KVPages, rec: RecurrentSlots,
            return_layers: tuple[int, ...] = (), queries: list | None = None):
    """Run T tokens of B sequences through the target, reading and updating their paged KV and slots.

    A row whose first position is 0 starts from a zero recurrent state (whatever its slot held before).
    Returns ``(h [B,T,D] after the final norm, kv', rec', feats)`` where ``feats`` is
    ``[len(return_layers), B, T, D]`` (outputs of those decoder layers, before the final norm) or None.
    queries: when a list, each attention layer's rotated queries ``[B,T,H,hd]`` are appended to it, in order.
    """
    valid = inp.valid
    fresh = inp.positions[:, 0] == 0  # a row starting at position 0 has no recurrent history
    decode = inp.tokens.shape[1] == 1  # one token a row: GDN layers through the fused gdn_decode op
    h = params["embed"].astype(param_dtype(params))[inp.tokens]
    ks, vs, convs, ssms = list(kv.k), list(kv.v), list(rec.conv), list(rec.ssm)
    feats = []
    ai = gi = 0
    for i, (lt, p) in enumerate(zip(cfg.layer_types, params["layers"])):
        u = rms_norm_zc(h, p["input_norm"], cfg.rms_norm_eps)
        if lt == FULL:
            out, ks[ai], vs[ai] = attention_layer(p["attn"], cfg, u, inp, valid, ks[ai], vs[ai], queries)
            ai += 1
        elif decode:
            out, convs[gi], ssms[gi] = gdn_decode_layer(p["gdn"], cfg, u, valid, fresh, inp.slots, convs[gi], ssms[gi])
            gi += 1
        else:
            cs = jnp.where(fresh[:, None, None], 0, convs[gi][inp.slots])
            ss = jnp.where(fresh[:, None, None, None], 0, ssms[gi][inp.slots])
            out, cs, ss = gdn_layer(p["gdn"], cfg, u, inp, valid, cs, ss)
            convs[gi] = set_rows_where(convs[gi], (inp.slots,), cs, inp.slots > 0)
            ssms[gi] = set_rows_where(ssms[gi], (inp.slots,), ss, inp.slots > 0)
            gi += 1
        h = h + out
        h = h + mlp(p["mlp"], rms_norm_zc(h, p["post_norm"], cfg.rms_norm_eps))
        if i in return_layers:
            feats.append(h)
    h = rms_norm_zc(h, params["final_norm"], cfg.rms_norm_eps)
    feats_arr = jnp.stack(feats) if feats else None
    return h, KVPages(tuple(ks), tuple(vs)), RecurrentSlots(tuple(convs), tuple(ssms)), feats_arr


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeScratch:
    """What a verification pass keeps so that the commit never runs the target again.

    k, v: per full-attention layer [B, N, Hkv, hd] (the tree's K/V, post-norm, post-RoPE);
    x: per GDN layer [B, N, conv_dim] pre-conv rows; gdn: per GDN layer the ``gdn.TreeGDNCache``
    from which the state at any slot is materialised.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    x: tuple[jax.Array, ...]
    gdn: tuple[gdn.TreeGDNCache, ...]


def forward_tree(params: Params, cfg: TargetConfig, tree: TreeInput, kv: KVPages, rec: RecurrentSlots,
                 return_layers: tuple[int, ...] = ()):
    """Verify B token trees in one pass: tree attention over paged prefix + ancestors, tree conv,
    ancestor-masked gated delta rule. Reads but never writes ``kv`` and ``rec``.

    Returns ``(h [B,N,D] after the final norm, TreeScratch, feats [len(return_layers), B, N, D] | None)``.
    """
    h = params["embed"].astype(param_dtype(params))[tree.tokens]
    ks, vs, xs, caches, feats = [], [], [], [], []
    ai = gi = 0
    for i, (lt, p) in enumerate(zip(cfg.layer_types, params["layers"])):
        u = rms_norm_zc(h, p["input_norm"], cfg.rms_norm_eps)
        if lt == FULL:
            pa = p["attn"]
            q, gate, k, v = attn_project(pa, cfg, u, tree.positions)
            o = attention.tree_attention(q, kv.k[ai], kv.v[ai], tree.page_table, tree.start, k, v, tree.ancestors,
                                         cfg.head_dim ** -0.5)
            out = attn_output(pa, o, gate)
            ks.append(k)
            vs.append(v)
            ai += 1
        else:
            pg = p["gdn"]
            x, z, braw, araw = gdn_project(pg, cfg, u)
            c = tree_ops.tree_conv(x, pg["conv"], rec.conv[gi], tree.parents, tree.slots)
            o, cache = gdn_tree_gated(c, braw, araw, pg["A_log"], pg["dt_bias"], tree.valid, rec.ssm[gi],
                                      tree.ancestors, tree.slots,
                                      n_k_heads=cfg.lin_num_k_heads, groups=cfg.gdn_qkv_groups)
            out = gdn_output(pg, cfg, o, z, u.dtype)
            xs.append(x)
            caches.append(cache)
            gi += 1
        h = h + out
        h = h + mlp(p["mlp"], rms_norm_zc(h, p["post_norm"], cfg.rms_norm_eps))
        if i in return_layers:
            feats.append(h)
    h = rms_norm_zc(h, params["final_norm"], cfg.rms_norm_eps)
    scratch = TreeScratch(tuple(ks), tuple(vs), tuple(xs), tuple(caches))
    return h, scratch, (jnp.stack(feats) if feats else None)


def commit_tree(cfg: TargetConfig, kv: KVPages, rec: RecurrentSlots, tree: TreeInput, scratch: TreeScratch,
                accepted: jax.Array, n_accepted: jax.Array, fast_rollback: bool = False,
                key_feedbacks: tuple | None = None) -> tuple[KVPages, RecurrentSlots]:
    """Make the accepted path durable, without running the target again.

    accepted: [B, L] slots of each row's accepted path, root first (-1 padded); n_accepted: [B] (0 = commit
    nothing for that row). K/V of the accepted slots land in pages at start, start+1, ...; each GDN layer's
    conv and SSM state become those after the deepest accepted slot.

    Replay (default): the deepest accepted slot's SSM state is materialised from the verify scratch alone
    (``gdn.tree_commit``: ``gdn.tree_node_state``, the accepted path's delta-rule recurrence in closed form, written
    into the slot; on a GPU one kernel that updates the slot's state in place). ``fast_rollback`` (one
    sequence): every slot's state is formed (``gdn.tree_node_states``, ``[B, N, H, dk, dv]`` per layer) and the
    accepted one selected; the two are equal. ``key_feedbacks``: per attention layer its :func:`key_feedback`
    (``all_key_feedbacks(params, cfg)``), for quantized pages with a key calibration.
    """
    l = accepted.shape[1]
    idx = jnp.clip(accepted, 0, None)
    keep = jnp.arange(l)[None, :] < n_accepted[:, None]  # [B, L]
    positions = tree.start[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]
    take = lambda a: jnp.take_along_axis(a, idx[:, :, None, None], axis=1)
    ks, vs = [], []
    feedbacks = key_feedbacks or (None,) * len(kv.k)
    for kp, vp, kt, vt, fb in zip(kv.k, kv.v, scratch.k, scratch.v, feedbacks):
        kp, vp = attention.write_kv(kp, vp, take(kt), take(vt), tree.page_table, positions, keep, fb)
        ks.append(kp)
        vs.append(vp)
    last = jnp.where(n_accepted > 0, jnp.take_along_axis(accepted, jnp.maximum(n_accepted - 1, 0)[:, None], 1)[:, 0], -1)
    convs, ssms = list(rec.conv), list(rec.ssm)
    for gi, (x, cache) in enumerate(zip(scratch.x, scratch.gdn)):
        if fast_rollback:
            s0 = ssms[gi][tree.slots]
            every = gdn.tree_node_states(cache, s0.astype(cache.vp.dtype))  # [B, N, H, dk, dv]
            sel = jnp.take_along_axis(every, jnp.clip(last, 0, None)[:, None, None, None, None], axis=1)[:, 0]
            s1 = jnp.where((last >= 0)[:, None, None, None], sel.astype(s0.dtype), s0)
            ssms[gi] = set_rows_where(ssms[gi], (tree.slots,), s1, tree.slots > 0)
        else:
            ssms[gi] = gdn.tree_commit(ssms[gi], tree.slots, cache, last)
        c1 = tree_ops.tree_conv_state(x, convs[gi], tree.parents, last, tree.slots)
        convs[gi] = set_rows_where(convs[gi], (tree.slots,), c1, tree.slots > 0)
    return KVPages(tuple(ks), tuple(vs)), RecurrentSlots(tuple(convs), tuple(ssms))


def all_key_feedbacks(params: Params, cfg: TargetConfig) -> tuple | None:
    """Every attention layer's :func:`key_feedback`, in order (None when the target has no KV calibration)."""
    fbs = tuple(key_feedback(params["layers"][i]["attn"]) for i in cfg.attn_layers)
    return None if all(f is None for f in fbs) else fbs


def lm_logits(params: Params, h: jax.Array) -> jax.Array:
    """[..., D] -> [..., V] float32 logits."""
    return linear(h, params["lm_head"], acc_dtype(h.dtype))
