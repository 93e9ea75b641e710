"""The share of each accelerator's memory JAX may take: 0.9 unless the environment or the caller says otherwise."""

import pytest

from dflash_jax import device_memory
from dflash_jax.device_memory import ENV, set_memory_fraction


def test_default_environment_and_explicit_fractions(monkeypatch):
    monkeypatch.setattr(device_memory, "_backends_initialized", lambda: False)
    monkeypatch.delenv(ENV, raising=False)
    assert set_memory_fraction() == "0.9"
    import os

    assert os.environ[ENV] == "0.9"
    monkeypatch.setenv(ENV, "0.5")
    assert set_memory_fraction() == "0.5"  # the user's environment wins over the default
    assert set_memory_fraction(0.95) == "0.95" and os.environ[ENV] == "0.95"  # an explicit flag wins over both
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="must be in"):
            set_memory_fraction(bad)


def test_too_late_is_said(monkeypatch):
    monkeypatch.setattr(device_memory, "_backends_initialized", lambda: True)
    monkeypatch.setenv(ENV, "0.9")
    with pytest.warns(UserWarning, match="next process"):
        set_memory_fraction(0.8)


def test_serve_flag_is_checked():
    from dflash_jax.serve.__main__ import StartupError, build_parser, resolve

    assert resolve(build_parser().parse_args(["--gpu-memory-utilization", "0.95"])).gpu_memory_utilization == 0.95
    assert resolve(build_parser().parse_args([])).gpu_memory_utilization is None
    with pytest.raises(StartupError, match="must be in"):
        resolve(build_parser().parse_args(["--gpu-memory-utilization", "1.5"]))
