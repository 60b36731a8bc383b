"""Numeric edge cases that once crashed sampling (a NaN row made searchsorted return an id
past the vocabulary, and the engine thread died on the embedding lookup).

Every case must give a valid token id, and the greedy-equivalent ones the argmax.
"""

from __future__ import annotations

import pytest
import torch

from fornax.engine.request import Request, SamplingParams
from fornax.engine.sample.metadata import SamplingMetadata, make_generator
from fornax.engine.sample.sampler import Sampler

VOCAB = 1000


def sample(
    params: SamplingParams, logits: torch.Tensor, output: list[int] | None = None, seed: int | None = None
) -> int:
    request = Request("r", [1, 2, 3], params, eos_token_ids={0})
    for token in output or []:
        request.append_output_token(token)
    generators = {} if seed is None else {"r": make_generator(seed)}
    meta = SamplingMetadata.build([request], generators)
    token = int(Sampler()(logits.unsqueeze(0), meta).sampled_token_ids[0])
    assert 0 <= token < VOCAB
    return token


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [vocab]


def test_tiny_temperature_is_greedy(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=1e-50)
    assert params.greedy
    assert sample(params, logits) == int(logits.argmax())


@pytest.mark.parametrize("temperature", [1e-5, 3e-5])
def test_small_temperature_at_the_limit_still_samples_the_best(
    logits: torch.Tensor, temperature: float
) -> None:
    params = SamplingParams(temperature=temperature, seed=1)
    assert not params.greedy
    assert sample(params, logits, seed=1) == int(logits.argmax())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_repetition_penalty_favours_a_seen_token(logits: torch.Tensor, temperature: float) -> None:
    # A penalty near 0 multiplies a seen token's positive logit without bound: it must win.
    seen = int(logits.argsort()[-5])  # fifth best, positive
    assert logits[seen] > 0
    params = SamplingParams(temperature=temperature, repetition_penalty=1e-50, seed=3)
    assert sample(params, logits, output=[seen], seed=3) == seen


def test_top_p_rounding_to_zero_keeps_the_best_token(logits: torch.Tensor) -> None:
    for top_p in (1e-30, 1e-50):
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=5)
        assert sample(params, logits, seed=5) == int(logits.argmax())


@pytest.mark.parametrize("bias", [100.0, -100.0])
def test_bias_on_every_token_changes_nothing_for_greedy(logits: torch.Tensor, bias: float) -> None:
    params = SamplingParams(temperature=0.0, logit_bias=dict.fromkeys(range(VOCAB), bias))
    assert sample(params, logits) == int(logits.argmax())


def test_all_masked_logits_give_a_valid_id() -> None:
    masked = torch.full((VOCAB,), float("-inf"))
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=2)):
        sample(params, masked, seed=params.seed)  # asserts 0 <= id < vocab


def test_large_repetition_penalty_is_finite(logits: torch.Tensor) -> None:
    best = int(logits.argmax())
    params = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    assert sample(params, logits, output=[best]) != best  # the penalty pushes the seen best token down
