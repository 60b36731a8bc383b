"""EngineCore's observer API (engine/stats.py): stats() and sequences() follow a request with
n=2 through chunked prefill, the held-back sibling's prefix-cache hit, and its end."""

from __future__ import annotations

import pytest

from fornax import LLM, SamplingParams
from fornax.engine.request import RequestStatus
from fornax.engine.stats import SequenceView
from tests.model.tiny_models import build_tiny_model

NUM_BLOCKS, BLOCK_SIZE, CHUNK = 64, 16, 16


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama-stats")
    build_tiny_model("llama", out)
    llm = LLM(
        str(out),
        dtype="float32",
        enable_prefix_caching=True,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=CHUNK,
        progress=False,
    )
    return llm.engine


def test_stats_and_sequences_through_a_request(core):
    fresh = core.stats()
    assert (fresh.num_running, fresh.num_waiting, fresh.num_used_kv_blocks) == (0, 0, 0)
    assert (fresh.num_kv_blocks, fresh.num_free_kv_blocks) == (NUM_BLOCKS, NUM_BLOCKS)
    assert fresh.block_size == BLOCK_SIZE
    assert (fresh.last_step_num_batched_tokens, fresh.last_step_num_seqs) == (0, 0)
    assert fresh.kv_cache_usage == 0.0 and fresh.prefix_cache_hit_rate == 0.0

    prompt = list(range(3, 3 + 40))  # 40 tokens: two full blocks and a partial one
    core.add_request("a", prompt, SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True))
    # The second sample waits, outside the scheduler, for the first one's prefill.
    assert core.stats().num_waiting == 1
    assert core.sequences() == [SequenceView("a", 0, RequestStatus.WAITING, 40, 0, 40, 0)]

    core.step()
    stats = core.stats()
    assert stats == core.stats()  # a read, nothing more
    assert (stats.last_step_num_batched_tokens, stats.last_step_num_seqs) == (CHUNK, 1)
    assert (stats.num_running, stats.num_waiting) == (1, 0)
    [first] = core.sequences()
    assert (first.request_id, first.index, first.num_computed_tokens) == ("a", 0, CHUNK) and first.running
    assert first.num_blocks == len(core.block_ids("a#0")) == stats.num_used_kv_blocks > 0
    assert stats.kv_cache_usage == stats.num_used_kv_blocks / NUM_BLOCKS

    seen_sibling = False
    while core.has_unfinished_requests():
        core.step()
        views = core.sequences()
        stats = core.stats()
        assert stats.num_running == sum(v.running for v in views)
        assert stats.num_waiting == sum(not v.running for v in views)
        assert stats.last_step_num_seqs <= 2 and stats.last_step_num_batched_tokens <= CHUNK
        if any(v.index == 1 for v in views):
            seen_sibling = True
            assert core.sequence_key("a#1") == ("a", 1)
            sibling = core.find_sequence("a", 1)
            assert sibling is not None and sibling.request_id == "a#1"
    assert seen_sibling

    done = core.stats()
    assert (done.num_running, done.num_waiting, done.num_used_kv_blocks) == (0, 0, 0)
    assert done.kv_cache_usage == 0.0
    # Both samples looked their prompt up; the second found the first's two full blocks.
    assert (done.prefix_cache_queries, done.prefix_cache_hits) == (80, 32)
    assert done.prefix_cache_hit_rate == 32 / 80
    assert core.sequences() == [] and core.find_sequence("a", 0) is None
    assert core.sequence_key("gone") == ("gone", 0)
    assert core.take_offload_stats() is None  # no KV tiers configured
    core.check_integrity()


def test_memory_report_counts_the_engines_tensors(core):
    owners = core.memory_report().as_dict()["owners"]
    assert "KV cache pools" in owners  # what a pool holds depends on which pages requests wrote
    assert owners["tokenizer"] == core.tokenizer_bytes
    assert any(owner.startswith("weights: ") for owner in owners)
