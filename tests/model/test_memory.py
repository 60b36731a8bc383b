"""Memory (docs/memory.md): the breakdown accounts for the resident set, every weight form held
is one some step uses, embedding rows read from the file equal the dense table, and the KV
budget's automatic default follows the model and the machine."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from fornax import LLM, SamplingParams
from fornax.config import KV_CACHE_MEMORY_FRACTION, default_kv_cache_memory
from fornax.engine.memory_report import FORM_NAMES
from fornax.layers.embedding import FileEmbedding
from fornax.layers.linear import Linear

MAKE_RUN = {"quantization": "auto", "large_step_quantization": "w8a8"}  # the Makefile's serving flags
MiB = 1 << 20


@pytest.fixture(scope="module")
def make_run_llm(default_gguf):
    return LLM(str(default_gguf), kv_cache_memory="64MiB", progress=False, **MAKE_RUN)


BREAKDOWN_CHILD = """
import json, sys
from fornax import LLM, SamplingParams
from fornax.layers.process_memory import release_free_heap
llm = LLM(sys.argv[1], kv_cache_memory="64MiB", progress=False, quantization="auto", large_step_quantization="w8a8")
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
llm.generate(["The capital of France is", "Count from one to ten:"] * 4, params)
release_free_heap()  # as the server does when it goes idle
report = llm.engine.memory_report()
print(json.dumps({**report.as_dict(), "table": report.table()}))
"""


def test_breakdown_sums_to_the_resident_set(default_gguf):
    """In a fresh interpreter holding only this engine, as a server does: inside the test
    process the heap also holds what every earlier test left behind, which no owner claims."""
    child = subprocess.run(
        [sys.executable, "-c", BREAKDOWN_CHILD, str(default_gguf)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(child.stdout.strip().splitlines()[-1])
    owners = report["owners"]
    # what this model must hold: its int4/int8 forms and the w8a8 ones, KV written by the requests
    assert owners["weights: int4 blocks (small steps)"] > 50 * MiB
    assert owners["weights: w8a8 rotated int8 (large steps)"] > 100 * MiB
    assert 0 < owners["KV cache pools"] <= 64 * MiB
    assert owners["tokenizer"] > 0 and owners["shared libraries (code and data)"] > 0
    assert not any(owner.startswith("weights: dense") for owner in owners)  # no step reads them (below)
    assert abs(report["unattributed_bytes"]) <= 0.10 * report["rss_bytes"], report["table"]


def test_every_weight_form_held_is_used_by_some_step(make_run_llm):
    """Run op by op (the one-call step reads the same forms, but not through Python), counting
    each form's calls: decodes of one and of several rows, and a prefill, must between them
    reach every form any Linear holds; no Linear keeps a dense weight nothing reads."""
    llm = make_run_llm
    runner = llm.engine.runner
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    calls: dict[int, int] = {}

    class Counted:
        def __init__(self, form):
            self.form, self.quantized = form, form.quantized

        def __call__(self, x):
            calls[id(self)] = calls.get(id(self), 0) + 1
            return self.form(x)

    held = []
    for linear in linears:
        assert linear.weight is None and not linear.plan.keep_dense and not linear.plan.reads_dense()
        for tier in ("small", "mid", "large"):
            form = getattr(linear, tier)
            if form is not None:
                assert type(form).__name__ in FORM_NAMES  # a form with memory of its own
                counted = Counted(form)
                setattr(linear, tier, counted)
                held.append((linear, tier, counted))
    native_step, runner.native_step = runner.native_step, None
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        llm.generate(["Once upon a time"], greedy)  # one-row decodes
        llm.generate(["a b c d e f g h " * 20, "Hello", "Why is the sky blue?"], greedy)  # prefill, batches
    finally:
        runner.native_step = native_step
        for linear, tier, counted in held:
            setattr(linear, tier, counted.form)
    unused = [(type(c.form).__name__, tier) for _, tier, c in held if calls.get(id(c), 0) == 0]
    assert held and not unused


def test_the_tied_table_is_held_once_in_dense_models(default_gguf):
    llm = LLM(str(default_gguf), kv_cache_memory="16MiB", progress=False)  # dense bf16
    model = llm.engine.runner.model
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    "type_name", ["Q8_0", "F16", "BF16", "F32", "Q4_1", "Q5_0"]
)  # the last two: gguf's path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_file_embedding_rows_equal_the_dense_table(type_name, dtype):
    """Rows converted on lookup, bit for bit what the loader's whole-table conversion gives
    (gguf's dequantizers to float32, then the model's dtype)."""
    qtype = GGMLQuantizationType[type_name]
    g = np.random.default_rng(0)
    table = (g.standard_normal((300, 256)) * 0.05).astype(np.float32)
    raw = quantize(table, qtype)
    if type_name == "F32":
        raw = raw.view(np.float32)
    elif type_name == "F16":
        raw = raw.view(np.float16)
    dense = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)).to(dtype)
    embedding = FileEmbedding(raw, qtype, 256, dtype)
    ids = torch.tensor([[0, 299, 7], [7, 150, 42]])
    got = embedding(ids)
    assert got.shape == (2, 3, 256) and got.dtype == dtype
    assert torch.equal(got, dense[ids])


def test_gguf_models_read_embedding_rows_from_the_file(make_run_llm, default_gguf):
    model = make_run_llm.engine.runner.model
    assert isinstance(model.embed_tokens, FileEmbedding)
    dense = LLM(str(default_gguf), kv_cache_memory="16MiB", progress=False).engine.runner.model
    ids = torch.tensor([0, 1, 500, 49151, 12])
    assert torch.equal(model.embed_tokens(ids), dense.embed_tokens(ids))


def test_automatic_kv_budget_follows_model_and_machine():
    per_token = 30 * 2 * 3 * 64 * 2  # the default model: 30 layers, K and V, 3 heads of 64, bf16
    one_sequence = per_token * 8192
    # a share of the machine's memory, within [one max-length sequence, max_num_seqs of them]
    assert default_kv_cache_memory(per_token, 8192, 64, total=24 << 30) == int(
        KV_CACHE_MEMORY_FRACTION * (24 << 30)
    )
    assert default_kv_cache_memory(per_token, 8192, 64, total=1 << 30) == one_sequence
    assert default_kv_cache_memory(per_token, 8192, 4, total=1 << 40) == 4 * one_sequence


def test_engine_sizes_its_kv_pool_from_the_automatic_budget(default_gguf):
    llm = LLM(str(default_gguf), max_model_len=1024, max_num_seqs=2, progress=False)
    cache = llm.engine.cache_config
    # on any machine with over 4 GiB, 5% exceeds two 1024-token sequences: the cap decides
    assert cache.num_blocks * cache.block_size == 2 * 1024
