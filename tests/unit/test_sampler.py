"""Sampler tests: exact checks of each processing stage and statistical checks of the draw.

Every random test fixes its seeds, so the suite is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from fornax.engine.request import Request, SamplingParams
from fornax.engine.sample.metadata import SamplingMetadata, make_generator
from fornax.engine.sample.sampler import (
    Sampler,
    SamplerOutput,
    filter_random_logits,
    min_p_threshold,
    process_logits,
    prompt_logprobs,
    to_token_logprobs,
    top_k_top_p_threshold,
)

VOCAB = 64


def make_request(
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: set[int] | None = None,
    **params: object,
) -> Request:
    sampling_params = SamplingParams(**params)
    request = Request(request_id, prompt or [1, 2, 3], sampling_params, eos_token_ids=eos or set())
    for token in output or []:
        request.append_output_token(token)
    return request


def run(
    requests: list[Request], logits: torch.Tensor, generators: dict[str, torch.Generator] | None = None
) -> tuple[SamplerOutput, SamplingMetadata]:
    meta = SamplingMetadata.build(requests, {} if generators is None else generators)
    return Sampler()(logits, meta), meta


def logits_from_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().expand(rows, -1).contiguous()  # [rows, vocab]


def counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).to(torch.float64)  # [vocab]


# -- greedy --


def test_temperature_zero_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)  # [6, vocab]
    requests = [make_request(f"r{i}", temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out, meta = run(requests, logits)
    assert not meta.all_greedy and not meta.all_random
    greedy_rows = torch.tensor([0, 2, 4])
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits.argmax(-1)[greedy_rows])
    out, meta = run([make_request(f"g{i}", temperature=0.0) for i in range(6)], logits)
    assert meta.all_greedy and meta.temperature is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.long and out.logprobs is None


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(32, VOCAB)  # [32, vocab]
    requests = [make_request(f"r{i}", temperature=1.5, top_k=1) for i in range(32)]
    for _ in range(5):
        out, _ = run(requests, logits)
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_nothing_to_process_returns_the_input_untouched() -> None:
    logits = torch.randn(3, VOCAB)  # [3, vocab]
    before = logits.clone()
    meta = SamplingMetadata.build([make_request(f"r{i}") for i in range(3)], {})
    assert meta.no_penalties and not meta.needs_processing
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None and meta.max_num_logprobs is None
    assert process_logits(logits, meta) is logits
    Sampler()(logits, meta)
    assert torch.equal(logits, before)


# -- filtering: top-p, top-k, min-p --


def test_top_p_never_samples_outside_the_nucleus() -> None:
    torch.manual_seed(2)
    probs = [0.5, 0.3, 0.15, 0.05]
    # Better tokens hold 0 (t0), 0.5 (t1), 0.8 (t2): with top_p 0.75 the nucleus is {t0, t1}.
    n = 4000
    requests = [make_request(f"r{i}", top_p=0.75) for i in range(n)]
    out, _ = run(requests, logits_from_probs(probs, n))
    c = counts(out.sampled_token_ids, 4)
    assert c[2] == 0 and c[3] == 0
    # Inside the nucleus the draw follows the renormalised distribution (0.625 / 0.375).
    assert abs(c[0] / n - 0.625) < 0.03


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """The logits with top-k / top-p applied at temperature 1 (filtered tokens at -inf)."""
    ones = torch.ones(logits.shape[0])
    threshold = top_k_top_p_threshold(logits, top_k, top_p, ones)  # [n, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def test_top_k_top_p_masks_exactly() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0, 4.0]])  # [2, 5]
    inf = float("-inf")
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), None)
    assert torch.equal(out, torch.tensor([[3.0, inf, 2.0, inf, inf], [0.0, 1.0, 2.0, 3.0, 4.0]]))
    # Row 0: top-k 3 leaves {0, 2, 1}; renormalised, token 0 alone holds ~0.665 < 0.7, so
    # token 2 joins and token 1 (mass before it ~0.91) is cut. Row 1: top-p off.
    out = apply_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([0.7, 1.0]))
    assert torch.equal(out, torch.tensor([[3.0, inf, 2.0, inf, inf], [0.0, 1.0, 2.0, 3.0, 4.0]]))


def reference_filter(row: torch.Tensor, temperature: float, min_p: float, k: int, p: float) -> torch.Tensor:
    """One row, the plain way: scale, min-p, full sort, cut to top-k, then to the nucleus of
    what is left (renormalised)."""
    scaled = (row / temperature).double()
    probs = torch.softmax(scaled, dim=-1)
    scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
    values, order = scaled.sort(descending=True)
    keep = torch.isfinite(values)
    if k > 0:
        keep[k:] = False
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    if p < 1.0:
        keep &= (probs.cumsum(-1) - probs) < p
    out = torch.full_like(scaled, float("-inf"))
    out[order[keep]] = scaled[order[keep]]
    return out


# (temperature, min_p, top_k, top_p) per row, with row scales that make flat rows (nuclei of
# thousands of tokens, so the candidate window must widen) and peaked ones.
FILTER_ROWS = [
    (1.0, 0.0, 0, 0.9, 0.1),
    (1.0, 0.0, 0, 1.0, 1.0),
    (0.7, 0.0, 300, 0.95, 0.2),
    (1.0, 0.0, 40, 1.0, 1.0),
    (1.3, 0.0, 0, 0.3, 3.0),
    (1.0, 0.0, 4000, 0.99, 0.05),
    (2.0, 0.0, 0, 0.999, 0.5),
    (0.5, 0.05, 0, 0.9, 1.0),
    (1.0, 0.2, 100, 0.8, 1.0),
    (1.5, 0.001, 0, 1.0, 1.0),
]


@pytest.mark.parametrize("use_min_p", [False, True])
def test_filters_match_a_full_sort_reference(use_min_p: bool) -> None:
    torch.manual_seed(9)
    vocab = 5000
    rows = [r if use_min_p else (r[0], 0.0, *r[2:]) for r in FILTER_ROWS]
    scales = torch.tensor([r[4] for r in rows]).unsqueeze(1)  # [n, 1]
    logits = torch.randn(len(rows), vocab) * scales  # [n, vocab]
    requests = [
        make_request(f"r{i}", temperature=t, min_p=m, top_k=k, top_p=p)
        for i, (t, m, k, p, _) in enumerate(rows)
    ]
    out = filter_random_logits(logits, SamplingMetadata.build(requests, {}))  # [n, vocab]
    for i, (t, m, k, p, _) in enumerate(rows):
        expected = reference_filter(logits[i], t, m, k, p)
        # The float32 cumsum may move the cut by a token with a near-zero margin.
        assert int((torch.isinf(out[i]) != torch.isinf(expected)).sum()) <= 1, rows[i]
        kept = torch.isfinite(out[i])
        torch.testing.assert_close(out[i][kept], logits[i][kept] / t)
    assert int(torch.isfinite(out[0]).sum()) > 1000  # the window really did widen
    assert torch.isfinite(out[1]).all()


def test_min_p_removes_tokens_below_threshold() -> None:
    probs = [0.4, 0.3, 0.2, 0.08, 0.02]
    logits = logits_from_probs(probs)  # [1, 5]
    threshold = min_p_threshold(logits, torch.tensor([0.3]), torch.tensor([1.0]))  # probability 0.12
    assert (logits[0, :3] >= threshold[0]).all() and (logits[0, 3:] < threshold[0]).all()
    # At temperature 2 the distribution flattens (p ~ sqrt(p)): 0.08 is now ~0.45 of the top, and stays.
    threshold = min_p_threshold(logits, torch.tensor([0.3]), torch.tensor([2.0]))
    assert (logits[0, :4] >= threshold[0]).all() and logits[0, 4] < threshold[0]
    torch.manual_seed(3)
    n = 3000
    sampled, _ = run([make_request(f"r{i}", min_p=0.3) for i in range(n)], logits_from_probs(probs, n))
    c = counts(sampled.sampled_token_ids, 5)
    assert c[3] == 0 and c[4] == 0 and (c[:3] > 0).all()


# -- distribution --


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_frequencies_match_softmax(temperature: float) -> None:
    torch.manual_seed(4)
    logits_row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # [6]
    n = 20000
    out, _ = run(
        [make_request(f"r{i}", temperature=temperature) for i in range(n)],
        logits_row.expand(n, -1).contiguous(),
    )
    expected = torch.softmax(logits_row.double() / temperature, dim=-1) * n  # [6]
    chi2 = float(((counts(out.sampled_token_ids, 6) - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


# -- seeds --


def test_seeded_row_is_independent_of_the_batch() -> None:
    torch.manual_seed(5)
    steps = 8
    seeded_logits = torch.randn(steps, 500)  # [steps, vocab]: the seeded request's logits per step

    def tokens_of_seeded(layout: list[str]) -> list[int]:
        """Run `steps` steps with the seeded request at the 'S' position of the layout."""
        generators: dict[str, torch.Generator] = {}
        requests = []
        for i, kind in enumerate(layout):
            if kind == "S":
                requests.append(make_request("seeded", seed=1234, top_p=0.95, top_k=200))
            elif kind == "G":
                requests.append(make_request(f"g{i}", temperature=0.0))
            elif kind == "O":  # another seeded request
                requests.append(make_request(f"o{i}", seed=i, temperature=0.8))
            else:
                requests.append(make_request(f"u{i}", min_p=0.01))
        row = layout.index("S")
        result = []
        for step in range(steps):
            logits = torch.randn(len(layout), 500) * 3  # [batch, vocab]
            logits[row] = seeded_logits[step]
            out, _ = run(requests, logits, generators)
            result.append(int(out.sampled_token_ids[row]))
        return result

    reference = tokens_of_seeded(["S"])
    assert len(set(reference)) > 1  # the draws really are random
    for layout in (["U", "S"], ["S", "G", "U", "O"], ["G", "O", "U", "U", "U", "S", "G"]):
        assert tokens_of_seeded(layout) == reference
    # A fresh generator with another seed gives another stream.
    generators: dict[str, torch.Generator] = {}
    other = make_request("other", seed=99, top_p=0.95, top_k=200)
    other_tokens = [
        int(run([other], seeded_logits[s : s + 1], generators)[0].sampled_token_ids[0]) for s in range(steps)
    ]
    assert other_tokens != reference


def test_build_creates_missing_generators_and_keeps_existing() -> None:
    generators = {"a": make_generator(7)}
    existing = generators["a"]
    requests = [make_request("a", seed=7), make_request("b", seed=8), make_request("c")]
    meta = SamplingMetadata.build(requests, generators)
    assert generators["a"] is existing and set(generators) == {"a", "b"}
    assert set(meta.generators) == {0, 1}
    assert make_generator(-5).initial_seed() != make_generator(5).initial_seed()
    make_generator(2**64 - 1)  # the whole validated range is accepted


# -- processing: logit bias, min_tokens, penalties --


def test_logit_bias_adds_exactly() -> None:
    logits = torch.randn(3, VOCAB)  # [3, vocab]
    requests = [
        make_request("a", logit_bias={5: 10.0, 7: -3.5}),
        make_request("b"),
        make_request("c", logit_bias={0: 100.0}, temperature=0.0),
    ]
    meta = SamplingMetadata.build(requests, {})
    processed = process_logits(logits, meta)
    expected = logits.clone()
    expected[0, 5] += 10.0
    expected[0, 7] -= 3.5
    expected[2, 0] += 100.0
    assert torch.equal(processed, expected)
    assert int(Sampler()(logits, meta).sampled_token_ids[2]) == 0


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(4, VOCAB)  # [4, vocab]
    logits[:, 2] = 50.0  # EOS would win every draw
    logits[:, 9] = 49.0  # and then the stop token
    requests = [
        make_request("a", output=[11], eos={2}, min_tokens=3, stop_token_ids=[9], temperature=0.0),
        make_request("b", output=[11, 12, 13], eos={2}, min_tokens=3, stop_token_ids=[9], temperature=0.0),
        make_request("c", eos={2}, min_tokens=1, ignore_eos=True, logit_bias={2: 5.0}),
        make_request("d", eos={2}),
    ]
    meta = SamplingMetadata.build(requests, {})
    processed = process_logits(logits, meta)
    assert math.isinf(processed[0, 2]) and math.isinf(processed[0, 9])
    assert math.isinf(processed[2, 2])  # ignore_eos does not lift the block; nor does a bias
    assert torch.equal(processed[1], logits[1]) and torch.equal(processed[3], logits[3])
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert int(sampled[0]) not in (2, 9) and int(sampled[1]) == 2 and int(sampled[2]) != 2


def test_penalties_change_logits_exactly() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, VOCAB) * 2  # [4, vocab]
    logits[0, 1] = 1.5  # a positive and a negative logit among the penalised tokens
    logits[0, 3] = -1.5
    requests = [
        make_request("rep", prompt=[1, 2], output=[3, 3, 5], repetition_penalty=1.3),
        make_request("plain", prompt=[1, 2], output=[3]),
        make_request(
            "add",
            prompt=[4, 6],
            output=[7, 7, 7, 8],
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            temperature=0.0,
        ),
        make_request("all", prompt=[10], output=[10, 11, 11], repetition_penalty=0.8, presence_penalty=1.0),
    ]
    meta = SamplingMetadata.build(requests, {})
    assert meta.penalties is not None and meta.penalties.rows is not None
    assert meta.penalties.rows.tolist() == [0, 2, 3]
    processed = process_logits(logits, meta)

    expected = logits.clone()
    for token in (1, 2, 3, 5):  # prompt + output, each once however often it occurs
        v = expected[0, token]
        expected[0, token] = v / 1.3 if v > 0 else v * 1.3
    for token, count in ((7, 3), (8, 1)):  # output only: the prompt's 4 and 6 are untouched
        expected[2, token] -= -0.25 * count + 0.5
    for token in (10, 11):
        v = expected[3, token]
        expected[3, token] = v / 0.8 if v > 0 else v * 0.8
        expected[3, token] -= 1.0  # presence (frequency 0)
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)
    assert torch.equal(processed[1], logits[1])


# -- logprobs --


def test_logprobs_are_of_the_raw_distribution_with_ranks() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB) * 2  # [3, vocab]
    requests = [
        make_request("a", logprobs=5, temperature=0.5, repetition_penalty=2.0, output=[4]),
        make_request("b", logprobs=0, temperature=0.0, logit_bias={int(logits[1].argmin()): 100.0}),
        make_request("c"),
    ]
    out, meta = run(requests, logits)
    assert meta.max_num_logprobs == 5 and out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)  # [3, vocab]
    for row, k in ((0, 5), (1, 0), (2, 5)):
        entry = to_token_logprobs(out, row, k)
        token = int(out.sampled_token_ids[row])
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
        assert entry.rank == int((raw[row] > raw[row, token]).sum()) + 1
        order = raw[row].argsort(descending=True)
        assert entry.rank == int((order == token).nonzero()) + 1
        assert entry.top_ids == order[:k].tolist()
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), raw[row, order[:k]])
    # Row 1 was biased onto the least likely token: its raw rank is last.
    assert to_token_logprobs(out, 1, 0).rank == VOCAB


def test_no_logprobs_requested() -> None:
    out, _ = run([make_request()], torch.randn(1, VOCAB))
    with pytest.raises(ValueError):
        to_token_logprobs(out, 0, 0)


def test_prompt_logprobs() -> None:
    torch.manual_seed(8)
    logits = torch.randn(7, VOCAB)  # [7, vocab]
    next_ids = torch.randint(0, VOCAB, (7,))  # [7]
    entries = prompt_logprobs(logits, next_ids, 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(entries) == 7
    for i, entry in enumerate(entries):
        token = int(next_ids[i])
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(raw[i, token]), abs=1e-6)
        assert entry.rank == int((raw[i] > raw[i, token]).sum()) + 1
        assert entry.top_ids == raw[i].topk(3).indices.tolist()
