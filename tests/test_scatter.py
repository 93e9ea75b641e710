"""``kv.scatter.set_rows_where``: kept rows written, dropped rows leave the target untouched, and the scatter is
emitted as unique-index (no atomics on a GPU), however many dropped rows there are."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.kv import quant as kv_quant
from dflash_jax.kv.scatter import set_rows_where


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.data())
def test_matches_numpy_with_colliding_dropped_rows(n_rows, n_pages, data):
    page_size = 4
    x = np.arange(n_pages * page_size * 3, dtype=np.float32).reshape(n_pages, page_size, 3)
    # kept rows address distinct (page, offset) pairs; dropped rows may address anything, duplicates included
    cells = data.draw(st.lists(st.tuples(st.integers(0, n_pages - 1), st.integers(0, page_size - 1)),
                               min_size=n_rows, max_size=n_rows))
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=n_rows, max_size=n_rows)))
    seen: set = set()
    for i, c in enumerate(cells):
        if keep[i] and c in seen:
            keep[i] = False
        seen.add(c) if keep[i] else None
    page = np.array([c[0] for c in cells], np.int32)
    off = np.array([c[1] for c in cells], np.int32)
    vals = -1.0 - np.arange(n_rows * 3, dtype=np.float32).reshape(n_rows, 3)
    want = x.copy()
    for i in range(n_rows):
        if keep[i]:
            want[page[i], off[i]] = vals[i]
    got = set_rows_where(jnp.asarray(x), (jnp.asarray(page), jnp.asarray(off)), jnp.asarray(vals), jnp.asarray(keep))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_lowers_to_unique_index_scatter():
    x = jnp.zeros((8, 4, 2), jnp.bfloat16)
    page = jnp.zeros((3, 5), jnp.int32)  # every row aims at the null page
    keep = jnp.zeros((3, 5), bool)
    f = jax.jit(lambda x, p, k: set_rows_where(x, (p, p), jnp.ones((3, 5, 2)), k))
    hlo = f.lower(x, page, keep).as_text()
    assert "unique_indices = true" in hlo or "unique_indices=true" in hlo
    np.testing.assert_array_equal(np.asarray(f(x, page, keep)), 0)


def test_quantized_pages_write_only_kept_rows():
    pages = kv_quant.zeros((4, 2, 1, 8), jnp.int8, jnp.float32)
    x = jnp.ones((1, 3, 1, 8), jnp.float32)
    page = jnp.array([[1, 0, 2]], jnp.int32)
    keep = jnp.array([[True, False, True]])
    got = kv_quant.take(kv_quant.set_rows(pages, page, jnp.zeros_like(page), x, keep), jnp.arange(4))
    np.testing.assert_allclose(np.asarray(got[:, 0, 0, 0]), [0, 1, 1, 0], atol=1e-2)
