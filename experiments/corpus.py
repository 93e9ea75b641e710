"""Deterministic local corpus for the toy tokenizer / target / drafter (reference §6.4). Nothing is downloaded.

Three sources:

(a) the installed Python's standard-library ``.py`` sources (``sysconfig`` stdlib dir, i.e. ``sys.base_prefix``
    ``lib/python3.x``; ``site-packages`` excluded), split by file path: a file is held out for eval iff
    ``int(sha1(relpath).hexdigest(), 16) % 20 == 0`` (``relpath`` relative to the stdlib dir, ``/``-separated);
(b) synthetic ChatML conversations (``dflash_jax.models.chat.render_chat``) wrapping code-explanation tasks built from
    the stdlib functions (explain / list parameters / write the docstring / a ``read_file`` tool round trip) plus a few
    arithmetic and list tasks; about half carry a ``<think>`` reasoning block, the rest the empty think block of
    ``enable_thinking=False``;
(c) long-context needle / key-value recall prompts: ``needle_example`` hides "The secret key for <name> is <value>."
    at a random depth in stdlib filler and asks for it at the end; ``retrieval_example`` hides several keys and asks
    for several of them in follow-up turns.

``main`` writes to ``--out``:

* ``train.txt``: training documents, each followed by ``<|endoftext|>`` (read back with ``read_train_docs``);
* ``retrieval.txt`` / ``retrieval_long.txt``: retrieval documents (``retrieval_documents``: the ``bench needle``
  prompt with 1-6 keys and 1-4 questions, or JSON key-value recall) of ``--retrieval-tokens`` /
  ``--retrieval-long-tokens`` approximate tokens, in the same format; the trainer packs each whole into one row;
* ``eval.jsonl``: one JSON record per line, ``{"kind": "stdlib", "path", "text"}``, ``{"kind": "chat", "task",
  "thinking", "text"}``, ``{"kind": "needle", "n_tokens_approx", "depth", "prompt", "answer", "text"}``;
* ``split.json`` (the rule and the eval file list) and ``stats.json`` (counts and sizes).

    python experiments/corpus.py --out /tmp/corpus [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import sysconfig
import textwrap
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from dflash_jax.bench import needle as _needle  # noqa: E402
from dflash_jax.models.chat import STRUCTURAL_TOKENS, render_chat  # noqa: E402

DOC_SEP = "<|endoftext|>"
EVAL_MOD = 20
#: Special-token strings that must never occur inside raw text (a file holding one is skipped).
FORBIDDEN = tuple(STRUCTURAL_TOKENS) + ("<|mask|>",)
CHARS_PER_TOKEN = _needle.CHARS_PER_TOKEN


# ---------------------------------------------------------------------------------------------------------------------
# (a) standard-library sources
# ---------------------------------------------------------------------------------------------------------------------

def stdlib_dir() -> str:
    """The installed Python's standard-library directory (``<sys.base_prefix>/lib/python3.x`` on POSIX)."""
    d = sysconfig.get_paths(vars={"installed_base": sys.base_prefix, "base": sys.base_prefix})["stdlib"]
    if not os.path.isdir(d):
        d = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    return d


def is_eval_path(relpath: str, mod: int = EVAL_MOD) -> bool:
    """The fixed held-out rule: ``sha1(relpath) mod 20 == 0``."""
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % mod == 0


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted ``/``-separated paths (relative to ``root``) of the stdlib ``.py`` files, ``site-packages`` excluded."""
    root = root or stdlib_dir()
    out = []
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in ("site-packages", "__pycache__", "dist-packages"))
        for fn in fns:
            if fn.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dp, fn), root).replace(os.sep, "/"))
    return sorted(out)


def split_stdlib(root: str | None = None, mod: int = EVAL_MOD) -> tuple[list[str], list[str]]:
    """``(train relpaths, eval relpaths)`` by ``is_eval_path``."""
    files = stdlib_files(root)
    return [f for f in files if not is_eval_path(f, mod)], [f for f in files if is_eval_path(f, mod)]


def read_source(relpath: str, root: str | None = None, max_bytes: int = 1 << 20) -> str | None:
    """A stdlib file's text, or None if it is not UTF-8, too large, empty or contains a special-token string."""
    path = os.path.join(root or stdlib_dir(), relpath)
    try:
        if os.path.getsize(path) > max_bytes:
            return None
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip() or any(t in text for t in FORBIDDEN):
        return None
    return text


@functools.lru_cache(maxsize=4)
def _load_texts(split: str, root: str | None, max_files: int | None) -> tuple[tuple[str, str], ...]:
    train, ev = split_stdlib(root)
    files = train if split == "train" else ev
    if max_files is not None:
        files = files[:max_files]
    out = []
    for f in files:
        t = read_source(f, root)
        if t is not None:
            out.append((f, t))
    return tuple(out)


def load_stdlib(split: str = "train", root: str | None = None, max_files: int | None = None
                ) -> list[tuple[str, str]]:
    """``[(relpath, text)]`` of one split (``"train"`` or ``"eval"``), readable files only, cached per process."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return list(_load_texts(split, root, max_files))


# ---------------------------------------------------------------------------------------------------------------------
# (b) synthetic chat conversations
# ---------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FunctionInfo:
    path: str                  # stdlib relpath
    qualname: str              # "Class.method" or "func"
    args: tuple[str, ...]
    doc: str | None
    code: str                  # dedented source of the def (decorators excluded)
    code_nodoc: str            # the same without its docstring
    n_lines: int
    n_returns: int
    is_generator: bool
    raises: tuple[str, ...]
    calls: tuple[str, ...]


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def extract_functions(source: str, relpath: str, min_lines: int = 3, max_lines: int = 60) -> list[FunctionInfo]:
    """The functions and methods of a module (``min_lines``–``max_lines`` long), with facts for synthetic answers."""
    try:
        with warnings.catch_warnings():  # e.g. SyntaxWarning for invalid escapes in old test files
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")
    out: list[FunctionInfo] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ClassDef):
                visit(ch, prefix + ch.name + ".")
            elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (ch.end_lineno or ch.lineno) - ch.lineno + 1
                if min_lines <= n <= max_lines:
                    out.append(_function_info(ch, prefix, lines, relpath))

    visit(tree, "")
    return out


def _function_info(fn: ast.FunctionDef | ast.AsyncFunctionDef, prefix: str, lines: list[str],
                   relpath: str) -> FunctionInfo:
    a = fn.args
    args = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        args.append("*" + a.vararg.arg)
    args += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        args.append("**" + a.kwarg.arg)
    seg = lines[fn.lineno - 1:fn.end_lineno]
    code = textwrap.dedent("\n".join(seg))
    doc = ast.get_docstring(fn)
    code_nodoc = code
    if doc is not None and fn.body and isinstance(fn.body[0], ast.Expr):
        d0, d1 = fn.body[0].lineno - fn.lineno, fn.body[0].end_lineno - fn.lineno
        kept = seg[:d0] + seg[d1 + 1:]
        if len(kept) > 1:
            code_nodoc = textwrap.dedent("\n".join(kept))
    returns = 0
    raised: list[str] = []
    calls: list[str] = []
    gen = False
    for sub in (n for stmt in fn.body for n in ast.walk(stmt)):  # decorators excluded
        if isinstance(sub, ast.Return) and sub.value is not None:
            returns += 1
        elif isinstance(sub, (ast.Yield, ast.YieldFrom)):
            gen = True
        elif isinstance(sub, ast.Raise) and sub.exc is not None:
            e = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
            nm = _call_name(e)
            if nm and nm not in raised:
                raised.append(nm)
        elif isinstance(sub, ast.Call):
            nm = _call_name(sub.func)
            if nm and nm not in calls and nm != fn.name:
                calls.append(nm)
    return FunctionInfo(relpath, prefix + fn.name, tuple(args), doc, code, code_nodoc,
                        (fn.end_lineno or fn.lineno) - fn.lineno + 1, returns, gen, tuple(raised[:4]),
                        tuple(calls[:6]))


def collect_functions(files: Sequence[tuple[str, str]]) -> list[FunctionInfo]:
    out: list[FunctionInfo] = []
    for rel, text in files:
        out.extend(extract_functions(text, rel))
    return out


def _module_name(relpath: str) -> str:
    m = relpath[:-3].replace("/", ".")
    return m[: -len(".__init__")] if m.endswith(".__init__") else m


def _join(xs: Sequence[str]) -> str:
    xs = [f"`{x}`" for x in xs]
    if not xs:
        return "nothing"
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def _summary(fn: FunctionInfo) -> str:
    if fn.doc:
        first = fn.doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        return " ".join(first.split())
    what = "a generator" if fn.is_generator else "a function"
    return f"`{fn.qualname}` is {what} of {fn.n_lines} lines in `{_module_name(fn.path)}`."


def _facts(fn: FunctionInfo) -> list[str]:
    params = [a for a in fn.args if a not in ("self", "cls")]
    out = [f"It takes {_join(params)}." if params else "It takes no arguments besides the receiver." if fn.args
           else "It takes no arguments."]
    if fn.is_generator:
        out.append("It is a generator: it yields values instead of returning a single result.")
    elif fn.n_returns:
        out.append(f"It has {fn.n_returns} return statement{'s' if fn.n_returns > 1 else ''}.")
    else:
        out.append("It returns None (there is no return with a value).")
    if fn.raises:
        out.append(f"It can raise {_join(fn.raises)}.")
    if fn.calls:
        out.append(f"It calls {_join(fn.calls)}.")
    return out


def _reasoning(fn: FunctionInfo, goal: str, rng: random.Random) -> str:
    opener = rng.choice(["The user wants", "I'm asked for", "The task is", "Okay, the request is for"])
    parts = [f"{opener} {goal} for `{fn.qualname}` from `{_module_name(fn.path)}`.",
             f"Let me read the code. It is {fn.n_lines} lines long."]
    parts += _facts(fn)
    if fn.doc:
        parts.append("Its docstring starts: \"" + _summary(fn)[:200] + "\"")
    else:
        parts.append("It has no docstring, so I have to infer the purpose from the body.")
    parts.append(rng.choice(["So I'll answer concisely.", "Now I can write the answer.",
                             "That should be enough to answer."]))
    return "\n".join(parts)


def _task_explain(fn: FunctionInfo, rng: random.Random) -> tuple[str, str, str]:
    q = rng.choice(["Explain what this function does:", "What does the following Python code do?",
                    "Can you explain this function from the standard library?", "Describe this code:"])
    user = f"{q}\n\n```python\n{fn.code}\n```"
    ans = [_summary(fn), ""] + ["- " + f for f in _facts(fn)]
    return user, "\n".join(ans), "an explanation"


def _task_params(fn: FunctionInfo, rng: random.Random) -> tuple[str, str, str]:
    user = f"List the parameters of `{fn.qualname}`:\n\n```python\n{fn.code}\n```"
    params = [a for a in fn.args if a not in ("self", "cls")]
    if params:
        ans = f"`{fn.qualname}` has {len(params)} parameter{'s' if len(params) > 1 else ''}:\n" + "\n".join(
            f"{i + 1}. `{p}`" for i, p in enumerate(params))
    else:
        ans = f"`{fn.qualname}` takes no parameters."
    return user, ans, "the parameter list"


def _task_docstring(fn: FunctionInfo, rng: random.Random) -> tuple[str, str, str]:
    if not fn.doc:
        return _task_explain(fn, rng)
    user = f"Write a docstring for this function:\n\n```python\n{fn.code_nodoc}\n```"
    ans = f'"""{fn.doc.strip()}"""'
    return user, ans, "a docstring"


_TASKS = (_task_explain, _task_explain, _task_params, _task_docstring)

READ_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "read_source",
        "description": "Return the source code of a function from the Python standard library.",
        "parameters": {
            "type": "object",
            "properties": {
                "module": {"type": "string", "description": "dotted module name, e.g. json.decoder"},
                "name": {"type": "string", "description": "function or Class.method name"},
            },
            "required": ["module", "name"],
        },
    },
}

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are an expert Python programmer. Answer precisely.",
    "You are a concise coding assistant.",
)


def code_chat_messages(fn: FunctionInfo, rng: random.Random, *, thinking: bool
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    """``(messages, tools, task name)`` of one code conversation about ``fn``, ending with the assistant answer."""
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.15:  # tool round trip
        mod = _module_name(fn.path)
        msgs.append({"role": "user", "content": f"What does `{fn.qualname}` in `{mod}` do?"})
        msgs.append({"role": "assistant", "content": "",
                     "reasoning_content": f"I need the source of `{fn.qualname}` first." if thinking else "",
                     "tool_calls": [{"type": "function", "function": {
                         "name": "read_source", "arguments": {"module": mod, "name": fn.qualname}}}]})
        msgs.append({"role": "tool", "content": fn.code})
        ans = "\n".join([_summary(fn), ""] + ["- " + f for f in _facts(fn)])
        msgs.append({"role": "assistant", "content": ans,
                     "reasoning_content": _reasoning(fn, "an explanation", rng) if thinking else ""})
        return msgs, [READ_FILE_TOOL], "tool"
    task = rng.choice(_TASKS)
    user, ans, goal = task(fn, rng)
    msgs.append({"role": "user", "content": user})
    msgs.append({"role": "assistant", "content": ans,
                 "reasoning_content": _reasoning(fn, goal, rng) if thinking else ""})
    return msgs, None, {"an explanation": "explain", "the parameter list": "params", "a docstring": "docstring"}[goal]


def misc_chat_messages(rng: random.Random, *, thinking: bool) -> tuple[list[dict[str, Any]], str]:
    """A small arithmetic / list task conversation (exercises digits and short answers)."""
    kind = rng.choice(["add", "mul", "sort", "max", "count"])
    if kind in ("add", "mul"):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        op, res = ("+", a + b) if kind == "add" else ("*", a * b)
        user = f"What is {a} {op} {b}?"
        r = f"I need to compute {a} {op} {b}. " + (
            f"{a} + {b} = {res}." if kind == "add" else f"{a} * {b} = {a} * {b // 10 * 10} + {a} * {b % 10} = "
                                                        f"{a * (b // 10 * 10)} + {a * (b % 10)} = {res}.")
        ans = f"{a} {op} {b} = {res}."
    else:
        xs = [rng.randint(0, 99) for _ in range(rng.randint(4, 12))]
        if kind == "sort":
            user, res = f"Sort this list in ascending order: {xs}", sorted(xs)
            r = f"The list has {len(xs)} numbers; the smallest is {min(xs)} and the largest is {max(xs)}."
            ans = f"The sorted list is {res}."
        elif kind == "max":
            user = f"What is the largest number in {xs}?"
            r = f"Scanning the {len(xs)} numbers, the running maximum ends at {max(xs)}."
            ans = f"The largest number is {max(xs)}."
        else:
            t = rng.choice(xs)
            user = f"How many times does {t} appear in {xs}?"
            r = f"Counting occurrences of {t}: it appears {xs.count(t)} time{'s' if xs.count(t) > 1 else ''}."
            ans = f"{t} appears {xs.count(t)} time{'s' if xs.count(t) > 1 else ''}."
    return ([{"role": "user", "content": user},
             {"role": "assistant", "content": ans, "reasoning_content": r if thinking else ""}], kind)


def chat_example(rng: random.Random, functions: Sequence[FunctionInfo], *, p_think: float = 0.5,
                 p_multi: float = 0.2, p_misc: float = 0.15) -> tuple[str, dict[str, Any]]:
    """One rendered training conversation ``(text, meta)``: ChatML with the final assistant turn closed.

    Thinking conversations carry ``<think>\\nreasoning\\n</think>``; the others the empty block
    ``<think>\\n\\n</think>`` of ``enable_thinking=False``. Multi-turn ones exercise dropped historical reasoning.
    """
    thinking = rng.random() < p_think
    tools = None
    if rng.random() < p_misc or not functions:
        msgs, task = misc_chat_messages(rng, thinking=thinking)
    else:
        msgs, tools, task = code_chat_messages(rng.choice(functions), rng, thinking=thinking)
    if tools is None and rng.random() < p_multi and functions:
        more, _, t2 = code_chat_messages(rng.choice(functions), rng, thinking=thinking)
        more = [m for m in more if m["role"] != "system"]
        msgs = msgs + more
        task = f"{task}+{t2}"
    text = render_chat(msgs, add_generation_prompt=False, tools=tools)
    return text, {"task": task, "thinking": thinking, "tools": tools is not None}


# ---------------------------------------------------------------------------------------------------------------------
# (c) long-context needle / key-value recall
# ---------------------------------------------------------------------------------------------------------------------

def needle_example(rng: random.Random, n_tokens_approx: int, tokenizer: Any = None, *,
                   filler: Sequence[tuple[str, str]] | None = None, **kw: Any):
    """``dflash_jax.bench.needle.needle_example`` with the stdlib train split as the default filler."""
    return _needle.needle_example(rng, n_tokens_approx, tokenizer,
                                  filler=filler if filler is not None else load_stdlib("train"), **kw)


def kv_recall_example(rng: random.Random, n_pairs: int) -> tuple[str, str]:
    """A key-value retrieval prompt: ``n_pairs`` JSON ``"name": "value"`` lines, then a question about one key."""
    names: set[str] = set()
    values: set[str] = set()
    pairs = []
    while len(pairs) < n_pairs:
        n, v = _needle.random_name(rng), _needle.random_value(rng)
        if n in names or v in values:
            continue
        names.add(n)
        values.add(v)
        pairs.append((n, v))
    k, v = pairs[rng.randrange(n_pairs)]
    body = "{\n" + ",\n".join(f'  "{a}": "{b}"' for a, b in pairs) + "\n}"
    return (f"Here is a JSON object of secret keys:\n\n{body}\n\nQuestion: What is the secret key for {k}? "
            f"Answer with the key only."), v


def needle_chat_text(prompt: str, answer: str, rng: random.Random, *, thinking: bool) -> str:
    """A needle prompt and its answer as one closed ChatML conversation (a training document)."""
    rc = f"The question asks for a secret key. I found the matching line; the key is {answer}." if thinking else ""
    msgs = [{"role": "user", "content": prompt},
            {"role": "assistant", "content": answer, "reasoning_content": rc}]
    return render_chat(msgs, add_generation_prompt=False)


QUESTION = "Question: What is the secret key for {name}? Answer with the key only."


def retrieval_example(rng: random.Random, n_tokens_approx: int, filler: Sequence[tuple[str, str]], *,
                      n_keys: int = 1, n_questions: int = 1, p_think: float = 0.2
                      ) -> tuple[str, list[tuple[str, str]]]:
    """One retrieval training document ``(text, [(name, value) asked, in order])``: the ``bench needle`` prompt
    (``needle_example``: ``n_keys`` keys hidden at random depths in ``filler`` lines, about ``n_tokens_approx``
    tokens) as a closed ChatML conversation answered with the key, then ``n_questions - 1`` follow-up user turns
    asking, in the bench's question wording, for other keys hidden in the same text, each answered. The last turn
    is in the exact format the bench decodes from (thinking off unless drawn with ``p_think``); follow-ups give
    several supervised retrievals per haystack."""
    if not 1 <= n_questions <= n_keys:
        raise ValueError(f"need 1 <= n_questions <= n_keys, got {n_questions}, {n_keys}")
    prompt, value, meta = needle_example(rng, n_tokens_approx, None, filler=filler, n_distractors=n_keys - 1,
                                         return_meta=True)
    others = list(meta["distractor_keys"])
    rng.shuffle(others)
    asked = [(meta["name"], value)] + others[: n_questions - 1]
    thinking = rng.random() < p_think
    msgs: list[dict[str, Any]] = []
    for i, (name, val) in enumerate(asked):
        msgs.append({"role": "user", "content": prompt if i == 0 else QUESTION.format(name=name)})
        rc = f"The question asks for the secret key for {name}; the matching line gives {val}." if thinking else ""
        msgs.append({"role": "assistant", "content": val, "reasoning_content": rc})
    return render_chat(msgs, add_generation_prompt=False), asked


def kv_recall_document(rng: random.Random, n_tokens_approx: int) -> tuple[str, list[tuple[str, str]]]:
    """``kv_recall_example`` sized to about ``n_tokens_approx`` tokens, as a closed conversation (thinking off)."""
    prompt, ans = kv_recall_example(rng, max(2, n_tokens_approx // 14))
    name = prompt.rsplit("secret key for ", 1)[1].split("?", 1)[0]
    return needle_chat_text(prompt, ans, rng, thinking=False), [(name, ans)]


def retrieval_documents(seed: int | str, n: int, lo: int, hi: int, filler: Sequence[tuple[str, str]], *,
                        p_long: float = 0.0, p_kv: float = 0.1) -> list[str]:
    """``n`` retrieval documents (``retrieval_example`` / ``kv_recall_document``) of about ``lo``..``hi`` tokens
    (uniform; with ``p_long`` drawn from the top quarter of the range instead), 1-6 keys, 1-4 questions.
    A pure function of ``seed`` (``random.Random(seed)``)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        top = rng.random() < p_long
        n_tok = rng.randint(hi - (hi - lo) // 4 if top else lo, hi)
        if rng.random() < p_kv:
            docs.append(kv_recall_document(rng, min(n_tok, 1024))[0])
            continue
        n_keys = rng.choice([1, 1, 2, 3, 4, 6])
        n_q = rng.randint(1, min(n_keys, 4))
        docs.append(retrieval_example(rng, n_tok, filler, n_keys=n_keys, n_questions=n_q)[0])
    return docs


def drill_documents(seed: int | str, n: int, lo: int, hi: int, filler: Sequence[tuple[str, str]], *,
                    keys: tuple[int, int] = (2, 6), questions: int = 4) -> list[str]:
    """``n`` dense recall drills: ``retrieval_example`` with ``keys[0]``..``keys[1]`` keys in only about
    ``lo``..``hi`` tokens of filler and ``min(keys, questions)`` of them asked, so a document is mostly key lines
    and supervised lookups (the dense associative-recall signal a copy mechanism forms from; the plain
    ``retrieval_documents`` hold a few answer tokens per thousand). A pure function of ``seed``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        n_keys = rng.randint(*keys)
        docs.append(retrieval_example(rng, rng.randint(lo, hi), filler, n_keys=n_keys,
                                      n_questions=min(n_keys, questions))[0])
    return docs


def _parse_range(spec: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in spec.split(","))
    if not 0 < lo <= hi:
        raise ValueError(f"token range wants LO,HI with 0 < LO <= HI, got {spec!r}")
    return lo, hi


# ---------------------------------------------------------------------------------------------------------------------
# train.txt helpers
# ---------------------------------------------------------------------------------------------------------------------

def stdlib_document(relpath: str, text: str) -> str:
    return f"# {relpath}\n{text}"


def write_docs(path: str, docs: Sequence[str]) -> None:
    """Documents, each followed by ``<|endoftext|>`` (``read_train_docs`` reads them back)."""
    with open(path, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(d)
            fh.write(DOC_SEP)


_FILLER: Sequence[tuple[str, str]] = ()


def _set_filler(filler: Sequence[tuple[str, str]]) -> None:
    global _FILLER
    _FILLER = filler


def _retrieval_chunk(job: tuple[str, int, int, int, float, int]) -> list[str]:
    seed, n, lo, hi, p_long, drill_keys = job
    if drill_keys:
        return drill_documents(seed, n, lo, hi, _FILLER, keys=(2, drill_keys), questions=drill_keys)
    return retrieval_documents(seed, n, lo, hi, _FILLER, p_long=p_long)


def parallel_retrieval_documents(seed: str, n: int, lo: int, hi: int, filler: Sequence[tuple[str, str]], *,
                                 p_long: float = 0.0, workers: int | None = None, chunk: int = 200,
                                 drill_keys: int = 0) -> list[str]:
    """``retrieval_documents`` (with ``drill_keys``: ``drill_documents`` of 2..``drill_keys`` keys, all asked) in
    chunks of ``chunk`` seeded ``f"{seed}-{i}"``, over ``workers`` processes: the same documents for any number of
    workers. The workers are spawned, not forked: the caller may already run JAX's threads."""
    jobs = [(f"{seed}-{i}", min(chunk, n - i * chunk), lo, hi, p_long, drill_keys) for i in range(-(-n // chunk))]
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers <= 1:
        _set_filler(filler)
        try:
            parts = [_retrieval_chunk(j) for j in jobs]
        finally:
            _set_filler(())
    else:
        # the workers never touch an accelerator: should an import start a JAX backend there, it is the CPU one
        old = os.environ.get("JAX_PLATFORMS")
        os.environ["JAX_PLATFORMS"] = "cpu"
        try:
            with mp.get_context("spawn").Pool(workers, initializer=_set_filler, initargs=(list(filler),)) as pool:
                parts = pool.map(_retrieval_chunk, jobs)
        finally:
            if old is None:
                os.environ.pop("JAX_PLATFORMS", None)
            else:
                os.environ["JAX_PLATFORMS"] = old
    return [d for p in parts for d in p]


def read_train_docs(path: str) -> Iterator[str]:
    """The documents of a ``train.txt`` (``<|endoftext|>``-terminated)."""
    with open(path, encoding="utf-8") as fh:
        data = fh.read()
    for d in data.split(DOC_SEP):
        if d:
            yield d


def iter_tokenizer_texts(*, max_bytes: int | None = None, n_chat: int = 2000, seed: int = 0,
                         root: str | None = None) -> Iterator[str]:
    """Texts for BPE training straight from the train split (no files): stdlib sources, then chat samples."""
    total = 0
    files = load_stdlib("train", root)
    for rel, text in files:
        doc = stdlib_document(rel, text)
        total += len(doc.encode("utf-8"))
        yield doc
        if max_bytes is not None and total >= max_bytes:
            return
    rng = random.Random(seed)
    fns = collect_functions(files[:200])
    for _ in range(n_chat):
        yield chat_example(rng, fns)[0]


# ---------------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-chat", type=int, default=20000, help="training chat conversations")
    ap.add_argument("--n-eval-chat", type=int, default=500)
    ap.add_argument("--n-needle", type=int, default=1000, help="training needle conversations")
    ap.add_argument("--n-eval-needle", type=int, default=100)
    ap.add_argument("--needle-tokens", default="256,512,1024,2048", help="comma-separated approximate lengths")
    ap.add_argument("--n-retrieval", type=int, default=0,
                    help="retrieval documents (retrieval.txt: each must stay whole inside one training row)")
    ap.add_argument("--retrieval-tokens", default="128,1800", help="LO,HI approximate tokens of those")
    ap.add_argument("--n-retrieval-long", type=int, default=0, help="long retrieval documents (retrieval_long.txt)")
    ap.add_argument("--retrieval-long-tokens", default="1024,8000", help="LO,HI approximate tokens of those")
    ap.add_argument("--n-drill", type=int, default=0,
                    help="dense recall drills (drill_documents), shuffled into retrieval.txt")
    ap.add_argument("--drill-tokens", default="32,256", help="LO,HI approximate filler tokens of a drill")
    ap.add_argument("--drill-keys", type=int, default=6, help="most keys of a drill (each one asked)")
    ap.add_argument("--workers", type=int, default=None, help="processes generating retrieval documents")
    ap.add_argument("--max-files", type=int, default=None, help="cap stdlib files per split (quick runs)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir to measure needle lengths (else estimated)")
    ap.add_argument("--stdlib", default=None, help="stdlib dir (default: this Python's)")
    args = ap.parse_args(argv)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    root = args.stdlib
    tok = None
    if args.tokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        tok = HFTokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    lengths = [int(x) for x in args.needle_tokens.split(",") if x.strip()]

    train_files = load_stdlib("train", root, args.max_files)
    eval_files = load_stdlib("eval", root, args.max_files)
    all_train, all_eval = split_stdlib(root)
    train_fns = collect_functions(train_files)
    eval_fns = collect_functions(eval_files)

    rng = random.Random(args.seed)
    docs: list[str] = [stdlib_document(r, t) for r, t in train_files]
    n_think = 0
    for _ in range(args.n_chat):
        text, meta = chat_example(rng, train_fns)
        n_think += meta["thinking"]
        docs.append(text)
    for i in range(args.n_needle):
        n_tok = lengths[i % len(lengths)]
        if rng.random() < 0.2:
            prompt, ans = kv_recall_example(rng, max(4, n_tok // 24))
        else:
            prompt, ans = needle_example(rng, n_tok, tok, filler=train_files, n_distractors=rng.choice([0, 0, 1, 3]))
        docs.append(needle_chat_text(prompt, ans, rng, thinking=rng.random() < 0.5))
    rng.shuffle(docs)
    write_docs(os.path.join(args.out, "train.txt"), docs)
    n_retr = {}
    for name, n, spec, p_long in (("retrieval", args.n_retrieval, args.retrieval_tokens, 0.0),
                                  ("retrieval_long", args.n_retrieval_long, args.retrieval_long_tokens, 0.5)):
        lo, hi = _parse_range(spec)
        rdocs = parallel_retrieval_documents(f"{args.seed}-{name}", n, lo, hi, train_files, p_long=p_long,
                                             workers=args.workers)
        if name == "retrieval" and args.n_drill:
            dlo, dhi = _parse_range(args.drill_tokens)
            rdocs += parallel_retrieval_documents(f"{args.seed}-drill", args.n_drill, dlo, dhi, train_files,
                                                  workers=args.workers, drill_keys=args.drill_keys)
            random.Random(f"{args.seed}-mix").shuffle(rdocs)  # drills spread over the rows and the epoch
            n_retr["drill"] = args.n_drill
        write_docs(os.path.join(args.out, f"{name}.txt"), rdocs)
        n_retr[name] = len(rdocs)

    erng = random.Random(args.seed + 1_000_003)
    n_eval = {"stdlib": 0, "chat": 0, "needle": 0}
    with open(os.path.join(args.out, "eval.jsonl"), "w", encoding="utf-8") as fh:
        for r, t in eval_files:
            fh.write(json.dumps({"kind": "stdlib", "path": r, "text": stdlib_document(r, t)}, ensure_ascii=False)
                     + "\n")
            n_eval["stdlib"] += 1
        for _ in range(args.n_eval_chat):
            text, meta = chat_example(erng, eval_fns)
            fh.write(json.dumps({"kind": "chat", **meta, "text": text}, ensure_ascii=False) + "\n")
            n_eval["chat"] += 1
        for i in range(args.n_eval_needle):
            n_tok = lengths[i % len(lengths)]
            prompt, ans, meta = needle_example(erng, n_tok, tok, filler=eval_files, return_meta=True)
            rec = {"kind": "needle", "n_tokens_approx": n_tok, "depth": meta["depth"], "prompt": prompt,
                   "answer": ans, "text": render_chat([{"role": "user", "content": prompt}], enable_thinking=False)}
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n_eval["needle"] += 1

    with open(os.path.join(args.out, "split.json"), "w") as fh:
        json.dump({"rule": f"int(sha1(relpath).hexdigest(), 16) % {EVAL_MOD} == 0 -> eval",
                   "stdlib_dir": root or stdlib_dir(), "eval_files": all_eval, "n_train_files": len(all_train)},
                  fh, indent=1)
    stats = {
        "train_docs": len(docs), "train_stdlib_files": len(train_files), "train_chat": args.n_chat,
        "train_chat_thinking": n_think, "train_needle": args.n_needle, **{f"train_{k}": v for k, v in n_retr.items()},
        "train_bytes": os.path.getsize(os.path.join(args.out, "train.txt")),
        "train_functions": len(train_fns), "eval_functions": len(eval_fns),
        "eval": n_eval, "eval_bytes": os.path.getsize(os.path.join(args.out, "eval.jsonl")),
        "seconds": round(time.time() - t0, 1),
    }
    with open(os.path.join(args.out, "stats.json"), "w") as fh:
        json.dump(stats, fh, indent=1)
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
