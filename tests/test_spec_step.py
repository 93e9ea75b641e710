"""The whole speculative round on the device (draft -> DDTree -> verify -> accept -> commit) is lossless:
greedy rows reproduce AR greedy token for token, whatever the drafter proposes, alone and in a batch."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash_jax as dj
from conftest import FIXTURES
from dflash_jax.config import DrafterConfig
from dflash_jax.engine.sampling import RowSampling, SamplingArrays
from dflash_jax.engine.spec_steps import SpecConfig, SpecInput, features, spec_step, write_draft_context
from dflash_jax.models import dflash, qwen36
from dflash_jax.state import DraftKV, EngineState, StepInput

pytestmark = pytest.mark.xdist_group("spec")

PAGE, WIDTH, ROWS = 8, 16, 3


def drafter_cfg(target_cfg) -> DrafterConfig:
    return DrafterConfig.from_hf_dict({
        "model_type": "qwen3", "hidden_size": target_cfg.hidden_size, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 1e7, "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16, "block_size": 8, "num_target_layers": target_cfg.num_layers,
        "vocab_size": target_cfg.vocab_size,
        "dflash_config": {"mask_token_id": target_cfg.vocab_size - 1, "target_layer_ids": [0, 1, 2]}})


@functools.lru_cache(maxsize=None)
def setup(name):
    t = dj.load_target(os.path.join(FIXTURES, name), dtype="float32")
    dcfg = drafter_cfg(t.config)
    dparams = dflash.init_params(dcfg, jax.random.key(3), jnp.float32)
    return t, dcfg, dparams


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg"))
def prefill(params, dparams, cfg, dcfg, state, dkv, tokens, n_valid, slots, table):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inp = StepInput(tokens=tokens, positions=pos, n_valid=n_valid, slots=slots, page_table=table)
    h, kv, rec, feats = qwen36.forward(params, cfg, inp, state.kv, state.rec, tuple(dcfg.target_layer_ids))
    dkv = write_draft_context(dcfg, dparams, dkv, features(feats), pos, inp.valid, table)
    last = jnp.take_along_axis(h, (n_valid - 1)[:, None, None], axis=1)[:, 0]
    return EngineState(kv, rec), dkv, jnp.argmax(qwen36.lm_logits(params, last), -1)


spec_jit = jax.jit(spec_step, static_argnums=(0, 1, 2), donate_argnums=(5, 6))


def run(name, prompts, n_new, budget=6, active_rows=None, level_bonus=None):
    t, dcfg, dparams = setup(name)
    cfg = t.config
    state = EngineState.zeros(cfg, n_pages=ROWS * WIDTH + 1, page_size=PAGE, n_slots=ROWS + 1, dtype=jnp.float32)
    dkv = DraftKV.zeros(dcfg, ROWS * WIDTH + 1, PAGE, jnp.float32)
    table = np.zeros((ROWS, WIDTH), np.int32)
    for r in range(len(prompts)):
        table[r] = np.arange(1 + r * WIDTH, 1 + (r + 1) * WIDTH)
    tok = np.zeros((ROWS, 32), np.int32)
    nv = np.zeros(ROWS, np.int32)
    for r, p in enumerate(prompts):
        tok[r, :len(p)] = p
        nv[r] = len(p)
    slots = np.array([r + 1 if r < len(prompts) else 0 for r in range(ROWS)], np.int32)
    state, dkv, first = prefill(t.params, dparams, cfg, dcfg, state, dkv, jnp.asarray(tok), jnp.asarray(np.maximum(nv, 1)),
                                jnp.asarray(slots), jnp.asarray(table))
    outs = [[int(first[r])] for r in range(len(prompts))]
    start = nv.copy()
    # chain-seeded trees, or best-first ones shaped by a given level bonus
    spec = SpecConfig(budget=budget, chain_seed=level_bonus is None, level_bonus=level_bonus)
    samp = SamplingArrays.from_rows([RowSampling() for _ in range(ROWS)], ROWS)
    nodes = []
    while min(len(o) for o in outs) < n_new:
        roots = np.array([o[-1] for o in outs] + [0] * (ROWS - len(outs)), np.int32)
        active = np.array([r < len(prompts) for r in range(ROWS)])
        inp = SpecInput(root=jnp.asarray(roots), start=jnp.asarray(start), slots=jnp.asarray(slots),
                        active=jnp.asarray(active), page_table=jnp.asarray(table))
        state, dkv, out = spec_jit(cfg, dcfg, spec, t.params, dparams, state, dkv, inp, samp)
        out = jax.device_get(out)
        for r in range(len(prompts)):
            n = int(out.n_accepted[r])
            assert out.accepted[r, 0] == roots[r] and n >= 1
            outs[r] += [int(x) for x in out.accepted[r, 1:n]] + [int(out.bonus[r])]
            start[r] += n
        nodes.append(int(out.tree_nodes[0]))
    return [o[:n_new] for o in outs], nodes


def test_spec_round_equals_ar_greedy_alone_and_batched():
    t, _, _ = setup("qwen36_tiny_a")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (9, 14)]
    want = [t.greedy(p, 12) for p in prompts]
    alone, nodes = run("qwen36_tiny_a", prompts[:1], 12)
    assert alone[0] == want[0]
    assert all(1 <= n <= 6 for n in nodes)  # the budget bounds the verified nodes
    both, _ = run("qwen36_tiny_a", prompts, 12)
    assert both == want


def test_level_bonus_rounds_stay_lossless():
    t, _, _ = setup("qwen36_tiny_a")
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (9, 14)]
    got, _ = run("qwen36_tiny_a", prompts, 10, level_bonus=1.0)
    assert got == [t.greedy(p, 10) for p in prompts]


def test_level_bonus_comes_from_the_drafter_unless_the_spec_sets_it():
    """SpecConfig.level_bonus None takes DrafterConfig.ddtree_level_bonus (a checkpoint's calibrated value); a
    number overrides it. A bonus past every log-prob gap makes each tree the drafter's top-1 chain."""
    from dflash_jax.engine.spec_steps import draft_tree

    t, base, dparams = setup("qwen36_tiny_a")
    cfg = t.config
    rng = np.random.default_rng(14)
    state = EngineState.zeros(cfg, n_pages=ROWS * WIDTH + 1, page_size=PAGE, n_slots=ROWS + 1, dtype=jnp.float32)
    dkv = DraftKV.zeros(base, ROWS * WIDTH + 1, PAGE, jnp.float32)
    table = np.arange(1, 1 + ROWS * WIDTH, dtype=np.int32).reshape(ROWS, WIDTH)
    tok = rng.integers(0, cfg.vocab_size - 1, (ROWS, 32)).astype(np.int32)
    nv = np.array([9, 20, 31], np.int32)
    slots = np.arange(1, ROWS + 1, dtype=np.int32)
    state, dkv, first = prefill(t.params, dparams, cfg, base, state, dkv, jnp.asarray(tok), jnp.asarray(nv),
                                jnp.asarray(slots), jnp.asarray(table))
    inp = SpecInput(root=first.astype(jnp.int32), start=jnp.asarray(nv), slots=jnp.asarray(slots),
                    active=jnp.ones(ROWS, bool), page_table=jnp.asarray(table))
    tree = jax.jit(draft_tree, static_argnums=(0, 1, 2))
    fields = lambda tr: [np.asarray(getattr(tr[0], f)) for f in ("tokens", "parent", "depth", "score")]  # noqa: E731
    calibrated = dataclasses.replace(base, ddtree_level_bonus=10.0)
    from_drafter = fields(tree(cfg, calibrated, SpecConfig(budget=6), t.params, dparams, dkv, inp))
    from_spec = fields(tree(cfg, base, SpecConfig(budget=6, level_bonus=10.0), t.params, dparams, dkv, inp))
    overridden = fields(tree(cfg, calibrated, SpecConfig(budget=6, level_bonus=0.0), t.params, dparams, dkv, inp))
    plain = fields(tree(cfg, base, SpecConfig(budget=6), t.params, dparams, dkv, inp))
    for a, b in zip(from_drafter, from_spec):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(overridden, plain):
        np.testing.assert_array_equal(a, b)
    assert (from_drafter[2][:, 1:] == np.arange(1, 7)).all() and (plain[2] < from_drafter[2]).any()  # a chain


def rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def test_draft_query_is_the_anchor_query_of_the_full_layers_per_kv_group_and_changes_nothing_else():
    """SpecConfig.draft_query returns, per row, the anchor's (block offset 0) query of every full-attention drafter
    layer after q_norm and RoPE at the root's position, summed over each KV group's heads and scaled by hd**-0.5,
    recomputed here in NumPy from the drafter params (a first full layer: its input is the embedded root alone);
    the sliding layer is left out. The round's outputs are the same with and without it."""
    t, base, _ = setup("qwen36_tiny_a")
    cfg = t.config
    dcfg = dataclasses.replace(base, layer_types=("full_attention", "sliding_attention"))
    assert dcfg.full_layers == (0,)
    dparams = dflash.init_params(dcfg, jax.random.key(5), jnp.float32, norm_noise=0.2)
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, cfg.vocab_size - 1, n).tolist() for n in (9, 14)]
    state = EngineState.zeros(cfg, n_pages=ROWS * WIDTH + 1, page_size=PAGE, n_slots=ROWS + 1, dtype=jnp.float32)
    dkv = DraftKV.zeros(dcfg, ROWS * WIDTH + 1, PAGE, jnp.float32)
    table = np.zeros((ROWS, WIDTH), np.int32)
    tok, nv = np.zeros((ROWS, 32), np.int32), np.ones(ROWS, np.int32)
    for r, p in enumerate(prompts):
        table[r] = np.arange(1 + r * WIDTH, 1 + (r + 1) * WIDTH)
        tok[r, :len(p)], nv[r] = p, len(p)
    slots = np.array([1, 2, 0], np.int32)
    state, dkv, first = prefill(t.params, dparams, cfg, dcfg, state, dkv, jnp.asarray(tok), jnp.asarray(nv),
                                jnp.asarray(slots), jnp.asarray(table))
    roots = np.array([int(first[0]), int(first[1]), 0], np.int32)
    inp = SpecInput(root=jnp.asarray(roots), start=jnp.asarray(nv * (slots > 0)), slots=jnp.asarray(slots),
                    active=jnp.asarray(slots > 0), page_table=jnp.asarray(table))
    samp = SamplingArrays.from_rows([RowSampling() for _ in range(ROWS)], ROWS)
    copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
    outs = [jax.device_get(spec_jit(cfg, dcfg, SpecConfig(budget=6, draft_query=flag), t.params, dparams,
                                    copy(state), copy(dkv), inp, samp)[2]) for flag in (False, True)]
    assert outs[0].draft_query is None
    for f in ("accepted", "n_accepted", "bonus", "tree_nodes"):
        np.testing.assert_array_equal(getattr(outs[0], f), getattr(outs[1], f))
    got = outs[1].draft_query
    hq, hkv, hd, eps = dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.rms_norm_eps
    assert got.shape == (ROWS, 1 * hkv * hd) and got.dtype == np.float32
    lay = jax.tree_util.tree_map(np.asarray, dparams["layers"][0])
    x = np.asarray(t.params["embed"])[roots]  # [B, D]: the anchor's block input
    q = (rms(x, lay["input_norm"], eps) @ lay["attn"]["q"].T).reshape(ROWS, hq, hd)
    q = rms(q, lay["attn"]["q_norm"], eps)
    ang = np.asarray(inp.start)[:, None] * (1.0 / dcfg.rope_theta ** (np.arange(0, hd, 2) / hd))  # [B, hd/2]
    cos, sin = (np.concatenate([f(ang), f(ang)], -1)[:, None] for f in (np.cos, np.sin))
    q = q * cos + np.concatenate([-q[..., hd // 2:], q[..., : hd // 2]], -1) * sin
    want = q.reshape(ROWS, hkv, hq // hkv, hd).sum(2).reshape(ROWS, -1) * hd ** -0.5
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-4, atol=1e-5)


# ---- the engine with a drafter ----------------------------------------------------------------------
from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams  # noqa: E402


@functools.lru_cache(maxsize=None)
def engines(name, cohort_yield_min, reprobe=0, fast_rollback=False):
    t, dcfg, dparams = setup(name)
    opts = EngineOptions(max_batch=1 if fast_rollback else 4, prefill_batch=2, prefill_chunk=16, max_model_len=128,
                         page_size=8, spec=SpecConfig(budget=6, fast_rollback=fast_rollback),
                         cohort_yield_min=cohort_yield_min, cohort_reprobe_tokens=reprobe)
    eng = Engine(t, None, opts, drafter=(dcfg, dparams))
    eng.warmup()
    return eng


def test_engine_speculative_greedy_equals_ar_with_joins_stops_and_telemetry():
    t, _, _ = setup("qwen36_tiny_a")
    eng = engines("qwen36_tiny_a", 0.0)  # guard off: every round is speculative
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (5, 21, 12)]
    want = [t.greedy(p, 10) for p in prompts]
    a = eng.submit(prompts[0], SamplingParams(max_tokens=10))
    eng.step()
    b = eng.submit(prompts[1], SamplingParams(max_tokens=10))
    stop_tok = want[2][3]
    c = eng.submit(prompts[2], SamplingParams(max_tokens=10, stop_token_ids=(stop_tok,)))
    final = {}
    while eng.has_work():
        for o in eng.step():
            if o.finish_reason:
                final[o.request_id] = o
    assert final[a].token_ids == want[0] and final[b].token_ids == want[1]
    cut = want[2].index(stop_tok)
    assert final[c].token_ids == want[2][:cut] and final[c].finish_reason == "stop"
    for o in final.values():
        st = o.stats
        assert st["spec_mode"] == "ddtree" and st["draft_steps"] >= 1 and st["mean_accept_len"] >= 1
        assert 0 <= st["accepted_tokens"] <= st["draft_nodes"]
    assert eng.pages.num_free == eng.pages.n_pages - 1 and sorted(eng.free_slots) == [1, 2, 3, 4]
    eng.pages.check_invariants()


def test_cohort_yield_switches_a_useless_drafter_to_ar():
    t, _, _ = setup("qwen36_tiny_a")
    eng = engines("qwen36_tiny_a", 6.0)  # a random drafter emits ~1 token per round, far below 6
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (7, 9)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12))
    for p, o in zip(prompts, outs):
        assert o.token_ids == t.greedy(p, 12)
        assert o.stats["spec_mode"] == "yielded" and o.stats["draft_steps"] == 1
        assert o.stats["cohort_yield_mean"] < 6 and o.stats["decode_steps"] >= 8
    assert eng.counters["cohort_yield"] >= 1
    # requests that need the AR path never enter speculation
    o = eng.generate([prompts[0]], SamplingParams(max_tokens=4, min_tokens=2))[0]
    assert o.stats["spec_mode"] == "ar" and o.stats["draft_steps"] == 0


def test_adaptive_reprobe_goes_back_to_ddtree_and_backs_off():
    """A yielded request probes DDTree again after 3 AR tokens, then after 6, 12... (a useless drafter fails every
    probe); the output stays the target's greedy."""
    t, _, _ = setup("qwen36_tiny_a")
    eng = engines("qwen36_tiny_a", 6.0, 3)
    p = np.random.default_rng(11).integers(0, t.config.vocab_size - 1, 8).tolist()
    o = eng.generate([p], SamplingParams(max_tokens=30))[0]
    assert o.token_ids == t.greedy(p, 30)
    st = o.stats
    assert st["spec_mode"] == "yielded" and st["reprobes"] >= 2
    assert st["draft_steps"] == 1 + st["reprobes"]  # one round per probe
    assert st["reprobes"] <= 3  # 3, 6, 12 AR tokens apart: at most three probes fit in 30 tokens
    assert eng.counters["cohort_reprobe"] >= st["reprobes"]


def test_fast_rollback_is_lossless_and_reported():
    t, dcfg, dparams = setup("qwen36_tiny_a")
    fast = engines("qwen36_tiny_a", 0.0, 0, True)
    replay = engines("qwen36_tiny_a", 0.0)
    p = np.random.default_rng(12).integers(0, t.config.vocab_size - 1, 9).tolist()
    a = fast.generate([p], SamplingParams(max_tokens=12))[0]
    b = replay.generate([p], SamplingParams(max_tokens=12))[0]
    assert a.token_ids == b.token_ids == t.greedy(p, 12)
    assert a.stats["rollback_mode"] == "fast-rollback" and b.stats["rollback_mode"] == "replay"
    with pytest.raises(ValueError, match="single sequence"):
        Engine(t, None, EngineOptions(max_batch=2, spec=SpecConfig(fast_rollback=True)), drafter=(dcfg, dparams))


@given(budget=st.integers(1, 64), cap=st.one_of(st.none(), st.integers(2, 512)), batch=st.integers(1, 128))
@settings(max_examples=200, deadline=None)
def test_max_verify_tokens_lowers_the_budget_by_bucket_and_never_below_one(budget, cap, batch):
    spec = SpecConfig(budget=budget, max_verify_tokens=cap)
    got = spec.budget_for(batch)
    assert 1 <= got <= budget
    if cap is None:
        assert got == budget
    else:
        assert got == budget or batch * (got + 1) <= cap or got == 1  # within the cap unless at the floor
        assert spec.budget_for(batch + 1) <= got  # larger buckets never get more nodes
    fixed = spec.for_batch(batch)
    assert fixed.budget == got and fixed.max_verify_tokens is None


def test_bucket_budgets_stay_lossless_and_bound_each_round():
    t, dcfg, dparams = setup("qwen36_tiny_a")
    spec = SpecConfig(budget=6, max_verify_tokens=8)  # buckets 1 / 2 / 4 -> budgets 6 / 3 / 1
    eng = Engine(t, None, EngineOptions(max_batch=4, prefill_batch=4, prefill_chunk=32, max_model_len=128,
                                        page_size=8, spec=spec, cohort_yield_min=0.0), drafter=(dcfg, dparams))
    assert eng.spec_budgets == {1: 6, 2: 3, 4: 1}
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (7, 19, 12, 4)]
    want = [t.greedy(p, 9) for p in prompts]
    outs = eng.generate(prompts[:3], SamplingParams(max_tokens=9))  # three rows: the 4-row bucket, budget 1
    alone = eng.generate(prompts[3:], SamplingParams(max_tokens=9))  # one row: bucket 1, budget 6
    assert [o.token_ids for o in outs + alone] == want
    for o in outs:  # bucket 4 (budget 1), or bucket 2 (budget 3) once a row has finished; never the full 6
        assert o.stats["draft_nodes"] <= 3 * o.stats["draft_steps"]
    assert alone[0].stats["draft_nodes"] > alone[0].stats["draft_steps"]  # the lone row drafts wider trees
    with pytest.raises(ValueError, match="max_verify_tokens"):
        SpecConfig(max_verify_tokens=1)


def test_speculative_rounds_return_the_targets_logprobs():
    """A request that wants logprobs stays speculative: each emitted token's log-probability (accepted draft tokens
    and the bonus) and its alternatives are the target's, as an AR step reports them."""
    t, dcfg, dparams = setup("qwen36_tiny_a")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (9, 14)]
    want = {tuple(p): t.greedy(p, 20) for p in prompts}

    def oracle(prompt, toks):  # proposes the greedy continuation: rounds accept several tokens
        full = want[tuple(prompt)] + [0] * dcfg.block_size
        return full[len(toks): len(toks) + dcfg.block_size - 1]

    opts = EngineOptions(max_batch=2, prefill_batch=2, prefill_chunk=16, max_model_len=128, page_size=8,
                         spec=SpecConfig(budget=6), cohort_yield_min=0.0, spec_oracle=oracle)
    eng = Engine(t, None, opts, drafter=(dcfg, dparams))
    outs = eng.generate(prompts, [SamplingParams(max_tokens=20, logprobs=True), SamplingParams(max_tokens=20)])
    for p, o in zip(prompts, outs):
        assert o.token_ids == want[tuple(p)] and o.stats["spec_mode"] == "ddtree"
        assert o.stats["accepted_tokens"] >= 10
    p, o = prompts[0], outs[0]
    ref = np.asarray(jax.nn.log_softmax(t.logits(p + o.token_ids), axis=-1))[len(p) - 1:-1]  # row e: token e
    np.testing.assert_allclose(o.logprobs, ref[np.arange(20), o.token_ids], atol=1e-4)
    for e, top in enumerate(o.top_logprobs):
        ids, lps = zip(*top)
        assert ids[0] == o.token_ids[e]  # greedy: the emitted token is the most likely
        np.testing.assert_allclose(lps, np.sort(ref[e])[::-1][:len(lps)], atol=1e-4)
    assert all(np.isnan(outs[1].logprobs))  # not asked for


def test_penalized_requests_stay_speculative_and_follow_the_host_reference():
    """Penalties and logit_bias apply to every tree node with its path's tokens counted: the tokens equal greedy
    decoding with the penalties applied on the host, whether the proposals are the penalized continuation (long
    accepted paths with repeats on them) or the unpenalized one (rejected where the penalties change the argmax)."""
    from test_engine import _penalized_reference

    t, dcfg, dparams = setup("qwen36_tiny_a")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, t.config.vocab_size - 1, n).tolist() for n in (9, 14, 11)]
    kws = [dict(repetition=0.6, presence=1.0), dict(frequency=-2.0),
           dict(repetition=0.5, frequency=1.5, bias=((7, 6.0),))]
    want = [_penalized_reference("qwen36_tiny_a", p, 16, **kw) for p, kw in zip(prompts, kws)]
    plain = {tuple(p): t.greedy(p, 16) for p in prompts}
    proposals = {tuple(prompts[0]): want[0], tuple(prompts[1]): want[1], tuple(prompts[2]): plain[tuple(prompts[2])]}

    def oracle(prompt, toks):
        full = proposals[tuple(prompt)] + [0] * dcfg.block_size
        return full[len(toks): len(toks) + dcfg.block_size - 1]

    opts = EngineOptions(max_batch=4, prefill_batch=2, prefill_chunk=16, max_model_len=128, page_size=8,
                         spec=SpecConfig(budget=6), cohort_yield_min=0.0, spec_oracle=oracle)
    eng = Engine(t, None, opts, drafter=(dcfg, dparams))
    sps = [SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=kw.get("repetition", 1.0),
                          frequency_penalty=kw.get("frequency", 0.0), presence_penalty=kw.get("presence", 0.0),
                          logit_bias=kw.get("bias", ())) for kw in kws]
    outs = eng.generate(prompts, sps)
    for w, o in zip(want, outs):
        assert o.token_ids == w and o.stats["spec_mode"] == "ddtree"
    assert outs[0].stats["accepted_tokens"] >= 8 and outs[1].stats["accepted_tokens"] >= 8
    assert want[2] != plain[tuple(prompts[2])]  # the third request's proposals are wrong somewhere
    assert len(set(want[1])) < len(want[1])  # negative frequency: repeats on the accepted paths


def test_an_oracle_proposing_the_wrong_number_of_tokens_is_named():
    t, dcfg, dparams = setup("qwen36_tiny_a")
    opts = EngineOptions(max_batch=1, prefill_batch=1, prefill_chunk=16, max_model_len=64, page_size=8,
                         spec=SpecConfig(budget=4), cohort_yield_min=0.0, spec_oracle=lambda prompt, toks: [1, 2, 3])
    eng = Engine(t, None, opts, drafter=(dcfg, dparams))
    with pytest.raises(ValueError, match=f"spec_oracle returned 3 token ids .* = {dcfg.block_size - 1}"):
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
