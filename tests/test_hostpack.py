"""A step's host inputs packed into one int32 buffer come back bit for bit inside a jitted function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.engine.hostpack import Packing
from dflash_jax.engine.sampling import RowSampling, SamplingArrays
from dflash_jax.state import StepInput

DTYPES = (np.int32, np.uint32, np.float32, np.bool_)


@st.composite
def trees(draw):
    """A dict of arrays of mixed dtypes and shapes (some empty), with a None leaf, and a leading axis size."""
    n = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lead = draw(st.sampled_from([(), (2,)]))
    tree = {"none": None}
    for i in range(n):
        dt = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=2)))
        bits = rng.integers(0, 2**32, lead + shape, dtype=np.uint64).astype(np.uint32)
        tree[f"x{i}"] = bits.view(np.float32) if dt == np.float32 else (bits & 1).astype(bool) if dt == np.bool_ \
            else bits.astype(dt)  # every bit pattern, NaNs and infinities included
    return tree, lead


def _bits(a):
    a = np.asarray(a)
    return a.astype(np.uint8) if a.dtype == bool else a.view(np.uint32)


@settings(max_examples=40, deadline=None)
@given(trees())
def test_pack_unpack_is_bit_exact(case):
    tree, lead = case
    packing = Packing.of(jax.tree_util.tree_map(lambda a: a[(0,) * len(lead)], tree))
    buf = packing.pack(tree)
    assert buf.dtype == np.int32 and buf.shape == lead + (packing.size,)
    for i in np.ndindex(*lead):
        one = jax.tree_util.tree_map(lambda a: a[i], tree)
        back = jax.jit(packing.unpack)(jnp.asarray(buf[i]))
        assert back["none"] is None
        for k, v in one.items():
            if v is not None:
                assert back[k].dtype == v.dtype and back[k].shape == v.shape
                np.testing.assert_array_equal(_bits(back[k]), _bits(v))
        # the device-side packer lays out the same bits as the host one
        np.testing.assert_array_equal(np.asarray(jax.jit(packing.pack_jnp)(one)), buf[i])


def test_engine_inputs_round_trip():
    inp = StepInput(tokens=np.arange(6, dtype=np.int32).reshape(2, 3), positions=np.full((2, 3), 7, np.int32),
                    n_valid=np.array([3, 1], np.int32), slots=np.array([1, 0], np.int32),
                    page_table=np.array([[1, 2], [0, 0]], np.int32))
    samp = SamplingArrays.from_rows([RowSampling(temperature=0.7, top_k=5, top_p=0.9, seed=2**32 - 1, step=3,
                                                 min_tokens=2, banned=(11,))], 2)
    packing = Packing.of((inp, samp))
    got_inp, got_samp = jax.jit(packing.unpack)(packing.pack((inp, samp)))
    for a, b in zip(jax.tree_util.tree_leaves((inp, samp)), jax.tree_util.tree_leaves((got_inp, got_samp))):
        np.testing.assert_array_equal(np.asarray(b), a)
        assert np.asarray(b).dtype == a.dtype


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="int8"):
        Packing.of({"x": np.zeros(3, np.int8)})
    packing = Packing.of({"x": np.zeros(3, np.int32)})
    with pytest.raises(ValueError, match="expects"):
        packing.pack({"x": np.zeros(4, np.int32)})
    with pytest.raises(ValueError, match="does not match"):
        packing.pack({"y": np.zeros(3, np.int32)})
    with pytest.raises(ValueError, match="expects"):
        packing.unpack(jnp.zeros(4, jnp.int32))
