"""llama.cpp GGUF files of the Qwen3.5/3.6 hybrid (``general.architecture = "qwen35"``) -> the target's params.

Read with the ``gguf`` package (``pip install 'dflash-jax[gguf]'``). Every tensor is dequantized on the host at
load (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; anything else is an error naming the tensor and its type),
then streamed through ``loader.stream_params`` like a safetensors checkpoint: cast to the activation dtype, or
re-quantized on the device: ``quantization="fp8"``, ``quantization="int8"`` (Q8_0's own layout, int8 with a scale
per 32 inputs: the Q8_0 tensors come back to the file's int8 values exactly; K-quants are re-rounded to 8 bits), or
``quantization="int4"`` (packed, two 4-bit values per byte, Q4_0's values with a float16 scale per 32 inputs: the
Q4_0 tensors come back to the file's 4-bit values and scales exactly, in float32 (in bfloat16 the values stay
exact and the scales are rounded to bfloat16, the activation dtype every tensor passes through on its way);
Q4_K's asymmetric sub-blocks (6-bit scale and min per 32) are re-rounded onto the symmetric 32-block grid, adding
at most half a step of it per element: see ``tests/test_gguf.py`` for the measured error). Q5_K / Q6_K stay
unpacked unless re-quantized (to int8 or int4).

What llama.cpp's converter (``convert_hf_to_gguf.py``, Qwen3Next -> Qwen3.5 classes) does to the HF tensors,
and what is undone here:

* names: ``blk.N.{attn_norm, post_attention_norm, ffn_gate|up|down, attn_q|k|v|output, attn_q_norm|k_norm,
  attn_qkv (in_proj_qkv), attn_gate (in_proj_z), ssm_beta (in_proj_b), ssm_alpha (in_proj_a), ssm_conv1d,
  ssm_a (A_log), ssm_dt.bias (dt_bias), ssm_norm, ssm_out}``, ``token_embd``, ``output_norm``, ``output``;
* zero-centred RMSNorm weights are stored as ``1 + w`` (every ``*norm.weight`` but the GDN output norm);
* ``A_log`` is stored as ``ssm_a = -exp(A_log)``;
* the conv weight is stored squeezed, ``[conv_dim, K]``;
* GDN value heads are re-ordered from HF's grouped order (value head ``j`` belongs to key head
  ``j // r``: ``[k0v0, k0v1, .., k0v(r-1), k1v0, ..]``) to a tiled order (``[k0v0, k1v0, .., k(K-1)v0, k0v1,
  ..]``) along the value-head axis of ``in_proj_qkv``'s V rows, ``in_proj_z`` rows, ``in_proj_a/b`` rows,
  ``A_log``, ``dt_bias``, the V channels of ``conv1d`` and the input columns of ``out_proj``. Left in the
  tiled order, value head j would read key head ``j % K`` instead of ``j // r`` (the GVA mapping breaks).

MTP blocks (``blk.N`` for N >= ``block_count - nextn_predict_layers``) are skipped.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import FULL, LINEAR, ConfigError, TargetConfig
from dflash_jax.models import loader
from dflash_jax.models.qwen36 import Params, param_shapes

ARCH = "qwen35"
# tensor types dequantized at load; everything else is rejected by name
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name -> (pytree path, fix): fix undoes the converter's change (see the module doc)
_TOP = {"token_embd.weight": (("embed",), None), "output_norm.weight": (("final_norm",), "norm"),
        "output.weight": (("lm_head",), None)}
_LAYER = {
    "attn_norm.weight": (("input_norm",), "norm"),
    "post_attention_norm.weight": (("post_norm",), "norm"),
    "ffn_gate.weight": (("mlp", "gate"), None),
    "ffn_up.weight": (("mlp", "up"), None),
    "ffn_down.weight": (("mlp", "down"), None),
}
_ATTN = {
    "attn_q.weight": (("attn", "q"), None),
    "attn_k.weight": (("attn", "k"), None),
    "attn_v.weight": (("attn", "v"), None),
    "attn_output.weight": (("attn", "o"), None),
    "attn_q_norm.weight": (("attn", "q_norm"), "norm"),
    "attn_k_norm.weight": (("attn", "k_norm"), "norm"),
}
_GDN = {
    "attn_qkv.weight": (("gdn", "qkv"), "qkv_rows"),
    "attn_gate.weight": (("gdn", "z"), "v_rows"),
    "ssm_beta.weight": (("gdn", "b"), "head_rows"),
    "ssm_alpha.weight": (("gdn", "a"), "head_rows"),
    "ssm_conv1d.weight": (("gdn", "conv"), "conv_rows"),
    "ssm_a": (("gdn", "A_log"), "a_log"),
    "ssm_dt.bias": (("gdn", "dt_bias"), "head_rows"),
    "ssm_norm.weight": (("gdn", "norm"), None),
    "ssm_out.weight": (("gdn", "out"), "v_cols"),
}


class GGUFError(ValueError):
    """A GGUF file this engine cannot load; the message names the key, tensor or type."""


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise GGUFError("loading .gguf files needs the 'gguf' package: pip install 'dflash-jax[gguf]'") from e
    return gguf


def name_map(cfg: TargetConfig) -> dict[str, tuple[tuple[Any, ...], str | None]]:
    """GGUF tensor name -> (path into the parameter pytree, fix)."""
    m = {k: v for k, v in _TOP.items() if k != "output.weight" or not cfg.tie_word_embeddings}
    for i, lt in enumerate(cfg.layer_types):
        for suffix, (path, fix) in (_LAYER | (_ATTN if lt == FULL else _GDN)).items():
            m[f"blk.{i}.{suffix}"] = (("layers", i) + path, fix)
    return m


# ---------------------------------------------------------------------------------------------
# value-head order
# ---------------------------------------------------------------------------------------------
def tiled_to_grouped(a: np.ndarray, axis: int, n_k: int, ratio: int, head_dim: int) -> np.ndarray:
    """Undo the converter's V-head re-order along ``axis`` (length ``n_k * ratio * head_dim``): tiled
    ``[ratio, n_k, head_dim]`` -> grouped ``[n_k, ratio, head_dim]``."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(ratio, n_k, head_dim, *rest).swapaxes(0, 1).reshape(n_k * ratio * head_dim, *rest)
    return np.moveaxis(a, 0, axis)


def grouped_to_tiled(a: np.ndarray, axis: int, n_k: int, ratio: int, head_dim: int) -> np.ndarray:
    """What the converter does: grouped ``[n_k, ratio, head_dim]`` -> tiled ``[ratio, n_k, head_dim]``."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_k, ratio, head_dim, *rest).swapaxes(0, 1).reshape(n_k * ratio * head_dim, *rest)
    return np.moveaxis(a, 0, axis)


def undo_fix(a: np.ndarray, fix: str | None, cfg: TargetConfig) -> np.ndarray:
    """Undo one converter change on a float32 host array (``fix`` from ``name_map``)."""
    nk, r, dv = cfg.lin_num_k_heads, cfg.gva_ratio, cfg.lin_v_dim
    if fix is None:
        return a
    if fix == "norm":
        return a - 1.0
    if fix == "a_log":
        return np.log(-tiled_to_grouped(a, 0, nk, r, 1))
    if fix == "head_rows":
        return tiled_to_grouped(a, 0, nk, r, 1)
    if fix == "v_rows":
        return tiled_to_grouped(a, 0, nk, r, dv)
    if fix == "v_cols":
        return tiled_to_grouped(a, 1, nk, r, dv)
    if fix in ("qkv_rows", "conv_rows"):
        k2 = 2 * cfg.key_dim
        return np.concatenate([a[:k2], tiled_to_grouped(a[k2:], 0, nk, r, dv)], axis=0)
    raise AssertionError(fix)


# ---------------------------------------------------------------------------------------------
# metadata -> config
# ---------------------------------------------------------------------------------------------
def _fields(reader) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except Exception:  # noqa: BLE001 - a value this loader never reads (odd array types)
            continue
    return out



def _rope_scaling(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """``rope_parameters`` keys for the file's rotary scaling: none, or YaRN from ``rope.scaling.type`` /
    ``factor`` / ``original_context_length`` (and the betas); attention-factor keys, whose meaning differs between
    llama.cpp and transformers, are refused rather than guessed."""
    kind = meta.get(f"{ARCH}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind != "yarn":
        raise GGUFError(f"{where}: {ARCH}.rope.scaling.type {kind!r} is not supported (none or 'yarn')")
    odd = [k for k in ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")
           if f"{ARCH}.rope.scaling.{k}" in meta]
    if odd:
        raise GGUFError(f"{where}: YaRN metadata {odd} is not supported; convert the checkpoint's config.json "
                        "instead (its rope_parameters carry the attention factor as transformers reads it)")
    out: dict[str, Any] = {"rope_type": "yarn"}
    for key, name, as_type in (("factor", "factor", float),
                               ("original_context_length", "original_max_position_embeddings", int),
                               ("yarn_beta_fast", "beta_fast", float), ("yarn_beta_slow", "beta_slow", float)):
        v = meta.get(f"{ARCH}.rope.scaling.{key}")
        if v is not None:
            out[name] = as_type(float(f"{float(v):.7g}"))
    return out

def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], where: str) -> tuple[TargetConfig, int]:
    """The ``TargetConfig`` a ``qwen35`` GGUF describes (metadata + tensor shapes) and its MTP block count."""
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{where}: general.architecture {arch!r} is not supported; only {ARCH!r} "
                        f"(Qwen3.5/3.6 dense hybrid, as llama.cpp's converter writes it)")

    def req(key: str) -> Any:
        k = f"{ARCH}.{key}"
        if k not in meta:
            raise GGUFError(f"{where}: missing metadata key {k!r}")
        return meta[k]

    n_mtp = int(meta.get(f"{ARCH}.nextn_predict_layers", 0) or 0)
    n_layers = int(req("block_count")) - n_mtp
    layer_types = [FULL if f"blk.{i}.attn_q.weight" in tensors else LINEAR for i in range(n_layers)]
    n_heads, n_kv = int(req("attention.head_count")), int(req("attention.head_count_kv"))
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{where}: missing tensor 'token_embd.weight'")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ne = [D, V]
    head_dim = meta.get(f"{ARCH}.attention.key_length")
    if head_dim is None:
        head_dim = int(req("embedding_length")) // n_heads
    head_dim = int(head_dim)
    q_rows = next((int(t.shape[-1]) for n, t in tensors.items() if n.endswith(".attn_q.weight")), None)
    n_v = int(req("ssm.time_step_rank"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    hf = {
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": int(req("embedding_length")),
        "intermediate_size": int(req("feed_forward_length")), "num_hidden_layers": n_layers,
        "layer_types": layer_types, "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
        "head_dim": head_dim, "partial_rotary_factor": int(req("rope.dimension_count")) / head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(f"{float(req('rope.freq_base')):.7g}"),
                            **_rope_scaling(meta, where)},
        "attn_output_gate": q_rows is None or q_rows == 2 * n_heads * head_dim,
        "linear_num_key_heads": int(req("ssm.group_count")), "linear_num_value_heads": n_v,
        "linear_key_head_dim": int(req("ssm.state_size")),
        "linear_value_head_dim": int(req("ssm.inner_size")) // n_v,
        "linear_conv_kernel_dim": int(req("ssm.conv_kernel")),
        # stored as float32: 7 significant digits give back the config's value (1e-6, not 9.99999997e-07)
        "rms_norm_eps": float(f"{float(meta.get(f'{ARCH}.attention.layer_norm_rms_epsilon', 1e-6)):.7g}"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "max_position_embeddings": int(req("context_length")),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    try:
        return TargetConfig.from_hf_dict(hf), n_mtp
    except ConfigError as e:
        raise GGUFError(f"{where}: metadata describes an unsupported model ({e})") from e


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def _dequantized(reader, cfg: TargetConfig, names: dict, n_layers: int, where: str
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 host array with the converter's changes undone), one tensor at a time."""
    gguf = _gguf()
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= n_layers:
            continue  # MTP block
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in SUPPORTED_TYPES:
            raise GGUFError(f"{where}: tensor {t.name!r} has type {qtype.name}, which this loader does not "
                            f"support (supported: {', '.join(SUPPORTED_TYPES)})")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        a = np.asarray(gguf.quants.dequantize(np.asarray(t.data), qtype), np.float32).reshape(shape)
        fix = names[t.name][1] if t.name in names else None
        yield t.name, undo_fix(a, fix, cfg)


def load_gguf(path: str | os.PathLike, dtype=jnp.bfloat16, quantization: str | None = None,
              place: loader.Placer | None = None) -> tuple[TargetConfig, Params, tuple[int, ...]]:
    """A ``qwen35`` GGUF file -> ``(config, params on the device, eos ids)``."""
    gguf = _gguf()
    p = os.fspath(path)
    where = f"GGUF {p!r}"
    reader = gguf.GGUFReader(p)
    tensors = {t.name: t for t in reader.tensors}
    cfg, _ = config_from_gguf(_fields(reader), tensors, where)
    names = name_map(cfg)
    tied = cfg.tie_word_embeddings
    tree = loader.stream_params(
        p, param_shapes(cfg, dtype), {n: path for n, (path, _) in names.items()}, lambda n: n, place,
        skip=lambda n: tied and n == "output.weight", where="GGUF file", config="its metadata",
        quantization=quantization, tensors=_dequantized(reader, cfg, names, cfg.num_layers, where))
    if tied:
        tree["lm_head"] = tree["embed"]
    return cfg, tree, cfg.eos_token_ids
