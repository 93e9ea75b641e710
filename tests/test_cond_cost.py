"""experiments/cond_cost.py: its select form of ``lax.cond`` gives lax.cond's results, pytrees and integer
predicates included, and the patched run records its own command."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_experiment


@pytest.mark.parametrize("pred", [True, False, 0, 3])
def test_select_cond_equals_lax_cond(pred):
    mod = load_experiment("cond_cost")
    x = jnp.arange(6.0).reshape(2, 3)

    def t(a, b):
        return {"s": a.sum() + b, "m": a * 2}

    def f(a, b):
        return {"s": a.max() - b, "m": a - 1}

    want = jax.lax.cond(pred, t, f, x, 1.5)
    got = jax.jit(lambda p, a, b: mod.select_cond(p, t, f, a, b))(pred, x, 1.5)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_needs_a_bench_command():
    mod = load_experiment("cond_cost")
    with pytest.raises(SystemExit):
        mod.main(["--select"])
