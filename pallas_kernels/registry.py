"""One registry of kernel implementations: op name -> {impl name -> implementation}.

Every op has a ``"reference"`` implementation (pure ``jnp``, any backend) and may have faster ones
(``"pallas_triton"``: Pallas lowered through Triton, for CUDA and ROCm GPUs). All implementations of
one op share one call signature, so callers pick one with :func:`get` and call it.

Selection, first match wins:

1. the ``impl=`` argument of :func:`get`;
2. the environment variable ``DFLASH_KERNELS="op=impl,op2=impl2"`` (read at every call, so at trace
   time under ``jax.jit``);
3. by backend (``jax.default_backend()``, with ROCm told apart from CUDA): on ``gpu``/``cuda``/``rocm``
   the first of :data:`GPU_PREFERENCE` registered (as preferred) for that backend, otherwise ``"reference"``.

An explicit choice (1 or 2) is honoured whatever the backend (a Pallas kernel on CPU then runs in
interpret mode, which is how the tests exercise it); an unknown name raises ``KeyError`` listing
what exists.

:func:`check_block_shapes` is the static check to run *before* lowering a Triton kernel: Triton
needs power-of-two tensor extents, ``tl.dot`` needs M, N, K >= 16, and a tile over the shared-memory
budget fails late (``RESOURCE_EXHAUSTED``) or, on some ROCm compilers, segfaults.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings
from typing import Callable, Mapping, Sequence

import jax

ENV_VAR = "DFLASH_KERNELS"
GPU_BACKENDS = ("gpu", "cuda", "rocm")
GPU_PREFERENCE = ("pallas_triton",)
ANY = "any"

# Ops whose implementations live in a module of this package: imported on first use by get().
_BUILTIN_MODULES = {
    "paged_decode": "pallas_kernels.paged_decode",
    "tree_attention": "pallas_kernels.tree_attention",
    "gdn_chunked": "pallas_kernels.gdn",
    "gdn_step": "pallas_kernels.gdn",
    "gdn_tree": "pallas_kernels.gdn",
    "gdn_decode": "pallas_kernels.gdn",
    "skinny_matmul": "pallas_kernels.skinny_matmul",
    "ddtree_build": "pallas_kernels.ddtree",
    "key_round": "pallas_kernels.key_round",
}


@dataclasses.dataclass(frozen=True)
class Impl:
    op: str
    name: str
    fn: Callable
    backends: tuple[str, ...]
    preferred: bool = True  # picked by default on its backends; False = only when asked for by name

    def supports(self, backend: str) -> bool:
        b = _normalize_backend(backend)
        if ANY in self.backends or b in self.backends:
            return True
        # "gpu" covers both GPU vendors; "cuda"/"rocm" name one.
        return b in ("cuda", "rocm") and "gpu" in self.backends


_REGISTRY: dict[str, dict[str, Impl]] = {}


def _normalize_backend(backend: str) -> str:
    b = backend.lower()
    return "cuda" if b == "gpu" else b


def register(op: str, impl_name: str, fn: Callable | None = None, *,
             backends: Sequence[str] = ("gpu",), preferred: bool = True) -> Callable:
    """Register ``fn`` as implementation ``impl_name`` of ``op`` for ``backends``.

    backends: any of "gpu" (CUDA or ROCm), "cuda", "rocm", "cpu", "tpu", or "any". preferred=False
    keeps it out of the backend default (opt-in through ``impl=`` or the environment variable, e.g.
    for a kernel not yet measured on hardware). Registering the same (op, impl_name) again replaces
    it. Usable as a decorator when ``fn`` is omitted.
    """
    if isinstance(backends, str):
        backends = (backends,)
    bs = tuple(b.lower() for b in backends)
    for b in bs:
        if b not in GPU_BACKENDS + ("cpu", "tpu", ANY):
            raise ValueError(f"register({op!r}, {impl_name!r}): unknown backend {b!r}")

    def _do(f: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[impl_name] = Impl(op, impl_name, f, bs, preferred)
        return f

    return _do if fn is None else _do(fn)


def _ensure_loaded(op: str) -> None:
    mod = _BUILTIN_MODULES.get(op)
    if mod is not None and op not in _REGISTRY:
        importlib.import_module(mod)


def ops() -> list[str]:
    for op in _BUILTIN_MODULES:
        _ensure_loaded(op)
    return sorted(_REGISTRY)


def implementations(op: str) -> dict[str, Impl]:
    _ensure_loaded(op)
    if op not in _REGISTRY:
        raise KeyError(f"no kernel op {op!r}; known ops: {ops()}")
    return dict(_REGISTRY[op])


def current_backend() -> str:
    """``jax.default_backend()``, with ``"rocm"`` for an AMD GPU and ``"cuda"`` for an NVIDIA one."""
    b = jax.default_backend().lower()
    if b in GPU_BACKENDS:
        try:
            pv = jax.devices()[0].client.platform_version.lower()
        except Exception:  # pragma: no cover - depends on the plugin
            pv = ""
        return "rocm" if ("rocm" in pv or "hip" in pv or b == "rocm") else "cuda"
    return b


def parse_overrides(spec: str | None) -> dict[str, str]:
    """``"op=impl,op2=impl2"`` -> ``{op: impl}``; blanks ignored, a malformed entry raises ValueError."""
    out: dict[str, str] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        op, sep, impl = part.partition("=")
        op, impl = op.strip(), impl.strip()
        if not sep or not op or not impl:
            raise ValueError(f"{ENV_VAR}: malformed entry {part!r}; expected 'op=impl,...'")
        out[op] = impl
    return out


def resolve(op: str, impl: str | None = None, *, backend: str | None = None) -> Impl:
    """The implementation :func:`get` would return, with its name and backends."""
    impls = implementations(op)
    choice = impl or parse_overrides(os.environ.get(ENV_VAR)).get(op)
    if choice is not None:
        if choice not in impls:
            src = "impl=" if impl else f"{ENV_VAR}"
            raise KeyError(f"{src}: op {op!r} has no implementation {choice!r}; available: {sorted(impls)}")
        return impls[choice]
    b = _normalize_backend(backend or current_backend())
    if b in GPU_BACKENDS:
        for name in GPU_PREFERENCE:
            if name in impls and impls[name].supports(b) and impls[name].preferred:
                return impls[name]
    if "reference" in impls and impls["reference"].supports(b):
        return impls["reference"]
    for cand in impls.values():
        if cand.supports(b) and cand.preferred:
            return cand
    raise KeyError(f"op {op!r} has no implementation for backend {b!r}; available: "
                   f"{ {n: i.backends for n, i in impls.items()} }")


def get(op: str, impl: str | None = None, *, backend: str | None = None) -> Callable:
    """The implementation function of ``op`` (see the module docstring for the selection order)."""
    return resolve(op, impl, backend=backend).fn


def warn_fallback(op: str, err: Exception, what: str = "this shape") -> None:
    """Say (once per distinct message) that a Pallas implementation handed a shape (or ``what``) to the reference."""
    warnings.warn(f"{op}: the Pallas kernel cannot take {what} ({err}); running the reference instead. "
                  f"Set {ENV_VAR}={op}=reference to silence this.", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Static block-shape checks (run before lowering).

KiB = 1024
# Max dynamic shared memory per thread block (opt-in) by CUDA compute capability major.minor, and
# LDS per workgroup on AMD. Hopper: 228 KiB per SM of which 227 KiB per block.
SMEM_BUDGET_BYTES = {
    "sm_90": 227 * KiB,   # H100 / H200
    "sm_100": 227 * KiB,  # B200
    "sm_80": 163 * KiB,   # A100
    "sm_86": 99 * KiB,
    "sm_89": 99 * KiB,
    "sm_120": 99 * KiB,
    "rocm": 64 * KiB,     # MI300-class LDS per workgroup
}
DEFAULT_GPU_BUDGET = 99 * KiB    # unknown NVIDIA part: assume the small one
DEFAULT_TARGET_BUDGET = SMEM_BUDGET_BYTES["sm_90"]  # off-GPU (interpret mode): check for our H200 target


def smem_budget_bytes(backend: str | None = None, device=None) -> int:
    """Shared-memory budget of one Triton program on ``backend`` (default: the current one)."""
    b = _normalize_backend(backend or current_backend())
    if b == "rocm":
        return SMEM_BUDGET_BYTES["rocm"]
    if b != "cuda":
        return DEFAULT_TARGET_BUDGET
    dev = device
    if dev is None:
        try:
            dev = jax.devices()[0]
        except Exception:  # pragma: no cover
            return DEFAULT_GPU_BUDGET
    cc = str(getattr(dev, "compute_capability", "") or "")
    key = "sm_" + cc.replace(".", "")
    return SMEM_BUDGET_BYTES.get(key, DEFAULT_GPU_BUDGET)


def first_fitting(candidates: Sequence[dict], check: Callable[[dict], object]) -> dict | None:
    """The first launch config that ``check`` accepts (it raises ValueError for one whose tiles do not fit); when
    none fits, the first candidate (its launch then fails with the check's message where it is used)."""
    for cfg in candidates:
        try:
            check(cfg)
        except ValueError:
            continue
        return cfg
    return candidates[0] if candidates else None


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def check_block_shapes(kernel: str, blocks: Mapping[str, Sequence[int]], *,
                       dots: Mapping[str, tuple[int, int, int]] | None = None,
                       smem: Mapping[str, int] | None = None,
                       smem_budget: int | None = None,
                       backend: str | None = None,
                       min_dot_dim: int = 16) -> int:
    """Statically check a Triton kernel's tiles; raise ValueError naming the offending block.

    blocks: name -> shape of each tensor the kernel loads, stores or computes on (every extent
    must be a power of two). dots: name -> (M, N, K) of each ``dot`` (each >= ``min_dot_dim``).
    smem: name -> estimated shared-memory bytes of each tile (staged loads count once per pipeline
    stage); their sum must fit ``smem_budget`` (default :func:`smem_budget_bytes` of ``backend``).
    Returns the estimated total shared-memory bytes.
    """
    for name, shape in blocks.items():
        shape = tuple(shape)
        for ax, d in enumerate(shape):
            if not _is_pow2(int(d)):
                raise ValueError(
                    f"{kernel}: block {name!r} has shape {shape}; extent {d} on axis {ax} is not a power of "
                    f"two (the Pallas Triton lowering needs power-of-two tensor extents: pad it or pick "
                    f"another block size)")
    for name, mnk in (dots or {}).items():
        for label, d in zip("MNK", mnk):
            if int(d) < min_dot_dim:
                raise ValueError(
                    f"{kernel}: dot {name!r} has {label}={d} (M, N, K = {tuple(mnk)}); tl.dot needs every "
                    f"dimension >= {min_dot_dim}: pad the block")
    total = int(sum(int(v) for v in (smem or {}).values()))
    if smem:
        budget = smem_budget if smem_budget is not None else smem_budget_bytes(backend)
        if total > budget:
            worst = max(smem, key=lambda k: smem[k])
            parts = ", ".join(f"{k}={v / KiB:.1f} KiB" for k, v in smem.items())
            raise ValueError(
                f"{kernel}: estimated shared memory {total} B ({total / KiB:.1f} KiB) exceeds the budget of "
                f"{budget} B ({budget / KiB:.0f} KiB); largest tile is block {worst!r} ({parts}). Use "
                f"smaller blocks or fewer pipeline stages")
    return total


__all__ = [
    "ANY", "ENV_VAR", "GPU_PREFERENCE", "Impl", "SMEM_BUDGET_BYTES", "check_block_shapes", "current_backend",
    "get", "implementations", "ops", "parse_overrides", "register", "resolve", "smem_budget_bytes", "warn_fallback",
]

