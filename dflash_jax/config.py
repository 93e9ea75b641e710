"""Frozen model configuration, parsed from Hugging Face ``config.json`` files.

``TargetConfig`` describes the Qwen3.5/3.6 hybrid target (model_type ``qwen3_5``; the text config may be
nested under ``text_config``). Parsing is strict: an unknown model type, a missing key or an inconsistent
value raises ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
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


def _req_positive(d: Mapping[str, Any], key: str, where: str) -> int:
    """A required int key that must be > 0."""
    return _positive(_req(d, key, int, where), key, where)


def _read_config_json(path: str | os.PathLike, kind: str) -> Any:
    """The parsed config.json at ``path`` (the file, or a ``kind`` checkpoint directory holding one)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.exists(p):
        raise ConfigError(f"no config.json at {p!r}; pass a {kind} checkpoint directory")
    try:
        with open(p) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from e


def _top_object(raw: Any, where: str) -> None:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: top level must be a JSON object, got {type(raw).__name__}")


def _check_layer_types(layer_types: Any, n_layers: int, allowed: tuple[str, str], where: str) -> tuple[str, ...]:
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"{where}: key 'layer_types' must list {n_layers} entries (num_hidden_layers)")
    bad = sorted({t for t in layer_types if t not in allowed}, key=str)
    if bad:
        raise ConfigError(f"{where}: key 'layer_types' has unsupported entries {bad}; "
                          f"expected {allowed[0]!r}/{allowed[1]!r}")
    return tuple(layer_types)


def _check_dense_silu(d: Mapping[str, Any], where: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: key 'hidden_act' must be 'silu', got {act!r}")
    if d.get("attention_bias", False):
        raise ConfigError(f"{where}: key 'attention_bias' = true is not supported")


def _rope(d: Mapping[str, Any], where: str, rope_types: tuple[str, ...] = ("default",)
          ) -> tuple[Mapping[str, Any], float]:
    """``(rope_parameters, rope_theta)``; ``rope_scaling`` and a top-level ``rope_theta`` are accepted."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{where}: key 'rope_parameters' must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in rope_types:
        raise ConfigError(f"{where}: key 'rope_parameters.rope_type' = {rope_type!r} is not supported "
                          f"(supported here: {', '.join(map(repr, rope_types))})")
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: key 'rope_theta' (or 'rope_parameters.rope_theta') must be a positive number, "
                          f"got {theta!r}")
    return rope, float(theta)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling (``rope_parameters.rope_type = "yarn"``), resolved as transformers resolves it.

    Rotary pair ``i`` (of ``rotary_dim // 2``) keeps its frequency where it turns more than ``beta_fast`` times
    over ``original_max_position_embeddings`` positions, is divided by ``factor`` where it turns fewer than
    ``beta_slow`` times, and blends the two linearly between (in pair index); cos and sin are multiplied by
    ``attention_factor`` (so q.k logits of the rotated dims by its square).
    """

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def keep(self, rotary_dim: int, theta: float) -> tuple[float, ...]:
        """Per rotary pair, the share of the unscaled frequency (1 = kept, 0 = divided by ``factor``)."""
        def pair(turns: float) -> float:
            return rotary_dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / (
                2 * math.log(theta))

        lo, hi = pair(self.beta_fast), pair(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001
        return tuple(1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(rotary_dim // 2))

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_parameters`` keys that give this scaling back (with ``rope_type`` and ``rope_theta``)."""
        return {"rope_type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "truncate": self.truncate}


def _yarn(rope: Mapping[str, Any], d: Mapping[str, Any], where: str) -> YarnScaling | None:
    """The YaRN scaling of ``rope_parameters`` (None unless its type is ``yarn``). Defaults as transformers':
    ``original_max_position_embeddings`` = ``max_position_embeddings``, ``factor`` = their ratio, attention
    factor ``0.1 ln(factor) + 1`` (or ``mscale`` / ``mscale_all_dim``'s ratio of that), betas 32 / 1."""
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return None
    k = "rope_parameters"
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta <= 1:
        raise ConfigError(f"{where}: key 'rope_theta' = {theta} must be > 1 with YaRN (its frequency bands are "
                          "placed by log(rope_theta))")

    def num(key: str, default: float | None) -> float | None:
        v = rope.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{where}: key '{k}.{key}' must be a positive number, got {v!r}")
        return float(v)

    orig = rope.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ConfigError(f"{where}: key '{k}.original_max_position_embeddings' (the length the model was trained "
                          f"at) must be a positive int, got {orig!r}")
    factor = num("factor", None)
    if factor is None:
        if not isinstance(d.get("max_position_embeddings"), int):
            raise ConfigError(f"{where}: key '{k}.factor' is missing and there is no max_position_embeddings to derive "
                              "it from (factor = max_position_embeddings / original_max_position_embeddings)")
        factor = d["max_position_embeddings"] / orig
    if factor < 1:
        raise ConfigError(f"{where}: key '{k}.factor' must be >= 1 (YaRN stretches the trained context), got {factor}")

    def mscale(s: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0

    att = num("attention_factor", None)
    if att is None:
        ms, ms_all = num("mscale", None), num("mscale_all_dim", None)
        att = mscale(ms) / mscale(ms_all) if ms and ms_all else mscale(1.0)
    fast, slow = num("beta_fast", 32.0), num("beta_slow", 1.0)
    if fast < slow:
        raise ConfigError(f"{where}: key '{k}.beta_fast' ({fast}) must be >= 'beta_slow' ({slow})")
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: key '{k}.truncate' must be true or false, got {truncate!r}")
    return YarnScaling(factor=factor, original_max_position_embeddings=orig, attention_factor=att,
                       beta_fast=fast, beta_slow=slow, truncate=truncate)


def _grouped_heads(d: Mapping[str, Any], heads_key: str, kv_key: str, where: str) -> tuple[int, int]:
    """Two positive head counts, the first a multiple of the second."""
    nh, nkv = _req_positive(d, heads_key, where), _req_positive(d, kv_key, where)
    if nh % nkv:
        raise ConfigError(f"{where}: {heads_key} ({nh}) must be a multiple of {kv_key} ({nkv})")
    return nh, nkv


def _qwen3_attention(d: Mapping[str, Any], where: str,
                     head_dim_missing: str = "hidden_size is not a multiple of heads") -> dict[str, Any]:
    """The attention geometry of a Qwen3 config: ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``
    (default ``hidden_size // num_attention_heads``), ``rope_theta`` and ``rope_scaling`` (YaRN, or None), as
    keyword arguments of a config class.

    ``head_dim_missing`` (a ``str.format`` template over ``hidden`` and ``nh``) ends the error raised when
    ``head_dim`` is absent and cannot be derived.
    """
    rope, theta = _rope(d, where, ("default", "yarn"))

    hidden = _req_positive(d, "hidden_size", where)
    nh, nkv = _grouped_heads(d, "num_attention_heads", "num_key_value_heads", where)
    head_dim = d.get("head_dim")
    if head_dim is None:
        if hidden % nh:
            detail = head_dim_missing.format(hidden=hidden, nh=nh)
            raise ConfigError(f"{where}: key 'head_dim' is missing and {detail}")
        head_dim = hidden // nh
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"{where}: key 'head_dim' must be a positive even int, got {head_dim!r}")
    return {"hidden_size": hidden, "num_heads": nh, "num_kv_heads": nkv, "head_dim": head_dim, "rope_theta": theta,
            "rope_scaling": _yarn(rope, d, where)}


def _rms_norm_eps(d: Mapping[str, Any], where: str) -> float:
    """Key ``rms_norm_eps`` (default 1e-6), a positive number."""
    eps = d.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"{where}: key 'rms_norm_eps' must be a positive number, got {eps!r}")
    return float(eps)


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
    # YaRN rotary scaling (None: plain rotary at rope_theta)
    rope_scaling: YarnScaling | None = None
    # layout of the GDN fused qkv channels (in_proj_qkv rows, conv1d rows, conv state): g groups, each
    # [q | k | v] of hk/g key heads and hv/g value heads. 1 = the checkpoint's [q | k | v]; tensor
    # parallelism sets g = tp so that each device's contiguous block holds whole heads of all three parts.
    gdn_qkv_groups: int = 1

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
        _top_object(raw, "config.json")
        mt = raw.get("model_type")
        if mt not in TARGET_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {mt!r} is not supported for the target; expected one of "
                f"{TARGET_MODEL_TYPES} (Qwen3.5/Qwen3.6 hybrid checkpoints)")
        d = raw.get("text_config", raw) if mt == "qwen3_5" else raw
        if not isinstance(d, Mapping):
            raise ConfigError("config.json: key 'text_config' must be an object")
        w = "config.json text_config" if d is not raw else "config.json"

        n_layers = _req_positive(d, "num_hidden_layers", w)
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"{w}: key 'full_attention_interval' must be a positive int, got {interval!r}")
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        layer_types = _check_layer_types(layer_types, n_layers, (LINEAR, FULL), w)

        _check_dense_silu(d, w)
        if d.get("mlp_only_layers"):
            raise ConfigError(f"{w}: key 'mlp_only_layers' is not supported (dense hybrid only)")
        if "num_experts" in d and d.get("num_experts"):
            raise ConfigError(f"{w}: key 'num_experts' is set; mixture-of-experts Qwen3.5 variants are not supported")

        head_dim = _req_positive(d, "head_dim", w)
        rope, theta = _rope(d, w, ("default", "mrope", "yarn"))
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

        nh, nkv = _grouped_heads(d, "num_attention_heads", "num_key_value_heads", w)
        lv, lk = _grouped_heads(d, "linear_num_value_heads", "linear_num_key_heads", w)

        eos = d.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        tie = bool(raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False)))
        return cls(
            vocab_size=_req_positive(d, "vocab_size", w),
            hidden_size=_req_positive(d, "hidden_size", w),
            intermediate_size=_req_positive(d, "intermediate_size", w),
            num_layers=n_layers,
            layer_types=layer_types,
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            attn_output_gate=bool(d.get("attn_output_gate", True)),
            lin_num_k_heads=lk,
            lin_num_v_heads=lv,
            lin_k_dim=_req_positive(d, "linear_key_head_dim", w),
            lin_v_dim=_req_positive(d, "linear_value_head_dim", w),
            conv_kernel=_req_positive({"linear_conv_kernel_dim": 4, **d}, "linear_conv_kernel_dim", w),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie,
            max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            rope_scaling=_yarn(rope, d, w),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TargetConfig":
        """From a config.json file, or a checkpoint directory holding one."""
        return cls.from_hf_dict(_read_config_json(path, "Hugging Face"))


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


# ---------------------------------------------------------------------------------------------------------------
# DFlash drafter
# ---------------------------------------------------------------------------------------------------------------
SLIDING = "sliding_attention"

DRAFTER_MODEL_TYPES = ("qwen3",)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The default target layers a drafter reads (z-lab / SpecForge ``build_target_layer_ids``).

    ``round(1 + i * (L - 4) / (n - 1))`` for i = 0..n-1; ``[L // 2]`` for a single draft layer.
    """
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return (L // 2,)
    return tuple(int(round(1 + i * (L - 4) / (n - 1))) for i in range(n))


def _int_list(val: Any, key: str, where: str) -> tuple[int, ...]:
    if not isinstance(val, list) or not val or not all(isinstance(v, int) and not isinstance(v, bool) for v in val):
        raise ConfigError(f"{where}: key {key!r} must be a non-empty list of ints, got {val!r}")
    return tuple(val)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash block drafter (HF ``model_type`` ``qwen3``, class ``DFlashDraftModel``).

    A small Qwen3-style transformer (plain RMSNorm, per-head q/k norm, full-dim NEOX RoPE, SwiGLU, no output
    gate) that shares the target's embedding and LM head and reads fused target features
    (``target_layer_ids``) through every layer's K/V. Layers are ``full_attention`` (bidirectional inside the
    block) or ``sliding_attention`` (causal inside the block, window ``sliding_window`` counting the query).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    num_target_layers: int | None = None
    vocab_size: int | None = None
    is_causal: bool | None = None  # None: per layer type (sliding causal, full bidirectional)
    rope_scaling: YarnScaling | None = None  # YaRN rotary scaling (None: plain rotary at rope_theta)
    # nats added per DDTree level to this drafter's log-probs (spec.ddtree's level bonus), calibrated on training
    # text; an inference setting, not architecture (``dflash_config.ddtree_level_bonus``, absent = 0)
    ddtree_level_bonus: float = 0.0

    # ---- derived -------------------------------------------------------------------------------
    @property
    def n_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in(self) -> int:
        return self.n_features * self.hidden_size

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Full-attention layers (their block queries see the whole context)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != SLIDING)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None for a full-attention layer)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def layer_causal(self, i: int) -> bool:
        """Whether block queries of layer ``i`` see only block keys at offsets <= their own."""
        return self.layer_types[i] == SLIDING if self.is_causal is None else self.is_causal

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Cached context K and V of every drafter layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    # ---- checks --------------------------------------------------------------------------------
    def validate_against(self, target: "TargetConfig") -> None:
        """Raise ConfigError unless this drafter can run on ``target``."""
        w = "drafter config.json"
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"{w}: key 'hidden_size' = {self.hidden_size} != the target's hidden_size "
                              f"{target.hidden_size} (the drafter shares the target's embedding and LM head)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(f"{w}: key 'dflash_config.target_layer_ids' has {bad} outside the target's "
                              f"{target.num_layers} layers")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            raise ConfigError(f"{w}: key 'num_target_layers' = {self.num_target_layers} != the target's "
                              f"num_hidden_layers {target.num_layers}")
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise ConfigError(f"{w}: key 'vocab_size' = {self.vocab_size} != the target's vocab_size "
                              f"{target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"{w}: key 'dflash_config.mask_token_id' = {self.mask_token_id} is outside the "
                              f"target's vocabulary ({target.vocab_size})")

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "DrafterConfig":
        w = "drafter config.json"
        _top_object(raw, w)
        mt = raw.get("model_type")
        if mt not in DRAFTER_MODEL_TYPES:
            raise ConfigError(f"{w}: key 'model_type' = {mt!r} is not supported for the drafter; expected one of "
                              f"{DRAFTER_MODEL_TYPES} (DFlash drafters)")
        d = raw
        dc = raw.get("dflash_config", {})
        if dc is None:
            dc = {}
        if not isinstance(dc, Mapping):
            raise ConfigError(f"{w}: key 'dflash_config' must be an object")
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if key in dc:
                raise ConfigError(f"{w}: key 'dflash_config.{key}' belongs to DFlash2 drafters, which are not supported")
        for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)):
            val = dc.get(key, d.get(key, default))
            if val not in (default, 0.0 if default is None else default):
                raise ConfigError(f"{w}: key {key!r} = {val!r} is not supported (only {default!r})")

        def dflash_value(key: str, default: Any = None) -> Any:
            """A dflash_config value, falling back to the top level; both present must agree."""
            if key in dc and key in d and dc[key] != d[key]:
                raise ConfigError(f"{w}: key 'dflash_config.{key}' = {dc[key]!r} disagrees with top-level "
                                  f"{key!r} = {d[key]!r}")
            return dc.get(key, d.get(key, default))

        n_layers = _req_positive(d, "num_hidden_layers", w)
        layer_types = d.get("layer_types")
        if layer_types is None:
            if d.get("use_sliding_window", False):
                raise ConfigError(f"{w}: key 'use_sliding_window' = true needs an explicit 'layer_types' list")
            layer_types = [FULL] * n_layers
        layer_types = _check_layer_types(layer_types, n_layers, (SLIDING, FULL), w)
        window = d.get("sliding_window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ConfigError(f"{w}: key 'sliding_window' must be a positive int or null, got {window!r}")
        if SLIDING in layer_types:
            if window is None:
                raise ConfigError(f"{w}: key 'sliding_window' is required when 'layer_types' has {SLIDING!r}")
            if d.get("use_sliding_window", True) is False:
                raise ConfigError(f"{w}: key 'use_sliding_window' = false contradicts {SLIDING!r} in 'layer_types'")

        _check_dense_silu(d, w)
        causal = d.get("is_causal")
        if causal is not None and not isinstance(causal, bool):
            raise ConfigError(f"{w}: key 'is_causal' must be a bool or null, got {causal!r}")

        attention = _qwen3_attention(d, w)

        block = dflash_value("block_size", 16)
        if isinstance(block, bool) or not isinstance(block, int) or block < 2:
            raise ConfigError(f"{w}: key 'block_size' must be an int >= 2, got {block!r}")
        mask_id = dflash_value("mask_token_id")
        if mask_id is None:
            raise ConfigError(f"{w}: missing required key 'dflash_config.mask_token_id'")
        if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0:
            raise ConfigError(f"{w}: key 'dflash_config.mask_token_id' must be a non-negative int, got {mask_id!r}")

        n_target = d.get("num_target_layers")
        if n_target is not None:
            if isinstance(n_target, bool) or not isinstance(n_target, int) or n_target <= 0:
                raise ConfigError(f"{w}: key 'num_target_layers' must be a positive int, got {n_target!r}")
        ids = dflash_value("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise ConfigError(f"{w}: missing key 'dflash_config.target_layer_ids' (and no 'num_target_layers' "
                                  "to derive it from)")
            if n_target < 4 and n_layers > 1:
                raise ConfigError(f"{w}: key 'num_target_layers' = {n_target} is too small to derive "
                                  "'dflash_config.target_layer_ids'; list them explicitly")
            ids = build_target_layer_ids(n_target, n_layers)
        else:
            ids = _int_list(ids, "dflash_config.target_layer_ids", w)
        if any(i < 0 for i in ids) or (n_target is not None and any(i >= n_target for i in ids)):
            raise ConfigError(f"{w}: key 'dflash_config.target_layer_ids' {list(ids)} must lie in "
                              f"[0, num_target_layers={n_target})")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{w}: key 'dflash_config.target_layer_ids' {list(ids)} has duplicates")

        vocab = d.get("vocab_size")
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0):
            raise ConfigError(f"{w}: key 'vocab_size' must be a positive int, got {vocab!r}")
        bonus = dc.get("ddtree_level_bonus", 0.0)
        if isinstance(bonus, bool) or not isinstance(bonus, (int, float)) or not math.isfinite(bonus):
            raise ConfigError(f"{w}: key 'dflash_config.ddtree_level_bonus' must be a finite number, got {bonus!r}")
        eps = _rms_norm_eps(d, w)
        return cls(
            **attention,
            intermediate_size=_req_positive(d, "intermediate_size", w),
            num_layers=n_layers,
            layer_types=layer_types,
            block_size=block,
            mask_token_id=mask_id,
            target_layer_ids=tuple(ids),
            sliding_window=window,
            rms_norm_eps=eps,
            num_target_layers=n_target,
            vocab_size=vocab,
            is_causal=causal,
            ddtree_level_bonus=float(bonus),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` of this drafter (``from_hf_dict(to_hf_dict()) == self``)."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling and self.rope_scaling.to_hf(),
            "sliding_window": self.sliding_window,
            "use_sliding_window": SLIDING in self.layer_types,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "tie_word_embeddings": False,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.ddtree_level_bonus:
            out["dflash_config"]["ddtree_level_bonus"] = self.ddtree_level_bonus
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "DrafterConfig":
        """From a drafter config.json file, or a checkpoint directory holding one."""
        return cls.from_hf_dict(_read_config_json(path, "DFlash drafter"))
