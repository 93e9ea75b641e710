"""The tiny set's training data and export helpers: retrieval documents (``experiments/corpus.py``) are well formed,
end in the exact prompt format ``bench needle`` decodes from, and hold every answer they ask for; ``pack_rows`` keeps
each retrieval document whole inside one row; the held-out retrieval rows mark exactly the answer; a target over the
file limit is exported as shards that load to the same model."""

import json
import os
import random
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import corpus, train_tiny  # noqa: E402
from experiments import tiny_configs as tc  # noqa: E402

from dflash_jax import load_target  # noqa: E402
from dflash_jax.bench import needle  # noqa: E402
from dflash_jax.models.chat import render_chat  # noqa: E402

pytestmark = pytest.mark.xdist_group("tiny_data")

FILLER = [(f"f{i}.py", "\n".join(f"def fn_{i}_{j}(x):\n    return x * {j} + {i}" for j in range(60)))
          for i in range(4)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n_keys=st.integers(1, 6), data=st.data(),
       n_tok=st.integers(64, 1500))
def test_retrieval_example_holds_its_answers(seed, n_keys, data, n_tok):
    n_q = data.draw(st.integers(1, n_keys))
    text, asked = corpus.retrieval_example(random.Random(seed), n_tok, FILLER, n_keys=n_keys, n_questions=n_q,
                                           p_think=0.0)
    assert len(asked) == n_q and len({n for n, _ in asked}) == n_q
    first_user = text.split("<|im_end|>", 1)[0]
    assert first_user.startswith("<|im_start|>user\nRead the following text carefully.")
    for name, value in asked:
        # hidden once in the haystack of the first user turn, answered once
        assert first_user.count(f"The secret key for {name} is {value}.") == 1
        assert text.count(value) == 2
    assert first_user.count("secret key for ") == n_keys + 1  # the keys + the question
    # the last turn is what the bench decodes from (thinking off), closed by the answer
    last_q = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert text.endswith(render_chat([{"role": "user", "content": last_q}], enable_thinking=False)
                         + asked[-1][1] + "<|im_end|>\n")
    if n_q > 1:
        assert last_q == corpus.QUESTION.format(name=asked[-1][0])


def test_retrieval_example_rejects_more_questions_than_keys():
    with pytest.raises(ValueError, match="n_questions"):
        corpus.retrieval_example(random.Random(0), 200, FILLER, n_keys=2, n_questions=3)


def test_retrieval_documents_are_seeded_and_worker_independent():
    a = corpus.retrieval_documents("s-0", 30, 64, 400, FILLER, p_kv=0.3)
    assert a == corpus.retrieval_documents("s-0", 30, 64, 400, FILLER, p_kv=0.3)
    assert a != corpus.retrieval_documents("s-1", 30, 64, 400, FILLER, p_kv=0.3)
    assert all(d.startswith("<|im_start|>user\n") and d.endswith("<|im_end|>\n") for d in a)
    one = corpus.parallel_retrieval_documents("p", 25, 64, 300, FILLER, workers=1, chunk=10)
    two = corpus.parallel_retrieval_documents("p", 25, 64, 300, FILLER, workers=2, chunk=10)
    assert one == two and len(one) == 25


def test_kv_recall_document_answer_is_in_the_prompt():
    rng = random.Random(3)
    for n in (64, 300, 1000):
        text, [(name, value)] = corpus.kv_recall_document(rng, n)
        assert f'"{name}": "{value}"' in text and text.endswith(f"{value}<|im_end|>\n")


def _runs(row: np.ndarray, doc: list[int]) -> int:
    n = len(doc)
    return sum(1 for i in range(len(row) - n + 1) if list(row[i:i + n]) == doc)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), seq_len=st.integers(8, 40), n_stream=st.integers(0, 12),
       n_whole=st.integers(0, 8))
def test_pack_rows_keeps_whole_documents_inside_one_row(seed, seq_len, n_stream, n_whole):
    rng = np.random.default_rng(seed)
    sep = 0
    stream = [list(rng.integers(1, 50, rng.integers(1, 30))) for _ in range(n_stream)]
    # whole documents use tokens >= 100 and start with a unique marker, so each is found exactly where it was put
    whole = [[100 + i] + list(rng.integers(200, 300, rng.integers(0, 45))) for i in range(n_whole)]
    rows, st_ = train_tiny.pack_rows(stream, whole, sep, seq_len, seed)
    assert rows.ndim == 2 and rows.shape[1] == seq_len and rows.dtype == np.int32
    fits = [d for d in whole if len(d) + 1 <= seq_len]
    assert st_["whole_dropped"] == len(whole) - len(fits) and st_["whole_docs"] == len(fits)
    n_bins = st_["rows_with_whole_docs"]
    in_row = {r: [] for r in range(n_bins)}
    for d in fits:
        hits = [r for r in range(len(rows)) if _runs(rows[r], d + [sep])]
        assert len(hits) == 1, (d, hits)
        assert hits[0] < n_bins
        in_row[hits[0]].append(d)
    for d in whole:
        if d not in fits:
            assert not np.any(rows == d[0])
    # around its documents (one contiguous run per row), each retrieval row holds the next stream tokens; the plain
    # rows after them continue the stream in order
    flat = [t for d in stream for t in (*d, sep)]
    fills = []
    for r, docs in in_row.items():
        assert docs, "a retrieval row without a retrieval document"
        start = int(np.argmax(rows[r] >= 100))
        n = sum(len(d) + 1 for d in docs)
        fills += list(rows[r][:start]) + list(rows[r][start + n:])
    plain = list(rows[n_bins:].reshape(-1))
    if len(fills) <= len(flat):
        assert fills == flat[:len(fills)]
        assert plain == flat[len(fills):len(fills) + (len(flat) - len(fills)) // seq_len * seq_len]
    else:  # a stream shorter than the retrieval rows' room is cycled (empty: separators)
        assert plain == [] and fills == ((flat or [sep]) * (len(fills) // max(1, len(flat)) + 1))[:len(fills)]


@pytest.fixture(scope="module")
def smoke_tokenizer(tmp_path_factory):
    from dflash_jax.models.tokenizer import Tokenizer
    from experiments.train_tokenizer import train_bpe

    d = tmp_path_factory.mktemp("tok")
    texts = [t for _, t in FILLER] + [corpus.retrieval_documents("t", 20, 32, 200, FILLER)[i] for i in range(20)]
    train_bpe(iter(texts), str(d), vocab_size=320)
    return Tokenizer.from_dir(str(d))


def test_retrieval_eval_rows_mark_the_answer(smoke_tokenizer, tmp_path):
    tok = smoke_tokenizer
    files = []
    for name, text in FILLER:
        p = tmp_path / name
        p.write_text(text)
        files.append(str(p))
    ctx, n, row_len = 300, 3, 400
    rows, mask = train_tiny.retrieval_eval_rows(tok, files, ctx, n, 0, row_len)
    cases = needle.bench_prompts(tok, files, ctx, n, 0)
    assert rows.shape == mask.shape == (n, row_len)
    for r, m, (ids, ans, _) in zip(rows, mask, cases):
        assert list(r[:len(ids)]) == ids  # exactly the bench's prompt
        nxt = r[1:][m[:-1]]
        assert tok.decode([int(t) for t in nxt]) == ans
        assert int(m.sum()) == len(tok.encode(ans)) and m[len(ids) - 1]
    with pytest.raises(ValueError, match="do not fit"):
        train_tiny.retrieval_eval_rows(tok, files, ctx, 1, 0, 120)


def test_sharded_target_export_loads_to_the_same_model(tmp_path):
    cfg = tc.target_config(tc.preset("smoke")["target"], 384, eos_token_id=2, pad_token_id=0)
    params = train_tiny.init_target(cfg, jax.random.key(0))
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    train_tiny.save_target(str(one), cfg, params)
    limit = 200_000
    train_tiny.save_target(str(sharded), cfg, params, max_shard_bytes=limit)
    assert (one / "model.safetensors").is_file() and not (one / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    with open(sharded / "model.safetensors.index.json") as fh:
        index = json.load(fh)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.getsize(sharded / s) <= limit for s in shards)
    ids = [5, 17, 3, 99, 250, 1]
    a = np.asarray(load_target(one).logits(ids))
    b = np.asarray(load_target(sharded).logits(ids))
    np.testing.assert_array_equal(a, b)
    # re-exporting small again removes the shards
    train_tiny.save_target(str(sharded), cfg, params)
    assert sorted(os.listdir(sharded)) == ["config.json", "model.safetensors"]


def test_assistant_mask_marks_answers_and_their_end():
    S, A, E, U = 1, 50, 2, 51  # <|im_start|>, "assistant", <|im_end|>, "user"
    row = [7, 8, E, 9, S, U, 10, 11, E, S, A, 12, 13, 14, E, 15, S, A, 16, E, 17]
    want = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    # the row starts inside an assistant turn: its tail (7, 8, E) is not counted
    got = np.asarray(train_tiny.assistant_mask(np.asarray([row], np.int32), S, (A,), E))[0]
    assert got.astype(int).tolist() == want
    # a role of several tokens: "assistant" = (60, 61); "as" + "sistant"-like prefixes of other roles do not count
    row2 = [S, 60, 62, 9, E, S, 60, 61, 12, 13, E, 14]
    want2 = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    got2 = np.asarray(train_tiny.assistant_mask(np.asarray([row2], np.int32), S, (60, 61), E))[0]
    assert got2.astype(int).tolist() == want2
    # the weighted CE is the plain mean at unit weights and leans on the weighted tokens otherwise
    rng = np.random.default_rng(0)
    toks = np.asarray([row], np.int32)
    logits = rng.standard_normal((1, len(row), 64)).astype(np.float32)
    plain = float(train_tiny.weighted_next_token_ce(logits, toks, None))
    assert np.isclose(float(train_tiny.weighted_next_token_ce(logits, toks, np.ones_like(toks))), plain, rtol=1e-6)
    ce = np.asarray(train_tiny.next_token_ce(logits, toks))[0]
    w = 1.0 + 4.0 * got
    assert np.isclose(float(train_tiny.weighted_next_token_ce(logits, toks, w[None])),
                      float((ce * w[1:]).sum() / w[1:].sum()), rtol=1e-6)


def test_run_phase_step_budget_is_capped_by_the_time_left(tmp_path):
    import jax.numpy as jnp

    def loss(params, frozen, batch, key):
        return jnp.mean((params["w"] @ batch.astype(jnp.float32).T) ** 2), {}

    params = lambda: {"w": jnp.ones((2, 3), jnp.float32)}  # noqa: E731 (the steps donate their parameters)
    batches = train_tiny.Batches(np.arange(24, dtype=np.int32).reshape(8, 3), 2, 0)
    hp = {"steps": 50, "lr": 1e-2, "warmup": 0.1, "wd": 0.0, "clip": 1.0, "minutes": 1.0}
    kw = dict(work=str(tmp_path), resume=False, seed=0, log_every=10, ckpt_every=1000)
    free = train_tiny.run_phase("free", params(), None, loss, batches, hp, **kw)
    assert free.steps == 50  # a minute fits all 50 steps
    none_left = train_tiny.run_phase("capped", params(), None, loss, batches, hp, max_seconds=-5.0, **kw)
    assert none_left.steps == 1 and none_left.timing["steps_run"] == 1


def test_needle_values_copy_token_for_token(smoke_tokenizer):
    # the value's tokens in the answer are the same tokens as in the haystack line (a value starting with a letter
    # would merge with the space before it there and be spelled differently: nothing to copy)
    rng = random.Random(5)
    tok = smoke_tokenizer
    for _ in range(200):
        v = needle.random_value(rng)
        assert v[0].isdigit() and len(v) == 9 and v[4] == "-"
        a, line = tok.encode(v), tok.encode(f"x = 1\nThe secret key for {needle.random_name(rng)} is {v}.\ny")
        assert any(line[i:i + len(a)] == a for i in range(len(line) - len(a) + 1)), v


def test_drill_documents_ask_every_key_in_the_bench_format():
    a = corpus.drill_documents("d-0", 12, 16, 120, FILLER, keys=(2, 5), questions=5)
    assert a == corpus.drill_documents("d-0", 12, 16, 120, FILLER, keys=(2, 5), questions=5)
    assert a != corpus.drill_documents("d-1", 12, 16, 120, FILLER, keys=(2, 5), questions=5)
    for d in a:
        head = d.split("<|im_end|>", 1)[0]
        n_keys = head.count("The secret key for ")
        assert 2 <= n_keys <= 5 and d.count("<|im_start|>assistant\n") == n_keys  # every key asked once
        assert d.endswith("<|im_end|>\n") and "Answer with the key only." in head
    par = corpus.parallel_retrieval_documents("d", 25, 16, 120, FILLER, workers=1, chunk=10, drill_keys=4)
    assert all(2 <= d.split("<|im_end|>", 1)[0].count("The secret key for ") <= 4 for d in par) and len(par) == 25


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), seq_len=st.integers(16, 300))
def test_copy_rows_weight_only_tokens_an_earlier_copy_predicts(seed, seq_len):
    rows, w = train_tiny.copy_rows(3, seq_len, np.arange(10, 10**6), seed)
    assert rows.shape == w.shape == (3, seq_len) and rows.dtype == np.int32
    assert rows.min() >= 10 and not w[:, : seq_len // 2].any() and w.sum() > 0
    for r, wr in zip(rows, w):
        first = list(r[: seq_len // 2])
        pairs = set(zip(first[:-1], first[1:]))
        for t in np.nonzero(wr)[0]:
            assert (r[t - 1], r[t]) in pairs  # the bigram occurred in the first half: an induction copy predicts it
    assert np.array_equal(rows, train_tiny.copy_rows(3, seq_len, np.arange(10, 10**6), seed)[0])
    small = train_tiny.copy_rows(2, seq_len, np.asarray([7, 40, 41]), seed)[0]
    assert set(np.unique(small)) <= {7, 40, 41}


def test_batches_carry_their_weights():
    rows = np.arange(40, dtype=np.int32).reshape(10, 4)
    w = rows.astype(np.float32) * 2
    b = train_tiny.Batches(rows, 3, 0, w)
    for step in range(5):
        x, y = b(step)
        np.testing.assert_array_equal(y, x * 2)
        np.testing.assert_array_equal(x, train_tiny.Batches(rows, 3, 0)(step))
    with pytest.raises(ValueError, match="do not match"):
        train_tiny.Batches(rows, 3, 0, w[:, :2])
