"""Packed tree attention over paged KV for Hopper, in Pallas Mosaic GPU (warpgroup MMA, TMA page copies).

The same contract as :func:`pallas_kernels.tree_attention.kernel.tree_attention` (bf16 / f16 pages; fp8 / int8
pages are the Triton kernel's), written the FlashAttention-3 way: a CTA holds two compute warpgroups of 64 query
rows each and one memory warpgroup that streams the K / V blocks of the prefix into a ring of shared-memory
slots with TMA, one copy per 16-token page (``k_pages[page, :, kv_head, :]``), while the compute warpgroups run
``wgmma`` on the slot before it. By default the two compute warpgroups also take the tensor cores in turn
(FA3's ping-pong, as in JAX's ``attention_mgpu``: a schedule barrier between one's score product and its
softmax, so one warpgroup's softmax runs under the other's products); each step's value product also covers the
wait for the next step's keys.

Rows: for (sequence b, KV head j) the ``N * G`` (tree node i, q head g) pairs, ``r = i * G + g``, padded to a
multiple of 128 (two warpgroups). They are gathered into ``[B, Hkv, R, D]`` before the kernel (a small copy: the
queries of a tree) so a warpgroup's 64 rows are one TMA box.

The ancestor mask rides in the tensor cores: the tree block's scores are ``q k_tree^T + onehot(node(r)) @ bias^T``
with ``bias[key, node] = 0`` where the key is visible to the node and ``-2^24`` elsewhere, so no mask tile is
loaded into registers. Prefix keys at or past the sequence's length, and keys of non-resident pages
(page-table entry < 0; the copy reads page 0 instead), are masked by position, only in the blocks that have such
keys (a scalar branch: a whole block of resident pages builds no mask). A row that sees no key at all
(its running max stays below half the scaled bias) returns zeros, as the reference does.

Grid ``(row_tiles, partitions, B * Hkv)``; with more than one prefix partition each CTA writes its normalised
partial output and log2-sum-exp and :func:`pallas_kernels.paged_decode.kernel.merge_partitions` merges them. The
tree's block is every partition's last step (static code: no wgmma under a branch) and counts in the last
partition only. A warpgroup whose 64 rows are all padding (rows 192-255 of a 32-node tree of the 27B) computes
nothing; it only releases each slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import registry
from pallas_kernels.paged_decode.kernel import LOG2E, MASK_VALUE, N_SM_TARGET, merge_partitions, split_blocks

WG_ROWS = 64  # query rows of one compute warpgroup (one wgmma M)
COMPUTE_WGS = 2
BLOCK_KV = 64  # keys a step; also the tree block (trees of <= 64 nodes)


def tree_bias(dtype) -> float:
    """The score added to an invisible tree key: exact in ``dtype`` and far below any real score (bf16: -2^24;
    f16, whose largest value is 65504: -2^15)."""
    return -float(2 ** 15) if jnp.dtype(dtype) == jnp.float16 else -float(2 ** 24)
SMEM_BUDGET = registry.SMEM_BUDGET_BYTES["sm_90"]  # the kernel runs on Hopper only


def smem_bytes(head_dim: int, itemsize: int, stages: int) -> int:
    """Shared memory of one CTA: q / out tiles, the K / V ring, the one-hot rows and the tree bias, lse rows."""
    q = COMPUTE_WGS * WG_ROWS * head_dim * itemsize
    kv = 2 * stages * BLOCK_KV * head_dim * itemsize
    mask = (COMPUTE_WGS * WG_ROWS + BLOCK_KV) * BLOCK_KV * itemsize
    return q + kv + mask + COMPUTE_WGS * WG_ROWS * 4


def plan(*, batch: int, n_tree: int, n_heads: int, n_kv_heads: int, head_dim: int, page_size: int, width: int,
         dtype, stages: int = 2, num_partitions: int | None = None, target_ctas: int = N_SM_TARGET) -> dict:
    """Static shapes of a launch; raises ValueError (before lowering) for what this kernel cannot take."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"tree_attention mosaic_gpu: pages of {jnp.dtype(dtype).name}; bf16 / f16 only "
                         "(quantized pages: the pallas_triton kernel)")
    if n_heads % n_kv_heads:
        raise ValueError(f"tree_attention mosaic_gpu: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if head_dim % 64:
        raise ValueError(f"tree_attention mosaic_gpu: head_dim={head_dim} must be a multiple of 64")
    if BLOCK_KV % page_size or page_size % 8:
        raise ValueError(f"tree_attention mosaic_gpu: page_size={page_size} must be a multiple of 8 dividing "
                         f"{BLOCK_KV}")
    if not 1 <= n_tree <= BLOCK_KV:
        raise ValueError(f"tree_attention mosaic_gpu: {n_tree} tree nodes; 1 to {BLOCK_KV}")
    if stages < 2:
        raise ValueError(f"tree_attention mosaic_gpu: stages={stages} must be >= 2")
    smem = smem_bytes(head_dim, jnp.dtype(dtype).itemsize, stages)
    if smem > SMEM_BUDGET:
        raise ValueError(f"tree_attention mosaic_gpu: {smem} bytes of shared memory (head_dim={head_dim}, "
                         f"stages={stages}) exceed {SMEM_BUDGET}; use fewer stages")
    g = n_heads // n_kv_heads
    rows = n_tree * g
    cta_rows = COMPUTE_WGS * WG_ROWS
    n_tiles = -(-rows // cta_rows)
    n_blocks = max(1, -(-width * page_size // BLOCK_KV))
    ctas = n_tiles * batch * n_kv_heads
    s, bpp = split_blocks(n_blocks, max(1, min(n_blocks, target_ctas // ctas)) if num_partitions is None
                          else int(num_partitions), "tree_attention mosaic_gpu")
    return dict(g=g, rows=rows, rows_padded=n_tiles * cta_rows, n_tiles=n_tiles, n_partitions=s,
                blocks_per_partition=bpp, pages_per_block=BLOCK_KV // page_size, smem_bytes=smem,
                ctas=ctas * s)


def _accumulate(acc: jax.Array, a: jax.Array, b_smem, a_smem) -> jax.Array:
    """``acc + a @ b`` by wgmma into the live accumulator, ``a`` from registers. ``a_smem`` (the Mosaic GPU
    interpreter, which takes neither an initialised accumulator nor a register operand; None on GPUs): ``a`` is
    staged there and the product goes to a fresh accumulator that is then added, the same sum."""
    if a_smem is not None:
        a_smem[...] = a

        def fresh(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_smem)
            return acc_ref[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

    def into(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)

    return pl.run_state(into)(plgpu.ACC.init(acc))


def _kernel(q_ref, k_ref, v_ref, kt_ref, vt_ref, onehot_ref, bias_ref, pt_ref, len_ref, o_ref, lse_ref, scoped, *,
            n_rows: int, n_kv_heads: int, page_size: int, width: int, blocks_per_partition: int, n_splits: int,
            stages: int, scale_log2: float, no_key: float, dtype, pingpong: bool, interpret: bool):
    (q_smem, oh_smem, bias_smem, k_smem, v_smem, lse_smem, *p_smem), bars, consumed, schedule = scoped
    k_bars, v_bars, q_bars, bias_bar = bars
    k_consumed, v_consumed = consumed
    p_smem = p_smem[0] if interpret else None
    tile, split, c = lax.axis_index("tile"), lax.axis_index("part"), lax.axis_index("bj")
    wg = lax.axis_index("wg")
    b, j = c // n_kv_heads, c % n_kv_heads
    ppb = BLOCK_KV // page_size
    d = q_smem.shape[-1]

    length = jnp.clip(len_ref[b], 0, width * page_size)
    n_blocks_seq = (length + BLOCK_KV - 1) // BLOCK_KV
    first = split * blocks_per_partition
    n_prefix = jnp.maximum(jnp.minimum(first + blocks_per_partition, n_blocks_seq) - first, 0)
    n_steps = n_prefix + 1  # the tree's block last, in every partition (static code); seen in the last one only
    is_last = split == n_splits - 1

    def page_of(i, p):
        return pt_ref[b, jnp.minimum((first + i) * ppb + p, width - 1)]

    row0 = tile * (COMPUTE_WGS * WG_ROWS) + wg * WG_ROWS

    def turn():  # FlashAttention-3's ping-pong: the two compute warpgroups take the tensor cores in turn
        if pingpong:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    def turn_arrive():
        if pingpong:
            plgpu.barrier_arrive(schedule)

    def turn_wait():
        if pingpong:
            plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _registers():
        plgpu.set_max_registers(232, action="increase")

    @pl.when((wg < COMPUTE_WGS) & (row0 >= n_rows))
    def _idle():  # a warpgroup of padding rows only (e.g. rows 192-255 of a 32-node tree): it keeps step with the
        pl.when(wg == 1)(turn)  # other on the ring and the schedule, releasing each slot once filled (arriving
        # ahead would complete a phase early)

        @pl.loop(0, n_steps)
        def _release(i):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(k_bars.at[slot])
            turn()
            plgpu.barrier_arrive(k_consumed.at[slot])
            turn_arrive()
            plgpu.barrier_wait(v_bars.at[slot])
            turn_wait()
            plgpu.barrier_arrive(v_consumed.at[slot])

    @pl.when((wg < COMPUTE_WGS) & (row0 < n_rows))
    def _compute():
        q_s, oh_s, lse_s = q_smem.at[wg], oh_smem.at[wg], lse_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, j, pl.ds(row0, WG_ROWS)], q_s, q_bars.at[wg])
        plgpu.copy_gmem_to_smem(onehot_ref.at[pl.ds(row0, WG_ROWS)], oh_s, q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[wg])

        def step(i, carry, *, tree: bool, mask):
            """Step i of the partition (its K / V in ring slot i % stages): scores, ``mask(scores)``, the online
            softmax and the value product. The K of step i is already waited for; this waits for step i + 1's
            under the value product (the tree step is the last)."""
            acc, m, l = carry
            slot = lax.rem(i, stages)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_smem.at[slot].transpose((1, 0)))
                if tree:  # + the ancestor bias of each row's node
                    plgpu.wgmma(acc_ref, oh_s, bias_smem.transpose((1, 0)))
                turn()
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, BLOCK_KV), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            sc = mask(sc * scale_log2)
            m_new = jnp.maximum(m, sc.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            probs = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = probs.astype(dtype)
            turn_arrive()  # done with the softmax
            plgpu.barrier_wait(v_bars.at[slot])
            turn_wait()  # the tensor cores are ours
            l = l * alpha + probs.sum(axis=1)

            if p_smem is not None:  # the interpreter (see _accumulate)
                acc = _accumulate(acc, p16, v_smem.at[slot], p_smem.at[wg])
                if not tree:
                    plgpu.barrier_wait(k_bars.at[lax.rem(i + 1, stages)])
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    if not tree:
                        plgpu.barrier_wait(k_bars.at[lax.rem(i + 1, stages)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l

        def prefix_mask(i):
            base = (first + i) * BLOCK_KV
            resident = [page_of(i, p) >= 0 for p in range(ppb)]
            whole = functools.reduce(jnp.logical_and, resident, base + BLOCK_KV <= length)

            def masked(sc):  # keys past the prefix and keys of non-resident pages (columns [cut, end of page))
                col = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
                sc = jnp.where(col < length - base, sc, MASK_VALUE)
                for p in range(ppb):
                    hi = (p + 1) * page_size
                    cut = jnp.where(resident[p], hi, p * page_size)
                    sc = jnp.where(col < cut, sc, jnp.where(col >= hi, sc, MASK_VALUE))
                return sc

            # most blocks are whole: no mask built for them
            return lambda sc: lax.cond(whole, lambda s_: s_, masked, sc)

        carry = (plgpu.layout_cast(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((WG_ROWS,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                 plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        plgpu.barrier_wait(k_bars.at[0])
        pl.when(wg == 1)(turn)
        carry = lax.fori_loop(0, n_prefix, lambda i, c: step(i, c, tree=False, mask=prefix_mask(i)), carry)
        plgpu.barrier_wait(bias_bar.at[0])
        # (no select with a scalar predicate under warpgroup semantics: the tree's keys count in the last
        # partition only by an added constant)
        acc, m, l = step(n_prefix, carry, tree=True, mask=lambda sc: sc + jnp.where(is_last, 0.0, MASK_VALUE))
        pl.when(wg == 0)(turn)

        has = m > no_key  # the row saw a key: its max is a real score, not a masked one
        inv = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
        q_s[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(q_s.dtype)
        lse_s[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)) * LOG2E, MASK_VALUE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, o_ref.at[b, split, j, pl.ds(row0, WG_ROWS)])
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, split, j, pl.ds(row0, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(bias_ref.at[b], bias_smem, bias_bar.at[0])

        def issue(i, src_k, src_v):
            slot = lax.rem(i, stages)
            for dst, bar, free, src in ((k_smem, k_bars, k_consumed, src_k), (v_smem, v_bars, v_consumed, src_v)):
                @pl.when(i >= stages)
                def _slot_free():
                    plgpu.barrier_wait(free.at[slot])

                for p in range(ppb):
                    plgpu.copy_gmem_to_smem(src(p), dst.at[slot, pl.ds(p * page_size, page_size)], bar.at[slot])

        @pl.loop(0, n_prefix)
        def _prefix(i):
            pages = [jnp.maximum(page_of(i, p), 0) for p in range(ppb)]  # non-resident: page 0, masked
            issue(i, lambda p: k_ref.at[pages[p], :, j], lambda p: v_ref.at[pages[p], :, j])

        issue(n_prefix, lambda p: kt_ref.at[b, j, pl.ds(p * page_size, page_size)],
              lambda p: vt_ref.at[b, j, pl.ds(p * page_size, page_size)])

        @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
        def _drain(i):  # every slot released before the CTA ends (no phase of a barrier left unobserved)
            plgpu.barrier_wait(k_consumed.at[lax.rem(i, stages)])
            plgpu.barrier_wait(v_consumed.at[lax.rem(i, stages)])


@functools.partial(jax.jit, static_argnames=("scale", "stages", "num_partitions", "target_ctas", "pingpong",
                                             "interpret"))
def tree_attention_mgpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                        start: jax.Array, k_tree: jax.Array, v_tree: jax.Array, ancestors: jax.Array, scale: float, *,
                        stages: int = 2, num_partitions: int | None = None, target_ctas: int = N_SM_TARGET,
                        pingpong: bool = True, interpret=False) -> jax.Array:
    """Tree queries over each sequence's paged prefix plus its own tree (``tree_attention_reference``'s contract).

    q [B, N, H, D]; k_pages, v_pages [n_pages, page_size, Hkv, D] (bf16 / f16); page_table [B, W] int32 (entry
    < 0: non-resident page); start [B] prefix lengths (clipped to [0, W * page_size]); k_tree, v_tree
    [B, N, Hkv, D]; ancestors [B, N, N] bool. Returns [B, N, H, D] in q's dtype. stages: K / V ring slots;
    num_partitions: prefix partitions (None: about ``target_ctas`` CTAs). pingpong: the two compute warpgroups
    take the tensor cores in turn (one's softmax under the other's products; False: each runs freely).
    interpret: the Mosaic GPU interpreter
    (CPU): True, or its ``InterpretGPUParams`` (e.g. ``detect_races=True``). Raises ValueError before lowering
    for shapes the kernel cannot take (see :func:`plan`)."""
    b, n, h, d = q.shape
    n_pages, page_size, hkv, dk = k_pages.shape
    if k_pages.shape != v_pages.shape or dk != d or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"tree_attention: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} disagree")
    if k_tree.shape != (b, n, hkv, d) or v_tree.shape != k_tree.shape or ancestors.shape != (b, n, n):
        raise ValueError(f"tree_attention: k_tree {k_tree.shape}, v_tree {v_tree.shape}, ancestors "
                         f"{ancestors.shape} do not fit q {q.shape} with {hkv} KV heads")
    width = page_table.shape[1]
    dt = k_pages.dtype
    pl_ = plan(batch=b, n_tree=n, n_heads=h, n_kv_heads=hkv, head_dim=d, page_size=page_size, width=width, dtype=dt,
               stages=stages, num_partitions=num_partitions, target_ctas=target_ctas)
    g, rows, rp, s = pl_["g"], pl_["rows"], pl_["rows_padded"], pl_["n_partitions"]

    qg = q.astype(dt).reshape(b, n, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rp - rows), (0, 0)))
    tree_pad = ((0, 0), (0, 0), (0, BLOCK_KV - n), (0, 0))
    kt = jnp.pad(k_tree.astype(dt).transpose(0, 2, 1, 3), tree_pad)  # [B, Hkv, 64, D]
    vt = jnp.pad(v_tree.astype(dt).transpose(0, 2, 1, 3), tree_pad)
    node = jnp.arange(rp) // g
    onehot = (node[:, None] == jnp.arange(BLOCK_KV)[None, :]).astype(dt)  # [R, 64]: row -> its node (none: pad)
    vis = jnp.zeros((b, BLOCK_KV, BLOCK_KV), bool).at[:, :n, :n].set(jnp.swapaxes(ancestors, 1, 2))
    bias = jnp.where(vis, 0.0, tree_bias(dt)).astype(dt)  # [B, key, node]
    pt = page_table.astype(jnp.int32)
    lens = start.astype(jnp.int32)

    kernel = functools.partial(
        _kernel, n_rows=rows, n_kv_heads=hkv, page_size=page_size, width=width,
        blocks_per_partition=pl_["blocks_per_partition"],
        n_splits=s, stages=stages, scale_log2=float(scale) * LOG2E,
        no_key=0.5 * tree_bias(dt) * float(scale) * LOG2E, dtype=dt, pingpong=pingpong, interpret=interpret)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, kt_ref, vt_ref, oh_ref, bias_ref, pt_ref, len_ref, o_ref, lse_ref):
        smem = (plgpu.SMEM((COMPUTE_WGS, WG_ROWS, d), dt, transforms=tiled),
                plgpu.SMEM((COMPUTE_WGS, WG_ROWS, BLOCK_KV), dt, transforms=tiled),
                plgpu.SMEM((BLOCK_KV, BLOCK_KV), dt, transforms=tiled),
                plgpu.SMEM((stages, BLOCK_KV, d), dt, transforms=tiled),
                plgpu.SMEM((stages, BLOCK_KV, d), dt, transforms=tiled),
                plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.float32),
                *([plgpu.SMEM((COMPUTE_WGS, WG_ROWS, BLOCK_KV), dt, transforms=tiled)] if interpret else []))
        ppb = pl_["pages_per_block"]
        bars = (plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),
                plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS),
                plgpu.Barrier(num_barriers=1))
        consumed = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2
        schedule = plgpu.Barrier(num_arrivals=COMPUTE_WGS)
        pl.run_scoped(lambda *a: kernel(q_ref, k_ref, v_ref, kt_ref, vt_ref, oh_ref, bias_ref, pt_ref, len_ref,
                                        o_ref, lse_ref, a), smem, bars, consumed, schedule, collective_axes="wg")

    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra["interpret"] = interpret if isinstance(interpret, InterpretGPUParams) else InterpretGPUParams()
    o, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((b, s, hkv, rp, d), dt), jax.ShapeDtypeStruct((b, s, hkv, rp), jnp.float32)),
        grid=(pl_["n_tiles"], s, b * hkv),
        grid_names=("tile", "part", "bj"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **extra,
    )(qg, k_pages, v_pages, kt, vt, onehot, bias, pt, lens)
    o = merge_partitions(o, lse, axis=1) if s > 1 else o[:, 0]  # [B, Hkv, R, D]
    o = o[:, :, :rows].reshape(b, hkv, n, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n, h, d)
    return o.astype(q.dtype)
