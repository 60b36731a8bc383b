"""RoPE scaling rules against transformers' own functions (modeling_rope_utils): the inverse
frequencies bit for bit and YaRN's cos/sin factor, over the shapes real configs use."""

from __future__ import annotations

import pytest
import torch

from fornax.layers.rotary import rope_attention_factor, rope_inv_freq


def _transformers_yarn(head_dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    heads = 8
    config = LlamaConfig(
        hidden_size=head_dim * heads,
        num_attention_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=4 * params["original_max_position_embeddings"],
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params},
    )
    return ROPE_INIT_FUNCTIONS["yarn"](config)


@pytest.mark.parametrize(
    "head_dim,theta,params",
    [
        (128, 1_000_000.0, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen3
        (128, 1_000_000.0, {"factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False}),
        (
            64,
            10_000.0,
            {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
        ),
        (
            128,
            10_000.0,
            {
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        ),
        (32, 10_000.0, {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.25}),
    ],
)
def test_yarn_matches_transformers(head_dim, theta, params):
    want, want_factor = _transformers_yarn(head_dim, theta, params)
    scaling = {"rope_type": "yarn", **params}
    assert torch.equal(rope_inv_freq(head_dim, theta, scaling), want.float())
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)


def test_other_rules_keep_cos_and_sin_unscaled():
    assert rope_attention_factor(None) == 1.0
    assert rope_attention_factor({"rope_type": "linear", "factor": 4.0}) == 1.0
