"""KVFlash's device side: whole-page copies to host slabs and back (pinned host memory and the NumPy fallback),
key summaries, and attention over partially resident page tables (non-resident pages masked, never read out of
bounds; exact when everything is resident)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from dflash_jax.config import TargetConfig
from dflash_jax.engine.compile import CompileWatch
from dflash_jax.kv import quant as kv_quant
from dflash_jax.kv.kvflash import Transfer
from dflash_jax.kv.kvflash_device import KVFlashDevice, host_memory_kind
from dflash_jax.models import attention
from dflash_jax.state import DraftKV, EngineState


def random_state(n_pages=6, ps=4, seed=0):
    cfg = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_a", "config.json"))
    st = EngineState.zeros(cfg, n_pages=n_pages, page_size=ps, n_slots=2, dtype=jnp.float32)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    rnd = lambda a: jax.random.normal(next(keys), a.shape, a.dtype)
    kv = jax.tree_util.tree_map(rnd, st.kv)

    class D:  # a drafter-shaped cache sharing the page tables
        num_layers, num_kv_heads, head_dim = 2, 1, 8

    dkv = jax.tree_util.tree_map(rnd, DraftKV.zeros(D, n_pages, ps, jnp.float32))
    return EngineState(kv=kv, rec=st.rec), dkv


def pages(state, dkv, p):
    return [np.asarray(a[p]) for a in state.kv.k + state.kv.v + dkv.k + dkv.v]


@pytest.mark.parametrize("kind", ["pinned_host", "numpy"])
def test_pages_round_trip_through_host_slabs(kind):
    state, dkv = random_state()
    if kind != "numpy":
        assert host_memory_kind(jax.devices()[0]) == kind  # the CPU jaxlib offers pinned host memory
    dev = KVFlashDevice(state, dkv, host_pages=8, host_kind=kind)
    assert dev.host_kind == kind
    dev.warmup(state, dkv)
    want2, want3 = pages(state, dkv, 2), pages(state, dkv, 3)
    with CompileWatch() as w:
        dev.page_out(state, dkv, [Transfer(0, 0, 2, 5), Transfer(0, 1, 3, 0)])
        if kind != "numpy":
            assert all(dev.slabs[i].sharding.memory_kind == kind for i in (5, 0))
        # bring them back into other physical pages (page 1 and page 4)
        state, dkv = dev.page_in(state, dkv, [Transfer(0, 0, 4, 5), Transfer(0, 1, 1, 0)])
    assert w.count == 0  # every bucket was compiled by warmup
    for a, b in zip(pages(state, dkv, 4), want2):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(pages(state, dkv, 1), want3):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pages(state, dkv, 2)[0], want2[0])  # the source is untouched
    assert dev.slab_bytes == sum(a.size for a in want2) * 4


def test_many_pages_span_buckets_and_summaries_are_mean_keys():
    state, dkv = random_state(n_pages=40)
    dev = KVFlashDevice(state, dkv, host_pages=40)
    ts = [Transfer(0, i, 1 + i, i) for i in range(21)]  # buckets 16 + 16 (padded)
    want = [pages(state, dkv, 1 + i) for i in range(21)]
    dev.page_out(state, dkv, ts)
    state, dkv = dev.page_in(state, dkv, [Transfer(0, i, 39 - i, i) for i in range(21)])
    for i in range(21):
        for a, b in zip(pages(state, dkv, 39 - i), want[i]):
            np.testing.assert_array_equal(a, b)
    s = dev.summaries(state, [3, 7])
    ref = np.concatenate([np.asarray(k[3]).mean(0).ravel() for k in state.kv.k])
    assert s.shape == (2, ref.size)
    np.testing.assert_allclose(s[0], ref, rtol=1e-6)


def test_attention_masks_non_resident_pages_and_is_exact_when_all_resident():
    rng = np.random.default_rng(0)
    n_pages, ps, hkv, d, h = 8, 4, 2, 8, 4
    kp = jnp.asarray(rng.normal(size=(n_pages, ps, hkv, d)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(n_pages, ps, hkv, d)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(1, 1, h, d)), jnp.float32)
    table = jnp.array([[3, 5, 2, 7]], jnp.int32)
    pos = jnp.array([[14]], jnp.int32)
    full = attention.paged_attention(q, kp, vp, table, pos, 0.3)
    partial = attention.paged_attention(q, kp, vp, table.at[0, 1].set(-1), pos, 0.3)
    # the reference for the partial table: logical page 1 dropped, keys of pages 0, 2, 3 (positions kept)
    k = jnp.concatenate([kp[3], kp[2], kp[7]])[None]
    v = jnp.concatenate([vp[3], vp[2], vp[7]])[None]
    keep = np.r_[0:4, 4:8, 8:11]  # concatenated pages 3, 2, 7 = positions 0-3, 8-11, 12-14 (<= 14)
    s = jnp.einsum("bkgd,bskd->bkgs", q[:, 0].reshape(1, hkv, 2, d), k[:, keep]) * 0.3
    ref = jnp.einsum("bkgs,bskd->bkgd", jax.nn.softmax(s, -1), v[:, keep]).reshape(1, 1, h, d)
    np.testing.assert_allclose(partial, ref, rtol=1e-5, atol=1e-6)
    assert not np.allclose(partial, full)
    # tree attention's prefix obeys the same rule: with no tree keys visible beyond the root it matches
    tree_k = jnp.asarray(rng.normal(size=(1, 1, hkv, d)), jnp.float32)
    anc = jnp.ones((1, 1, 1), bool)
    t_full = attention.tree_attention(q, kp, vp, table, jnp.array([14]), tree_k, tree_k, anc, 0.3)
    t_part = attention.tree_attention(q, kp, vp, table.at[0, 1].set(-1), jnp.array([14]), tree_k, tree_k, anc, 0.3)
    assert np.isfinite(np.asarray(t_part)).all() and not np.allclose(t_part, t_full)
    # a write through a non-resident entry goes to the null page, never wraps to the last page
    k2, _ = attention.write_kv(kp, vp, jnp.ones((1, 1, hkv, d)), jnp.ones((1, 1, hkv, d)), table.at[0, 1].set(-1),
                               jnp.array([[5]]), jnp.ones((1, 1), bool))
    np.testing.assert_array_equal(k2[n_pages - 1], kp[n_pages - 1])


def quantized_state(dtype, n_pages=6, ps=4, seed=0):
    """``random_state`` with every target and drafter page array quantized (fp8 / int8 values + f32 scales)."""
    state, dkv = random_state(n_pages, ps, seed)

    def q(a):
        data, scale = kv_quant.quantize_rows(a, dtype)
        return kv_quant.QuantizedPages(data, scale, jnp.float32)

    kv = type(state.kv)(k=tuple(map(q, state.kv.k)), v=tuple(map(q, state.kv.v)))
    return EngineState(kv=kv, rec=state.rec), DraftKV(k=tuple(map(q, dkv.k)), v=tuple(map(q, dkv.v)))


def leaves(state, dkv, p):
    return [np.asarray(a[p]).view(np.uint8) for a in jax.tree_util.tree_leaves((state.kv, dkv))]


@pytest.mark.parametrize("kind", ["pinned_host", "numpy"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
def test_quantized_pages_round_trip_bit_exactly_at_about_half_the_bytes(kind, dtype):
    state, dkv = quantized_state(dtype)
    dev = KVFlashDevice(state, dkv, host_pages=8, host_kind=kind)
    dev.warmup(state, dkv)
    want2, want3 = leaves(state, dkv, 2), leaves(state, dkv, 3)
    with CompileWatch() as w:
        dev.page_out(state, dkv, [Transfer(0, 0, 2, 5), Transfer(0, 1, 3, 0)])
        state, dkv = dev.page_in(state, dkv, [Transfer(0, 0, 4, 5), Transfer(0, 1, 1, 0)])
    assert w.count == 0
    assert all(isinstance(a, kv_quant.QuantizedPages) and a.dtype == dtype for a in state.kv.k + dkv.v)
    for a, b in zip(leaves(state, dkv, 4), want2, strict=True):  # both leaves, bit for bit
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(state, dkv, 1), want3, strict=True):
        np.testing.assert_array_equal(a, b)
    # a page's bytes: data (1 byte per value) + scales (4 bytes per token and KV head), (D + 4) / 2D of a bf16 page
    arrays = state.kv.k + state.kv.v + dkv.k + dkv.v
    assert dev.dtype == np.uint8 and dev.slab_bytes == sum(a.nbytes for a in want2)
    rows = lambda dt: sum(a.shape[1] * a.shape[2] * kv_quant.row_bytes(a.shape[3], dt) for a in arrays)
    assert dev.slab_bytes == rows(dtype) < 0.8 * rows(jnp.bfloat16)

def test_summaries_of_quantized_pages_are_mean_dequantized_keys():
    state, dkv = quantized_state(jnp.int8, n_pages=8)
    dev = KVFlashDevice(state, dkv, host_pages=8)
    s = dev.summaries(state, [3, 7])
    deq = lambda k, p: np.asarray(k.data[p], np.float32) * np.asarray(k.scale[p])[..., None]
    ref = np.concatenate([deq(k, 7).mean(0).ravel() for k in state.kv.k])
    np.testing.assert_allclose(s[1], ref, rtol=1e-6, atol=1e-7)
    # close to the mean of the unquantized keys (int8 rows keep ~2 decimal digits)
    raw, _ = random_state(n_pages=8)
    np.testing.assert_allclose(s[1], np.concatenate([np.asarray(k[7]).mean(0).ravel() for k in raw.kv.k]), atol=0.03)


@pytest.mark.parametrize("quantized", [False, True])
def test_drafter_summaries_are_mean_context_keys_of_the_full_layers(quantized):
    """Drafter scoring's page summary: the mean over the page's tokens of the drafter's context keys of the given
    (full-attention) layers only, flattened in layer order; dequantized for quantized pages; compiled by warmup."""
    state, dkv = quantized_state(jnp.int8, n_pages=8) if quantized else random_state(n_pages=8)
    dev = KVFlashDevice(state, dkv, host_pages=8, draft_summary_layers=(1,))
    dev.warmup(state, dkv)
    with CompileWatch() as w:
        s = dev.draft_summaries(dkv, [2, 5, 7])
    assert w.count == 0
    keys = lambda k, p: (np.asarray(k.data[p], np.float32) * np.asarray(k.scale[p])[..., None] if quantized
                         else np.asarray(k[p]))
    assert s.shape == (3, 1 * 1 * 8)  # one full layer x Hkv 1 x hd 8
    for i, p in enumerate([2, 5, 7]):
        np.testing.assert_allclose(s[i], keys(dkv.k[1], p).mean(0).ravel(), rtol=1e-6, atol=1e-7)
        assert not np.allclose(s[i], keys(dkv.k[0], p).mean(0).ravel())  # the sliding layer is left out
    both = KVFlashDevice(state, dkv, host_pages=8, draft_summary_layers=(0, 1)).draft_summaries(dkv, [5])
    np.testing.assert_allclose(both[0], np.concatenate([keys(dkv.k[i], 5).mean(0).ravel() for i in (0, 1)]),
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="no drafter summary layers"):
        KVFlashDevice(state, dkv, host_pages=8).draft_summaries(dkv, [5])


def test_page_in_sweep_writes_its_figures(tmp_path):
    import json
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from experiments import page_in_sweep

    assert page_in_sweep.main(["--config", os.path.join(FIXTURES, "qwen36_tiny_a", "config.json"), "--pages", "2",
                               "4", "--iters", "1", "--page-size", "8", "--dispatch", "--busy-n", "64",
                               "--alloc", "5", "--out-dir", str(tmp_path)]) == 0
    (res,) = tmp_path.iterdir()
    f = json.loads(res.read_text())["figures"]
    for n in (2, 4):
        assert f[f"page_in.n{n}.page_in_gbs"] > 0 and f[f"page_in.n{n}.per_page_put_gbs"] > 0
        assert f[f"page_in.n{n}.ratio"] == f[f"page_in.n{n}.page_in_gbs"] / f[f"page_in.n{n}.host_to_device_gbs"]
    for b in (1, 4):  # buckets above the 4 pages run as 4
        assert all(f[f"dispatch.b{b}.{k}_ms"] > 0 for k in ("out", "in", "done", "busy_out", "busy_in"))
    assert f["dispatch.busy_ms"] > 0
    assert f["alloc.n_pages"] == 5 and f["alloc.prewarm_gbs"] > 0
    assert all(f[f"alloc.{p}.{k}_ms_per_page"] > 0 for p in ("first", "reuse") for k in ("host", "done"))


@pytest.mark.parametrize("kind", ["pinned_host", "numpy"])
def test_the_bandwidth_probe_leaves_pages_and_slabs_as_they_were(kind):
    state, dkv = random_state(n_pages=6)
    dev = KVFlashDevice(state, dkv, host_pages=8, host_kind=kind)
    dev.warmup(state, dkv)
    before = [pages(state, dkv, p) for p in range(6)]
    dev.page_out(state, dkv, [Transfer(0, 0, 2, 1)])
    slab1 = np.asarray(dev.slabs[1]).copy()
    res, state, dkv = dev.bandwidth(state, dkv, n=3, iters=3)
    assert set(res) == {"page_in_gbs", "page_out_gbs", "host_to_device_gbs", "ratio"}
    assert all(v > 0 for v in res.values()) and res["ratio"] == res["page_in_gbs"] / res["host_to_device_gbs"]
    for p in range(6):
        for a, b in zip(pages(state, dkv, p), before[p]):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(dev.slabs[1]), slab1)  # a slab in use keeps its contents


@pytest.mark.parametrize("kind", ["pinned_host", "numpy"])
def test_prewarm_sizes_to_every_slab_plus_a_bucket_within_its_cap_and_moves_nothing(kind):
    state, dkv = random_state(n_pages=6)
    dev = KVFlashDevice(state, dkv, host_pages=8, host_kind=kind)
    dev.warmup(state, dkv)
    dev.page_out(state, dkv, [Transfer(0, 0, 2, 1)])
    slab1 = np.asarray(dev.slabs[1]).copy()
    before = [pages(state, dkv, p) for p in range(6)]
    with CompileWatch() as w:
        full = dev.prewarm(state, dkv, float("inf"))
        capped = dev.prewarm(state, dkv, 3.5 * dev.slab_bytes)
        none = dev.prewarm(state, dkv, 0)
    assert w.count == 0
    if kind == "numpy":  # nothing to make ready: the slabs are one NumPy array
        assert full["slabs"] == capped["slabs"] == 0
    else:
        assert full["slabs"] == 8 + 64 and full["bytes"] == full["slabs"] * dev.slab_bytes
        assert capped["slabs"] == 3
    assert none["slabs"] == 0
    np.testing.assert_array_equal(np.asarray(dev.slabs[1]), slab1)
    assert all(s is None for i, s in enumerate(dev.slabs) if i != 1) if kind != "numpy" else True
    for p in range(6):
        for a, b in zip(pages(state, dkv, p), before[p]):
            np.testing.assert_array_equal(a, b)
