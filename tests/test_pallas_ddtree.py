"""The DDTree pop-loop kernel (``pallas_kernels.ddtree``, op ``ddtree_build``): in interpret mode it equals the XLA
reference exactly (every tree array, ties in the scores included, padding trees, chain seeds, top-K 1), the
engine's builder routes to it when asked, and it lowers to Triton IR for an H200 and an MI300."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax.spec import ddtree, topk
from pallas_kernels import registry
from pallas_kernels.ddtree import ddtree_build

from test_ddtree import draft_logprobs
from test_pallas_lowering import TARGETS, lower

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# (L, V, budget, top_k, chain_seed): each compiles once in each implementation
CONFIGS = [
    (16, 40, 22, None, False),  # the engine's shape: 16 depths, budget 22
    (16, 40, 22, None, True),
    (2, 2, 9, None, False),  # 6 prefixes < budget: padding slots
    (4, 3, 16, 2, True),
    (4, 5, 3, 1, True),  # top-K 1, chain longer than the budget
    (3, 8, 40, None, False),  # frontier of 81 slots: a 128-slot tile
]


def top_lists(lp: np.ndarray, budget: int, top_k, tie_step: float | None):
    lp = jnp.asarray(lp)
    k = ddtree._resolve_k(top_k, budget, lp.shape[-1])
    tl, tt = topk.top_k(lp, k)
    if tie_step:  # coarse scores: many equal candidates, so the tie rule (earliest push) decides pops
        tl = jnp.round(tl / tie_step) * tie_step
    return tl, tt


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), seed=st.integers(0, 2**31 - 1), tie_step=st.sampled_from([None, 0.5, 2.0]))
def test_kernel_equals_the_reference(cfg, seed, tie_step):
    L, V, budget, top_k, chain = cfg
    tl, tt = top_lists(draft_logprobs(seed, 3, L, V), budget, top_k, tie_step)
    want = ddtree.build_reference(tl, tt, budget, chain)
    got = ddtree_build(tl, tt, budget, chain, interpret=True)
    for f in ddtree.TREE_FIELDS:
        np.testing.assert_array_equal(np.asarray(got[f]), np.asarray(want[f]), err_msg=f"{cfg} {f}")


def test_build_tree_routes_to_the_kernel_when_asked(monkeypatch):
    lp = draft_logprobs(7, 2, 16, 40)
    want = ddtree.build_tree(lp, 22)
    calls = []
    impl = registry.implementations("ddtree_build")["pallas_triton"]

    def spy(*a):
        calls.append(a[2:])
        return impl.fn(*a)

    monkeypatch.setitem(registry._REGISTRY["ddtree_build"], "pallas_triton", impl.__class__(
        impl.op, impl.name, spy, impl.backends, impl.preferred))
    monkeypatch.setenv(registry.ENV_VAR, "ddtree_build=pallas_triton")
    got = ddtree.build_tree(lp, 22)
    assert calls == [(22, False)]
    for f in ddtree.TREE_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)))
    assert got.valid.dtype == jnp.bool_ and got.ancestors.dtype == jnp.bool_


def test_the_kernel_is_the_gpu_default_and_cpu_keeps_the_reference():
    assert registry.resolve("ddtree_build", backend="cuda").name == "pallas_triton"
    assert registry.resolve("ddtree_build", backend="rocm").name == "pallas_triton"
    assert registry.resolve("ddtree_build", backend="cpu").name == "reference"


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("chain_seed", [False, True])
def test_kernel_lowers(platform, chain_seed):
    sd = jax.ShapeDtypeStruct
    fn = lambda lp, tok: ddtree_build(lp, tok, 22, chain_seed)  # noqa: E731
    assert "__gpu$xla.gpu.triton" in lower(platform, fn, sd((4, 16, 22), jnp.float32), sd((4, 16, 22), jnp.int32))


def test_engine_rounds_with_the_kernel_equal_the_reference_rounds_and_ar(monkeypatch):
    import os

    import dflash_jax as dj
    from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams
    from dflash_jax.engine.spec_steps import SpecConfig
    from dflash_jax.models.dflash_loader import load_drafter
    from dflash_jax.models.tokenizer import Tokenizer

    path = os.path.join(dj.SHIPPED_MODELS, "target")
    target, tok = dj.load_target(path, dtype="float32"), Tokenizer.from_dir(path)
    drafter = load_drafter(os.path.join(dj.SHIPPED_MODELS, "drafter"), dtype="float32")
    prompts = [tok.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser("), tok.encode("import os\n")]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    opts = dict(max_batch=2, max_model_len=128, prefill_chunk=64)
    runs = {}
    for impl in ("reference", "pallas_triton"):
        monkeypatch.setenv(registry.ENV_VAR, f"ddtree_build={impl}")
        eng = Engine(target, tok, EngineOptions(spec=SpecConfig(budget=22), cohort_yield_min=0.0, **opts),
                     drafter=drafter)
        runs[impl] = [(o.token_ids, o.stats["draft_steps"], o.stats["accepted_tokens"])
                      for o in eng.generate(prompts, sp)]
    assert runs["pallas_triton"] == runs["reference"]
    assert all(steps > 0 for _, steps, _ in runs["reference"])
    ar = Engine(target, tok, EngineOptions(**opts)).generate(prompts, sp)
    assert [o.token_ids for o in ar] == [t for t, _, _ in runs["reference"]]


def test_cost_experiment_checks_and_times_both(capsys):
    from conftest import load_experiment

    cost = load_experiment("ddtree_build_cost")
    assert cost.main(["--batch", "2", "--budget", "6", "--depth", "4", "--vocab", "64", "--iters", "1",
                      "--no-write"]) == 0
    out = capsys.readouterr().out
    for kind in cost.KINDS:
        assert f"ddtree_build.b2.{kind}: reference" in out
