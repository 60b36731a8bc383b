"""KV tiers end to end on the default model: the same tokens with and without them (fp32,
greedy), across eviction to host memory, swap preemption, a restart from disk, damaged chunk
files and a different model file."""

from __future__ import annotations

import shutil

import pytest

from fornax import LLM, SamplingParams
from tests.engine import words

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SMALL_POOL = 40  # blocks of 16: one 330-token document plus a little, not two


def _llm(gguf, **kwargs) -> LLM:
    kwargs.setdefault("num_blocks", SMALL_POOL)
    return LLM(str(gguf), dtype="float32", block_size=16, progress=False, **kwargs)


def _prompts(tok) -> tuple[list[list[int]], list[int]]:
    """Three questions about one document, and an unrelated text that evicts it."""
    doc = "Read this and answer.\n" + words(280, start=3)
    questions = [
        tok.encode(doc + f"\nQuestion {i}: {q}")
        for i, q in enumerate(["who bakes bread?", "what do bees do?", "why carry a map?"])
    ]
    filler = tok.encode("Unrelated notes.\n" + words(450, start=120))
    return questions, filler


def _tokens(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    out = llm.generate([prompt], params)[0]
    llm.engine.check_integrity()
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.fixture(scope="module")
def reference(default_gguf):
    """No tiers: every evicted prefix is recomputed."""
    return _llm(default_gguf)


@pytest.fixture(scope="module")
def expected(reference):
    questions, filler = _prompts(reference.get_tokenizer())
    return {tuple(p): _tokens(reference, p)[0] for p in [*questions, filler]}


def test_evicted_prefix_comes_back_from_host_memory(default_gguf, expected):
    llm = _llm(default_gguf, kv_offload_memory="64MiB")
    questions, filler = _prompts(llm.get_tokenizer())
    connector = llm.engine.scheduler.connector
    for i, q in enumerate(questions):
        assert _tokens(llm, filler)[0] == expected[tuple(filler)]  # evicts the document's blocks
        tokens, cached = _tokens(llm, q)
        assert tokens == expected[tuple(q)]
        if i:  # the document was computed once, then loaded back from tier 1 each time
            assert cached >= 256, f"question {i}: only {cached} cached tokens"
    stats = connector.stats()
    assert stats.hit_tokens_host >= 2 * 256 and stats.bytes_from_host > 0 and stats.bytes_to_host > 0
    assert stats.hit_tokens_disk == 0


def test_swap_preemption_gives_the_same_tokens_as_recompute(default_gguf):
    prompts = [list(range(1000 + 40 * i, 1000 + 40 * i + 60 + 13 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = _llm(default_gguf, num_blocks=256)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    for mode in ("swap", "recompute"):
        llm = _llm(default_gguf, num_blocks=14, kv_offload_memory="64MiB", preemption_mode=mode)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        sched = llm.engine.scheduler
        assert sched.num_preemptions_total > 0, "the pool must be too small for all six at once"
        assert got == want, f"{mode}: tokens differ from the unpreempted run"
        stats = sched.connector.stats()
        if mode == "swap":
            assert stats.swapped_out > 0 and stats.swapped_in == stats.swapped_out
        else:
            assert stats.swapped_out == 0
        llm.engine.check_integrity()
        assert llm.engine.kv_cache_usage == 0.0
        assert sched.connector.index.swapped("0") is None


def test_disk_tier_survives_a_restart_and_ignores_damaged_chunks(default_gguf, expected, tmp_path):
    tiers = {"kv_offload_memory": "64MiB", "kv_offload_dir": str(tmp_path / "kv")}
    first = _llm(default_gguf, **tiers)
    questions, _ = _prompts(first.get_tokenizer())
    assert _tokens(first, questions[0])[0] == expected[tuple(questions[0])]
    first.close()  # what the server's drain does: finished requests' blocks reach the disk
    disk = first.engine.scheduler.connector.disk
    files = sorted(disk.dir.rglob("*.kv"))
    assert len(files) >= 256 // 16, f"only {len(files)} chunk files written"
    del first

    second = _llm(default_gguf, **tiers)  # a new engine: nothing in memory, the same directory
    tokens, cached = _tokens(second, questions[1])
    assert tokens == expected[tuple(questions[1])] and cached >= 256
    assert second.engine.scheduler.connector.stats().hit_tokens_disk >= 256
    del second

    # Damage the third chunk of the chain: the first two load, the rest is recomputed.
    third = _llm(default_gguf, **tiers)
    connector = third.engine.scheduler.connector
    request_hashes = _chain(third, questions[2])
    victim = connector.disk._path(request_hashes[2])
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    tokens, cached = _tokens(third, questions[2])
    assert tokens == expected[tuple(questions[2])]
    assert cached == 2 * 16, "loading stops at the damaged chunk"
    assert connector.stats().corrupt_chunks == 1 and not victim.exists()


def _chain(llm: LLM, prompt: list[int]) -> list[bytes]:
    from fornax.engine.kv.block_pool import ROOT_BLOCK_HASH, hash_block_tokens

    chain, parent = [], ROOT_BLOCK_HASH
    for i in range(len(prompt) // 16):
        parent = hash_block_tokens(parent, prompt[i * 16 : (i + 1) * 16])
        chain.append(parent)
    return chain


def test_a_different_model_file_never_reuses_chunks(default_gguf, tmp_path):
    tiers = {"kv_offload_memory": "64MiB", "kv_offload_dir": str(tmp_path / "kv")}
    first = _llm(default_gguf, **tiers)
    questions, _ = _prompts(first.get_tokenizer())
    _tokens(first, questions[0])
    first.close()
    assert list((tmp_path / "kv").rglob("*.kv"))
    del first
    # The same architecture and shapes, one byte of the file different: another model.
    other = tmp_path / "other.gguf"
    shutil.copyfile(default_gguf, other)
    with other.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    second = _llm(other, **tiers)
    _, cached = _tokens(second, questions[1])
    assert cached == 0 and second.engine.scheduler.connector.stats().hit_tokens_disk == 0
