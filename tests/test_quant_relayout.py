"""Quantized weights re-laid out for tensor parallelism (``sharding.relayout``): the data rows and their
scales move together, so dequantizing after the re-layout equals re-laying out the dequantized matrix; scale
blocks that a re-layout would split are refused by name."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from dflash_jax.config import TargetConfig
from dflash_jax.models import quant
from dflash_jax.sharding import ShardingError, ShardPlan, relayout

CFG = TargetConfig.from_file(os.path.join(FIXTURES, "qwen36_tiny_b", "config.json"))
QKV = ("layers", 0, "gdn", "qkv")


def weight(rows: int, cols: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (rows, cols), jnp.float32)


def check(path: tuple, w: jax.Array, q: quant.QuantizedWeight, plan: ShardPlan) -> None:
    got = quant.dequantize(relayout(path, q, CFG, plan))
    want = relayout(path, quant.dequantize(q), CFG, plan)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("make", [quant.quantize_fp8, quant.quantize_int8, quant.quantize_int4,
                                  lambda w: quant.quantize_fp8(w, block=(2, 32))], ids=["fp8", "int8", "int4", "fp8_2x32"])
def test_gdn_qkv_rows_and_scales_move_together(make):
    plan = ShardPlan.for_config(CFG, 2)
    assert plan.gdn
    w = weight(2 * CFG.key_dim + CFG.value_dim, CFG.hidden_size)
    check(QKV, w, make(w), plan)


def test_repeated_kv_heads_carry_their_scales():
    plan = ShardPlan.for_config(CFG, 2 * CFG.num_kv_heads)  # more devices than KV heads: heads repeat
    assert plan.kv_repeat > 1
    w = weight(CFG.num_kv_heads * CFG.head_dim, CFG.hidden_size, 1)
    for q in (quant.quantize_fp8(w), quant.quantize_int8(w), quant.quantize_fp8(w, block=(2, 32))):
        check(("layers", 3, "attn", "k"), w, q, plan)


def test_scale_blocks_a_relayout_would_split_are_refused():
    plan = ShardPlan.for_config(CFG, 2)
    w = weight(2 * CFG.key_dim + CFG.value_dim, CFG.hidden_size)
    blk = CFG.key_dim // 2 * 3  # a block spanning the q / k boundary of the per-device groups
    with pytest.raises(ShardingError, match="splits its .*-row scale blocks"):
        relayout(QKV, quant.quantize_fp8(w, block=(blk, 32)), CFG, plan)
