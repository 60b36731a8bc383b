"""EngineConfig refuses unknown weight forms and kernel backends with a clear error."""

from __future__ import annotations

import pytest

from fornax.config import ConfigError, EngineConfig


@pytest.mark.parametrize("value", ["int8", "int4", "auto", None])
def test_known_quantizations_are_accepted(value):
    assert EngineConfig(quantization=value).small_step_method == value


def test_unknown_quantization_is_a_clear_error():
    with pytest.raises(ConfigError, match="'int8', 'int4' or 'auto'"):
        EngineConfig(quantization="fp8")


def test_unknown_kernel_backend_is_a_clear_error():
    assert EngineConfig(kernel_backend="torch").kernel_backend == "torch"
    with pytest.raises(ConfigError, match="kernel_backend must be 'native' or 'torch'"):
        EngineConfig(kernel_backend="cuda")


def test_num_threads_must_be_positive():
    assert EngineConfig(num_threads=3).num_threads == 3
    with pytest.raises(ConfigError, match="num_threads must be >= 1"):
        EngineConfig(num_threads=0)
