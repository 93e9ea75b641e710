"""Scale-out on ``jax.sharding``: the ``(data, model)`` mesh, the tensor-parallel plan of a target config,
partition specs for every parameter and state array, and the load-time re-layout that makes them split evenly.

Tensor parallelism (the ``model`` axis, Megatron layout). Column-parallel projections split their output rows
by whole heads (attention q/gate, k, v; GDN qkv, z, b, a) or by MLP column (gate, up); the row-parallel
projection that follows (attention o, GDN out, MLP down) splits its input columns the same way, so a layer's
only collective is one all-reduce of its ``[B, T, D]`` output. Embedding and LM head split the vocabulary
(a masked local lookup + all-reduce; logits come out vocabulary-split). KV pages split by KV head, GDN state by
value head (SSM) and channel (conv). Norm weights and everything of size D stay replicated.

Two re-layouts at load make every split land on whole heads; the model code sees them only through its config
(``TargetConfig.num_kv_heads`` and ``gdn_qkv_groups``, see ``ShardPlan.model_config``):

* GDN's fused ``in_proj_qkv`` (and ``conv1d``) rows are ``[q | k | v]``; they are permuted to ``tp`` groups of
  ``[q_j | k_j | v_j]`` so device j's contiguous block holds its key heads and the value heads that read them.
* Fewer KV heads than ``tp`` (e.g. 4 KV heads over TP=8): each KV head's k/v rows are repeated ``tp / Hkv``
  times so every device holds exactly the one KV head its query heads read (the cache per device is one head).

A part that cannot split evenly (query heads not divisible by ``tp``, KV heads neither dividing nor divided by
``tp``, key heads of GDN, MLP width, vocabulary) is replicated and computed redundantly on every device of the
``model`` axis; ``ShardPlan.notes`` says which, for the start-up log.

Data parallelism (the ``data`` axis): ``dp`` independent replicas of the batch in one SPMD program. State and
step inputs carry a leading ``[dp]`` replica axis split over ``data``, and the step is manual over ``data``
(``shard_map``, the ``model`` axis left to the partitioner), so no collective ever crosses replicas; each replica
owns its own slots and pages (the host keeps one page allocator per replica and admits a request to the least
loaded replica). Parameters are replicated over ``data``.

Multi-host: ``initialize_distributed()`` calls ``jax.distributed.initialize`` when ``JAX_COORDINATOR_ADDRESS``
is set (with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; without them JAX auto-detects SLURM / Open MPI /
cloud TPU); ``jax.devices()`` is then the global device list and parameters are placed with
``jax.make_array_from_callback`` (each process writes only its own shards).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.config import TargetConfig
from dflash_jax.models.quant import QuantizedWeight

DATA, MODEL = "data", "model"
log = logging.getLogger(__name__)


class ShardingError(ValueError):
    """A mesh or plan that cannot be built; the message says what to change."""


# ---------------------------------------------------------------------------------------------
# mesh
# ---------------------------------------------------------------------------------------------
def initialize_distributed() -> bool:
    """Join a multi-host job when ``JAX_COORDINATOR_ADDRESS`` is set; returns whether it did.

    Environment: ``JAX_COORDINATOR_ADDRESS=host:port`` (process 0's address), ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID`` (optional where JAX detects the cluster). Call before anything touches ``jax.devices()``.
    """
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not addr or jax.distributed.is_initialized():
        return False
    n, pid = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(addr, num_processes=int(n) if n else None, process_id=int(pid) if pid else None)
    return True


def to_host(tree: Any) -> Any:
    """Device arrays -> NumPy on every process. An array split over devices of several processes (a multi-host
    ``data`` axis: each process holds only its replicas' rows) is gathered across processes first (a collective:
    every process must call this for the same arrays, as the lock-step host loop does)."""
    if all(getattr(a, "is_fully_addressable", True) for a in jax.tree_util.tree_leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def make_mesh(tp: int = 1, dp: int = 1, devices: list | None = None) -> Mesh:
    """A ``(data=dp, model=tp)`` mesh over the first ``dp * tp`` devices; a model group is ``tp`` consecutive
    devices (so it stays inside one host whenever ``tp`` <= devices per host)."""
    if tp < 1 or dp < 1:
        raise ShardingError(f"--tensor-parallel and --data-parallel must be >= 1, got {tp} and {dp}")
    devices = list(jax.devices() if devices is None else devices)
    n = tp * dp
    if n > len(devices):
        raise ShardingError(f"--tensor-parallel {tp} x --data-parallel {dp} needs {n} devices but only "
                            f"{len(devices)} are visible ({devices[0].platform}); lower them, or on CPU set "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts")
    return Mesh(np.array(devices[:n], dtype=object).reshape(dp, tp), (DATA, MODEL))


# ---------------------------------------------------------------------------------------------
# the plan: what splits over the model axis
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which parts of a target split over ``tp`` devices (the rest is replicated)."""

    tp: int
    attn: bool  # attention heads (q/gate, k, v, o) and KV pages split by head
    kv_repeat: int  # each KV head stored on this many devices (> 1 when there are fewer KV heads than tp)
    gdn: bool  # GDN heads (qkv, z, b, a, conv, A_log, dt_bias, out) and recurrent state split by head
    mlp: bool  # MLP columns (gate/up rows, down columns)
    vocab: bool  # embedding and LM head rows
    notes: tuple[str, ...] = ()

    @classmethod
    def for_config(cls, cfg: TargetConfig, tp: int) -> "ShardPlan":
        if tp < 1:
            raise ShardingError(f"tensor parallel size must be >= 1, got {tp}")
        if cfg.gdn_qkv_groups != 1:
            raise ShardingError("the config is already re-laid out for tensor parallelism; plan from the "
                                "checkpoint's own config")
        notes = []
        h, hkv = cfg.num_heads, cfg.num_kv_heads
        attn = tp > 1 and h % tp == 0 and (hkv % tp == 0 or tp % hkv == 0)
        kv_repeat = max(1, tp // hkv) if attn else 1
        if tp > 1 and not attn:
            notes.append(f"attention replicated: {h} query heads / {hkv} KV heads do not split over TP={tp} "
                         f"(query heads must divide by TP, and KV heads divide or be divided by it)")
        if kv_repeat > 1:
            notes.append(f"KV heads replicated: {hkv} KV heads over TP={tp}, each KV head stored on {kv_repeat} "
                         f"devices (one KV head per device)")
        gdn = tp > 1 and cfg.lin_num_k_heads % tp == 0
        if tp > 1 and not gdn and cfg.gdn_layers:
            notes.append(f"GDN replicated: {cfg.lin_num_k_heads} key heads / {cfg.lin_num_v_heads} value heads "
                         f"do not split over TP={tp}")
        mlp = tp > 1 and cfg.intermediate_size % tp == 0
        if tp > 1 and not mlp:
            notes.append(f"MLP replicated: intermediate_size {cfg.intermediate_size} does not divide by TP={tp}")
        vocab = tp > 1 and cfg.vocab_size % tp == 0
        if tp > 1 and not vocab:
            notes.append(f"embedding and LM head replicated: vocab_size {cfg.vocab_size} does not divide by TP={tp}")
        return cls(tp, attn, kv_repeat, gdn, mlp, vocab, tuple(notes))

    def model_config(self, cfg: TargetConfig) -> TargetConfig:
        """The config the model code runs with: KV heads as stored (repeated), GDN qkv channels in groups."""
        return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * self.kv_repeat,
                                   gdn_qkv_groups=self.tp if self.gdn else 1)

    def describe(self) -> str:
        parts = [f"{n}={'split' if on else 'replicated'}" for n, on in
                 (("attention", self.attn), ("gdn", self.gdn), ("mlp", self.mlp), ("vocab", self.vocab))]
        return f"TP={self.tp}: " + ", ".join(parts) + (f"; kv_repeat={self.kv_repeat}" if self.kv_repeat > 1 else "")


def qkv_permutation(cfg: TargetConfig, groups: int) -> np.ndarray:
    """Row order taking GDN qkv channels ``[q | k | v]`` to ``groups`` x ``[q_j | k_j | v_j]`` (whole heads)."""
    kd, vd = cfg.key_dim // groups, cfg.value_dim // groups
    kk = cfg.key_dim
    return np.concatenate([np.r_[j * kd:(j + 1) * kd, kk + j * kd:kk + (j + 1) * kd,
                                 2 * kk + j * vd:2 * kk + (j + 1) * vd] for j in range(groups)])


def _key(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def path_names(path: tuple) -> tuple:
    """A pytree path (jax key entries or plain keys) -> plain keys, e.g. ``("layers", 3, "attn", "q")``."""
    return tuple(_key(k) for k in path)


_COL = {"attn": ("q", "k", "v"), "gdn": ("qkv", "z", "b", "a", "conv"), "mlp": ("gate", "up")}
_ROW = {"attn": ("o",), "gdn": ("out",), "mlp": ("down",)}


def param_spec(path: tuple, plan: ShardPlan) -> P:
    """The partition spec of the target parameter at ``path`` (checkpoint ``[out, in]`` layout)."""
    path = path_names(path)
    name, group = path[-1], (path[-2] if len(path) >= 2 else None)
    on = {"attn": plan.attn, "gdn": plan.gdn, "mlp": plan.mlp}.get(group, False)
    if path in (("embed",), ("lm_head",)):
        return P(MODEL, None) if plan.vocab else P()
    if on and name in _COL[group]:
        return P(MODEL, None)
    if on and name in _ROW[group]:
        return P(None, MODEL)
    if on and group == "gdn" and name in ("A_log", "dt_bias"):
        return P(MODEL)
    if plan.attn and group == "kv_calib":  # a KV calibration's key_mean / key_feedback: by KV head, as the pages
        return P(MODEL)
    return P()


def relayout(path: tuple, x, cfg: TargetConfig, plan: ShardPlan):
    """One checkpoint tensor (numpy or jax, checkpoint layout of ``cfg``) -> the layout of
    ``plan.model_config(cfg)``: KV heads repeated, GDN qkv / conv rows grouped. A ``QuantizedWeight``'s data rows
    and their scales (per channel ``[out]``, or block rows ``[out / bo, ...]``) move together; block scales move
    only as whole blocks, otherwise a ShardingError says so."""
    names = path_names(path)
    name, group = names[-1], (names[-2] if len(names) >= 2 else None)
    if group == "attn" and name in ("k", "v") and plan.kv_repeat > 1:
        return _repeat_rows(x, cfg.num_kv_heads, plan.kv_repeat, names)
    if group == "gdn" and name in ("qkv", "conv") and plan.gdn:
        return _permute_rows(x, qkv_permutation(cfg, plan.tp), names)
    return x


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def _block(x: QuantizedWeight) -> tuple[int, int]:
    """A ``QuantizedWeight``'s scale block ``(rows, columns)``; per-channel scales: ``(1, 1)``."""
    return tuple(x.block) if x.block else (1, 1)


def _repeat_rows(x, groups: int, times: int, names: tuple):
    """Rows ``[groups * per, ...]`` -> each group's rows ``times`` over (a QuantizedWeight: data and scales)."""
    if _is_quantized(x):
        if (x.shape[0] // groups) % _block(x)[0]:
            raise ShardingError(f"{'/'.join(map(str, names))}: a head's {x.shape[0] // groups} rows are not whole "
                                f"{_block(x)[0]}-row scale blocks, so KV heads cannot be repeated for tensor "
                                "parallelism; quantize per channel")
        return dataclasses.replace(x, data=_repeat_rows(x.data, groups, times, names),
                                   scale=_repeat_rows(x.scale, groups, times, names))
    x = x.reshape(groups, -1, *x.shape[1:]).repeat(times, axis=0)
    return x.reshape(-1, *x.shape[2:])


def _permute_rows(x, perm: np.ndarray, names: tuple):
    """Rows reordered by ``perm`` (a QuantizedWeight: its scale rows or blocks with them)."""
    if not _is_quantized(x):
        return x[perm]
    bo = _block(x)[0]
    runs = perm.reshape(-1, bo) if len(perm) % bo == 0 else None  # each block's rows, in their new order
    if runs is None or (runs[:, 0] % bo).any() or ((runs - runs[:, :1]) != np.arange(bo)).any():
        raise ShardingError(f"{'/'.join(map(str, names))}: grouping the GDN q / k / v rows per device splits its "
                            f"{bo}-row scale blocks; quantize per channel for this tensor-parallel size")
    return dataclasses.replace(x, data=x.data[perm], scale=x.scale[runs[:, 0] // bo])


def param_sharding(path: tuple, shape: tuple[int, ...], cfg: TargetConfig, mesh: Mesh) -> NamedSharding:
    """The sharding of one target parameter: ``path`` into the tree, its (re-laid-out) ``shape``, the checkpoint's
    ``cfg`` and the mesh (TP = its ``model`` axis). ``Layout`` does the same for whole trees."""
    return Layout(mesh, ShardPlan.for_config(cfg, mesh.shape[MODEL])).param_sharding(path, shape)


# ---------------------------------------------------------------------------------------------
# the layout: mesh + plan -> shardings of every array
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where everything lives: ``mesh`` (``data`` x ``model``) and the tensor-parallel ``plan``."""

    mesh: Mesh
    plan: ShardPlan

    @classmethod
    def build(cls, cfg: TargetConfig, tp: int = 1, dp: int = 1, devices: list | None = None) -> "Layout":
        """The layout of checkpoint config ``cfg`` over ``dp`` x ``tp`` devices; logs the plan and its notes."""
        lay = cls(make_mesh(tp, dp, devices), ShardPlan.for_config(cfg, tp))
        log.info("mesh data=%d x model=%d; %s", dp, tp, lay.plan.describe())
        for note in lay.plan.notes:
            log.warning("%s", note)
        return lay

    @property
    def tp(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def dp(self) -> int:
        return self.mesh.shape[DATA]

    def named(self, *spec) -> NamedSharding:
        """``NamedSharding(mesh, P(*spec))``."""
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def per_replica(self, *spec) -> NamedSharding:
        """An array of the per-replica state / inputs: leading ``[dp]`` axis over ``data`` when dp > 1, then
        ``spec`` over the replica's own dims."""
        return self.named(DATA, *spec) if self.dp > 1 else self.named(*spec)

    # ---- parameters --------------------------------------------------------------------------------------
    def param_sharding(self, path: tuple, shape: tuple[int, ...]) -> NamedSharding:
        """The sharding of the parameter at ``path`` with (re-laid-out) ``shape``; checks the split is even."""
        spec = param_spec(path, self.plan)
        for dim, ax in zip(shape, spec):
            if ax is not None and dim % self.tp:
                raise ShardingError(f"parameter {'/'.join(map(str, path_names(path)))} dim {dim} does not split "
                                    f"over TP={self.tp}")
        return NamedSharding(self.mesh, spec)

    def quantized_sharding(self, path: tuple, w):
        """The shardings of a (re-laid-out) ``QuantizedWeight`` at ``path``, as a ``QuantizedWeight`` of
        ``NamedSharding``: data as the full-precision matrix; per-channel scales ``[out]`` split with the output rows
        (column-parallel) or replicated (row-parallel: they scale the reduced output); block scales as the data,
        which needs each device's rows / columns to be whole blocks."""
        spec = param_spec(path, self.plan)
        col, row = spec == P(MODEL, None), spec == P(None, MODEL)
        where = "/".join(map(str, path_names(path)))
        if col or row:
            axis = 0 if col else 1
            dim, blk = w.shape[axis], _block(w)[axis]
            if dim % self.tp or (dim // self.tp) % blk:
                raise ShardingError(f"quantized parameter {where}: its {dim} {'rows' if col else 'columns'} in "
                                    f"scale blocks of {blk} do not split over TP={self.tp}")
        scale = (P(MODEL) if col else P()) if w.scale.ndim == 1 else spec
        return dataclasses.replace(w, data=NamedSharding(self.mesh, spec), scale=NamedSharding(self.mesh, scale))

    def sharding_of(self, path: tuple, x):
        """The sharding of the (re-laid-out) parameter ``x`` at ``path``: a NamedSharding, or for a
        ``QuantizedWeight`` a ``QuantizedWeight`` of them."""
        return self.quantized_sharding(path, x) if _is_quantized(x) else self.param_sharding(path, x.shape)

    def params(self, params) -> Any:
        """The sharding tree of a (re-laid-out) target parameter tree (arrays or ShapeDtypeStructs)."""
        return jax.tree_util.tree_map_with_path(self.sharding_of, params, is_leaf=_is_quantized)

    def place(self, cfg: TargetConfig):
        """The loader's ``place(path, host_array)`` hook: re-layout, then write each device's shard directly."""

        def place(path: tuple, host: np.ndarray) -> jax.Array:
            x = np.ascontiguousarray(relayout(path, host, cfg, self.plan))
            sh = self.param_sharding(path, x.shape)
            return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

        return place

    def reshard(self, cfg: TargetConfig):
        """``f(path, array)``: one device array of checkpoint config ``cfg`` -> re-laid-out on its shards (the
        ``place`` hook of ``qwen36.init_params``)."""

        def one(path: tuple, x: jax.Array) -> jax.Array:
            y = relayout(path, x, cfg, self.plan)
            return jax.device_put(y, self.sharding_of(path, y))

        return one

    def shard_params(self, params, cfg: TargetConfig) -> Any:
        """Re-lay-out and reshard an already-loaded parameter tree of checkpoint config ``cfg``, leaf by leaf
        (a ``QuantizedWeight`` as one leaf: its data and scales move together)."""
        tied = params.get("lm_head") is params.get("embed")
        rest = {k: v for k, v in params.items() if not (tied and k == "lm_head")}
        out = jax.tree_util.tree_map_with_path(self.reshard(cfg), rest, is_leaf=_is_quantized)
        if tied:
            out["lm_head"] = out["embed"]
        return out

    # ---- state and inputs --------------------------------------------------------------------------------
    def kv(self) -> NamedSharding:
        """KV pages ``[n_pages, page, Hkv, hd]``: split by KV head."""
        return self.per_replica(None, None, MODEL) if self.plan.attn else self.per_replica()

    def conv(self) -> NamedSharding:
        """Conv state ``[n_slots, K-1, conv_dim]``: split by (grouped) channel."""
        return self.per_replica(None, None, MODEL) if self.plan.gdn else self.per_replica()

    def ssm(self) -> NamedSharding:
        """SSM state ``[n_slots, Hv, dk, dv]``: split by value head."""
        return self.per_replica(None, MODEL) if self.plan.gdn else self.per_replica()

    def state(self, state) -> Any:
        """Shardings of an ``EngineState`` (same tree)."""
        from dflash_jax.state import EngineState, KVPages, RecurrentSlots

        kv, rec = state.kv, state.rec
        return EngineState(kv=KVPages(tuple(self.kv() for _ in kv.k), tuple(self.kv() for _ in kv.v)),
                           rec=RecurrentSlots(tuple(self.conv() for _ in rec.conv), tuple(self.ssm() for _ in rec.ssm)),
                           pen=None if state.pen is None else self.replica_tree(state.pen))

    def replica_tree(self, tree) -> Any:
        """Per-replica arrays with nothing split over ``model`` (drafter cache, step inputs, sampling)."""
        return jax.tree_util.tree_map(lambda _: self.per_replica(), tree)

    def per_replica_step(self, fn: Callable, n_replicated: int, n_per_replica: int) -> Callable:
        """``fn`` over one replica -> over all: manual over ``data`` (``shard_map``; the ``model`` axis stays with
        the partitioner), so no collective can cross replicas. The first ``n_replicated`` arguments are the same on
        every replica (parameters); the next ``n_per_replica`` and every output lead with the ``[dp]`` axis."""
        one = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
        lead = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)

        def body(*args):
            shared, mine = args[:n_replicated], args[n_replicated:]
            return lead(fn(*shared, *(one(a) for a in mine)))

        specs = (P(),) * n_replicated + (P(DATA),) * n_per_replica
        return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=P(DATA), axis_names={DATA},
                             check_vma=False)

    def memory_per_device(self, tree) -> dict[Any, int]:
        """Bytes of ``tree``'s arrays held by each device (from the arrays' shardings)."""
        out: dict[Any, int] = {d: 0 for d in self.mesh.devices.flat}
        for a in {id(a): a for a in jax.tree_util.tree_leaves(tree)}.values():  # a tied embedding counts once
            for s in a.addressable_shards:
                out[s.device] = out.get(s.device, 0) + s.data.nbytes
        return out
