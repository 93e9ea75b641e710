"""Start-up flag checks of ``python -m dflash_jax.serve``: what cannot run is rejected with a message naming it."""

import os

import pytest

from conftest import FIXTURES
from dflash_jax.serve.__main__ import StartupError, build_parser, resolve

MODEL = os.path.join(FIXTURES, "qwen36_tiny_b")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _resolve(*argv):
    return resolve(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("argv,needle", [
    ((), "no model given"),
    (("--model", "/nonexistent"), "not a directory"),
    (("--model", MODEL, "--ddtree"), "--ddtree needs --drafter"),
    (("--model", MODEL, "--drafter", MODEL), "--drafter is only used with --ddtree"),
    (("--model", MODEL, "--kvflash", "auto"), "--kvflash auto"),
    (("--model", MODEL, "--fast-rollback"), "--fast-rollback"),
    (("--model", MODEL, "--prefill-compression", "auto"), "needs --prefill-drafter"),
    (("--model", MODEL, "--prefill-drafter", MODEL), "only used with --prefill-compression"),
    (("--model", MODEL, "--target-device", "cuda:0", "--draft-device", "cpu:0"), "mixed-device"),
    (("--model", MODEL, "--target-device", "tpu:0"), "not understood"),
    (("--model", MODEL, "--max-concurrency", "0"), "--max-concurrency"),
    (("--model", os.path.join(FIXTURES, "missing.gguf")), "not a directory (or a .gguf file)"),
    (("--model", MODEL, "--config", os.path.join(ROOT, "configs", "strix_halo.yaml")), "--ddtree needs --drafter"),
])
def test_unsupported_or_inconsistent_flags_are_rejected(argv, needle):
    with pytest.raises(StartupError) as e:
        _resolve(*argv)
    assert needle in str(e.value)


def test_presets_load_and_command_line_overrides_them(tmp_path):
    ns = _resolve("--model", MODEL, "--config", os.path.join(ROOT, "configs", "h200.yaml"), "--port", "9001")
    assert ns.max_concurrency == 32 and ns.dtype == "bfloat16" and ns.port == 9001
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(StartupError, match="unknown flag 'no-such-flag'"):
        _resolve("--model", MODEL, "--config", str(bad))


def test_quantization_flag_and_preset_value_are_checked(tmp_path):
    assert _resolve("--model", MODEL).quantization == "none"
    assert _resolve("--model", MODEL, "--quantization", "fp8").quantization == "fp8"
    preset = tmp_path / "p.yaml"
    preset.write_text("quantization: int3\n")
    with pytest.raises(StartupError, match="--quantization must be none or fp8"):
        _resolve("--model", MODEL, "--config", str(preset))
