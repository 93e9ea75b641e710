"""Golden fixtures for the Qwen3.6 hybrid target, produced by Hugging Face transformers.

Builds tiny random checkpoints of the real Qwen3.5/3.6 structure (``Qwen3_5ForConditionalGeneration``
with a one-block vision tower, so the saved names are the real ``model.language_model.*`` plus
``model.visual.*``), saves them with ``save_pretrained`` and records, in fp32:

* full-sequence logits for a few prompts (lengths crossing transformers' 64-token GDN chunk),
* the hidden states of every decoder layer (``output_hidden_states``),
* the greedy continuation of 16 tokens from ``generate``.

Run where torch + transformers (>= 5) are installed, e.g. on the H200 test machine:

    python experiments/make_hf_fixtures.py --out tests/fixtures
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
import transformers
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

TINY_A_SHAPES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=32, linear_value_head_dim=32,
)

CASES = {
    # name: (text config overrides, shard size or None, prompt lengths)
    "qwen36_tiny_a": (
        dict(
            TINY_A_SHAPES,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
        ),
        None,
        [7, 64, 100],
    ),
    "qwen36_tiny_b": (
        dict(
            vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=6,
            linear_key_head_dim=32, linear_value_head_dim=32,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True),
        ),
        "1MB",
        [5, 64, 130],
    ),
    # YaRN over 32 trained positions, prompts up to 130: transformers' YaRN frequencies and attention factor
    "qwen36_tiny_yarn": (
        dict(
            TINY_A_SHAPES,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e4, partial_rotary_factor=0.5, factor=4.0,
                                 original_max_position_embeddings=32, mrope_section=[4, 2, 2],
                                 mrope_interleaved=True),
        ),
        None,
        [7, 64, 130],
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter non-trivial values (norm weights, A_log, dt_bias included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("A_log"):
                val = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=g))
            elif name.endswith("dt_bias"):
                val = 0.5 * torch.randn(shape, generator=g)
            elif name.endswith("linear_attn.norm.weight"):
                val = 1.0 + 0.2 * torch.randn(shape, generator=g)  # plain RMSNorm scale
            elif p.ndim == 1:
                val = 0.2 * torch.randn(shape, generator=g)  # zero-centred norms and biases
            elif "conv1d" in name:
                val = 0.4 * torch.randn(shape, generator=g)
            elif "embed_tokens" in name:
                val = 1.0 * torch.randn(shape, generator=g)
            else:
                fan_in = shape[-1] if p.ndim == 2 else math.prod(shape[1:])
                val = torch.randn(shape, generator=g) / math.sqrt(fan_in)
            p.copy_(val.to(p.dtype))


def build(name: str, text_overrides: dict, seed: int) -> Qwen3_5ForConditionalGeneration:
    vocab = text_overrides["vocab_size"]
    text = dict(
        max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
        linear_conv_kernel_dim=4, attention_bias=False, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
        attn_output_gate=True, full_attention_interval=4, mamba_ssm_dtype="float32",
    )
    text.update(text_overrides)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=64)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision,
                        image_token_id=vocab - 5, video_token_id=vocab - 4,
                        vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 2,
                        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                         torch_dtype=torch.float32)
    randomize_(model, seed)
    return model.eval().float()


def shipped_golden(ckpt: str, out: str, lengths: list[int], new_tokens: int, every: int = 128) -> None:
    """Logits of an exported target (the shipped tiny one) from transformers' ``Qwen3_5ForCausalLM``, its weights
    loaded from the checkpoint's ``model.language_model.*`` tensors (strict: every tensor used, none missing), on
    held-out needle prompts of ``lengths`` tokens (ids from the checkpoint's tokenizer); logits kept at every
    ``every``-th position and the last 8 (the fixture stays small), plus the greedy continuation."""
    import sys

    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dflash_jax.bench import needle
    from dflash_jax.models.loader import weights_sha256
    from dflash_jax.models.tokenizer import Tokenizer
    from experiments import corpus

    with open(os.path.join(ckpt, "config.json")) as f:
        raw = json.load(f)
    text = dict(raw.get("text_config", raw))
    text.pop("model_type", None)
    model = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**text), attn_implementation="eager",
                                            torch_dtype=torch.float32)
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    state = {}
    for fname in files:
        for k, v in load_file(os.path.join(ckpt, fname)).items():
            state[k.replace("model.language_model.", "model.")] = v.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"{ckpt}: tensors missing {missing}, unexpected {unexpected}")
    model = model.eval().float()
    tok = Tokenizer.from_dir(ckpt)
    _, ev = corpus.split_stdlib()
    held_out = [os.path.join(corpus.stdlib_dir(), f) for f in ev]
    record = {}
    for j, T in enumerate(lengths):
        [(ids, _, _)] = needle.bench_prompts(tok, held_out, T, 1, seed=j)
        ids = np.asarray(ids, np.int64)
        pos = np.unique(np.concatenate([np.arange(0, len(ids), every), np.arange(len(ids) - 8, len(ids))]))
        x = torch.from_numpy(ids)[None]
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0].float().numpy()
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=int(raw.get("text_config", raw).get("pad_token_id") or 0))
        record[f"p{j}.ids"] = ids.astype(np.int32)
        record[f"p{j}.positions"] = pos.astype(np.int32)
        record[f"p{j}.logits"] = logits[pos]
        record[f"p{j}.greedy"] = gen[0, len(ids):].numpy().astype(np.int32)
    np.savez_compressed(out + ".npz", **record)
    with open(out + ".json", "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "checkpoint": ckpt,
                   "weights_sha256": weights_sha256(ckpt),
                   "prompt_lengths": [int(len(record[f"p{j}.ids"])) for j in range(len(lengths))],
                   "rope_parameters": text.get("rope_parameters"), "new_tokens": new_tokens,
                   "command": f"python experiments/make_hf_fixtures.py --shipped {ckpt} --shipped-out {out}"},
                  f, indent=1)
    print(out, "ok", {k: v.shape for k, v in record.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (default: all)")
    ap.add_argument("--shipped", metavar="DIR", help="instead: golden logits of this exported target")
    ap.add_argument("--shipped-out", default="tests/fixtures/shipped_target_golden",
                    help="path stem of the --shipped fixture (.npz + .json)")
    ap.add_argument("--shipped-lengths", default="48,700,2600")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    if args.shipped:
        shipped_golden(args.shipped, args.shipped_out, [int(x) for x in args.shipped_lengths.split(",")],
                       args.new_tokens)
        return

    for i, (name, (overrides, shard, lengths)) in enumerate(CASES.items()):
        if args.case and name not in args.case:
            continue
        model = build(name, overrides, seed=1234 + i)
        ckpt = os.path.join(args.out, name)
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(ckpt, safe_serialization=True, **kw)
        vocab = overrides["vocab_size"]
        rng = np.random.default_rng(99 + i)
        record = {}
        for j, T in enumerate(lengths):
            ids = rng.integers(0, vocab - 8, size=T).astype(np.int64)
            x = torch.from_numpy(ids)[None]
            with torch.no_grad():
                out = model(input_ids=x, output_hidden_states=True, use_cache=False)
                gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                     max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=vocab - 1)
            record[f"p{j}.ids"] = ids.astype(np.int32)
            record[f"p{j}.logits"] = out.logits[0].float().numpy()
            # hidden_states[0] = embeddings, [l+1] = output of layer l, last = after the final norm
            record[f"p{j}.hidden"] = torch.stack(out.hidden_states)[:, 0].float().numpy()
            record[f"p{j}.greedy"] = gen[0, T:].numpy().astype(np.int32)
        np.savez_compressed(os.path.join(args.out, f"{name}_golden.npz"), **record)
        meta = {"transformers": transformers.__version__, "torch": torch.__version__,
                "prompt_lengths": lengths, "new_tokens": args.new_tokens,
                "fla_installed": _has_fla(), "command": "python experiments/make_hf_fixtures.py --out " + args.out}
        with open(os.path.join(args.out, f"{name}_golden.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(name, "ok", {k: v.shape for k, v in record.items()})


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
