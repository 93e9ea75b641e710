"""experiments/control_flow_cost.py: its select form of ``lax.cond`` gives lax.cond's results (pytrees, integer
predicates), the unrolled tree builder gives the rolled one's tree, and the script wants a bench command."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_experiment


@pytest.mark.parametrize("pred", [True, False, 0, 3])
def test_select_cond_equals_lax_cond(pred):
    mod = load_experiment("control_flow_cost")
    x = jnp.arange(6.0).reshape(2, 3)

    def t(a, b):
        return {"s": a.sum() + b, "m": a * 2}

    def f(a, b):
        return {"s": a.max() - b, "m": a - 1}

    want = jax.lax.cond(pred, t, f, x, 1.5)
    got = jax.jit(lambda p, a, b: mod.select_cond(p, t, f, a, b))(pred, x, 1.5)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_unrolled_tree_builder_builds_the_same_tree(monkeypatch):
    from dflash_jax.spec import ddtree

    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (2, 5, 40)), axis=-1)
    build = lambda: jax.jit(ddtree.build_tree, static_argnames=("budget",))(lp, budget=9)  # noqa: E731
    want = build()
    assert "stablehlo.while" in jax.jit(ddtree.build_tree, static_argnames=("budget",)).lower(lp, budget=7).as_text()
    mod = load_experiment("control_flow_cost")
    monkeypatch.setattr(jax.lax, "fori_loop", jax.lax.fori_loop)  # restored after the test
    mod.unroll_tree_loop()
    lowered = jax.jit(ddtree.build_tree, static_argnames=("budget",)).lower(lp, budget=8).as_text()
    assert "stablehlo.while" not in lowered
    got = jax.jit(ddtree.build_tree, static_argnames=("budget",))(lp, budget=9)
    for f in ("tokens", "parent", "depth", "score", "valid", "ancestors"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))


def test_needs_a_bench_command():
    mod = load_experiment("control_flow_cost")
    with pytest.raises(SystemExit):
        mod.main(["--select-conds"])
