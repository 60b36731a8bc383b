"""Tensor-parallel shards (fornax/models/sharding.py) in real processes over gloo on
loopback: each rank reads only its parts of the safetensors files, builds its slice of the
model, runs the same prompt through it with its own paged KV cache and the all-reduces, and
the logits equal the single-process model's in float32 (within 1e-4) on a tiny random model
of each family, with heads split evenly and with KV heads replicated (2 KV heads over 4 ranks);
the uneven split (the default model's 3 KV heads over 2 ranks) is the plan test's and the
engine test's. Also the plan itself (which rank holds which heads), and the parts a rank reads
of a GGUF file."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fornax.config import ModelConfig
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.layers.native import load_paged_attention
from fornax.layers.ops import layer_ops
from fornax.models import load_model, load_weights
from fornax.models.base import KVCache
from fornax.models.loader import read_cut
from fornax.models.registry import resolve_model
from fornax.models.sharding import (
    ShardPlan,
    connect_gloo_groups,
    gloo_shard,
    plan_shards,
    shard_cuts,
    take_cut,
)
from tests.model.tiny_models import build_tiny_model
from tests.support import free_port

PROMPT = [5, 17, 99, 200, 31, 7, 3, 3, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
BLOCK = 16


def _logits(source: str, world: int, rank: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The prompt's logits through rank `rank`'s shard (world 1: the whole model)."""
    loaded = load_model(
        source, "float32", progress=False, shard=None if group is None else gloo_shard(group, rank)
    )
    model, local = loaded.model, loaded.local_config or loaded.config
    model.use_ops(layer_ops("native", torch.float32))
    blocks = -(-len(PROMPT) // BLOCK)
    cache = KVCache(local, blocks + 2, BLOCK, torch.float32)
    kernel = load_paged_attention()
    spans = [SeqSpan(0, len(PROMPT), list(range(blocks + 1, 1, -1)))]  # scattered, reversed blocks
    meta = build_attention_metadata(
        spans, BLOCK, local.sliding_window, kernel, interleaved=local.interleaves_sliding_window
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache, meta)
        return model.compute_logits(hidden)


def _shard_tensors(
    tensors: dict[str, torch.Tensor], config: ModelConfig, plan: ShardPlan, exact: bool
) -> dict[str, torch.Tensor]:
    """The definition of a rank's tensors: its cuts (shard_cuts) of the whole model's."""
    cuts = shard_cuts(config, plan, exact)
    return {k: take_cut(v, cuts[k]).contiguous() if k in cuts else v for k, v in tensors.items()}


def _rank_main(rank: int, world: int, port: int, sources: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)  # one thread per rank: the ranks share this machine's cores
    group, _ = connect_gloo_groups(f"tcp://127.0.0.1:{port}", rank, world, 120)
    for i, source in enumerate(sources):
        torch.save(_logits(source, world, rank, group), os.path.join(out_dir, f"{i}.rank{rank}.pt"))


def _run_ranks(world: int, sources: list[str], out_dir: Path) -> list[list[torch.Tensor]]:
    """Each source's logits from every rank of a `world`-process group."""
    mp.spawn(_rank_main, args=(world, free_port(), sources, str(out_dir)), nprocs=world, join=True)
    return [[torch.load(out_dir / f"{i}.rank{r}.pt") for r in range(world)] for i in range(len(sources))]


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory) -> dict[str, str]:
    sources = {}
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma3"):
        out = tmp_path_factory.mktemp(f"tp-{arch}")
        build_tiny_model(arch, out)
        sources[arch] = str(out)
    return sources


def test_two_ranks_match_one_process(tiny_sources, tmp_path):
    """(The default model's uneven split runs through the engine in test_tensor_parallel_engine.py.)"""
    names = list(tiny_sources)
    sources = list(tiny_sources.values())
    per_rank = _run_ranks(2, sources, tmp_path)
    for name, source, ranks in zip(names, sources, per_rank):
        single = _logits(source, 1, 0)
        assert torch.equal(ranks[0], ranks[1]), f"{name}: the ranks disagree"
        torch.testing.assert_close(ranks[0], single, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_four_ranks_replicate_kv_heads(tiny_sources, tmp_path):
    """Tiny Llama: 4 query heads, 2 KV heads over 4 ranks: each KV head on two ranks."""
    (ranks,) = _run_ranks(4, [tiny_sources["llama"]], tmp_path)
    single = _logits(tiny_sources["llama"], 1, 0)
    for r, logits in enumerate(ranks):
        torch.testing.assert_close(logits, single, atol=1e-4, rtol=0, msg=lambda m, r=r: f"rank {r}: {m}")


@pytest.mark.parametrize(("arch", "world"), [("llama", 4), ("gemma3", 2)])
def test_exact_layout_gives_one_process_bits(tiny_sources, arch, world):
    """Deterministic mode's layout (O and down split by output channel over gathered inputs):
    the engine over `world` ranks gives the single process's tokens and logprobs bit for bit,
    float32, KV heads replicated at 4 ranks (2 KV heads)."""
    from fornax import LLM, SamplingParams

    args = {"dtype": "float32", "deterministic": True, "progress": False}
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:], PROMPT[:7] * 3]

    def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
        return [
            (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)
        ]

    want = run(LLM(tiny_sources[arch], **args))
    tp = LLM(tiny_sources[arch], tensor_parallel_size=world, **args)
    try:
        assert run(tp) == want
    finally:
        tp.engine.executor.close()


def _config(heads: int, kv_heads: int, inter: int = 1536) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=heads * 64,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )


def test_plan_splits_by_kv_group():
    # the default model's shape: 9 query heads in 3 groups, over 2 ranks: 2 groups + 1
    plans = plan_shards(_config(9, 3), 2)
    assert [(p.q_heads, p.kv_heads, p.intermediate) for p in plans] == [
        (range(6), range(2), range(768)),
        (range(6, 9), range(2, 3), range(768, 1536)),
    ]
    # fewer KV heads than ranks: each KV head on two ranks, its 4 query heads split 2 + 2
    plans = plan_shards(_config(8, 2), 4)
    assert [(p.q_heads, p.kv_heads) for p in plans] == [
        (range(2), range(1)),
        (range(2, 4), range(1)),
        (range(4, 6), range(1, 2)),
        (range(6, 8), range(1, 2)),
    ]
    assert plans[3].local_config(_config(8, 2)).num_attention_heads == 2


def test_plan_refuses_splits_that_break_a_group():
    with pytest.raises(ValueError, match="cannot be split"):
        plan_shards(_config(9, 3), 4)  # 3 KV heads over 4 ranks
    with pytest.raises(ValueError, match="cannot be split"):
        plan_shards(_config(6, 2), 8)  # 3 query heads per KV head over 4 ranks each


def test_a_rank_reads_its_parts_of_the_gguf(default_gguf):
    """What each rank reads of the default model's file (its Q4_1 blocks cut on block
    boundaries, never dequantized whole) equals the whole model's tensors cut afterwards, and
    so do the int4 blocks `--quantization auto` builds its forms from; in both layouts (O and
    down cut by input, or by output channel: Shard.exact)."""
    source = resolve_model(str(default_gguf))
    whole = load_weights(source, torch.float32, progress=False, keep_int4_blocks=True)
    for plan, exact in itertools.product(plan_shards(whole.config, 2), (False, True)):
        cuts = shard_cuts(whole.config, plan, exact)
        part = load_weights(
            source, torch.float32, progress=False, keep_int4_blocks=True, cuts_for=lambda c, cuts=cuts: cuts
        )
        want = _shard_tensors(whole.tensors, whole.config, plan, exact)
        assert want.keys() == part.tensors.keys()
        for name, tensor in want.items():
            assert torch.equal(part.tensors[name], tensor), name
        assert part.int4_blocks.keys() == whole.int4_blocks.keys()
        for name, blocks in whole.int4_blocks.items():
            axis, start, stop = cuts.get(name, (0, 0, len(blocks.q)))
            scale_cut = (axis, start // 32, stop // 32) if axis else (axis, start, stop)
            assert torch.equal(part.int4_blocks[name].q, take_cut(blocks.q, (axis, start, stop))), name
            assert torch.equal(part.int4_blocks[name].scale, take_cut(blocks.scale, scale_cut)), name
            assert torch.equal(part.int4_blocks[name].zero, take_cut(blocks.zero, scale_cut)), name


def test_a_cut_inside_the_files_blocks(gemma3_gguf):
    """Gemma 3's Q4_K / Q6_K tensors hold 256 values per block: a column cut at a multiple of
    32 inside one reads whole rows and is cut after dequantizing; one on a block boundary reads
    only its bytes. Both give the same values as dequantizing the whole tensor."""
    from gguf.quants import dequantize

    from fornax.models.loader import read_gguf

    file = read_gguf(gemma3_gguf)
    down = next(t for t in file.tensors if t.name == "blk.0.ffn_down.weight" and t.type_name == "Q6_K")
    whole = dequantize(down.data, down.qtype)
    for cut, reads_whole_rows in (((1, 96, 608), True), ((1, 256, 768), False)):
        raw, after = read_cut(down, cut)
        assert (after is not None) == reads_whole_rows
        values = dequantize(raw, down.qtype)
        values = take_cut(values, after) if after is not None else values
        assert (values == take_cut(whole, cut)).all()
