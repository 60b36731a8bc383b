"""LoRA adapters made by peft on tiny random models of every family: fornax's tokens and logits
against PEFT's own model (unmerged) and against the merged weights, alone and mixed in one batch,
and a prefix cached under one adapter never served to another."""

from __future__ import annotations

import copy
import json
import mmap

import pytest
import torch
from safetensors.torch import load_file, save_file

from fornax import LLM, LoRARequest, SamplingParams
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.layers.linear import Linear
from fornax.layers.lora import LoRAStep
from fornax.models.base import KVCache
from fornax.models.lora import write_slot
from tests.model.tiny_models import build_tiny_model

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3"]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA): ranks 1, 8 and 64, all targets and subsets.
ADAPTERS = {
    "r1-qv": (1, 2, ["q_proj", "v_proj"], False),
    "r8-all": (8, 16, ALL_TARGETS, False),
    "r64-subset": (64, 32, ["k_proj", "o_proj", "up_proj", "down_proj"], True),
}
PROMPTS = [[5, 17, 99, 200, 31, 7], [3] * 3 + list(range(40, 80)), [250]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_adapter(hf, out, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int) -> None:
    """A PEFT LoRA adapter of `hf` with random A and B (PEFT starts B at zero: an adapter
    that changes nothing would prove nothing), saved in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora)
    peft_model = get_peft_model(hf, config, adapter_name="default")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(str(out))
    peft_model.unload()  # hf back to the base model, for the next adapter


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf = build_tiny_model(request.param, root / "base")
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        make_adapter(hf, root / name, *spec, seed=seed)
    llm = LLM(
        str(root / "base"),
        dtype="float32",
        num_blocks=128,
        max_loras=2,  # fewer slots than adapters: the third waits for one, then swaps in
        max_lora_rank=64,
        lora=[f"{name}={root / name}" for name in ADAPTERS],
        progress=False,
    )
    return request.param, hf, root, llm


def _peft_model(hf, path):
    """PEFT's model over a copy of the base (merging writes into the weights it wraps)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_match_peft(tiny, name):
    _arch, hf, root, llm = tiny
    engine = llm.engine
    model, config, lora = engine.runner.model, engine.model_config, engine.lora
    adapter = lora.registry.get(name)
    ids = PROMPTS[1]
    peft_model = _peft_model(hf, root / name)
    with torch.inference_mode():
        ref = peft_model(torch.tensor([ids])).logits[0]
        base_logits = hf(torch.tensor([ids])).logits[0]
    # The adapter in a slot of its own, outside the scheduler's books, then put back as they say.
    slot = 1
    write_slot(model, config, slot, adapter)
    lora.state.version += 1
    cache = KVCache(config, 8, 16, torch.float32)
    meta = build_attention_metadata(
        [SeqSpan(0, len(ids), [2, 0, 5, 1])],
        16,
        config.sliding_window,
        interleaved=config.interleaves_sliding_window,
    )
    try:
        lora.state.current = LoRAStep.build([slot], [len(ids)], {slot: adapter.rank}, lora.state.version)
        with torch.inference_mode():
            ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, meta))
    finally:
        lora.state.current = None
        write_slot(model, config, slot, lora.slots.occupant[slot])
        lora.state.version += 1
    assert (ref - base_logits).abs().max().item() > 0.1  # the adapter changes the logits...
    assert (ours - ref).abs().max().item() < 1e-4  # ...exactly as PEFT's model does


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_matches_peft_unmerged_and_merged(tiny, name):
    _arch, hf, root, llm = tiny
    peft_model = _peft_model(hf, root / name)
    unmerged = [_greedy(peft_model, p) for p in PROMPTS]
    merged_model = peft_model.merge_and_unload()  # the base weights + B A, one model
    merged = [_greedy(merged_model, p) for p in PROMPTS]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(name))
    ours = [o.outputs[0].token_ids for o in outs]
    assert ours == unmerged
    assert ours == merged
    llm.engine.check_integrity()


def test_a_mixed_batch_gives_each_request_its_own_tokens(tiny):
    _arch, _hf, _root, llm = tiny
    names = [None, *ADAPTERS]  # the base and three adapters, over two slots
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)

    def logprobs(out) -> list[float]:
        return [lp.logprob for lp in out.outputs[0].logprobs]

    alone = {n: llm.generate(PROMPTS[1], params, lora_request=n and LoRARequest(n))[0] for n in names}
    prompts = [PROMPTS[1]] * len(names) * 2
    requests = [n and LoRARequest(n) for n in names] * 2
    mixed = llm.generate(prompts, params, lora_request=requests)
    for request, out in zip(requests, mixed):
        name = request and request.lora_name
        assert out.outputs[0].token_ids == alone[name].outputs[0].token_ids, name
        assert logprobs(out) == pytest.approx(logprobs(alone[name]), abs=1e-4), name
    # Each adapter's outputs are its own (a tiny model may repeat one token, so by logprobs):
    # rows given another adapter's product would have failed above.
    for a in names:
        for b in names:
            if a != b:
                assert logprobs(alone[a]) != pytest.approx(logprobs(alone[b]), abs=1e-3), (a, b)
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0
    assert sum(llm.engine.lora.slots.pins) == 0


def test_the_memory_report_counts_the_adapter_slots(tiny):
    """`fornax memory` and the engine's report name the slots as an owner of their own, no more
    than their float32 size in whole pages (pages never written stay out of the resident set)."""
    _arch, _hf, _root, llm = tiny
    llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest(next(iter(ADAPTERS))))  # a slot written
    slots = [
        m.lora for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.lora is not None
    ]
    tensors = [t for s in slots for t in (s.a, s.b)]
    pages = sum(-(-t.numel() * t.element_size() // mmap.PAGESIZE) + 1 for t in tensors)  # +1: any start
    owners = llm.engine.memory_report().as_dict()["owners"]
    assert 0 < owners["weights: LoRA adapter slots"] <= pages * mmap.PAGESIZE


def test_a_prefix_cached_under_one_adapter_is_no_hit_for_another(tiny):
    _arch, _hf, _root, llm = tiny
    prompt = list(range(100, 164))  # four full blocks
    first = llm.generate(prompt, GREEDY, lora_request=LoRARequest("r8-all"))[0]
    again = llm.generate(prompt, GREEDY, lora_request=LoRARequest("r8-all"))[0]
    other = llm.generate(prompt, GREEDY, lora_request=LoRARequest("r1-qv"))[0]
    base = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # the full blocks before the last token
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_adapters_are_refused_and_change_nothing(tiny, tmp_path):
    from fornax.models.lora import AdapterError

    _arch, _hf, root, llm = tiny
    lora = llm.engine.lora
    before = sorted(lora.registry.names())

    def clone(name: str, dest: str):
        d = tmp_path / dest
        d.mkdir()
        for f in (root / name).iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        return d

    over = clone("r64-subset", "over-rank")
    cfg = json.loads((over / "adapter_config.json").read_text())
    cfg["r"] = 128  # over max_lora_rank=64
    (over / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="over this server's limit"):
        lora.load("over", over)
    shapes = clone("r8-all", "wrong-rank")
    cfg = json.loads((shapes / "adapter_config.json").read_text())
    cfg["r"] = 4  # the tensors say 8
    (shapes / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="another rank"):
        lora.load("shapes", shapes)
    corrupt = clone("r8-all", "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="safetensors"):
        lora.load("corrupt", corrupt)
    missing = clone("r8-all", "missing")
    tensors = load_file(missing / "adapter_model.safetensors")
    dropped = {k: v for k, v in tensors.items() if "layers.1.mlp.down_proj" not in k}
    save_file(dropped, missing / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"named in adapter_config\.json but has no weights"):
        lora.load("missing", missing)
    other_base = clone("r8-all", "other-base")
    tensors = load_file(other_base / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.randn(8, 32)  # a base with hidden size 32, not 64
    save_file(tensors, other_base / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="another base model"):
        lora.load("other-base", other_base)
    with pytest.raises(AdapterError, match="already loaded"):
        lora.load("r8-all", root / "r8-all")
    assert sorted(lora.registry.names()) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_kernel_adds_what_the_torch_path_adds(dtype):
    """kernels/lora.c against the two-matmul torch path of layers/lora.py: three fused parts,
    four slots, rows of several adapters and of none, a step rank below the slots' maximum."""
    from fornax.layers.lora import LoRASlots, LoRAStepState
    from fornax.layers.native import load_lora_kernel

    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("the native kernels cannot be built here")
    gen = torch.Generator().manual_seed(0)
    parts, max_rank = (48, 16, 16), 8
    state = LoRAStepState()
    native = LoRASlots(state, 40, parts, 4, max_rank, kernel)
    reference = LoRASlots(state, 40, parts, 4, max_rank, None)
    for slot, rank in ((0, 8), (2, 3), (3, 5)):
        pairs = [(torch.randn(rank, 40, generator=gen), torch.randn(n, rank, generator=gen)) for n in parts]
        pairs[1] = None  # a part this adapter does not adapt
        for slots in (native, reference):
            slots.write(slot, pairs, scaling=0.5)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the same sum
    # many rows (split over threads by row), and one row (its products split over threads)
    for slots_of_requests, rows, base_rows in (
        ([0, None, 2, 3, 0], [3, 2, 1, 4, 1], slice(3, 5)),
        ([3], [1], None),
    ):
        state.current = LoRAStep.build(slots_of_requests, rows, {0: 8, 2: 3, 3: 5}, version=1)
        x = torch.randn(sum(rows), 40, generator=gen).to(dtype)
        y = torch.randn(sum(rows), sum(parts), generator=gen).to(dtype)
        try:
            got = native.add_to(x, y.clone())
            want = reference.add_to(x, y.clone())
        finally:
            state.current = None
        assert (got.float() - want.float()).abs().max().item() < tolerance * max(1.0, want.abs().max().item())
        assert (got.float() - y.float()).abs().max().item() > 0.1  # the products were added
        if base_rows is not None:  # the request without an adapter: untouched, bit for bit
            assert torch.equal(got[base_rows], y[base_rows])


@pytest.mark.slow
def test_adapted_steps_in_the_one_call_step_give_the_op_by_op_bits(default_gguf, tmp_path):
    """make run's forms on the real model: steps with adapted rows run in the one-call native
    step (its projections carry the slots) and give, to the bit, what the Python layers give."""
    from benchmarks.lora import write_random_adapter
    from fornax.models.loader import gguf_model_config, read_gguf

    config = gguf_model_config(read_gguf(default_gguf).metadata)
    for n in range(2):
        write_random_adapter(tmp_path / f"a{n}", config, rank=8, seed=n, scale=0.05)
    llm = LLM(
        str(default_gguf),
        quantization="auto",
        large_step_quantization="w8a8",
        kv_cache_memory="128MiB",
        lora=[f"a{n}={tmp_path / f'a{n}'}" for n in range(2)],
        max_lora_rank=8,
        progress=False,
    )
    runner = llm.engine.runner
    assert runner.native_step is not None and runner.native_step.adapts
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Tell me a story about the number {i}.") for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    adapters = [LoRARequest("a0"), LoRARequest("a1"), None] * 2

    def run() -> list:
        outs = llm.generate(prompts, params, lora_request=adapters)
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]

    native = run()
    step, runner.native_step = runner.native_step, None
    try:
        op_by_op = run()
    finally:
        runner.native_step = step
    assert native == op_by_op
    assert native[0][0] != native[2][0] or native[0][1] != native[2][1]  # the adapter changed something
