"""Tokenizer wrapper (chat template ids, structural mask, round trips, eos ids), the toy BPE trainer and the corpus."""

import json
import os
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import corpus  # noqa: E402
from experiments.train_tokenizer import SPECIAL_TOKENS, train_bpe  # noqa: E402

from dflash_jax.models.chat import parse_assistant, render_chat  # noqa: E402
from dflash_jax.models.tokenizer import Tokenizer  # noqa: E402

TEXT = """def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Greeter:
    def hello(self, name: str) -> str:
        return f"Hello, {name}! Today is 2026-05-09."

Explain what this function does. The user wants a short answer with reasoning.
Café, naïve, Straße, 東京, привет, 🙂 — unicode text for the byte-level tokenizer.
"""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    train_bpe([TEXT] * 20, d, vocab_size=400, min_frequency=2)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    t = Tokenizer.from_dir(tok_dir)
    assert t is not None
    return t


def test_trained_files_and_special_ids(tok_dir, tok):
    cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    assert cfg["eos_token"] == "<|im_end|>"
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.endoftext_id, tok.im_start_id, tok.im_end_id, tok.think_start_id, tok.think_end_id,
            tok.tool_call_id, tok.tool_call_end_id, tok.tool_response_id, tok.tool_response_end_id,
            tok.mask_token_id) == tuple(range(10))
    assert tok.special_ids == {0, 1, 2, 9}  # think/tool tokens are added but not special, as in Qwen
    assert 256 + 10 <= tok.vocab_size <= 400


def test_from_dir_eos_ids(tok_dir, tmp_path):
    assert Tokenizer.from_dir(tok_dir).eos_token_ids == (2, 0)  # tokenizer_config eos, then generation_config
    d = tmp_path / "m"
    d.mkdir()
    assert Tokenizer.from_dir(str(d)) is None
    (d / "tokenizer.json").write_text(open(os.path.join(tok_dir, "tokenizer.json")).read())
    assert Tokenizer.from_dir(str(d)).eos_token_ids == ()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(str(d)).eos_token_ids == (0,)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 2]}))
    t = Tokenizer.from_dir(str(d))
    assert t.eos_token_ids == (2, 0) and t.mask_token_id == 9


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x + 1  # ascii, tabs\tand  spaces\n\n",
    "Café naïve Straße 東京 привет 🙂🙂 ñ — “quotes” … 12345",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
    "",
])
def test_decode_encode_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_split_and_specials_are_single_ids(tok):
    ids = tok.encode("x=90210")
    assert [tok.decode([i]) for i in ids][-5:] == ["9", "0", "2", "1", "0"]
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.encode(t) == [i]
    # skip_special_tokens drops the ChatML tokens but keeps <think> (not special)
    assert tok.decode(tok.encode("<|im_start|>a<think>b</think><|im_end|>")) == "a<think>b</think>"


def _positions(ids, i):
    return [k for k, x in enumerate(ids) if x == i]


def test_apply_chat_template_ids(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, 東京!"},
            {"role": "assistant", "content": "Hi.", "reasoning_content": "greet",
             "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "ok"}]
    ids = tok.apply_chat_template(msgs)
    text = render_chat(msgs)
    assert ids == tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    S, E = tok.im_start_id, tok.im_end_id
    assert ids[0] == S and ids[-2:] == [tok.think_start_id, tok.encode("\n")[0]]
    assert len(_positions(ids, S)) == 5 and len(_positions(ids, E)) == 4
    # every <|im_start|> is followed by the role text and a newline, every <|im_end|> closes a turn
    roles = [tok.decode(ids[p + 1:p + 1 + len(tok.encode(r + "\n"))]) for p, r in
             zip(_positions(ids, S), ["system", "user", "assistant", "user", "assistant"])]
    assert roles == ["system\n", "user\n", "assistant\n", "user\n", "assistant\n"]
    # the text between consecutive template tokens decodes to the rendered pieces
    assert tok.decode(ids[_positions(ids, S)[1] + 1:_positions(ids, E)[1]]) == "user\nHello, 東京!"
    for i in (tok.think_end_id, tok.tool_call_id, tok.tool_call_end_id, tok.tool_response_id,
              tok.tool_response_end_id):
        assert len(_positions(ids, i)) == 1
    assert len(_positions(ids, tok.think_start_id)) == 2
    # thinking off: the prompt ends with the closed empty think block
    off = tok.apply_chat_template(msgs[:2], enable_thinking=False)
    assert tok.decode(off[-6:], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="message 1"):
        tok.apply_chat_template([msgs[0], {"role": "nobody", "content": "x"}])


def test_structural_mask(tok):
    msgs = [{"role": "user", "content": "Why <think> here? 42"},
            {"role": "assistant", "content": "Because.", "reasoning_content": "r"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    m = tok.structural_mask(ids)
    assert m.dtype == np.bool_ and m.shape == (len(ids),)
    arr = np.asarray(ids)
    for i in (tok.im_start_id, tok.im_end_id, tok.think_start_id, tok.think_end_id):
        assert m[arr == i].all()
    # role headers ("user\n", "assistant\n") and the newline after <|im_end|> are kept too
    for p in _positions(ids, tok.im_start_id):
        k = p + 1
        while not tok.decode([ids[k]]).endswith("\n"):
            assert m[k]
            k += 1
        assert m[k]
    for p in _positions(ids, tok.im_end_id):
        assert m[p + 1]
    # ordinary content is not structural
    content = tok.encode(" here? 42")
    start = next(k for k in range(len(ids)) if ids[k:k + len(content)] == content)
    assert not m[start:start + len(content)].any()
    assert not tok.structural_mask(tok.encode("plain text only")).any()
    assert tok.structural_mask(np.zeros((0,), np.int32)).shape == (0,)
    assert not tok.structural_mask(ids, role_headers=False)[_positions(ids, tok.im_start_id)[0] + 1]


def test_parse_generated_ids(tok):
    gen = tok.encode("weigh options\n</think>\n\nDone.<|im_end|>")
    assert parse_assistant(tok.decode(gen, skip_special_tokens=False), thinking=True) == (
        "weigh options", "Done.", [])


# ---------------------------------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def filler():
    files = corpus.load_stdlib("train", max_files=40)
    assert len(files) >= 10
    return files


def test_stdlib_split_is_fixed_by_path():
    train, ev = corpus.split_stdlib()
    assert train and ev and not set(train) & set(ev)
    assert 0.02 < len(ev) / (len(train) + len(ev)) < 0.09  # ≈ 1/20
    assert all(corpus.is_eval_path(p) for p in ev) and not any(corpus.is_eval_path(p) for p in train)
    assert corpus.is_eval_path("json/decoder.py") == corpus.is_eval_path("json/decoder.py")
    assert all("/" in p or p.endswith(".py") for p in train[:50])
    assert not any(p.startswith("site-packages/") for p in train)


@pytest.mark.parametrize("n_tokens", [200, 1000, 3000])
def test_needle_example(filler, tok, n_tokens):
    rng = random.Random(n_tokens)
    prompt, answer, meta = corpus.needle_example(rng, n_tokens, filler=filler, n_distractors=2, return_meta=True)
    assert prompt.count(answer) == 1
    assert f"The secret key for {meta['name']} is {answer}." in prompt
    assert prompt.rstrip().endswith("Answer with the key only.") and meta["name"] in prompt.split("\n")[-1]
    assert 0.8 * n_tokens <= len(prompt) / corpus.CHARS_PER_TOKEN <= 1.02 * n_tokens
    # measured with a real tokenizer (the wrapper or a raw tokenizers.Tokenizer)
    prompt, answer = corpus.needle_example(random.Random(1), n_tokens, tok, filler=filler)
    assert prompt.count(answer) == 1
    assert 0.8 * n_tokens <= len(tok.encode(prompt)) <= n_tokens
    # deterministic
    assert corpus.needle_example(random.Random(7), n_tokens, filler=filler) == corpus.needle_example(
        random.Random(7), n_tokens, filler=filler)


def test_needle_depth_and_kv(filler):
    p, a = corpus.needle_example(random.Random(0), 1000, filler=filler, depth=0.0)
    assert p.index(a) < len(p) * 0.1
    p, a = corpus.needle_example(random.Random(0), 1000, filler=filler, depth=1.0)
    assert p.index(a) > len(p) * 0.9
    p, a = corpus.kv_recall_example(random.Random(3), 30)
    assert p.count(a) == 1 and p.count('": "') == 30


def test_chat_examples(filler):
    fns = corpus.collect_functions(filler)
    assert fns
    rng = random.Random(0)
    out = [corpus.chat_example(rng, fns) for _ in range(60)]
    assert out == [corpus.chat_example(r, fns) for r in [random.Random(0)] for _ in range(60)]
    texts = [t for t, _ in out]
    for t, meta in out:
        assert t.startswith("<|im_start|>") and t.endswith("<|im_end|>\n")
        if meta["thinking"]:
            assert "<think>\n\n</think>" not in t.rsplit("<|im_start|>assistant\n", 1)[1]
        else:
            assert t.rsplit("<|im_start|>assistant\n", 1)[1].startswith("<think>\n\n</think>\n\n")
    assert any(m["thinking"] for _, m in out) and any(not m["thinking"] for _, m in out)
    assert any("```python" in t for t in texts)


def test_corpus_main(tmp_path):
    stats = corpus.main(["--out", str(tmp_path), "--max-files", "8", "--n-chat", "10", "--n-eval-chat", "4",
                         "--n-needle", "4", "--n-eval-needle", "3", "--needle-tokens", "200,400"])
    docs = list(corpus.read_train_docs(str(tmp_path / "train.txt")))
    assert len(docs) == stats["train_docs"] == stats["train_stdlib_files"] + 10 + 4
    recs = [json.loads(x) for x in open(tmp_path / "eval.jsonl")]
    kinds = [r["kind"] for r in recs]
    assert kinds.count("chat") == 4 and kinds.count("needle") == 3 and kinds.count("stdlib") >= 1
    for r in recs:
        if r["kind"] == "needle":
            assert r["prompt"].count(r["answer"]) == 1
        if r["kind"] == "stdlib":
            assert corpus.is_eval_path(r["path"])
    split = json.load(open(tmp_path / "split.json"))
    assert split["eval_files"] and all(corpus.is_eval_path(p) for p in split["eval_files"])
    # deterministic
    stats2 = corpus.main(["--out", str(tmp_path / "b"), "--max-files", "8", "--n-chat", "10", "--n-eval-chat", "4",
                          "--n-needle", "4", "--n-eval-needle", "3", "--needle-tokens", "200,400"])
    assert (tmp_path / "train.txt").read_bytes() == (tmp_path / "b" / "train.txt").read_bytes()
    assert stats2["train_docs"] == stats["train_docs"]
