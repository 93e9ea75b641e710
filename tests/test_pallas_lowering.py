"""Every Pallas kernel, at the 27B's shapes with its per-backend defaults, lowers to Triton IR for an H200 (CUDA)
and an MI300 (ROCm gfx942) target, on a CPU-only machine (an abstract GPU device; nothing is compiled or run).

This catches what interpret mode cannot: primitives without a Triton lowering, block specs the Triton backend
refuses (dynamic grids, scalar prefetch), non-power-of-two tensors. Triton's own compiler passes (layouts,
shared memory, registers) run in ``experiments/triton_offline.py`` with the optional ``triton`` package; speed
needs a GPU: ``python -m dflash_jax.bench kernels``."""

from __future__ import annotations

import os

import pytest

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from pallas_kernels import gdn, paged_decode, tree_attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TARGETS = {"cuda": "NVIDIA H200", "rocm": "gfx942"}
CFG = TargetConfig.from_file(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen36_27b.json"))
sd = jax.ShapeDtypeStruct


def lower(platform, fn, *args) -> str:
    dev = jax.sharding.AbstractDevice(device_kind=TARGETS[platform], num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def attention_args(b, n, dtype, n_pages=4096, width=512):
    h, hkv, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    pages = sd((n_pages, 16, hkv, d), dtype)
    q = sd((b, n, h, d), dtype) if n else sd((b, h, d), dtype)
    return q, pages, pages, sd((b, width), jnp.int32), sd((b,), jnp.int32), sd((b, n or 1, hkv, d), dtype), \
        sd((b, n or 1, n or 1), jnp.bool_)


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b,n,parts,prefetch", [(16, 23, None, False), (1, 64, None, False), (64, 16, 1, False),
                                                 (16, 16, None, True)])
def test_tree_attention_lowers(platform, dtype, b, n, parts, prefetch):
    q, kp, vp, pt, start, kt, anc = attention_args(b, n, dtype)
    cfg = tree_attention.default_config(CFG.head_dim, 16, dtype, backend=platform)
    fn = lambda *a: tree_attention.tree_attention(  # noqa: E731
        *a, CFG.head_dim ** -0.5, block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"],
        num_partitions=parts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=prefetch)
    assert "__gpu$xla.gpu.triton" in lower(platform, fn, q, kp, vp, pt, start, kt, kt, anc)


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b,parts,prefetch", [(1, None, False), (64, 1, False), (1, None, True)])
def test_paged_decode_lowers(platform, dtype, b, parts, prefetch):
    q, kp, vp, pt, lens, _, _ = attention_args(b, 0, dtype)
    cfg = paged_decode.default_config(CFG.head_dim, 16, dtype, backend=platform)
    fn = lambda *a: paged_decode.paged_decode(  # noqa: E731
        *a, CFG.head_dim ** -0.5, pages_per_block=cfg["pages_per_block"], num_partitions=parts,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=prefetch)
    assert "__gpu$xla.gpu.triton" in lower(platform, fn, q, kp, vp, pt, lens)


H200_GDN = dict(chunk=64, block_v=64, num_warps=8, num_stages=1)  # fp32 64-token chunks: fit only the H200 budget


@pytest.mark.parametrize("platform,dtype,precision,cfg", [(p, d, None, None) for p in sorted(TARGETS)
                                                          for d in (jnp.float32, jnp.bfloat16)]
                         + [("cuda", jnp.float32, "tf32x3", None), ("cuda", jnp.float32, None, H200_GDN)])
def test_gdn_chunked_lowers(platform, dtype, precision, cfg):
    b, t, h, dk, dv = 2, 1000, CFG.lin_num_v_heads, CFG.lin_k_dim, CFG.lin_v_dim
    x = sd((b, t, h, dk), dtype)
    gates = sd((b, t, h), jnp.float32)
    cfg = cfg or gdn.default_config(dk, dv, dtype=dtype, backend=platform)
    fn = lambda *a: gdn.gdn_chunked(*a, **cfg, precision=precision)  # noqa: E731
    text = lower(platform, fn, x, x, sd((b, t, h, dv), dtype), gates, gates, sd((b, h, dk, dv), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("platform", sorted(TARGETS))
def test_gdn_step_lowers(platform):
    b, h, dk, dv = 64, CFG.lin_num_v_heads, CFG.lin_k_dim, CFG.lin_v_dim
    x = sd((b, h, dk), jnp.float32)
    gates = sd((b, h), jnp.float32)
    block_v = gdn.default_config(dk, dv, backend=platform)["block_v"]
    fn = lambda *a: gdn.gdn_step(*a, block_v=block_v)  # noqa: E731
    text = lower(platform, fn, x, x, sd((b, h, dv), jnp.float32), gates, gates, sd((b, h, dk, dv), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text


def quantized_pages(pages, kv_dtype):
    """A ``QuantizedPages`` of abstract arrays standing for bf16 ``pages`` stored as ``kv_dtype``."""
    from dflash_jax.kv.quant import QuantizedPages

    return QuantizedPages(sd(pages.shape, kv_dtype), sd(pages.shape[:-1], jnp.float32), jnp.dtype(jnp.bfloat16))


# fp8 e4m3fn pages on ROCm run the reference (gfx942 converts only e4m3fnuz): see check_page_dtype
QUANTIZED = [("cuda", jnp.float8_e4m3fn), ("cuda", jnp.int8), ("rocm", jnp.int8)]


@pytest.mark.parametrize("platform,kv_dtype", QUANTIZED)
@pytest.mark.parametrize("b,parts,prefetch", [(1, None, False), (64, 1, True)])
def test_paged_decode_lowers_quantized(platform, kv_dtype, b, parts, prefetch):
    q, kp, _, pt, lens, _, _ = attention_args(b, 0, jnp.bfloat16)
    kq = quantized_pages(kp, kv_dtype)
    cfg = paged_decode.default_config(CFG.head_dim, 16, jnp.bfloat16, backend=platform)
    fn = lambda *a: paged_decode.paged_decode(  # noqa: E731
        *a, CFG.head_dim ** -0.5, pages_per_block=cfg["pages_per_block"], num_partitions=parts,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=prefetch)
    text = lower(platform, fn, q, kq, kq, pt, lens)
    assert "__gpu$xla.gpu.triton" in text and f"_kv{jnp.dtype(kv_dtype).name}" in text  # the quantized variant


@pytest.mark.parametrize("platform,kv_dtype", QUANTIZED)
@pytest.mark.parametrize("b,n,parts,prefetch", [(16, 16, None, False), (1, 23, None, True)])
def test_tree_attention_lowers_quantized(platform, kv_dtype, b, n, parts, prefetch):
    q, kp, _, pt, start, kt, anc = attention_args(b, n, jnp.bfloat16)
    kq = quantized_pages(kp, kv_dtype)
    cfg = tree_attention.default_config(CFG.head_dim, 16, jnp.bfloat16, backend=platform)
    fn = lambda *a: tree_attention.tree_attention(  # noqa: E731
        *a, CFG.head_dim ** -0.5, block_m=cfg["block_m"], pages_per_block=cfg["pages_per_block"],
        num_partitions=parts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], prefetch=prefetch)
    text = lower(platform, fn, q, kq, kq, pt, start, kt, kt, anc)
    assert "__gpu$xla.gpu.triton" in text and f"_kv{jnp.dtype(kv_dtype).name}" in text


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("m,n,k,form", [(1, 5120, 17408, "gemv"), (3, 10240, 5120, "gemv"), (1, 5120, 17408, "dot"),
                                         (16, 10240, 5120, "dot"), (64, 17408, 5120, "dot")])
def test_skinny_matmul_lowers(platform, w_dtype, m, n, k, form):
    from pallas_kernels import skinny_matmul

    if platform == "rocm" and w_dtype == jnp.float8_e4m3fn:
        pytest.skip("gfx942's Triton converts only e4m3fnuz")
    scale = sd((n,), jnp.float32) if w_dtype == jnp.float8_e4m3fn else None
    fn = lambda *a: skinny_matmul.skinny_matmul_pallas(*a, form=form, interpret=False)  # noqa: E731
    text = lower(platform, fn, sd((m, k), jnp.bfloat16), sd((n, k), w_dtype), scale)
    assert "__gpu$xla.gpu.triton" in text and f"skinny_matmul_{form}" in text


H200_BUDGET = 227 * 1024


@pytest.mark.parametrize("platform,dtype,n,solve", [("cuda", d, n, sv) for d in (jnp.float32, jnp.bfloat16)
                                                    for n in (16, 23, 33) for sv in ("blocked", "doubling", "substitution")]
                         + [("cuda", jnp.float32, 32, "product"), ("rocm", jnp.float32, 16, "substitution"),
                            ("rocm", jnp.float32, 16, "blocked"), ("rocm", jnp.bfloat16, 23, "blocked")])
def test_gdn_tree_lowers(platform, dtype, n, solve):
    b, h, dk, dv = 16, CFG.lin_num_v_heads, CFG.lin_k_dim, CFG.lin_v_dim
    cfg = gdn.tree_default_config(n, dk, dv, dtype=dtype, backend=platform,
                                  smem_budget=H200_BUDGET if platform == "cuda" else None)
    x = sd((b, n, h, dk), dtype)
    gates = sd((b, n, h), jnp.float32)
    fn = lambda *a: gdn.gdn_tree(*a, block_v=cfg["block_v"], num_warps=cfg["num_warps"], solve=solve,  # noqa: E731
                                 precision=gdn.launch_precision(dtype, platform))  # the model's: tf32x3 fp32 on cuda
    text = lower(platform, fn, x, x, sd((b, n, h, dv), dtype), gates, gates, sd((b, h, dk, dv), jnp.float32),
                 sd((b, n, n), jnp.bool_))
    assert "__gpu$xla.gpu.triton" in text and f"gdn_tree_n{gdn.tree.padded_slots(n)}" in text
    pooled = lower(platform, fn, x, x, sd((b, n, h, dv), dtype), gates, gates, sd((33, h, dk, dv), jnp.float32),
                   sd((b, n, n), jnp.bool_), sd((b,), jnp.int32))  # the state read from the slot pool in place
    assert "__gpu$xla.gpu.triton" in pooled
    if dtype == jnp.float32 and solve == "substitution":  # the gated form: from the post-conv rows
        gated = lambda *a: gdn.gdn_tree_gated(  # noqa: E731
            *a, n_k_heads=CFG.lin_num_k_heads, block_v=cfg["block_v"], num_warps=cfg["num_warps"], solve=solve,
            precision=gdn.launch_precision(dtype, platform))
        text = lower(platform, gated, sd((b, n, CFG.conv_dim), jnp.bfloat16), gates, gates, sd((h,), jnp.float32),
                     sd((h,), jnp.float32), sd((b, n), jnp.bool_), sd((33, h, dk, dv), jnp.float32),
                     sd((b, n, n), jnp.bool_), sd((b,), jnp.int32))
        assert "__gpu$xla.gpu.triton" in text and "gdn_tree_gated_n" in text


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("b,n", [(1, 23), (16, 33)])
def test_gdn_tree_commit_lowers(platform, b, n):
    h, dk, dv, f32 = CFG.lin_num_v_heads, CFG.lin_k_dim, CFG.lin_v_dim, jnp.float32
    fn = lambda *a: gdn.commit.gdn_tree_commit(*a, **gdn.commit.default_config(dv),  # noqa: E731
                                               precision=gdn.launch_precision(f32, platform))
    text = lower(platform, fn, sd((33, h, dk, dv), f32), sd((b,), jnp.int32), sd((b, h, n, dk), f32),
                 sd((b, h, n, dv), f32), sd((b, h, n), f32), sd((b, h, n, n), f32), sd((b,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text and "gdn_tree_commit_n" in text


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b", [1, 16])
def test_gdn_decode_lowers(platform, dtype, b):
    c, hv, dv, dk, kk, n_slots = CFG.conv_dim, CFG.lin_num_v_heads, CFG.lin_v_dim, CFG.lin_k_dim, CFG.conv_kernel, 33
    f32 = jnp.float32
    args = ((sd((b, c + hv * dv + 2 * hv), dtype),), sd((c, kk), dtype), sd((hv,), f32), sd((hv,), f32), sd((dv,), f32),
            sd((n_slots, kk - 1, c), dtype), sd((n_slots, hv, dk, dv), f32), sd((b,), jnp.int32), sd((b,), jnp.bool_),
            sd((b,), jnp.bool_))
    fn = lambda *a: gdn.decode.gdn_decode(*a, n_k_heads=CFG.lin_num_k_heads, eps=CFG.rms_norm_eps)  # noqa: E731
    assert "__gpu$xla.gpu.triton" in lower(platform, fn, *args)
