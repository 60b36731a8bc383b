"""Mixture-of-experts families against transformers on tiny random models built here:
Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with a dense layer among sparse ones,
OLMoE with whole-projection Q/K norms and clipped values. The config's routing, fp32 logits
within 1e-3, 32 greedy tokens identical for prompts batched together, routing ties broken as
transformers breaks them, the quantized forms running on every expert (models/moe.py); then
the same models as llama.cpp-style GGUF files, experts merged per layer (models/gguf_moe.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.config import ConfigError
from fornax.layers.linear import BlockInt4
from fornax.models import ModelLoadError
from fornax.models.moe import SparseMoE
from tests.hf_reference import greedy_disagreement, logit_gap
from tests.model.tiny_models import build_tiny_model

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
PROMPTS = [[5, 17, 99, 200, 31, 7], [3] * 3 + list(range(40, 80)), [250], list(range(300, 340, 3))]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model(request.param, out)
    llm = LLM(str(out), dtype="float32", num_blocks=64, progress=False)
    return request.param, hf, llm, out


def test_routing_config_mapped(tiny):
    arch, _hf, llm, _ = tiny
    moe = llm.engine.model_config.moe
    assert moe is not None
    expected = {
        "mixtral": (4, 2, True, (0, 1), 0),
        "qwen2_moe": (6, 2, False, (0, 1), 96),
        "qwen3_moe": (8, 3, True, (0,), 0),  # layer 1 is in mlp_only_layers
        "olmoe": (8, 2, False, (0, 1), 0),
    }[arch]
    got = (
        moe.num_experts,
        moe.top_k,
        moe.normalize_top_k,
        moe.sparse_layers,
        moe.shared_expert_intermediate_size,
    )
    assert got == expected
    layers = llm.engine.runner.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [
        i in moe.sparse_layers for i in range(2)
    ]


def test_logits_match_transformers(tiny):
    _arch, hf, llm, _ = tiny
    for ids in PROMPTS:
        assert logit_gap(llm.engine.runner.model, hf, ids) < 1e-3


def test_greedy_matches_transformers_batched(tiny):
    arch, hf, llm, _ = tiny
    outs = llm.generate(PROMPTS, GREEDY)  # batched: each step's tokens grouped by expert together
    for prompt, out in zip(PROMPTS, outs):
        at = greedy_disagreement(hf, prompt, out.outputs[0].token_ids)
        assert at is None, f"{arch}: prompt {prompt[:4]}... differs from transformers at token {at}"
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0


def test_routing_ties_break_as_in_transformers(tiny, tmp_path):
    """A router of zeros gives every expert the same probability: which top-k it picks is
    then torch.topk's tie rule alone, and must be transformers' (the same experts, so the
    same logits)."""
    _arch, hf, _llm, src = tiny
    import shutil

    tied = tmp_path / "tied"
    shutil.copytree(src, tied)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tied / "model.safetensors"))
    name = next(n for n in tensors if n.endswith(".gate.weight") and ".layers.0." in n)
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    hf_tied = type(hf).from_pretrained(str(tied), dtype=torch.float32).eval()
    llm = LLM(str(tied), dtype="float32", num_blocks=16, progress=False)
    weights, _experts = llm.engine.runner.model.layers[0].mlp.route(torch.randn(3, 64))
    assert (weights == weights[0, 0]).all()  # a true tie: every pick has the same weight
    assert logit_gap(llm.engine.runner.model, hf_tied, PROMPTS[1]) < 1e-3


@pytest.mark.parametrize("quantization", ["int8", "int4", "auto"])
def test_quantized_experts_run_close_to_float(tiny, quantization):
    """Each expert's projections take the planned integer forms (bf16 model, make run's w8a8
    large steps): the outputs stay close to the float model's, tokens are produced, nothing leaks."""
    _arch, _hf, ref_llm, src = tiny
    llm = LLM(str(src), dtype="bfloat16", quantization=quantization, num_blocks=64, progress=False)
    model = llm.engine.runner.model
    if quantization != "auto":  # "auto" keeps float tensors dense
        assert model.has_quantized_small_steps()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    want = ref_llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))
    # the first token's logprob under the float model vs this form: close, not equal
    for o, w in zip(outs, want):
        assert abs(o.outputs[0].logprobs[0].logprob - w.outputs[0].logprobs[0].logprob) < 0.5
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_two_ranks_split_the_experts_and_match_one_process(arch, tmp_path):
    """Tensor parallelism over two processes: each rank holds half the experts (and half the
    shared expert's channels); greedy tokens equal one process's and logprobs within 1e-4.
    Qwen2-MoE brings the shared expert, Qwen3-MoE a dense layer among the sparse ones."""
    from fornax.models.moe import SparseMoE as Block

    build_tiny_model(arch, tmp_path / arch)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=4)

    def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate(PROMPTS, params)
        return [
            (
                o.outputs[0].token_ids,
                [x for lp in o.outputs[0].logprobs for x in (lp.logprob, *lp.top_logprobs)],
            )
            for o in outs
        ]

    config = {"dtype": "float32", "num_blocks": 64, "progress": False}
    want = run(LLM(str(tmp_path / arch), **config))
    tp = LLM(str(tmp_path / arch), tensor_parallel_size=2, **config)
    held = [len(m.experts) for m in tp.engine.runner.model.modules() if isinstance(m, Block)]
    local = tp.engine.runner.model.config.moe  # rank 0's slice of the config
    assert held and all(n == len(local.held_experts) < local.num_experts for n in held)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(run(tp), want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
    tp.engine.check_integrity()


def test_olmoe_refuses_tensor_parallelism_by_name(tmp_path):
    """Its Q/K norms take an RMS over every head at once, which no single rank holds."""
    build_tiny_model("olmoe", tmp_path / "olmoe")
    with pytest.raises(ConfigError, match=r"whole projection \(OLMoE\) are not split over ranks"):
        LLM(str(tmp_path / "olmoe"), dtype="float32", tensor_parallel_size=2, num_blocks=16, progress=False)


def test_deterministic_mode_gives_each_prompt_its_bits_alone(tiny):
    """Batch-invariant expert forms and a router whose sums do not depend on the batch: each
    prompt alone gets the tokens and logprob bits it gets among the others, and they are still
    transformers' greedy tokens."""
    _arch, hf, _llm, src = tiny
    llm = LLM(str(src), dtype="float32", deterministic=True, num_blocks=64, progress=False)
    assert all(
        m.router_matmul is not None for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)

    def key(out) -> tuple:
        comp = out.outputs[0]
        return tuple(comp.token_ids), tuple(lp.logprob for lp in comp.logprobs)

    together = llm.generate(PROMPTS, params)
    assert [key(o) for o in together] == [key(llm.generate([p], params)[0]) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, together):
        assert greedy_disagreement(hf, prompt, out.outputs[0].token_ids) is None


# -- the same models as llama.cpp-style GGUF files (gguf's writer, llama.cpp's names) --

_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
_EXPERT_PARTS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_PLAIN = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"self_attn.{p}_proj.bias": f"attn_{p}.bias" for p in "qkv"},
}


def _write_moe_gguf(
    src,
    hf,
    path,
    qtype,
    expert_used: int | None = None,
    drop_expert: bool = False,
    hostile: dict | None = None,
) -> dict:
    """The saved checkpoint as llama.cpp's converter lays it out: experts merged per layer into
    3-D tensors, the shared expert's gate 1-D, Q/K permuted for the `llama` architecture.
    Returns what each written tensor dequantizes to, by GGUF name. hostile: extra metadata
    (key: value, written as given) and tensors (name: array) a malformed file would carry."""
    import re

    import numpy as np
    from safetensors.torch import load_file

    from tests.model.test_gguf_loading import (
        _GGUF_NAMES,
        _LAYER_NAMES,
        _llama_cpp_permute,
        finish_gguf,
        start_gguf,
    )

    arch, cfg = _GGUF_ARCH[src.name.rstrip("0123456789")], hf.config
    writer = start_gguf(path, arch, cfg, float(cfg.rope_parameters["rope_theta"]))  # Mixtral's is 1e6
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(expert_used or cfg.num_experts_per_tok)
    if arch not in ("llama", "olmoe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "olmoe" and "olmoe.attention.clamp_kqv" not in (hostile or {}):
        writer.add_clamp_kqv(cfg.clip_qkv)
    for key, value in (hostile or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
    merged: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        w = tensor.float().numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            out[_GGUF_NAMES[name]] = w
            continue
        layer, rest = int(m.group(1)), m.group(2)
        e = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", rest)
        if e:
            merged.setdefault((layer, _EXPERT_PARTS[e.group(2)]), {})[int(e.group(1))] = w
            continue
        if rest == "mlp.shared_expert_gate.weight":
            w = w.reshape(-1)
        if arch == "llama" and rest.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
            w = _llama_cpp_permute(w, heads)
        out[f"blk.{layer}.{_PLAIN.get(rest) or _LAYER_NAMES[rest]}"] = w
    for (layer, part), per_expert in merged.items():
        kept = experts - 1 if drop_expert and part == "down" else experts  # a file short of one expert
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([per_expert[i] for i in range(kept)])
    out |= {k: v for k, v in (hostile or {}).items() if not isinstance(v, str)}
    return finish_gguf(writer, out, qtype, lambda name, w: w.ndim >= 2 and "ffn_gate_inp" not in name)


def llm_moe(tiny):
    return tiny[2].engine.model_config.moe


def test_gguf_f32_matches_transformers(tiny, tmp_path):
    from fornax.models import load_model

    arch, hf, _llm, src = tiny
    from gguf import GGMLQuantizationType as Q

    path = tmp_path / f"{arch}.gguf"
    _write_moe_gguf(src, hf, path, Q.F32)
    loaded = load_model(path, "float32", progress=False)
    moe, want = loaded.config.moe, llm_moe(tiny)
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.sparse_layers) == (
        want.num_experts,
        want.top_k,
        want.sparse_layers,
    )
    assert logit_gap(loaded.model, hf, PROMPTS[1]) < 1e-3


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0"])
def test_gguf_quantized_experts_split_block_for_block(tiny, tmp_path, qtype_name):
    """Each expert's slice of a merged quantized tensor dequantizes to exactly gguf's values,
    and with quantization "auto" every expert takes its form from the file's own blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from fornax.models import load_model
    from fornax.models.loader import load_gguf

    arch, hf, _llm, src = tiny
    path = tmp_path / f"{arch}-{qtype_name}.gguf"
    written = _write_moe_gguf(src, hf, path, Q[qtype_name])
    weights = load_gguf(path, torch.float32, progress=False, keep_int4_blocks=True)
    moe = weights.config.moe
    assert moe is not None
    for layer in moe.sparse_layers:
        for part in ("gate", "up", "down"):
            merged = written[f"blk.{layer}.ffn_{part}_exps.weight"]
            for e in range(moe.num_experts):
                name = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
                assert np.array_equal(weights.tensors[name].numpy(), merged[e]), name
                assert weights.file_quantization[name] == ("int4" if qtype_name == "Q4_0" else "int8")
                assert (name in weights.int4_blocks) == (qtype_name == "Q4_0")
    dense = load_model(path, "float32", progress=False)  # the file's values, dense
    native = load_model(path, "float32", progress=False, small_step=("auto", 8))
    blocks = [m for m in native.model.modules() if isinstance(m, SparseMoE)]
    dense_blocks = [m for m in dense.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and len(blocks) == len(dense_blocks)
    for block, dense_block in zip(blocks, dense_blocks):
        for expert, dense_expert in zip(block.experts, dense_block.experts):
            for name in ("gate_up_proj", "down_proj"):
                form, w = getattr(expert, name).small, getattr(dense_expert, name).weight
                assert form is not None and form.quantized
                err = (form.dequantize() - w).abs().max().item()
                if qtype_name == "Q4_0" and isinstance(form, BlockInt4):  # the file's blocks as they are
                    assert err <= 1e-6 * w.abs().max().item(), err
                elif qtype_name == "Q4_0":  # torch's int4 form (a 32-wide expert): bf16 scales
                    assert err <= w.abs().max().item() * 2**-7, err
                else:  # Q8_0's blocks requantized per row: within one int8 step
                    assert err <= w.abs().max().item() / 127, err


def test_malformed_moe_gguf_is_one_clear_error(tiny, tmp_path):
    from gguf import GGMLQuantizationType as Q

    from fornax.models.loader import load_gguf

    arch, hf, llm, src = tiny
    experts = llm.engine.model_config.moe.num_experts
    path = tmp_path / "too-many-used.gguf"
    _write_moe_gguf(src, hf, path, Q.F32, expert_used=experts + 1)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok must be in"):
        load_gguf(path, torch.float32, progress=False)
    path = tmp_path / "short.gguf"
    _write_moe_gguf(src, hf, path, Q.F32, drop_expert=True)
    with pytest.raises(ModelLoadError, match=r"ffn_down_exps.weight has shape .* the metadata implies"):
        load_gguf(path, torch.float32, progress=False)
    # a router-like name outside any block is an unexpected tensor, named
    path = tmp_path / "stray-router.gguf"
    _write_moe_gguf(src, hf, path, Q.F32, hostile={"x.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'x\.ffn_gate_inp\.weight'"):
        load_gguf(path, torch.float32, progress=False)
    if arch == "olmoe":  # its value clamp must be a number
        path = tmp_path / "clamp.gguf"
        _write_moe_gguf(src, hf, path, Q.F32, hostile={"olmoe.attention.clamp_kqv": "wide"})
        with pytest.raises(ModelLoadError, match="clamp_kqv must be a positive number, got 'wide'"):
            load_gguf(path, torch.float32, progress=False)


def test_prefix_cache_chunked_prefill_and_speculation_keep_the_tokens(tiny):
    """The engine's paths that change how tokens reach the model (prefill in 16-token chunks,
    cached prefixes, n-gram drafts verified k + 1 at a time) give the plain run's tokens."""
    _arch, _hf, llm, src = tiny
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    other = LLM(
        str(src),
        dtype="float32",
        num_blocks=64,
        progress=False,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        speculative_config={**spec, "row_cost": 0.0, "draft_cost": 0.0},
    )
    for _ in range(2):  # the second run's prompts are served from the prefix cache
        outs = other.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[1].num_cached_tokens > 0 and other.engine.stats().spec_num_draft_tokens_total > 0
    other.engine.check_integrity()


def test_a_rank_reads_only_its_experts_from_a_gguf(tiny, tmp_path):
    """Rank 1 of 2's cuts: the experts rank 0 holds are not read from the merged tensors."""
    from gguf import GGMLQuantizationType as Q

    from fornax.models.loader import load_gguf
    from fornax.models.sharding import plan_shards, shard_cuts

    _arch, hf, _llm, src = tiny
    path = tmp_path / "moe.gguf"
    written = _write_moe_gguf(src, hf, path, Q.Q8_0)

    def rank_1(config):  # OLMoE's whole-projection norms are refused for TP; the experts' split is not
        return plan_shards(replace(config, qk_norm_whole=False), 2)[1]

    weights = load_gguf(path, torch.float32, progress=False, cuts_for=lambda c: shard_cuts(c, rank_1(c)))
    moe = weights.config.moe
    held = rank_1(weights.config).experts
    assert 0 < len(held) < moe.num_experts
    for e in range(moe.num_experts):
        got = weights.tensors[f"model.layers.{moe.sparse_layers[0]}.mlp.experts.{e}.down_proj.weight"]
        if e in held:
            assert torch.equal(
                got, torch.from_numpy(written[f"blk.{moe.sparse_layers[0]}.ffn_down_exps.weight"][e])
            )
        else:
            assert got.numel() == 0


def test_attention_adapter_matches_peft(tiny, tmp_path):
    """A PEFT LoRA adapter on the attention projections of a MoE model serves as PEFT computes
    it (greedy tokens of every prompt)."""
    from peft import PeftModel

    from fornax import LoRARequest
    from tests.model.test_lora import make_adapter

    _arch, hf, _llm, src = tiny
    make_adapter(hf, tmp_path / "qv", 8, 16, ["q_proj", "v_proj"], False, seed=1)
    llm = LLM(str(src), dtype="float32", num_blocks=64, lora=[f"qv={tmp_path / 'qv'}"], progress=False)
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "qv")).eval()
    outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("qv"))
    for prompt, out in zip(PROMPTS, outs):
        assert greedy_disagreement(peft, prompt, out.outputs[0].token_ids) is None
    peft.unload()
