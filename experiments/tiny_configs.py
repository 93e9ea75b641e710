"""Sizes of the shipped tiny model set, their Hugging Face ``config.json`` dicts, and the tiny dense scorer.

Presets (``PRESETS``) give every size knob of ``experiments/train_tiny.py``; command-line flags override them.

* ``tiny``  - the shipped set (trained on an H200; sized so the three checkpoints in bf16 with their tokenizers stay
  under 24 MB): vocabulary 4096, sequences of 2048; target hidden 256, 8 layers ``[GDN, GDN, GDN, attn] x 2``, 4/2
  attention heads x 64 with the output gate (full rotary, theta 1e4), GDN 2/6 heads x 64, ff 512; drafter 4
  layers ``[S x 3, F]`` (window 256, block 16, ff 384, target layers by the default rule); dense scorer hidden 128,
  2 layers, 4/2 heads x 32.
  Training (``train``): the target on synthetic copy rows of 128 alone (``target_copy``), then at 2048 (rows of
  stdlib + chat, each retrieval document and dense recall drill whole in a row, 10 % synthetic copy rows, assistant
  answers weighted 2x), then a long phase ``target_long`` at 8448 on rows each holding a long retrieval document;
  the drafter (on the target's rows, labels = the target's argmax, so retrieval haystacks are code to it); the
  scorer (copy rows alone first, then text with copy rows and answers weighted 2x). Each phase's
  ``minutes`` fits its step count to a time budget.
* ``smoke`` - the same structure at toy width, a small corpus and a few steps (CPU, about a minute).

The PFlash scorer is a plain Qwen3-style dense causal LM (reference §5): *plain* RMSNorm ``w * x / rms(x)`` (weights 1
at init), per-head q/k norm, full-dim NEOX RoPE, GQA, SwiGLU, untied head: ``dflash_jax.models.dense``, saved in the
layout of real Qwen3 checkpoints (``model_type`` ``qwen3``).
"""

from __future__ import annotations

import copy
from typing import Any


from dflash_jax.config import FULL, LINEAR, SLIDING, DrafterConfig, TargetConfig, build_target_layer_ids
from dflash_jax.models.dense import DenseConfig

# ---------------------------------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        # retrieval: 8000 documents of ~128-1700 tokens (bench-format needles, 1-6 keys, 1-4 questions), each whole
        # in a row of 2048; then 1500 of ~1024-7600 for the long phase (estimated lengths: a document longer than
        # its row is dropped); held-out needle accuracy at 1K / 8K on the bench's own prompts
        "data": {"max_files": None, "n_chat": 20000, "n_eval_chat": 500, "n_needle": 0, "n_eval_needle": 100,
                 "needle_tokens": "512,1024,2048", "vocab_size": 4096, "tok_max_mb": 16.0,
                 "n_retrieval": 8000, "retrieval_tokens": "128,1700", "n_retrieval_long": 1500,
                 "retrieval_long_tokens": "1024,7600", "retrieval_eval": "1024,8192", "n_retrieval_eval": 16,
                 "n_drill": 12000, "drill_tokens": "32,256", "drill_keys": 6},
        "seq_len": 2048,
        "target": {"hidden_size": 256, "num_layers": 8, "full_attention_interval": 4, "num_heads": 4,
                   "num_kv_heads": 2, "head_dim": 64, "lin_num_k_heads": 2, "lin_num_v_heads": 6, "lin_k_dim": 64,
                   "lin_v_dim": 64, "intermediate_size": 512, "conv_kernel": 4, "rope_theta": 1e4,
                   "partial_rotary_factor": 1.0, "max_position_embeddings": 32768},
        "drafter": {"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 384,
                    "sliding_window": 256, "block_size": 16, "rope_theta": 1e7},
        "scorer": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
                   "intermediate_size": 256, "rope_theta": 1e4, "max_position_embeddings": 32768},
        "train": {
            # "minutes": each phase's step count is fitted to this time budget on the machine it runs on
            # (train_tiny.run_phase); the report records the steps run.
            # copy rows alone first, at 128 tokens: on the GPU the shipped shape starts copying after ~1-1.5K such
            # steps with full rotary at theta 1e4 (0.95 of held-out copies at 1500), not within 3K at a quarter
            # rotary and theta 1e7 (0.27) (experiments/results/retrieval_proxy_*.md)
            "target_copy": {"seq_len": 128, "rows": 8000, "steps": 2000, "batch": 32, "lr": 3e-3, "warmup": 0.02,
                            "wd": 0.1, "clip": 1.0, "minutes": None},
            "target": {"steps": 3000, "batch": 16, "lr": 1e-3, "warmup": 0.01, "wd": 0.1, "clip": 1.0,
                       "minutes": 3.0, "answer_weight": 2.0, "copy_fraction": 0.1},
            # then the target continues at 8192 + 256 tokens (the 8K bench prompt and its answer fit a row) on
            # rows that each hold a long retrieval document, with YaRN over the 2048 positions it was trained at:
            # at plain rotary 456 such steps left the 8K needle at 0.125 (rotary pairs turning by angles never
            # seen before 2048); YaRN x4 alone, untrained, answered 0.81 of them
            "target_long": {"seq_len": 8448, "steps": 1000, "batch": 4, "lr": 3e-4, "warmup": 0.05, "wd": 0.1,
                            "clip": 1.0, "minutes": 3.5, "answer_weight": 4.0,
                            "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 2048}},
            # the drafter's loss was still falling after 2 minutes (2K steps, held-out tau 2.89)
            "drafter": {"steps": 8000, "batch": 8, "lr": 6e-4, "warmup": 0.04, "wd": 0.0, "clip": 1.0,
                        "anchors": 128, "gamma": 7.0, "minutes": 4.0},
            # the scorer too: PFlash finds a question's chunk through the scorer's attention, which needs a model
            # that retrieves; at rope theta 1e6 it did not copy after 1000 steps (induction 0.015 on the H200), so
            # theta 1e4 as the target (copies from ~1.5K steps) and 2500 steps
            "scorer_copy": {"seq_len": 128, "rows": 8000, "steps": 2500, "batch": 32, "lr": 3e-3, "warmup": 0.02,
                            "wd": 0.1, "clip": 1.0, "minutes": None},
            "scorer": {"steps": 3000, "batch": 16, "lr": 1e-3, "warmup": 0.01, "wd": 0.1, "clip": 1.0,
                       "minutes": 1.0, "answer_weight": 2.0, "copy_fraction": 0.1},
        },
        "eval": {"seqs": 48, "tau_seqs": 16, "tau_anchors": 16, "every": 500},
        "log_every": 20, "ckpt_every": 250,
    },
    "smoke": {
        "data": {"max_files": 6, "n_chat": 60, "n_eval_chat": 8, "n_needle": 4, "n_eval_needle": 2,
                 "needle_tokens": "96", "vocab_size": 384, "tok_max_mb": 0.5,
                 "n_retrieval": 12, "retrieval_tokens": "8,24", "n_retrieval_long": 6,
                 "retrieval_long_tokens": "40,90", "retrieval_eval": "160", "n_retrieval_eval": 2,
                 "n_drill": 6, "drill_tokens": "8,24", "drill_keys": 3},
        "seq_len": 256,
        "target": {"hidden_size": 32, "num_layers": 8, "full_attention_interval": 4, "num_heads": 2,
                   "num_kv_heads": 1, "head_dim": 16, "lin_num_k_heads": 1, "lin_num_v_heads": 3, "lin_k_dim": 16,
                   "lin_v_dim": 16, "intermediate_size": 64, "conv_kernel": 4, "rope_theta": 1e7,
                   "partial_rotary_factor": 0.25, "max_position_embeddings": 1024},
        "drafter": {"num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 64,
                    "sliding_window": 8, "block_size": 16, "rope_theta": 1e7},
        "scorer": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                   "intermediate_size": 64, "rope_theta": 1e6, "max_position_embeddings": 1024},
        "train": {
            "target_copy": {"seq_len": 64, "rows": 16, "steps": 3, "batch": 4, "lr": 1e-2, "warmup": 0.1, "wd": 0.1,
                            "clip": 1.0, "minutes": None},
            "target": {"steps": 12, "batch": 4, "lr": 1e-2, "warmup": 0.1, "wd": 0.1, "clip": 1.0, "minutes": None,
                       "answer_weight": 3.0, "copy_fraction": 0.2},
            "target_long": {"seq_len": 512, "steps": 4, "batch": 2, "lr": 3e-3, "warmup": 0.1, "wd": 0.1,
                            "clip": 1.0, "answer_weight": 3.0, "minutes": None,
                            "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                             "original_max_position_embeddings": 256}},
            "drafter": {"steps": 6, "batch": 2, "lr": 3e-3, "warmup": 0.1, "wd": 0.0, "clip": 1.0,
                        "anchors": 8, "gamma": 7.0},
            "scorer_copy": {"seq_len": 64, "rows": 16, "steps": 3, "batch": 4, "lr": 1e-2, "warmup": 0.1, "wd": 0.1,
                            "clip": 1.0, "minutes": None},
            "scorer": {"steps": 6, "batch": 4, "lr": 1e-2, "warmup": 0.1, "wd": 0.1, "clip": 1.0,
                       "answer_weight": 3.0, "copy_fraction": 0.2},
        },
        "eval": {"seqs": 4, "tau_seqs": 2, "tau_anchors": 4, "every": 0},
        "log_every": 2, "ckpt_every": 6,
    },
}


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


# ---------------------------------------------------------------------------------------------------------------------
# target and drafter configs (HF dicts, parsed back by dflash_jax.config)
# ---------------------------------------------------------------------------------------------------------------------

def target_hf_dict(t: dict[str, Any], vocab_size: int, eos_token_id: int | None = None,
                   pad_token_id: int | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    """A Qwen3.5/3.6 ``config.json`` (model_type ``qwen3_5``, nested ``text_config``) for preset section ``t``."""
    n, every = t["num_layers"], t.get("full_attention_interval", 4)
    layer_types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
    prf = t.get("partial_rotary_factor", 0.25)
    text = {
        "model_type": "qwen3_5_text",
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": dtype,
        "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "bos_token_id": None,
        "full_attention_interval": every, "layer_types": layer_types,
        "head_dim": t["head_dim"], "hidden_act": "silu", "hidden_size": t["hidden_size"],
        "initializer_range": 0.02, "intermediate_size": t["intermediate_size"],
        "linear_conv_kernel_dim": t.get("conv_kernel", 4), "linear_key_head_dim": t["lin_k_dim"],
        "linear_num_key_heads": t["lin_num_k_heads"], "linear_num_value_heads": t["lin_num_v_heads"],
        "linear_value_head_dim": t["lin_v_dim"], "mamba_ssm_dtype": "float32",
        "max_position_embeddings": t.get("max_position_embeddings", 4096), "mlp_only_layers": [],
        "mtp_num_hidden_layers": 0, "num_attention_heads": t["num_heads"], "num_hidden_layers": n,
        "num_key_value_heads": t["num_kv_heads"], "partial_rotary_factor": prf, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(t.get("rope_theta", 1e7)),
                            "partial_rotary_factor": prf, **(t.get("rope_scaling") or {})},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab_size,
    }
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": False}


def target_config(t: dict[str, Any], vocab_size: int, **kw: Any) -> TargetConfig:
    return TargetConfig.from_hf_dict(target_hf_dict(t, vocab_size, **kw))


def target_hf_dict_from_config(cfg: TargetConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``config.json`` dict of any ``TargetConfig`` (``TargetConfig.from_hf_dict`` of it gives ``cfg`` back)."""
    every = None
    attn = cfg.attn_layers
    if attn and all(t == (FULL if (i + 1) % (attn[0] + 1) == 0 else LINEAR) for i, t in enumerate(cfg.layer_types)):
        every = attn[0] + 1
    eos = list(cfg.eos_token_ids)
    t = {"num_layers": cfg.num_layers, "full_attention_interval": every or 4, "num_heads": cfg.num_heads,
         "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "lin_num_k_heads": cfg.lin_num_k_heads,
         "lin_num_v_heads": cfg.lin_num_v_heads, "lin_k_dim": cfg.lin_k_dim, "lin_v_dim": cfg.lin_v_dim,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "conv_kernel": cfg.conv_kernel,
         "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
         "max_position_embeddings": cfg.max_position_embeddings,
         "rope_scaling": cfg.rope_scaling and cfg.rope_scaling.to_hf()}
    d = target_hf_dict(t, cfg.vocab_size, eos_token_id=(eos[0] if len(eos) == 1 else (eos or None)),
                       pad_token_id=cfg.pad_token_id, dtype=dtype)
    d["text_config"]["layer_types"] = list(cfg.layer_types)
    d["text_config"]["rms_norm_eps"] = cfg.rms_norm_eps
    d["text_config"]["attn_output_gate"] = cfg.attn_output_gate
    d["tie_word_embeddings"] = d["text_config"]["tie_word_embeddings"] = cfg.tie_word_embeddings
    back = TargetConfig.from_hf_dict(d)
    if back != cfg:
        raise ValueError(f"config.json round trip changed the config: {back} != {cfg}")
    return d


def drafter_config(d: dict[str, Any], target: TargetConfig, mask_token_id: int) -> DrafterConfig:
    """Drafter of preset section ``d`` for ``target``: ``[sliding x (n-1), full]`` layers, target layers by the
    default rule (``build_target_layer_ids``), the target's hidden size and vocabulary."""
    n = d["num_layers"]
    types = tuple([SLIDING] * (n - 1) + [FULL]) if d.get("sliding_window") else (FULL,) * n
    cfg = DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=d["intermediate_size"], num_layers=n, layer_types=types,
        num_heads=d["num_heads"], num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"],
        rope_theta=float(d.get("rope_theta", 1e7)), block_size=d.get("block_size", 16), mask_token_id=mask_token_id,
        target_layer_ids=build_target_layer_ids(target.num_layers, n), sliding_window=d.get("sliding_window"),
        num_target_layers=target.num_layers, vocab_size=target.vocab_size)
    assert DrafterConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    cfg.validate_against(target)
    return cfg


# ---------------------------------------------------------------------------------------------------------------------
# the tiny dense scorer (plain Qwen3 causal LM)
# ---------------------------------------------------------------------------------------------------------------------

def dense_config(s: dict[str, Any], vocab_size: int, *, eos_token_id: int | None = None,
                 pad_token_id: int | None = None) -> DenseConfig:
    """The scorer preset -> the library's ``DenseConfig`` (a plain Qwen3 dense causal LM, untied head)."""
    return DenseConfig.from_hf_dict({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
        "vocab_size": vocab_size, "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_layers"], "num_attention_heads": s["num_heads"],
        "num_key_value_heads": s["num_kv_heads"], "head_dim": s["head_dim"], "rms_norm_eps": 1e-6,
        "rope_theta": float(s.get("rope_theta", 1e6)), "tie_word_embeddings": False,
        "max_position_embeddings": s.get("max_position_embeddings", 4096),
        "eos_token_id": eos_token_id, "pad_token_id": pad_token_id})

