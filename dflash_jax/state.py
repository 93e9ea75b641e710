"""Device state of the engine as registered dataclass pytrees, donated to every step.

Layer-indexed state is a tuple with one array per layer (not one stacked array): the model is unrolled
over layers (DESIGN.md §8), so each layer reads and updates its own buffer with static indexing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.kv import quant as kv_quant


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class KVPages:
    """K/V of the full-attention layers in fixed-size pages; page 0 is the null page.

    k[i], v[i]: [n_pages, page_size, n_kv_heads, head_dim] for the i-th full-attention layer.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def n_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def zeros(cls, cfg: TargetConfig, n_pages: int, page_size: int, dtype=jnp.bfloat16,
              compute_dtype=None) -> "KVPages":
        """Pages in ``dtype``; fp8 / int8 give ``kv.quant.QuantizedPages`` read back in ``compute_dtype``."""
        shape = (n_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        n = len(cfg.attn_layers)
        cd = compute_dtype or jnp.bfloat16
        return cls(k=tuple(kv_quant.zeros(shape, dtype, cd) for _ in range(n)),
                   v=tuple(kv_quant.zeros(shape, dtype, cd) for _ in range(n)))


@_pytree
class RecurrentSlots:
    """Gated DeltaNet state per sequence slot; slot 0 is the null slot.

    conv[i]: [n_slots, conv_kernel - 1, conv_dim] pre-conv rows (activation dtype).
    ssm[i]:  [n_slots, lin_num_v_heads, lin_k_dim, lin_v_dim] float32 (float64 for a float64 model).
    """

    conv: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]

    @property
    def n_slots(self) -> int:
        return self.ssm[0].shape[0]

    @classmethod
    def zeros(cls, cfg: TargetConfig, n_slots: int, dtype=jnp.bfloat16) -> "RecurrentSlots":
        n = len(cfg.gdn_layers)
        conv = (n_slots, cfg.conv_kernel - 1, cfg.conv_dim)
        ssm = (n_slots, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim)
        return cls(conv=tuple(jnp.zeros(conv, dtype) for _ in range(n)),
                   ssm=tuple(jnp.zeros(ssm, jnp.promote_types(dtype, jnp.float32)) for _ in range(n)))


@_pytree
class SlotPenalties:
    """What the sampling penalties and ``logit_bias`` of each slot's request need over the vocabulary (slot 0
    null); written at admission for requests that use them (``set_row``), counted by every decode step.

    counts: [n_slots, V] int32 tokens the request has generated (frequency / presence / repetition penalties);
    prompt: [n_slots, V] bool tokens of its prompt (repetition penalty); bias: [n_slots, V] float32 its logit_bias;
    allow: [n_slots, ceil(V / 32)] uint32 bitmask of the tokens its structured-output automaton allows next (bit
    i % 32 of word i // 32; all set for an unconstrained request).
    """

    counts: jax.Array
    prompt: jax.Array
    bias: jax.Array
    allow: jax.Array

    @classmethod
    def zeros(cls, n_slots: int, vocab: int) -> "SlotPenalties":
        return cls(counts=jnp.zeros((n_slots, vocab), jnp.int32), prompt=jnp.zeros((n_slots, vocab), jnp.bool_),
                   bias=jnp.zeros((n_slots, vocab), jnp.float32),
                   allow=jnp.full((n_slots, -(-vocab // 32)), 0xFFFFFFFF, jnp.uint32))

    @staticmethod
    def bytes_per_slot(vocab: int) -> int:
        return vocab * (4 + 1 + 4) + 4 * -(-vocab // 32)

    def set_row(self, at: tuple, prompt: jax.Array, bias: jax.Array, allow: jax.Array) -> "SlotPenalties":
        """Start a request in row ``at`` (``(slot,)``, or ``(replica, slot)`` with a leading replica axis): no
        tokens generated, ``prompt [V]`` bool, ``bias [V]`` float32, ``allow [V / 32]`` uint32."""
        return SlotPenalties(counts=self.counts.at[at].set(0), prompt=self.prompt.at[at].set(prompt),
                             bias=self.bias.at[at].set(bias), allow=self.allow.at[at].set(allow))

    def set_allow(self, at: tuple, allow: jax.Array) -> "SlotPenalties":
        """The tokens row ``at``'s automaton allows next (``[V / 32]`` uint32 bitmask)."""
        return dataclasses.replace(self, allow=self.allow.at[at].set(allow))


@_pytree
class EngineState:
    """Everything durable on the device: paged KV, recurrent slots and (optionally) the slots' sampling-penalty
    statistics."""

    kv: KVPages
    rec: RecurrentSlots
    pen: SlotPenalties | None = None

    @classmethod
    def zeros(cls, cfg: TargetConfig, *, n_pages: int, page_size: int, n_slots: int,
              dtype=jnp.bfloat16, kv_dtype=None, penalties: bool = False) -> "EngineState":
        """Zero state; K/V pages in ``kv_dtype`` (default ``dtype``; fp8 / int8 quantized, read in ``dtype``);
        ``penalties``: with ``SlotPenalties`` tables over the vocabulary."""
        return cls(kv=KVPages.zeros(cfg, n_pages, page_size, kv_dtype or dtype, compute_dtype=dtype),
                   rec=RecurrentSlots.zeros(cfg, n_slots, dtype),
                   pen=SlotPenalties.zeros(n_slots, cfg.vocab_size) if penalties else None)


@_pytree
class StepInput:
    """One step's inputs for a batch bucket of B rows and T tokens per row (right padded).

    tokens, positions: [B, T] int32; n_valid: [B] int32 tokens of each row that are real (0 for an
    empty row); slots: [B] int32 recurrent slot per row (0 = null); page_table: [B, W] int32 physical
    pages of each row's sequence (0-padded).
    """

    tokens: jax.Array
    positions: jax.Array
    n_valid: jax.Array
    slots: jax.Array
    page_table: jax.Array

    @property
    def valid(self) -> jax.Array:
        """[B, T] bool mask of real tokens."""
        t = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)
        return t[None, :] < self.n_valid[:, None]


@_pytree
class TreeInput:
    """One verification pass over B token trees of N slots (slot 0 = root, parents precede children).

    tokens, positions, parents (-1 for root and padding), valid: [B, N]; ancestors: [B, N, N] bool
    (j is i or an ancestor of i); start: [B] position of each root (= tokens already in the cache);
    slots: [B]; page_table: [B, W]. Positions are start + depth. Nothing durable is written by a
    verification pass: the tree's K/V and recurrent quantities come back as scratch for the commit.
    """

    tokens: jax.Array
    positions: jax.Array
    parents: jax.Array
    ancestors: jax.Array
    valid: jax.Array
    start: jax.Array
    slots: jax.Array
    page_table: jax.Array


@_pytree
class DraftKV:
    """The drafter's cached context K/V per sequence, in pages addressed by the target's page tables.

    k[i], v[i]: [n_pages, page_size, drafter kv heads, drafter head_dim] for drafter layer i (k-normed, RoPE'd):
    the projection of the fused target features of every committed position, computed once.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, dcfg, n_pages: int, page_size: int, dtype=jnp.bfloat16, compute_dtype=None) -> "DraftKV":
        shape = (n_pages, page_size, dcfg.num_kv_heads, dcfg.head_dim)
        cd = compute_dtype or jnp.bfloat16
        return cls(k=tuple(kv_quant.zeros(shape, dtype, cd) for _ in range(dcfg.num_layers)),
                   v=tuple(kv_quant.zeros(shape, dtype, cd) for _ in range(dcfg.num_layers)))
