"""The speculative step as one pure function: draft -> DDTree -> packed verify -> accept -> commit.

One executable per batch bucket does the whole round on the device; the host receives only the accepted
tokens. The drafter reads its context K/V from ``DraftKV`` pages (same page tables as the target), and the
commit appends the accepted positions' context K/V there, so nothing is recomputed across rounds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.engine import sampling
from dflash_jax.engine.sampling import TOP_LOGPROBS, SamplingArrays
from dflash_jax.models import attention, dflash, quant, qwen36
from dflash_jax.models.quant import QuantizedWeight
from dflash_jax.spec import ddtree, draft_vocab, verify
from dflash_jax.state import DraftKV, EngineState, TreeInput

DRAFT_HEAD, DRAFT_IDS = "draft_head", "draft_ids"  # drafter params entries of a drafting vocabulary


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of the speculative step (part of the compiled executable)."""

    budget: int = 22
    top_k: int | None = None
    # False: the paper's best-first tree (the budget's highest-scoring prefixes). True: the full top-1 chain first,
    # then best-first (tree ⊇ chain, never shorter than the chain on one draft; helps a noisy, e.g. 4-bit, target).
    # On the shipped pair the best-first tree accepts more at every budget (held-out, 416 blocks: 3.57 vs 3.42 at 22,
    # 2.83 vs 2.52 at 7): the chain leaves only budget - 15 nodes for branches
    chain_seed: bool = False
    # nats added to each tree level's draft log-prob (spec.ddtree's level bonus); None: the drafter's own
    # (DrafterConfig.ddtree_level_bonus, 0 unless its checkpoint carries one)
    level_bonus: float | None = None
    fast_rollback: bool = False  # commit by selecting the accepted node's kept state (one sequence; see commit_tree)
    # also return the drafter's anchor queries (SpecOutput.draft_query; KVFlash drafter scoring). Off by default:
    # the executable is then the plain round, with nothing extra computed or copied to the host
    draft_query: bool = False
    # cap on the tree tokens one round verifies over its batch bucket: a bucket of B rows gets the node budget
    # min(budget, max_verify_tokens // B - 1) (>= 1), so verify stays near the weight-streaming regime at large B
    # instead of turning compute-bound (B x (budget + 1) tokens through every matmul). None: budget at every B
    max_verify_tokens: int | None = None
    # the drafter's LM head over a set of frequent tokens only (spec.draft_vocab: an int N = ids 0..N-1, a file of
    # ids, or the ids); None: the whole vocabulary. Lossless either way; only what is drafted changes
    draft_vocab: int | str | tuple[int, ...] | None = None
    # the drafter's matmul weights and its drafting head (a quantized copy of the target's LM head rows it drafts
    # over, unless that head is quantized already) in this weight format (quant.QUANTIZATIONS: "fp8", "fp8_dynamic",
    # "int8", "int4"), whatever the target's; None: as the engine's ``quantization``. Lossless either way (the target verifies); only what is drafted
    # changes. The seed system drafts with a Q8_0 drafter
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.draft_vocab is not None:
            object.__setattr__(self, "draft_vocab", draft_vocab.normalise(self.draft_vocab))
        object.__setattr__(self, "draft_quantization", quant.check_quantization(self.draft_quantization))
        if self.budget < 1:
            raise ValueError(f"the DDTree budget must be >= 1, got {self.budget}")
        if self.max_verify_tokens is not None and self.max_verify_tokens < 2:
            raise ValueError(f"max_verify_tokens must be >= 2 (one root + one node), got {self.max_verify_tokens}")

    def bonus_for(self, dcfg: DrafterConfig) -> float:
        """The level bonus the trees take: ``level_bonus``, or the drafter's calibrated one when None."""
        return float(dcfg.ddtree_level_bonus if self.level_bonus is None else self.level_bonus)

    def budget_for(self, batch: int) -> int:
        """The node budget of a round over a bucket of ``batch`` rows (see ``max_verify_tokens``)."""
        if self.max_verify_tokens is None:
            return self.budget
        return max(1, min(self.budget, self.max_verify_tokens // max(1, batch) - 1))

    def for_batch(self, batch: int) -> "SpecConfig":
        """The static settings of the executable for a bucket of ``batch`` rows."""
        return dataclasses.replace(self, budget=self.budget_for(batch), max_verify_tokens=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInput:
    """[B] per row: the pending root token, its position (= tokens in the cache), slot, and whether the row is
    real; page_table [B, W]. ``proposal [B, L]`` (benchmarks only, ``EngineOptions.spec_oracle``): when given,
    ``spec_step`` verifies these proposals as a chain instead of drafting (``oracle_step``)."""

    root: jax.Array
    start: jax.Array
    slots: jax.Array
    active: jax.Array
    page_table: jax.Array
    proposal: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    """accepted [B, L+1]: tokens of the accepted path, root first (-1 padded); n_accepted [B] (root counted:
    tokens committed this round); bonus [B]: the target's token after the path (the next root); tree_nodes [B]
    valid draft nodes verified. Emitted this round: accepted[1:n_accepted] then bonus. draft_query
    [B, n_full*Hkv*hd] float32 (only with ``SpecConfig.draft_query``; None otherwise, and for oracle rounds, which
    do not draft): the anchor's queries of the drafter's full-attention layers, summed per KV group and scaled
    (``dflash.anchor_query``), the query KVFlash's drafter scoring ranks pages with."""

    accepted: jax.Array
    n_accepted: jax.Array
    bonus: jax.Array
    tree_nodes: jax.Array
    draft_query: jax.Array | None = None
    # the emitted tokens' log-probabilities under the target [B, L+1] (emitted token e: accepted[e + 1], or bonus at
    # e = n_accepted - 1) and each one's K most likely alternatives [B, L+1, K]; zeros when no row of the round
    # wants logprobs (SamplingArrays.want_logprobs)
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def write_draft_context(dcfg: DrafterConfig, dparams, dkv: DraftKV, feats: jax.Array, positions: jax.Array,
                        valid: jax.Array, page_table: jax.Array) -> DraftKV:
    """Append committed positions to the drafter's context cache.

    feats [B, T, n_feat * D] target features (concatenated in ``target_layer_ids`` order); positions, valid [B, T].
    """
    ctx = dflash.fuse(dparams, dcfg, feats)
    ks, vs = dflash.context_kv(dparams, dcfg, ctx, positions)
    out_k, out_v = [], []
    for kp, vp, k, v in zip(dkv.k, dkv.v, ks, vs):
        kp, vp = attention.write_kv(kp, vp, k, v, page_table, positions, valid)
        out_k.append(kp)
        out_v.append(vp)
    return DraftKV(tuple(out_k), tuple(out_v))


def features(feats: jax.Array) -> jax.Array:
    """[n_feat, B, T, D] (layer outputs) -> [B, T, n_feat * D], layers concatenated in order."""
    n, b, t, d = feats.shape
    return jnp.moveaxis(feats, 0, 2).reshape(b, t, n * d)


def _check(cfg: TargetConfig, dcfg: DrafterConfig) -> tuple[int, ...]:
    layers = tuple(dcfg.target_layer_ids)
    if list(layers) != sorted(layers):
        raise ValueError(f"drafter target_layer_ids {layers} must be increasing")
    dcfg.validate_against(cfg)
    return layers


def window_pages(window: int | None, page_size: int, width: int) -> int | None:
    """Pages that hold every context key a sliding layer of ``window`` can show a block (positions
    ``start - window + 1 .. start - 1``), or None where that is the whole table (a full layer, a short table)."""
    if window is None:
        return None
    n = -(-(window - 1) // page_size) + 1
    return n if n < width else None


def draft_context(dcfg: DrafterConfig, dkv: DraftKV, page_table: jax.Array, start: jax.Array,
                  windowed: bool = True) -> tuple[tuple, tuple, tuple, tuple]:
    """Each drafter layer's context for a draft step -> (k, v ``[B, C_i, Hkv, hd]``, positions, valid ``[B, C_i]``)
    per layer. A full layer gathers the whole page table (``C = W * page_size``); a sliding layer only the
    ``window_pages`` pages from the first one its window reaches (unless ``windowed=False``), so its gather and
    attention do not grow with the context. Layers of one window share positions and validity."""
    b, width = page_table.shape
    ps = dkv.k[0].shape[1]
    views: dict[int | None, tuple] = {}
    out_k, out_v, out_pos, out_valid = [], [], [], []
    for i, (kp, vp) in enumerate(zip(dkv.k, dkv.v)):
        n = window_pages(dcfg.layer_window(i), ps, width) if windowed else None
        key = None if n is None else dcfg.layer_window(i)
        if key not in views:
            if n is None:
                first, table = jnp.zeros((b,), jnp.int32), page_table
            else:
                lo = jnp.maximum(start - (dcfg.layer_window(i) - 1), 0) // ps
                first = jnp.clip(lo, 0, width - n).astype(jnp.int32)
                table = jnp.take_along_axis(page_table, first[:, None] + jnp.arange(n, dtype=jnp.int32)[None], axis=1)
            pos = first[:, None] * ps + jnp.arange(table.shape[1] * ps, dtype=jnp.int32)[None]
            views[key] = (table, pos, (pos < start[:, None]) & attention.resident_tokens(table, ps))
        table, pos, valid = views[key]
        out_k.append(attention.gather_pages(kp, table))
        out_v.append(attention.gather_pages(vp, table))
        out_pos.append(pos)
        out_valid.append(valid)
    return tuple(out_k), tuple(out_v), tuple(out_pos), tuple(out_valid)


def draft_tree(cfg: TargetConfig, dcfg: DrafterConfig, spec: SpecConfig, params, dparams, dkv: DraftKV,
               inp: SpecInput) -> tuple[ddtree.Tree, jax.Array | None]:
    """One drafter forward per row from the cached context -> (a DDTree of at most ``spec.budget`` nodes, the
    anchor queries ``[B, F]`` if ``spec.draft_query`` else None)."""
    ctx_k, ctx_v, ctx_pos, ctx_valid = draft_context(dcfg, dkv, inp.page_table, inp.start)
    blocks = dflash.make_blocks(dcfg, inp.root)
    head = dparams.get(DRAFT_HEAD, params["lm_head"])  # [Vh, D] with a drafting vocabulary, else the target's
    out = dflash.draft_forward(dparams, dcfg, params["embed"], head, blocks, inp.start,
                               ctx_k, ctx_v, ctx_pos, ctx_valid, with_query=spec.draft_query)
    logits, query = out if spec.draft_query else (out, None)
    logp = jax.nn.log_softmax(logits[:, 1:], axis=-1)
    tree = ddtree.build_tree(logp, spec.budget, spec.top_k, spec.chain_seed, spec.bonus_for(dcfg))
    if DRAFT_IDS in dparams:
        tree = dataclasses.replace(tree, tokens=to_vocab_ids(tree.tokens, dparams[DRAFT_IDS]))
    return tree.with_root(inp.root), query


def draft_head_rows(lm_head, ids):
    """The rows ``ids`` of the LM head ``[V, D]`` (an array or a ``QuantizedWeight``) -> the drafting head
    ``[Vh, D]`` of the same kind. Block-scaled weights keep their column blocks; their rows become blocks of one."""
    idx = jnp.asarray(ids, jnp.int32)
    if not isinstance(lm_head, QuantizedWeight):
        return jnp.take(jnp.asarray(lm_head), idx, axis=0)
    if lm_head.block is None:
        scale = jnp.take(lm_head.scale, idx, axis=0)
        block = None
    else:
        bo, bi = lm_head.block
        scale = jnp.take(lm_head.scale, idx // bo, axis=0)
        block = (1, bi)
    return QuantizedWeight(data=jnp.take(lm_head.data, idx, axis=0), scale=scale, block=block, dtype=lm_head.dtype,
                           packing=lm_head.packing, act=lm_head.act)


def to_vocab_ids(tokens: jax.Array, ids: jax.Array) -> jax.Array:
    """Drafting-set indices -> vocabulary ids; negative entries (a tree's root placeholder) stay as they are."""
    return jnp.where(tokens >= 0, jnp.take(ids, jnp.clip(tokens, 0, ids.shape[0] - 1)), tokens).astype(jnp.int32)


def with_draft_vocab(dparams: dict, lm_head, ids) -> dict:
    """The drafter's params plus a drafting vocabulary (``spec.draft_vocab``): the LM head's rows ``ids`` and the
    ids, which ``draft_tree`` drafts over instead of the whole head."""
    return {**dparams, DRAFT_HEAD: draft_head_rows(lm_head, ids), DRAFT_IDS: jnp.asarray(ids, jnp.int32)}


def with_draft_quantization(dparams: dict, lm_head, quantization: str) -> dict:
    """The drafter's params with its matmul weights in ``quantization`` (``SpecConfig.draft_quantization``; leaves
    quantized already stay) and a drafting head in it: the drafting vocabulary's rows (``with_draft_vocab``) if
    any, else a quantized copy of the target's whole LM head ``[V, D]``, which ``draft_tree`` then reads instead of
    the target's (none is made where that head is quantized already)."""
    dparams = quant.quantize_params(dparams, quantization)
    head = dparams.get(DRAFT_HEAD, lm_head)
    if not quant.is_quantized(head):
        dparams = {**dparams, DRAFT_HEAD: quant.quantize_params({"lm_head": head}, quantization)["lm_head"]}
    return dparams


def verify_commit(cfg: TargetConfig, dcfg: DrafterConfig, params, dparams, state: EngineState, dkv: DraftKV,
                  inp: SpecInput, samp: SamplingArrays, tree: ddtree.Tree, fast_rollback: bool = False,
                  draft_query: jax.Array | None = None, node_allow: jax.Array | None = None):
    """Verify B trees in one target pass, accept losslessly, commit target state and drafter context
    (``draft_query`` is passed through to the output). ``node_allow`` [B, N, V/32] uint32: each node's allowed
    next tokens (structured output; applied to the penalized rows, as every constrained row is)."""
    layers = _check(cfg, dcfg)
    valid = tree.valid & inp.active[:, None]
    parents = jnp.where(valid, tree.parent, -1).at[:, 0].set(-1)
    tin = TreeInput(tokens=tree.tokens, positions=ddtree.positions(tree, inp.start), parents=parents,
                    ancestors=tree.ancestors, valid=valid, start=inp.start, slots=inp.slots,
                    page_table=inp.page_table)
    h, scratch, feats = qwen36.forward_tree(params, cfg, tin, state.kv, state.rec, layers)
    logits = qwen36.lm_logits(params, h)  # [B, N, V]
    pen = state.pen
    if pen is not None:  # penalized rows: each node's logits as AR would adjust them after its path
        logits = sampling.penalize_tree(pen, inp.slots, tree.tokens, tree.ancestors, valid, samp,
                                        logits.astype(jnp.float32), node_allow)
    y = verify.sample_per_slot(logits, samp.temperature, samp.top_k, samp.top_p, samp.seed, samp.step, samp.min_p)
    slots, n_acc, bonus = verify.accept_sampled(tree, y)
    n_acc = jnp.where(inp.active, n_acc, 0)
    kv, rec = qwen36.commit_tree(cfg, state.kv, state.rec, tin, scratch, slots, n_acc, fast_rollback,
                                 qwen36.all_key_feedbacks(params, cfg))
    idx = jnp.clip(slots, 0, None)
    acc_feats = jnp.take_along_axis(features(feats), idx[:, :, None], axis=1)  # [B, L+1, F]
    l1 = slots.shape[1]
    pos = inp.start[:, None] + jnp.arange(l1, dtype=jnp.int32)[None]
    keep = jnp.arange(l1)[None] < n_acc[:, None]
    dkv = write_draft_context(dcfg, dparams, dkv, acc_feats, pos, keep, inp.page_table)
    toks = jnp.where(keep, jnp.take_along_axis(tree.tokens, idx, axis=1), -1)
    if pen is not None:  # the round's inputs (root and accepted nodes) are counted; the bonus is the next input
        pen = sampling.count_tokens(pen, inp.slots, toks, keep)
    lp, top_ids, top_lp = emitted_logprobs(logits, idx, toks, n_acc, bonus, samp.want_logprobs)
    out = SpecOutput(accepted=toks, n_accepted=n_acc, bonus=bonus,
                     tree_nodes=jnp.sum(valid[:, 1:], axis=1).astype(jnp.int32), draft_query=draft_query,
                     logprobs=lp, top_ids=top_ids, top_logprobs=top_lp)
    return EngineState(kv=kv, rec=rec, pen=pen), dkv, out


def emitted_logprobs(logits: jax.Array, path: jax.Array, toks: jax.Array, n_acc: jax.Array, bonus: jax.Array,
                     want: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of a round's emitted tokens under the target's distribution (before temperature and
    filtering, as the AR step reports them): logits [B, N, V], path [B, L+1] the accepted slots (clipped), toks
    [B, L+1] their tokens, n_acc / bonus [B]. Emitted token e is predicted at path[e]: toks[e + 1] while
    e + 1 < n_acc, then the bonus. Returns ([B, L+1], top ids [B, L+1, K], top log-probabilities), zeros unless
    some row ``want``s them."""
    b, l1 = path.shape
    k = min(TOP_LOGPROBS, logits.shape[-1])

    def compute(_):
        e = jnp.arange(l1)[None]
        nxt = jnp.concatenate([toks[:, 1:], jnp.zeros((b, 1), toks.dtype)], axis=1)
        emit = jnp.where(e + 1 < n_acc[:, None], nxt, bonus[:, None])
        logp = jax.nn.log_softmax(jnp.take_along_axis(logits, path[:, :, None], axis=1).astype(jnp.float32), -1)
        top_lp, top_ids = jax.lax.top_k(logp, k)
        lp = jnp.take_along_axis(logp, jnp.clip(emit, 0)[:, :, None], axis=-1)[..., 0]
        return lp, top_ids.astype(jnp.int32), top_lp

    zeros = (jnp.zeros((b, l1), jnp.float32), jnp.zeros((b, l1, k), jnp.int32), jnp.zeros((b, l1, k), jnp.float32))
    return jax.lax.cond(jnp.any(want), compute, lambda _: zeros, None)


def spec_step(cfg: TargetConfig, dcfg: DrafterConfig, spec: SpecConfig, params, dparams, state: EngineState,
              dkv: DraftKV, inp: SpecInput, samp: SamplingArrays):
    """One speculative round for B rows -> (state', dkv', SpecOutput). Lossless: the emitted tokens are
    distributed exactly as the target's own (greedy rows: identical to AR greedy)."""
    if inp.proposal is not None:
        return oracle_step(cfg, dcfg, spec, params, dparams, state, dkv, inp, samp, inp.proposal)
    tree, query = draft_tree(cfg, dcfg, spec, params, dparams, dkv, inp)
    return verify_commit(cfg, dcfg, params, dparams, state, dkv, inp, samp, tree, spec.fast_rollback, query)


def oracle_step(cfg: TargetConfig, dcfg: DrafterConfig, spec: SpecConfig, params, dparams, state: EngineState,
                dkv: DraftKV, inp: SpecInput, samp: SamplingArrays, proposal: jax.Array):
    """A speculative round whose tree comes from given proposals instead of the drafter (forced acceptance,
    for benchmarks): ``proposal [B, L]`` token ids at depths 1..L become a chain (the rest of the budget is
    filled from a flat distribution). Verification, acceptance and commit are the real ones."""
    tree = oracle_tree(cfg, spec, inp.root, proposal)
    return verify_commit(cfg, dcfg, params, dparams, state, dkv, inp, samp, tree, spec.fast_rollback)


def oracle_tree(cfg: TargetConfig, spec: SpecConfig, root: jax.Array, proposal: jax.Array) -> ddtree.Tree:
    """The tree of ``oracle_step``: ``proposal [B, L]`` as a chain under ``root [B]``."""
    onehot = jax.nn.one_hot(proposal, cfg.vocab_size, dtype=jnp.float32)
    logp = jax.nn.log_softmax(onehot * 20.0, axis=-1)
    return ddtree.build_tree(logp, spec.budget, spec.top_k, True).with_root(root)


# A round with constrained rows (structured output) runs in two steps with the host between them: ``draft_step``
# returns the tree, the host walks each constrained row's automaton along it to get every node's allowed tokens,
# and ``masked_verify_step`` verifies under those masks (the target never accepts a token its node disallows).


def draft_step(cfg: TargetConfig, dcfg: DrafterConfig, spec: SpecConfig, params, dparams, state: EngineState,
               dkv: DraftKV, inp: SpecInput, samp: SamplingArrays):
    """The draft half of a round -> (state, dkv, the rows' trees): state and drafter cache pass through unchanged
    (the step signature of the engine's executables)."""
    del samp
    if inp.proposal is not None:
        tree = oracle_tree(cfg, spec, inp.root, inp.proposal)
    else:
        tree, _ = draft_tree(cfg, dcfg, dataclasses.replace(spec, draft_query=False), params, dparams, dkv, inp)
    return state, dkv, tree


def masked_verify_step(cfg: TargetConfig, dcfg: DrafterConfig, spec: SpecConfig, params, dparams,
                       state: EngineState, dkv: DraftKV, inp: SpecInput, samp: SamplingArrays, tree: ddtree.Tree,
                       node_allow: jax.Array):
    """The verify half: ``tree`` from ``draft_step``, ``node_allow`` [B, N, V/32] uint32 each node's allowed next
    tokens (all ones on unconstrained rows). No drafter query is returned (KVFlash drafter scoring keeps its last
    ranking for these rows)."""
    return verify_commit(cfg, dcfg, params, dparams, state, dkv, inp, samp, tree, spec.fast_rollback,
                         node_allow=node_allow)
