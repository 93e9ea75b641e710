"""Tensor parallelism on 8 host CPU devices: logits, greedy continuations, compiled collectives, memory.

The cases need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, and pytest workers have
JAX running already; so this module runs itself once in a subprocess (``python tests/test_sharding.py OUT``),
which computes every case and writes the results as JSON, and the tests below check them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
TINY = ("qwen36_tiny_a", "qwen36_tiny_b")
N_DEVICES = 8
TPS = (1, 2, 4, 8)
B = 2  # engine batch bucket used for the decode-step HLO
# the 8-layer fixture at every TP; the 4-layer one (same head counts) where it differs least from the engine cases
LOGIT_CASES = [("qwen36_tiny_b", tp) for tp in TPS[1:]] + [("qwen36_tiny_a", 4)]

if __name__ != "__main__":
    import pytest

    pytestmark = pytest.mark.xdist_group("sharding")

    @pytest.fixture(scope="module")
    def results(tmp_path_factory) -> dict:
        out = tmp_path_factory.mktemp("sharding") / "results.json"
        root = os.path.dirname(HERE)
        from conftest import xla_flags

        env = {**os.environ, "XLA_FLAGS": xla_flags(N_DEVICES),
               "JAX_PLATFORMS": "cpu", "OPENBLAS_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return json.loads(out.read_text())

    @pytest.mark.parametrize("name,tp", LOGIT_CASES)
    def test_sharded_logits_equal_unsharded_and_transformers(results, name, tp):
        r = results["logits"][name][str(tp)]
        # logits ~5 in size: sharded matmuls sum fp32 partials in another order (1.03e-4 seen on some CPUs)
        assert r["vs_unsharded"] <= 2e-4, r
        assert r["vs_transformers"] <= 5e-4, r

    @pytest.mark.parametrize("tp", TPS[1:])
    def test_engine_greedy_under_tp_equals_unsharded_and_transformers(results, tp):
        r = results["engine"][str(tp)]
        # golden = transformers' greedy continuation, which the unsharded engine reproduces (test_engine.py)
        assert r["tokens"] == results["engine"]["golden"]

    @pytest.mark.parametrize("tp", TPS[1:])
    def test_decode_step_has_one_all_reduce_per_sharded_block_and_gathers_no_weights(results, tp):
        r = results["engine"][str(tp)]
        assert r["all_reduce_hidden"] == r["expected_all_reduces"], r
        # every other collective works on activations of the batch (sampling over the vocabulary-split logits)
        assert all(s[0] == B and n <= B * r["vocab"] for s, n in r["all_gathers"]), r["all_gathers"]
        assert not r["weight_shaped_gathers"], r["weight_shaped_gathers"]

    def test_uneven_heads_are_replicated_and_reported(results):
        notes = results["plans"]
        assert notes["qwen36_tiny_b/4"]["kv_repeat"] == 2 and notes["qwen36_tiny_b/4"]["attn"]
        assert any("KV heads replicated" in n for n in notes["qwen36_tiny_b/4"]["notes"])
        assert not notes["qwen36_tiny_b/4"]["gdn"]
        assert any("GDN replicated" in n for n in notes["qwen36_tiny_b/4"]["notes"])
        assert not notes["qwen36_tiny_b/8"]["attn"]
        assert any("attention replicated" in n for n in notes["qwen36_tiny_b/8"]["notes"])

    def test_wide_model_fully_split_matches_and_memory_is_one_over_tp(results):
        w = results["wide"]
        assert w["plan"]["attn"] and w["plan"]["gdn"] and w["plan"]["mlp"] and w["plan"]["vocab"]
        assert w["plan"]["kv_repeat"] == 2  # 4 KV heads over TP=8
        assert w["logits_rel_err"] <= 2e-4, w
        per = w["bytes_per_device"]
        assert len(set(per)) == 1
        # everything but the norm vectors splits: within 2 % of 1/TP of the (re-laid-out) total
        assert per[0] <= 1.02 * w["bytes_total"] / 8, (per[0], w["bytes_total"])

    def test_loader_places_shards_directly(results):
        r = results["loader"]
        assert r["logits_err"] <= 2e-4  # as the sharded logits above: fp32 partials summed in another order
        assert r["qkv_spec"] == ["model", None] and r["out_spec"] == [None, "model"]
        assert r["kv_spec"] == [None, None, "model", None]
        assert r["engine_tp"] == 2

    def test_data_parallel_2x4_greedy_equals_unsharded_with_no_collective_across_replicas(results):
        r = results["dp"]
        assert r["tokens"] == results["engine"]["golden"]
        assert r["replicas"] == [0, 1]  # the two requests ran on different replicas
        assert r["penalized"] == r["penalized_unsharded"] and r["penalized"] != r["tokens"]
        assert r["kv_spec"] == ["data", None, None, "model", None]
        assert r["all_reduce_hidden"] == r["expected_all_reduces"], r
        assert r["groups"] and all(g == "model" for g in r["groups"]), r["groups"]

    def test_speculative_greedy_under_tp2_equals_unsharded(results):
        r = results["spec"]
        assert r["tokens"] == r["golden"]
        assert r["spec_steps"] > 0


    def test_quantized_kv_pages_split_by_kv_head_under_dp_and_tp(results):
        """int8 pages (values and per token-head scales) split over ``model`` by KV head, per replica over
        ``data``; greedy AR over 2 x 2 devices and DDTree under TP=2 equal the unsharded AR engine on the same
        pages."""
        r = results["kv_quant"]
        assert r["data_dtype"] == "int8"
        assert r["data_spec"] == ["data", None, None, "model", None] and r["scale_spec"] == ["data", None, None, "model"]
        assert r["tp_data_spec"] == [None, None, "model", None]
        assert r["ar"] == r["ar_unsharded"]
        # DDTree is lossless on quantized pages too (its commit writes keys as decode does: test_kv_calibration.py),
        # so the unsharded AR engine on the same pages is its reference (an unsharded DDTree engine cost a compile)
        assert r["spec"] == r["ar_unsharded"] and r["spec_steps"] > 0

    def test_quantized_weights_split_with_their_scales(results):
        """fp8 weights over TP=2 and 2 x 2 devices: greedy equals the unsharded fp8 engine; a column-parallel
        weight's per-channel scales split with its rows, a row-parallel weight's are replicated; no quantized
        weight is gathered. int8 / int4 blocks (32 columns) split too where each device gets whole blocks, and a
        split that would cut them is refused by name."""
        r = results["weight_quant"]
        for case in ("2x1", "2x2"):
            c = r["fp8"][case]
            assert c["tokens"] == r["fp8_ref"], case
            assert c["qkv"] == [["model", None], ["model"]] and c["down"] == [[None, "model"], [None]], c
            assert c["weight_shaped_gathers"] == [], c
        assert r["wide"]["int8"] <= 1e-5 and r["wide"]["int4"] <= 1e-5, r["wide"]
        assert "layers/0/mlp/down" in r["misaligned"] and "scale blocks of 32" in r["misaligned"]
        assert "already sharded in full precision" in r["sharded_then_quantized"], r["sharded_then_quantized"]

    def test_shipped_set_splits_fully_at_tp2_and_ddtree_greedy_equals_unsharded(results):
        r = results["shipped"]
        assert all(r["plan"].values()), r["plan"]
        assert r["logits_rel_err"] <= 1e-4, r
        assert r["tokens"] == r["golden"]
        assert r["spec_steps"] > 0 and r["accepted"] > 0

    def test_structured_speculative_rounds_over_two_replicas_equal_unsharded_ar(results):
        r = results["structured_dp"]
        assert r["tokens"] == r["golden"]
        assert r["modes"] == ["ddtree", "ddtree"] and r["replicas"] == [0, 1] and r["masked_steps"] > 0

    def test_each_data_parallel_replica_caches_prefixes_and_serves_them(results):
        r = results["prefix_dp"]
        assert r["tokens"] == r["golden"]
        assert r["cached"] == [0, 0, 64, 64] and r["entries"] == [1, 1]

    def test_a_group_on_a_data_parallel_replica_equals_separate_requests(results):
        r = results["structured_dp"]
        assert r["groups"] == 1 and r["group"] == r["group_golden"]


# ---------------------------------------------------------------------------------------------------------------
# the subprocess: every case, results as JSON
# ---------------------------------------------------------------------------------------------------------------
def _collectives(text: str, op: str) -> list[tuple[list[int], int]]:
    """(shape, element count) of every ``op`` result in compiled HLO text."""
    out = []
    for m in re.finditer(rf"= \(?[a-z]+\d*\[([\d,]*)\][^=]*? {op}(?:-start)?\(", text):
        shape = [int(d) for d in m.group(1).split(",") if d]
        n = 1
        for d in shape:
            n *= d
        out.append((shape, n))
    return out


def _groups(text: str, tp: int, dp: int) -> list[str]:
    """For every collective of compiled HLO text: "model" if its device groups are the model axis (``tp``
    consecutive devices), else the groups as written."""
    out = []
    for line in text.splitlines():
        if not re.search(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line):
            continue
        m = re.search(r"replica_groups=(\[[\d,]+\]<=\[\d+\](?:T\([\d,]+\))?|mesh\[[^\]]*\] \{[^}]*\})", line)
        g = m.group(1) if m else line
        iota = re.fullmatch(r"\[(\d+),(\d+)\]<=\[\d+\]", g)
        named = re.fullmatch(r"mesh\[(.*)\] \{(.*)\}", g)
        if iota and int(iota.group(2)) == tp:
            out.append("model")
        elif named and named.group(2).strip("'") in ("model", named.group(1).split(",")[-1].split("=")[0].strip("'")):
            out.append("model")
        else:
            out.append(g)
    return out


def _main(out_path: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dflash_jax as dj
    from dflash_jax.config import DrafterConfig
    from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
    from dflash_jax.engine.spec_steps import SpecConfig
    from dflash_jax.models import dflash, qwen36
    from dflash_jax.target import Target, shard_target

    assert len(jax.devices()) == N_DEVICES, jax.devices()
    res: dict = {"logits": {}, "engine": {}, "plans": {}, "timing": {}}
    t0 = time.perf_counter()
    golden = {n: dict(np.load(os.path.join(FIXTURES, f"{n}_golden.npz"))) for n in TINY}
    base = {n: dj.load_target(os.path.join(FIXTURES, n), dtype="float32") for n in TINY}

    # ---- logits of every fixture at every TP ----
    for name in TINY:
        ids = golden[name]["p1.ids"]
        ref = np.asarray(base[name].logits(ids))
        res["logits"][name] = {}
        for tp in [tp for n, tp in LOGIT_CASES if n == name]:
            t = shard_target(base[name], tp)
            got = np.asarray(t.logits(ids))
            res["logits"][name][str(tp)] = {"vs_unsharded": float(np.abs(got - ref).max()),
                                           "vs_transformers": float(np.abs(got - golden[name]["p1.logits"]).max())}
            p = t.layout.plan
            res["plans"][f"{name}/{tp}"] = {"attn": p.attn, "gdn": p.gdn, "kv_repeat": p.kv_repeat,
                                           "notes": list(p.notes)}
    res["timing"]["logits"] = time.perf_counter() - t0

    # ---- the engine: greedy continuations and the decode step's collectives ----
    t1 = time.perf_counter()
    name = "qwen36_tiny_b"
    g = golden[name]
    prompts = [g["p0.ids"].tolist(), g["p1.ids"].tolist()]
    n_new = len(g["p0.greedy"])
    res["engine"]["golden"] = [g["p0.greedy"].tolist(), g["p1.greedy"].tolist()]
    sp = SamplingParams(max_tokens=n_new, ignore_eos=True)
    opts = dict(max_batch=B, prefill_batch=B, prefill_chunk=64, max_model_len=96, page_size=16)
    cfg0 = base[name].config
    for tp in TPS[1:]:
        eng = Engine(base[name], None, EngineOptions(tensor_parallel=tp, **opts))
        r = {"tokens": [o.token_ids for o in eng.generate(prompts, sp)]}
        text = eng._exec[("decode", B)].as_text()
        p = eng.layout.plan
        per_layer = sum(int(p.attn if lt == "full_attention" else p.gdn) + int(p.mlp) for lt in cfg0.layer_types)
        r["expected_all_reduces"] = per_layer + int(p.vocab)
        r["all_reduce_hidden"] = sum(1 for s, _ in _collectives(text, "all-reduce") if s == [B, 1, cfg0.hidden_size])
        r["all_gathers"] = _collectives(text, "all-gather")
        weights = {tuple(a.shape) for a in jax.tree_util.tree_leaves(eng.target.params) if a.ndim == 2}
        r["weight_shaped_gathers"] = [s for s, _ in r["all_gathers"] if tuple(s) in weights]
        r["vocab"] = cfg0.vocab_size
        res["engine"][str(tp)] = r
    res["timing"]["engine"] = time.perf_counter() - t1

    # ---- a wider random model where every part splits over 8 (4 KV heads over TP=8 repeat) ----
    t2 = time.perf_counter()
    wcfg = dataclasses.replace(cfg0, num_heads=8, num_kv_heads=4, head_dim=16, rotary_dim=4, lin_num_k_heads=8,
                               lin_num_v_heads=16, lin_k_dim=16, lin_v_dim=16, hidden_size=128,
                               intermediate_size=256, vocab_size=1024, layer_types=cfg0.layer_types[:4],
                               num_layers=4)
    wt = Target(wcfg, qwen36.init_params(wcfg, jax.random.key(7), jnp.float32))
    ids = np.arange(3, 40) % wcfg.vocab_size
    ref = np.asarray(wt.logits(ids))
    ws = shard_target(wt, 8)
    per = ws.layout.memory_per_device(ws.params)
    total = sum(a.nbytes for a in {id(a): a for a in jax.tree_util.tree_leaves(ws.params)}.values())
    p = ws.layout.plan
    res["wide"] = {"plan": {"attn": p.attn, "gdn": p.gdn, "mlp": p.mlp, "vocab": p.vocab, "kv_repeat": p.kv_repeat},
                   "logits_rel_err": float(np.abs(np.asarray(ws.logits(ids)) - ref).max() / np.abs(ref).max()),
                   "bytes_per_device": sorted(per.values()), "bytes_total": total}
    res["timing"]["wide"] = time.perf_counter() - t2

    # ---- the loader writes each tensor straight to its shards ----
    t3 = time.perf_counter()
    lt = dj.load_target(os.path.join(FIXTURES, name), dtype="float32", tensor_parallel=2)
    gdn0 = lt.params["layers"][0]["gdn"]
    adopted = Engine(lt, None, EngineOptions(max_batch=1, max_model_len=32))  # takes the target's own layout
    eng_state = adopted.state
    spec_of = lambda a: list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec))
    res["loader"] = {"logits_err": float(np.abs(np.asarray(lt.logits(g["p1.ids"])) -
                                                np.asarray(base[name].logits(g["p1.ids"]))).max()),
                     "qkv_spec": spec_of(gdn0["qkv"]), "out_spec": spec_of(gdn0["out"]),
                     "kv_spec": spec_of(eng_state.kv.k[0]), "engine_tp": adopted.options.tensor_parallel}
    res["timing"]["loader"] = time.perf_counter() - t3

    # ---- data x tensor parallel 2 x 4: one request on each replica ----
    t5 = time.perf_counter()
    eng = Engine(base[name], None, EngineOptions(tensor_parallel=4, data_parallel=2, **opts))
    rids = [eng.submit(pr, sp) for pr in prompts]
    eng._admit()
    replicas = sorted(eng.running[i].replica for i in rids)
    final = {}
    while eng.has_work():
        final.update({o.request_id: o.token_ids for o in eng.step() if o.finish_reason is not None})
    text = eng._exec[("decode", 1)].as_text()
    # penalties: each replica writes its own slot's row of the tables
    pen_sp = dataclasses.replace(sp, presence_penalty=-2.0, frequency_penalty=1.0, logit_bias=((3, 1.5),))
    pen_dp = [o.token_ids for o in eng.generate(prompts, pen_sp)]
    pen_one = [o.token_ids for o in Engine(base[name], None, EngineOptions(**opts)).generate(prompts, pen_sp)]
    p = eng.layout.plan
    res["dp"] = {"tokens": [final[i] for i in rids], "replicas": replicas, "penalized": pen_dp,
                 "penalized_unsharded": pen_one,
                 "kv_spec": spec_of(eng.state.kv.k[0]),
                 "expected_all_reduces": sum(int(p.attn if lt == "full_attention" else p.gdn) + int(p.mlp)
                                             for lt in cfg0.layer_types) + int(p.vocab),
                 "all_reduce_hidden": sum(1 for s, _ in _collectives(text, "all-reduce")  # one replica's [B, 1, D]
                                          if s == [1, 1, cfg0.hidden_size]),
                 "groups": _groups(text, 4, 2)}
    res["timing"]["dp"] = time.perf_counter() - t5

    # ---- speculative decoding under TP=2 (drafter replicated) ----
    t4 = time.perf_counter()
    dcfg = DrafterConfig.from_hf_dict({
        "model_type": "qwen3", "hidden_size": cfg0.hidden_size, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 1e7, "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16, "block_size": 8, "num_target_layers": cfg0.num_layers, "vocab_size": cfg0.vocab_size,
        "dflash_config": {"mask_token_id": cfg0.vocab_size - 1, "target_layer_ids": [0, 2, 5]}})
    dparams = dflash.init_params(dcfg, jax.random.key(3), jnp.float32)
    eng = Engine(base[name], None, EngineOptions(tensor_parallel=2, spec=SpecConfig(budget=6), cohort_yield_min=0.0,
                                                 **opts), drafter=(dcfg, dparams))
    outs = eng.generate(prompts, sp)
    res["spec"] = {"tokens": [o.token_ids for o in outs], "golden": res["engine"]["golden"],
                   "spec_steps": sum(o.stats["draft_steps"] for o in outs)}
    res["timing"]["spec"] = time.perf_counter() - t4

    # ---- quantized KV pages split by KV head: AR over 2 x 2 (data x model), DDTree under TP=2 ----
    t8 = time.perf_counter()
    q_opts = dict(opts, kv_dtype="int8")
    eng = Engine(base[name], None, EngineOptions(tensor_parallel=2, data_parallel=2, **q_opts))
    ar_q = [o.token_ids for o in eng.generate(prompts, sp)]
    pages = eng.state.kv.k[0]
    spec_q = SpecConfig(budget=6)
    sp_eng = Engine(base[name], None, EngineOptions(tensor_parallel=2, spec=spec_q, cohort_yield_min=0.0, **q_opts),
                    drafter=(dcfg, dparams))
    sp_outs = sp_eng.generate(prompts, sp)
    res["kv_quant"] = {
        "ar": ar_q, "ar_unsharded": [o.token_ids for o in Engine(base[name], None, EngineOptions(**q_opts))
                                     .generate(prompts, sp)],
        "spec": [o.token_ids for o in sp_outs], "spec_steps": sum(o.stats["draft_steps"] for o in sp_outs),
        "data_dtype": str(pages.data.dtype), "data_spec": spec_of(pages.data), "scale_spec": spec_of(pages.scale),
        "tp_data_spec": spec_of(sp_eng.state.kv.k[0].data)}
    res["timing"]["kv_quant"] = time.perf_counter() - t8

    # ---- quantized weights: fp8 engines over TP=2 and 2 x 2; int8 / int4 logits of the wide model at TP=2 ----
    t9 = time.perf_counter()
    from dflash_jax.models import quant
    from dflash_jax.sharding import ShardingError

    fp8_ref = [o.token_ids for o in Engine(base[name], None, EngineOptions(quantization="fp8", **opts))
               .generate(prompts, sp)]
    wq = {"fp8_ref": fp8_ref, "fp8": {}}
    for tp, dp in ((2, 1), (2, 2)):
        eng = Engine(base[name], None, EngineOptions(quantization="fp8", tensor_parallel=tp, data_parallel=dp, **opts))
        qkv, down = eng.target.params["layers"][0]["gdn"]["qkv"], eng.target.params["layers"][0]["mlp"]["down"]
        tokens = [o.token_ids for o in eng.generate(prompts, sp)]
        text = eng._exec[("decode", 1 if dp > 1 else B)].as_text()
        quantized = {tuple(a.shape) for w in jax.tree_util.tree_leaves(
            eng.target.params, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
            if isinstance(w, quant.QuantizedWeight) for a in (w.data, w.scale)}
        wq["fp8"][f"{tp}x{dp}"] = {
            "tokens": tokens,
            "qkv": [spec_of(qkv.data), spec_of(qkv.scale)], "down": [spec_of(down.data), spec_of(down.scale)],
            "weight_shaped_gathers": [s for s, _ in _collectives(text, "all-gather") if tuple(s) in quantized]}
    wide_q = {}
    for q in ("int8", "int4"):
        qt = Target(wcfg, quant.quantize_params(wt.params, q))
        want = np.asarray(qt.logits(ids))
        got = np.asarray(shard_target(qt, 2).logits(ids))
        wide_q[q] = float(np.abs(got - want).max() / np.abs(want).max())
    wq["wide"] = wide_q
    try:  # the fixture's MLP: 160 columns, 80 per device, not whole 32-column scale blocks
        Engine(base[name], None, EngineOptions(quantization="int8", tensor_parallel=2, **opts))
        wq["misaligned"] = ""
    except ShardingError as e:
        wq["misaligned"] = str(e)
    try:  # a target sharded in full precision cannot be quantized afterwards (its scales would not move with rows)
        Engine(shard_target(base[name], 2), None, EngineOptions(quantization="fp8", **opts))
        wq["sharded_then_quantized"] = ""
    except ValueError as e:
        wq["sharded_then_quantized"] = str(e)
    res["weight_quant"] = wq
    res["timing"]["weight_quant"] = time.perf_counter() - t9

    # ---- the shipped trained set under TP=2: target logits, and DDTree with its own drafter ----
    t6 = time.perf_counter()
    from dflash_jax.models.dflash_loader import load_drafter
    from dflash_jax.models.tokenizer import Tokenizer
    st = dj.load_target(os.path.join(dj.SHIPPED_MODELS, "target"), dtype="float32")
    tok = Tokenizer.from_dir(os.path.join(dj.SHIPPED_MODELS, "target"))
    ids = tok.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(")
    ref = np.asarray(st.logits(ids))
    sst = shard_target(st, 2)
    p = sst.layout.plan
    sd = load_drafter(os.path.join(dj.SHIPPED_MODELS, "drafter"), dtype="float32")
    sp16 = SamplingParams(max_tokens=16, ignore_eos=True)
    sopts = dict(max_batch=1, prefill_batch=1, prefill_chunk=64, max_model_len=128, page_size=16)
    plain = Engine(st, None, EngineOptions(**sopts)).generate([ids], sp16)[0].token_ids
    outs = Engine(st, None, EngineOptions(tensor_parallel=2, spec=SpecConfig(budget=8), cohort_yield_min=0.0,
                                          **sopts), drafter=sd).generate([ids], sp16)
    res["shipped"] = {"logits_rel_err": float(np.abs(np.asarray(sst.logits(ids)) - ref).max() / np.abs(ref).max()),
                      "plan": {"attn": p.attn, "gdn": p.gdn, "mlp": p.mlp, "vocab": p.vocab},
                      "tokens": outs[0].token_ids, "golden": plain, "spec_steps": outs[0].stats["draft_steps"],
                      "accepted": outs[0].stats["accepted_tokens"]}
    res["timing"]["shipped"] = time.perf_counter() - t6

    # ---- structured output in speculative rounds over two replicas: each row's tree masks from its own automaton
    t7 = time.perf_counter()
    from dflash_jax.engine.structured import Constraint
    prompts2 = [ids, tok.encode("settings = ")]
    csp = [SamplingParams(max_tokens=24, constraint=Constraint("json_object")),
           SamplingParams(max_tokens=24, constraint=Constraint("regex", "[a-z_]+ = [0-9]+"))]
    dopts = dict(sopts, max_batch=4, prefill_batch=2)
    one = Engine(st, tok, EngineOptions(**dopts))
    golden = [o.token_ids for o in one.generate(prompts2, csp)]
    eng = Engine(st, tok, EngineOptions(data_parallel=2, spec=SpecConfig(budget=8), cohort_yield_min=0.0,
                                        structured_spec=True, prefix_cache=2, batch_buckets=(2,), **dopts),
                 drafter=sd)
    rids = [eng.submit(pr, c) for pr, c in zip(prompts2, csp)]
    eng._admit()
    replicas = sorted(eng.running[i].replica for i in rids)
    final = {}
    while eng.has_work():
        final.update({o.request_id: o for o in eng.step() if o.finish_reason is not None})
    # a group (the API's n) on one replica of two: the members after the fork start from a copy of the leader's
    # recurrent slot in that replica's state (greedy: these rounds are speculative, equal to AR token for token only
    # for greedy rows)
    gp = (ids * 3)[:48]
    gsp = [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True)]
    gids = eng.submit_group(gp, gsp)
    while eng.has_work():
        final.update({o.request_id: o for o in eng.step() if o.finish_reason is not None})
    # prefix caching per replica: two prompts over one 64-token head (a prefill chunk) cache it on both replicas,
    # two more start from it, wherever they go
    head = (ids * 5)[:64]
    pc = [head + tok.encode(t) for t in ("x = 1", "y = [2, 3]", "z = {}", "w = ()")]
    pc_sp = SamplingParams(max_tokens=6, ignore_eos=True)
    first = eng.generate(pc[:2], pc_sp)
    again = eng.generate(pc[2:], pc_sp)
    res["prefix_dp"] = {"tokens": [o.token_ids for o in first + again],
                        "golden": [o.token_ids for o in one.generate(pc, pc_sp)],
                        "cached": [o.stats["cached_tokens"] for o in first + again],
                        "entries": [len(c) for c in eng.prefix_caches]}
    res["structured_dp"] = {"tokens": [final[i].token_ids for i in rids], "golden": golden, "replicas": replicas,
                            "modes": [final[i].stats["spec_mode"] for i in rids],
                            "masked_steps": eng.counters["spec_masked_steps"],
                            "group": [final[i].token_ids for i in gids], "groups": eng.counters["groups"],
                            "group_golden": [o.token_ids for o in one.generate([gp] * 2, gsp)]}
    res["timing"]["structured_dp"] = time.perf_counter() - t7
    res["timing"]["total"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _main(sys.argv[1])
