"""Start-up flag checks of ``python -m dflash_jax.serve``: what cannot run is rejected with a message naming it."""

import os

import pytest

from conftest import FIXTURES, xla_flags
from dflash_jax.serve.__main__ import StartupError, build_parser, resolve

MODEL = os.path.join(FIXTURES, "qwen36_tiny_b")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _resolve(*argv):
    return resolve(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("argv,needle", [
    (("--model", "/nonexistent"), "not a directory"),
    (("--model", MODEL, "--ddtree"), "--ddtree needs --drafter"),
    (("--model", MODEL, "--drafter", MODEL), "--drafter is only used with --ddtree"),
    (("--model", MODEL, "--kvflash", "lots"), "expected off, auto or a resident pool size"),
    (("--model", MODEL, "--kvflash", "-5"), "at least one token"),
    (("--model", MODEL, "--fast-rollback"), "--fast-rollback selects how DDTree rounds commit"),
    (("--ddtree", "--fast-rollback", "--max-concurrency", "4"), "use --max-concurrency 1"),
    (("--model", MODEL, "--ddtree-chain-seed"), "--ddtree-chain-seed shapes DDTree trees"),
    (("--model", MODEL, "--ddtree-level-bonus", "0.3"), "--ddtree-level-bonus shapes DDTree trees"),
    (("--model", MODEL, "--ddtree-draft-vocab", "32768"), "--ddtree-draft-vocab sets what DDTree drafts"),
    (("--ddtree", "--ddtree-draft-vocab", "/no/such/ids.json"), "no such file"),
    (("--ddtree", "--ddtree-draft-vocab", "0"), "a token count >= 1"),
    (("--cohort-reprobe-tokens", "-1"), "--cohort-reprobe-tokens must be >= 0"),
    (("--model", MODEL, "--ddtree-max-verify-tokens", "64"), "--ddtree-max-verify-tokens caps DDTree rounds"),
    (("--ddtree", "--ddtree-max-verify-tokens", "1"), "--ddtree-max-verify-tokens must be >= 2"),
    (("--model", MODEL, "--prefill-compression", "auto"), "needs --prefill-drafter"),
    (("--model", MODEL, "--prefill-drafter", MODEL), "only used with --prefill-compression"),
    (("--model", MODEL, "--target-device", "cuda:0", "--draft-device", "cpu:0"), "mixed-device"),
    (("--model", MODEL, "--target-device", "tpu:0"), "not understood"),
    (("--model", MODEL, "--target-device", "hip:0", "--draft-device", "cpu:0"), "mixed-device"),
    (("--model", MODEL, "--target-device", "cuda:0", "--draft-device", "cuda:1"), "mixed-device"),
    (("--model", MODEL, "--max-concurrency", "0"), "--max-concurrency"),
    (("--model", MODEL, "--tensor-parallel", "0"), "--tensor-parallel and --data-parallel must be >= 1"),
    (("--model", MODEL, "--tensor-parallel", "2", "--target-device", "cpu:0"), "drop --target-device"),
    (("--model", os.path.join(FIXTURES, "missing.gguf")), "not a directory (or a .gguf file)"),
    (("--model", MODEL, "--config", os.path.join(ROOT, "configs", "strix_halo.yaml")), "--ddtree needs --drafter"),
])
def test_unsupported_or_inconsistent_flags_are_rejected(argv, needle):
    with pytest.raises(StartupError) as e:
        _resolve(*argv)
    assert needle in str(e.value)


def test_no_model_means_the_shipped_set_with_its_drafter_and_scorer():
    from dflash_jax.serve.__main__ import SHIPPED

    ns = _resolve()
    assert ns.model == os.path.join(SHIPPED, "target") and os.path.isdir(ns.model)
    ns = _resolve("--ddtree", "--prefill-compression", "auto")
    assert ns.drafter == os.path.join(SHIPPED, "drafter") and ns.prefill_drafter == os.path.join(SHIPPED, "scorer")
    with pytest.raises(StartupError, match="--ddtree needs --drafter"):  # another model: no implicit drafter
        _resolve("--model", MODEL, "--ddtree")


def test_ddtree_trees_are_best_first_unless_chain_seeded():
    assert _resolve("--ddtree").ddtree_chain_seed is False
    assert _resolve("--ddtree", "--ddtree-chain-seed").ddtree_chain_seed is True
    assert _resolve("--ddtree", "--no-ddtree-chain-seed").ddtree_chain_seed is False


def test_a_preset_chain_seed_must_be_a_boolean(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ddtree: true\nddtree-chain-seed: sometimes\n")
    with pytest.raises(StartupError, match="--ddtree-chain-seed must be true or false, got 'sometimes'"):
        _resolve("--config", str(bad))
    good = tmp_path / "good.yaml"
    good.write_text("ddtree: true\nddtree-chain-seed: true\n")
    assert _resolve("--config", str(good)).ddtree_chain_seed is True


def test_the_level_bonus_defaults_to_the_drafters_and_a_preset_must_give_a_number(tmp_path):
    assert _resolve("--ddtree").ddtree_level_bonus is None  # the drafter checkpoint's, resolved by the engine
    assert _resolve("--ddtree", "--ddtree-level-bonus", "0.25").ddtree_level_bonus == 0.25
    bad = tmp_path / "bad.yaml"
    bad.write_text("ddtree: true\nddtree-level-bonus: lots\n")
    with pytest.raises(StartupError, match="--ddtree-level-bonus must be a finite number, got 'lots'"):
        _resolve("--config", str(bad))


def test_the_drafting_vocabulary_is_a_count_or_a_file(tmp_path):
    assert _resolve("--ddtree").ddtree_draft_vocab is None
    assert _resolve("--ddtree", "--ddtree-draft-vocab", "32768").ddtree_draft_vocab == 32768
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    assert _resolve("--ddtree", "--ddtree-draft-vocab", str(ids)).ddtree_draft_vocab == str(ids)
    preset = tmp_path / "p.yaml"
    preset.write_text("ddtree: true\nddtree-draft-vocab: '4096'\n")
    assert _resolve("--config", str(preset)).ddtree_draft_vocab == 4096


def test_the_drafters_weight_format_is_a_quantization_and_needs_ddtree(tmp_path):
    assert _resolve("--ddtree").ddtree_draft_quantization is None
    assert _resolve("--ddtree", "--ddtree-draft-quantization", "fp8").ddtree_draft_quantization == "fp8"
    with pytest.raises(StartupError, match="it needs --ddtree"):
        _resolve("--ddtree-draft-quantization", "int8")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ddtree: true\nddtree-draft-quantization: fp4\n")
    with pytest.raises(StartupError, match="must be one of"):
        _resolve("--config", str(bad))


def test_presets_load_and_command_line_overrides_them(tmp_path):
    ns = _resolve("--model", MODEL, "--config", os.path.join(ROOT, "configs", "h200.yaml"), "--port", "9001")
    assert ns.max_concurrency == 32 and ns.dtype == "bfloat16" and ns.port == 9001
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(StartupError, match="unknown flag 'no-such-flag'"):
        _resolve("--model", MODEL, "--config", str(bad))


def test_kvflash_flags_are_accepted():
    ns = _resolve("--model", MODEL, "--kvflash", "8192", "--kvflash-scoring", "lru")
    assert ns.kvflash == 8192 and ns.kvflash_scoring == "lru"
    assert _resolve("--model", MODEL, "--kvflash", "auto").kvflash == "auto"
    ns = _resolve("--model", MODEL)
    assert ns.kvflash is None and ns.kvflash_scoring == "shadow" and ns.kvflash_max_page_in == 64
    assert _resolve("--model", MODEL, "--kvflash", "8192", "--kvflash-max-page-in", "16").kvflash_max_page_in == 16
    with pytest.raises(StartupError, match="--kvflash-max-page-in -1: must be >= 0"):
        _resolve("--model", MODEL, "--kvflash-max-page-in", "-1")
    assert ns.kvflash_host_prewarm_gb == 8.0
    assert _resolve("--model", MODEL, "--kvflash", "8192", "--kvflash-host-prewarm-gb", "0.5").kvflash_host_prewarm_gb == 0.5
    with pytest.raises(StartupError, match="--kvflash-host-prewarm-gb -1.0: must be >= 0"):
        _resolve("--model", MODEL, "--kvflash-host-prewarm-gb", "-1")


def test_kvflash_drafter_scoring_needs_ddtree_and_presets_are_checked(tmp_path):
    ns = _resolve("--ddtree", "--kvflash", "8192", "--kvflash-scoring", "drafter")  # the shipped drafter
    assert ns.kvflash == 8192 and ns.kvflash_scoring == "drafter"
    with pytest.raises(StartupError, match="--kvflash-scoring drafter .* needs --ddtree"):
        _resolve("--model", MODEL, "--kvflash", "8192", "--kvflash-scoring", "drafter")
    preset = tmp_path / "p.yaml"
    for text, needle in (("kvflash: 8192\nkvflash-scoring: drafter\n", "needs --ddtree"),
                         ("kvflash-scoring: attention\n",
                          "--kvflash-scoring must be one of keys, bounds, shadow, drafter, lru")):
        preset.write_text(text)
        with pytest.raises(StartupError, match=needle):
            _resolve("--model", MODEL, "--config", str(preset))


def test_quantization_flag_and_preset_value_are_checked(tmp_path):
    assert _resolve("--model", MODEL).quantization == "none"
    assert _resolve("--model", MODEL, "--quantization", "fp8").quantization == "fp8"
    assert _resolve("--model", MODEL, "--quantization", "int8").quantization == "int8"
    assert _resolve("--model", MODEL, "--quantization", "int4").quantization == "int4"
    preset = tmp_path / "p.yaml"
    preset.write_text("quantization: int3\n")
    with pytest.raises(StartupError, match="--quantization must be one of none, fp8, fp8_dynamic, int8, int4"):
        _resolve("--model", MODEL, "--config", str(preset))


def test_hip_is_accepted_as_rocm():
    ns = _resolve("--model", MODEL, "--target-device", "hip:0", "--draft-device", "rocm")  # one device
    assert (ns.target_device, ns.draft_device) == ("hip:0", "rocm")


def test_draft_residency_and_thinking_defaults_and_checks(tmp_path):
    """The issue's server defaults: drafter/scorer resident for the server's life, thinking on (Qwen3.6's default);
    a preset cannot slip in a value argparse would refuse."""
    ns = _resolve("--model", MODEL)
    assert ns.draft_residency == "persistent" and ns.enable_thinking is True
    assert _resolve("--model", MODEL, "--enable-thinking", "false").enable_thinking is False
    assert _resolve("--model", MODEL, "--config", os.path.join(ROOT, "configs", "h200.yaml")).enable_thinking is True
    preset = tmp_path / "p.yaml"
    preset.write_text("enable-thinking: false\n")  # YAML reads a bool
    assert _resolve("--model", MODEL, "--config", str(preset)).enable_thinking is False
    for text, needle in (("draft-residency: swap\n", "only 'persistent'"),
                         ("enable-thinking: maybe\n", "--enable-thinking must be true or false")):
        preset.write_text(text)
        with pytest.raises(StartupError, match=needle):
            _resolve("--model", MODEL, "--config", str(preset))
    with pytest.raises(SystemExit):  # argparse: not a choice
        _resolve("--model", MODEL, "--draft-residency", "swap")


def test_draft_device_other_than_the_target_is_refused_at_start():
    """Only --draft-device given: it is compared with the device the target lands on (here the first of two CPU
    devices), before any model is loaded."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "dflash_jax.serve", "--model", MODEL, "--draft-device", "cpu:1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "--draft-device cpu:1 is not the target's device" in r.stderr, r.stderr
