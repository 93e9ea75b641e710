"""The Mosaic GPU tree-attention kernel (the Mosaic GPU interpreter on CPU) against the jnp reference: ragged and
empty prefixes, non-resident pages, one node to the full 64-node block, warpgroups of padding rows only, one and
several prefix partitions; the registry's opt-in entry.

Not collected by the suite directly: ``test_pallas_tree_attention_mgpu.py`` runs this file in a child pytest process
whose XLA:CPU thread pool is large enough for the interpreter (see there)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pallas_kernels import registry
from pallas_kernels.tree_attention import tree_attention_mgpu, tree_attention_reference
from test_pallas_tree_attention import make_case, trees

def check(case, stages=2, num_partitions=None, dtype=jnp.bfloat16, pingpong=True):
    args = make_case(dtype=dtype, **case)
    scale = case["d"] ** -0.5
    out = np.asarray(tree_attention_mgpu(*args, scale, stages=stages, num_partitions=num_partitions,
                                         pingpong=pingpong, interpret=True).astype(jnp.float32))
    ref = np.asarray(tree_attention_reference(*args, scale).astype(jnp.float32))
    assert out.shape == ref.shape == (case["b"], case["n"], case["g"] * case["hkv"], case["d"])
    assert np.isfinite(out).all()
    err = np.abs(out - ref).max()
    assert err <= 2e-2 * max(1.0, np.abs(ref).max()), (err, case, stages, num_partitions)


@st.composite
def cases(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    g = draw(st.integers(1, 6))
    page_size = draw(st.sampled_from([8, 16]))
    width = draw(st.integers(1, 12))
    n = draw(st.sampled_from([1, 5, 23]))
    full = width * page_size
    starts = draw(st.lists(st.one_of(st.just(0), st.just(full), st.integers(0, full)), min_size=b, max_size=b))
    non_resident = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, width - 1)), max_size=2))
    parents = [draw(trees(n)) for _ in range(b)]
    seed = draw(st.integers(0, 2**31 - 1))
    return (dict(seed=seed, b=b, hkv=hkv, g=g, d=64, page_size=page_size, width=width, n=n, starts=starts,
                 parents=parents, non_resident=non_resident),
            draw(st.sampled_from([2, 3])), draw(st.sampled_from([1, 2, None])), draw(st.booleans()))


# The 27B's group of 6 with 23 nodes: 138 rows, so the second CTA's second warpgroup holds padding only; a
# prefix ending mid-block, an empty one, and a non-resident page mid-prefix; three partitions.
EDGE = (dict(seed=1, b=2, hkv=1, g=6, d=64, page_size=16, width=9, n=23, starts=[140, 0],
             parents=[[-1] + list(range(22)), [-1, 0, 1, -1, 2] + [0] * 18], non_resident=[(0, 5)]), 2, 3, True)
# A full 64-node block of keys, one KV head, pages of 8 tokens, the prefix on one partition.
FULL_TREE = (dict(seed=2, b=1, hkv=1, g=1, d=64, page_size=8, width=3, n=64, starts=[17],
                  parents=[[-1] + [i // 2 for i in range(63)]], non_resident=[]), 2, 1, False)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(EDGE)
@example(FULL_TREE)
def test_kernel_matches_reference(c):
    check(c[0], stages=c[1], num_partitions=c[2], pingpong=c[3])


def test_padding_warpgroup_keeps_step_with_the_ring_race_free():
    """138 rows (23 nodes x 6 heads): the second CTA's second warpgroup holds padding only. Over more steps than
    ring slots it must release each slot once filled, not run ahead (arriving early completed a phase before the
    other warpgroup had read the slot: the memory warpgroup refilled it under the reader, then hung on the parity;
    seen on an H100), and take its turns on the ping-pong schedule (else the other waits forever). The
    interpreter's race detector is on."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    case = dict(seed=3, b=1, hkv=1, g=6, d=64, page_size=16, width=9, n=23, starts=[140],
                parents=[[-1] + list(range(22))], non_resident=[])
    args = make_case(dtype=jnp.bfloat16, **case)
    out = tree_attention_mgpu(*args, 0.125, num_partitions=1, interpret=InterpretGPUParams(detect_races=True))
    ref = tree_attention_reference(*args, 0.125)
    assert not interpret_pallas_call.get_races().races_found
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


def test_float16_pages():
    check(dict(EDGE[0], n=5, parents=[[-1, 0, 0, 1, 3]] * 2), dtype=jnp.float16)


def test_registered_opt_in_for_cuda_only():
    impl = registry.resolve("tree_attention", "mosaic_gpu")
    assert not impl.preferred and impl.supports("cuda") and not impl.supports("rocm")
    assert registry.resolve("tree_attention", backend="cuda").name == "pallas_triton"
    case = dict(EDGE[0], n=5, parents=[[-1, 0, 0, 1, 3]] * 2)
    args = make_case(dtype=jnp.bfloat16, **case)
    out = impl.fn(*args, 0.125)  # off GPU: the interpreter
    ref = tree_attention_reference(*args, 0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)
    with pytest.warns(RuntimeWarning, match="pallas_triton"):  # a head_dim the kernel cannot take
        small = make_case(dtype=jnp.float32, **dict(case, d=16))
        jax.block_until_ready(impl.fn(*small, 0.25))
