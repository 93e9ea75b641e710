"""Frozen model configuration, parsed from Hugging Face ``config.json`` files.

``TargetConfig`` describes the Qwen3.5/3.6 hybrid target (model_type ``qwen3_5``; the text config may be
nested under ``text_config``). Parsing is strict: an unknown model type, a missing key or an inconsistent
value raises ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

LINEAR = "linear_attention"
FULL = "full_attention"

TARGET_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class ConfigError(ValueError):
    """A config.json that this engine cannot serve; the message names the key."""


def _req(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing required key {key!r}")
    val = d[key]
    if kind is int and isinstance(val, bool) or not isinstance(val, kind):
        raise ConfigError(f"{where}: key {key!r} must be {getattr(kind, '__name__', kind)}, got {val!r}")
    return val


def _positive(val: int, key: str, where: str) -> int:
    if val <= 0:
        raise ConfigError(f"{where}: key {key!r} must be > 0, got {val}")
    return val


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """The text model of a Qwen3.5/3.6 hybrid (Gated DeltaNet + gated full attention)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attn_output_gate: bool
    # gated DeltaNet
    lin_num_k_heads: int
    lin_num_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    # ---- derived -------------------------------------------------------------------------------
    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def key_dim(self) -> int:
        return self.lin_num_k_heads * self.lin_k_dim

    @property
    def value_dim(self) -> int:
        return self.lin_num_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gva_ratio(self) -> int:
        return self.lin_num_v_heads // self.lin_num_k_heads

    @property
    def q_proj_dim(self) -> int:
        return self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """K and V of every full-attention layer for one token."""
        return 2 * len(self.attn_layers) * self.num_kv_heads * self.head_dim * itemsize

    def recurrent_bytes_per_seq(self, conv_itemsize: int = 2) -> int:
        """fp32 SSM state plus the conv window of every GDN layer for one sequence."""
        n = len(self.gdn_layers)
        ssm = n * self.lin_num_v_heads * self.lin_k_dim * self.lin_v_dim * 4
        conv = n * (self.conv_kernel - 1) * self.conv_dim * conv_itemsize
        return ssm + conv

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "TargetConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config.json: top level must be a JSON object, got {type(raw).__name__}")
        mt = raw.get("model_type")
        if mt not in TARGET_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {mt!r} is not supported for the target; expected one of "
                f"{TARGET_MODEL_TYPES} (Qwen3.5/Qwen3.6 hybrid checkpoints)")
        d = raw.get("text_config", raw) if mt == "qwen3_5" else raw
        if not isinstance(d, Mapping):
            raise ConfigError("config.json: key 'text_config' must be an object")
        w = "config.json text_config" if d is not raw else "config.json"

        n_layers = _positive(_req(d, "num_hidden_layers", int, w), "num_hidden_layers", w)
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"{w}: key 'full_attention_interval' must be a positive int, got {interval!r}")
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConfigError(f"{w}: key 'layer_types' must list {n_layers} entries (num_hidden_layers)")
        bad = sorted({t for t in layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ConfigError(f"{w}: key 'layer_types' has unsupported entries {bad}; expected {LINEAR!r}/{FULL!r}")

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{w}: key 'hidden_act' must be 'silu', got {act!r}")
        if d.get("attention_bias", False):
            raise ConfigError(f"{w}: key 'attention_bias' = true is not supported")
        if d.get("mlp_only_layers"):
            raise ConfigError(f"{w}: key 'mlp_only_layers' is not supported (dense hybrid only)")
        if "num_experts" in d and d.get("num_experts"):
            raise ConfigError(f"{w}: key 'num_experts' is set; mixture-of-experts Qwen3.5 variants are not supported")

        head_dim = _positive(_req(d, "head_dim", int, w), "head_dim", w)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{w}: key 'rope_parameters' must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"{w}: key 'rope_parameters.rope_type' = {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"{w}: key 'rope_parameters.rope_theta' must be a positive number, got {theta!r}")
        prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        if not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ConfigError(f"{w}: key 'partial_rotary_factor' must be in (0, 1], got {prf!r}")
        rotary_dim = int(head_dim * prf)
        if rotary_dim % 2 or rotary_dim <= 0:
            raise ConfigError(f"{w}: head_dim * partial_rotary_factor = {head_dim * prf} must be a positive even integer")
        section = rope.get("mrope_section")
        if section is not None and (not isinstance(section, list)
                                    or not all(isinstance(s, int) and not isinstance(s, bool) for s in section)):
            raise ConfigError(f"{w}: key 'rope_parameters.mrope_section' must be a list of ints, got {section!r}")
        if section is not None and sum(section) != rotary_dim // 2:
            raise ConfigError(f"{w}: key 'rope_parameters.mrope_section' {section} must sum to rotary_dim/2 = {rotary_dim // 2}")

        nh = _positive(_req(d, "num_attention_heads", int, w), "num_attention_heads", w)
        nkv = _positive(_req(d, "num_key_value_heads", int, w), "num_key_value_heads", w)
        if nh % nkv:
            raise ConfigError(f"{w}: num_attention_heads ({nh}) must be a multiple of num_key_value_heads ({nkv})")
        lk = _positive(_req(d, "linear_num_key_heads", int, w), "linear_num_key_heads", w)
        lv = _positive(_req(d, "linear_num_value_heads", int, w), "linear_num_value_heads", w)
        if lv % lk:
            raise ConfigError(f"{w}: linear_num_value_heads ({lv}) must be a multiple of linear_num_key_heads ({lk})")

        eos = d.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        tie = bool(raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False)))
        return cls(
            vocab_size=_positive(_req(d, "vocab_size", int, w), "vocab_size", w),
            hidden_size=_positive(_req(d, "hidden_size", int, w), "hidden_size", w),
            intermediate_size=_positive(_req(d, "intermediate_size", int, w), "intermediate_size", w),
            num_layers=n_layers,
            layer_types=tuple(layer_types),
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(theta),
            attn_output_gate=bool(d.get("attn_output_gate", True)),
            lin_num_k_heads=lk,
            lin_num_v_heads=lv,
            lin_k_dim=_positive(_req(d, "linear_key_head_dim", int, w), "linear_key_head_dim", w),
            lin_v_dim=_positive(_req(d, "linear_value_head_dim", int, w), "linear_value_head_dim", w),
            conv_kernel=_positive(_req({"linear_conv_kernel_dim": 4, **d}, "linear_conv_kernel_dim", int, w),
                                  "linear_conv_kernel_dim", w),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie,
            max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TargetConfig":
        """From a config.json file, or a checkpoint directory holding one."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.exists(p):
            raise ConfigError(f"no config.json at {p!r}; pass a Hugging Face checkpoint directory")
        try:
            with open(p) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_hf_dict(raw)


def read_generation_eos(path: str | os.PathLike) -> tuple[int, ...]:
    """EOS ids from a checkpoint's generation_config.json (empty if there is none)."""
    p = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.exists(p):
        return ()
    with open(p) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
