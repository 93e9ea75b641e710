"""``pallas_kernels.dot_acc``: ``acc + a @ b`` equals its jnp form in interpret mode and under jit, and lowers for a
GPU to one ``tt.dot`` whose accumulator is ``acc`` (no zero tile, no separate add)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from conftest import load_experiment
from pallas_kernels.dot_acc import dot_acc


def _kernel(a_ref, b_ref, acc_ref, o_ref, *, trans_b, precision):
    o_ref[...] = dot_acc(a_ref[...], b_ref[...], acc_ref[...] * 0.5, trans_b=trans_b, precision=precision)


def _call(a, b, acc, *, trans_b=False, precision=None, interpret=True):
    return pl.pallas_call(
        lambda *r: _kernel(*r, trans_b=trans_b, precision=precision),
        out_shape=jax.ShapeDtypeStruct(acc.shape, jnp.float32), interpret=interpret)(a, b, acc)


@pytest.mark.parametrize("dtype,trans_b", [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, True)])
def test_equals_acc_plus_dot(dtype, trans_b):
    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(ka, (32, 64), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (16, 64) if trans_b else (64, 16), jnp.float32).astype(dtype)
    acc = jax.random.normal(kc, (32, 16), jnp.float32)
    bb = b.T if trans_b else b
    want = np.asarray(acc) * 0.5 + np.asarray(a, np.float64) @ np.asarray(bb, np.float64)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    got = _call(a, b, acc, trans_b=trans_b, precision=precision)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    jitted = jax.jit(lambda *x: dot_acc(*x, trans_b=trans_b, precision=precision))(a, b, acc)  # XLA's lowering
    np.testing.assert_allclose(np.asarray(jitted), want - np.asarray(acc) * 0.5 + np.asarray(acc), rtol=1e-5,
                               atol=1e-4)


def test_refuses_what_does_not_fit():
    a = jnp.zeros((16, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        dot_acc(a, jnp.zeros((32, 16), jnp.bfloat16), jnp.zeros((16, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        dot_acc(a, jnp.zeros((16, 32), jnp.bfloat16), jnp.zeros((16, 16), jnp.float32))


def test_lowers_to_one_dot_into_the_accumulator():
    mod = load_experiment("triton_offline")
    sd = jax.ShapeDtypeStruct
    fn = lambda a, b, acc: _call(a, b, acc, trans_b=True, interpret=False)  # noqa: E731
    ttir, _ = mod.lower_for_h100(fn, sd((64, 64), jnp.bfloat16), sd((32, 64), jnp.bfloat16),
                                 sd((64, 32), jnp.float32))
    dots = re.findall(r"= tt\.dot (%\w+), (%\w+), (%\w+)", ttir)
    assert len(dots) == 1, ttir
    acc = dots[0][2]
    assert not re.search(rf"{acc} = tt\.splat", ttir)  # the accumulator is the scaled input, not zeros
    assert "arith.addf" not in ttir
