"""Embeddings through the engine: pooling requests against transformers and sentence-transformers.

- the real all-MiniLM-L6-v2 (the registry alias, a BERT) against sentence-transformers' own
  `encode` on 64 texts (English, Chinese, code, short and cut at its 256-token limit), float32
  and bfloat16;
- a tiny random BERT built by transformers, against its mean-pooled last hidden state;
- decoders as embedders (tiny Llama and Qwen3): last-token and mean pooling against
  transformers' final hidden states (after the final norm), whole and chunked, alone and in a
  batch with generation requests, which keep their greedy tokens;
- Matryoshka dimensions, the refusals (generation on an encoder, an input over the limit), and
  no KV block held after any of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fornax import LLM, PoolingParams, SamplingParams
from fornax.config import CacheConfig, SchedulerConfig
from fornax.engine.outputs import ModelRunnerOutput
from fornax.engine.pooling import POOLING_SAMPLING, PoolingParamsError
from fornax.engine.request import Request, RequestRejected
from fornax.engine.scheduler import Scheduler
from tests.model.tiny_models import TRAIN_TEXT, build_tiny_bert, build_tiny_model

MINILM = "all-minilm-l6-v2"
ENGLISH = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome, the best I have seen this year.",
    "Inference turns static weights into answers.",
    "Continuous batching keeps the hardware busy.",
    "How do I bake sourdough bread at home?",
    "The weather in Lisbon is mild in winter.",
    "Quantum computers use qubits instead of bits.",
    "She sells sea shells by the sea shore.",
    "Stocks fell sharply after the announcement.",
    "Paris is the capital of France.",
    "Embeddings map text to vectors so that similar meanings lie close together.",
]
CHINESE = [
    "今天天气很好，我们去公园散步吧。",
    "机器学习是人工智能的一个分支。",
    "我喜欢在周末读书和喝茶。",
    "这家餐厅的饺子非常好吃。",
    "北京是中国的首都。",
    "请问最近的地铁站在哪里？",
]
CODE = [
    "def add(a, b):\n    return a + b",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "import torch\nx = torch.randn(4, 8)\nprint(x.softmax(-1))",
    "const f = async (url) => (await fetch(url)).json();",
    'fn main() { println!("hello"); }',
]
LONG = [  # each well over 256 tokens: cut at the model's limit, as sentence-transformers cuts it
    " ".join(ENGLISH) * 4,
    "".join(CHINESE) * 5,
    "\n".join(CODE) * 5,
    " ".join(TRAIN_TEXT) * 4,
]


def _texts() -> list[str]:
    """64 texts: the short ones, pairs of them, and the long ones."""
    short = ENGLISH + CHINESE + CODE
    pairs = [f"{a} {b}" for a, b in zip(short, reversed(short))]
    texts = short + pairs + LONG
    return (texts + [t.upper() for t in ENGLISH])[:64]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def _idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


# -- the scheduler's bookkeeping (no model) --


def _pooling(request_id: str, prompt: list[int], kind: str, whole: bool = False) -> Request:
    params = PoolingParams(kind, normalize=False)
    return Request(request_id, prompt, POOLING_SAMPLING, pooling_params=params, whole_prompt=whole)


def _finish_step(sched: Scheduler) -> tuple[list[str], list[str]]:
    """One step whose "runner" pools a vector for each pooling request at its prompt's end and
    samples a token for the others: (the ids scheduled, with their token counts; the ids that
    got a token or a vector)."""
    out = sched.schedule()
    ends = [s.request for s in out.scheduled if s.samples]
    pooled = {r.request_id: [1.0] for r in ends if r.pooling_params is not None}
    sampled = {r.request_id: 7 for r in ends if r.pooling_params is None}
    done = sched.update_from_output(out, ModelRunnerOutput(sampled=sampled, pooled=pooled))
    return [f"{s.request.request_id}:{s.num_new_tokens}" for s in out.scheduled], [r.request_id for r in done]


def test_scheduler_keeps_encoder_prompts_whole_and_skips_cache_hits_that_pooling_cannot_use() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=64), CacheConfig(block_size=4), 64
    )
    sched.add_request(_pooling("a", list(range(1, 21)), "mean", whole=True))
    sched.add_request(_pooling("b", list(range(1, 21)), "mean", whole=True))
    # b does not fit the 12 tokens left: it waits whole rather than being chunked.
    assert _finish_step(sched) == (["a:20"], ["a"])
    assert _finish_step(sched) == (["b:20"], ["b"])
    with pytest.raises(RequestRejected, match="in one step of at most 32 tokens"):
        sched.add_request(_pooling("c", list(range(1, 41)), "mean", whole=True))
    # A decoder's pooling prompt chunks; a cached prefix serves last-token pooling only.
    sched.add_request(Request("gen", list(range(1, 41)), SamplingParams(max_tokens=1)))
    _finish_step(sched), _finish_step(sched)  # prefilled and finished: its 10 blocks are cached
    sched.add_request(_pooling("last", list(range(1, 41)), "last"))
    sched.add_request(_pooling("mean", list(range(1, 41)), "mean"))
    assert _finish_step(sched) == (["last:4", "mean:28"], ["last"])  # 36 tokens from the cache
    assert _finish_step(sched) == (["mean:12"], ["mean"])
    assert sched.requests == {} and sched.kv.num_free_blocks == 64
    sched.kv.check_integrity()


# -- the real model against sentence-transformers --


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from fornax.models.registry import resolve_model

    hf_dir = resolve_model(MINILM).hf_dir
    assert hf_dir is not None
    return hf_dir


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> torch.Tensor:
    """sentence-transformers' own vectors for _texts(), float32."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    vectors = model.encode(_texts(), normalize_embeddings=True, convert_to_tensor=True, batch_size=64)
    return vectors.float()


@pytest.fixture(scope="module")
def minilm_f32() -> LLM:
    return LLM(MINILM, dtype="float32", progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_matches_sentence_transformers(dtype: str, reference: torch.Tensor, minilm_f32: LLM) -> None:
    llm = minilm_f32 if dtype == "float32" else LLM(MINILM, dtype="bfloat16", progress=False)
    cfg = llm.engine.model_config
    assert (cfg.encoder, cfg.hidden_size, cfg.pooling.type, cfg.pooling.normalize) == (
        True,
        384,
        "mean",
        True,
    )
    assert llm.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    outs = llm.embed(_texts(), truncate_prompt_tokens=256)
    ours = torch.tensor([o.embedding for o in outs])
    assert ours.shape == (64, 384) and max(o.num_prompt_tokens for o in outs) == 256
    cos = _cos(ours, reference)
    diff = (ours - reference).abs().max().item()
    print(
        f"all-MiniLM-L6-v2 {dtype}: min cosine vs sentence-transformers {cos.min().item():.10f}, max |diff| {diff:.1e}"
    )
    assert cos.min().item() >= (0.99999 if dtype == "float32" else 0.999)
    _idle(llm)


def test_minilm_tokens_match_sentence_transformers(minilm_dir: Path, minilm_f32: LLM) -> None:
    """The same ids as sentence-transformers' tokenizer, [CLS] and [SEP] included, also when cut."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    texts = [*ENGLISH[:2], CHINESE[0], CODE[0], LONG[1]]
    ours = minilm_f32.get_tokenizer().encode_batch(texts, truncate_to=256)
    assert ours == hf(texts, truncation=True, max_length=256)["input_ids"]


def test_batch_of_64_equals_64_single_calls(minilm_f32: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    llm, texts = minilm_f32, _texts()
    steps = 0
    step = llm.engine.step

    def counting_step() -> Any:
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(llm.engine, "step", counting_step)
    batched = torch.tensor([o.embedding for o in llm.embed(texts, truncate_prompt_tokens=256)])
    batch_steps, steps = steps, 0
    single = torch.tensor([llm.embed(t, truncate_prompt_tokens=256)[0].embedding for t in texts])
    monkeypatch.undo()
    # One batch of requests: the scheduler packs whole prompts (at most 256 tokens each) into
    # steps of its token budget, each filled past budget - 256 before the next starts.
    total = sum(len(ids) for ids in llm.get_tokenizer().encode_batch(texts, truncate_to=256))
    budget = llm.engine.scheduler_config.max_num_batched_tokens
    assert batch_steps <= -(-total // (budget - 256)) and steps == 64
    assert (batched - single).abs().max().item() < 1e-5
    assert _cos(batched, single).min().item() > 0.999999
    _idle(llm)


def test_minilm_refusals(minilm_f32: LLM) -> None:
    llm = minilm_f32
    with pytest.raises(RequestRejected, match=r"encoder .*not generation"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="maximum context length is 256"):
        llm.embed(LONG[0])  # over the limit, and not asked to cut
    with pytest.raises(PoolingParamsError, match="matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=128))
    assert len(llm.embed("hello", PoolingParams(dimensions=384))[0].embedding) == 384  # all of it: allowed
    _idle(llm)


# -- a tiny random BERT against transformers --


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp("bert")
    return build_tiny_bert(out), out


def test_tiny_bert_matches_transformers(tiny_bert: tuple[Any, Path]) -> None:
    hf, out = tiny_bert
    prompts = [[2, 17, 99, 150, 31, 7, 3], [2, *range(40, 100), 3], [2, 3], [2, 120, 121, 3]]
    llm = LLM(str(out), dtype="float32", progress=False)
    assert llm.engine.model_config.pooling.type is None  # no sentence-transformers files: mean
    ours = torch.tensor([o.embedding for o in llm.embed(prompts, PoolingParams(normalize=False))])
    cls = torch.tensor([o.embedding for o in llm.embed(prompts, PoolingParams("cls", normalize=False))])
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with torch.inference_mode():
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, hidden]
    ref = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    assert (ours - ref).abs().max().item() < 1e-4
    assert (cls - hidden[:, 0]).abs().max().item() < 1e-4
    # Text goes through the WordPiece files: [CLS] ... [SEP], the same vector as those ids.
    text = TRAIN_TEXT[0]
    ids_of_text = llm.get_tokenizer().encode(text)
    assert ids_of_text[0] == 2 and ids_of_text[-1] == 3
    assert llm.embed(text)[0].embedding == llm.embed([ids_of_text])[0].embedding
    with pytest.raises(RequestRejected, match="in one step of at most 16 tokens"):
        LLM(str(out), dtype="float32", progress=False, max_num_batched_tokens=16).embed([prompts[1]])
    _idle(llm)


# -- decoders as embedders --


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_decoder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model(request.param, out)
    if request.param == "qwen3":  # a Matryoshka embedder, as config.json may declare one
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, "matryoshka_dimensions": [16, 32]}))
    return hf, out


def _final_hidden(hf: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), [L, hidden]."""
    with torch.inference_mode():
        return hf.model(torch.tensor([prompt])).last_hidden_state[0]


LONG_PROMPT = [5, *range(20, 80), 17]  # 62 tokens: 4 chunks of a 16-token budget
PROMPTS = [[5, 17, 99, 200, 31, 7], LONG_PROMPT, [250]]


@pytest.mark.parametrize("budget", [2048, 16])
def test_decoder_pooling_matches_transformers(tiny_decoder: tuple[Any, Path], budget: int) -> None:
    """Last-token and mean pooling of the final hidden states; budget 16 chunks the long prompt
    (and runs the short ones beside its chunks)."""
    hf, out = tiny_decoder
    llm = LLM(str(out), dtype="float32", num_blocks=64, max_num_batched_tokens=budget, progress=False)
    assert llm.engine.model_config.pooling.type is None  # the default for decoders: last
    for kind in ("last", "mean"):
        outs = llm.embed(PROMPTS, PoolingParams(kind if kind == "mean" else None, normalize=False))
        for prompt, o in zip(PROMPTS, outs):
            hidden = _final_hidden(hf, prompt)
            ref = hidden[-1] if kind == "last" else hidden.mean(0)
            assert (torch.tensor(o.embedding) - ref).abs().max().item() < 1e-4, (kind, len(prompt))
    normalized = llm.embed(LONG_PROMPT)[0].embedding  # normalize defaults to on
    assert abs(torch.tensor(normalized).norm().item() - 1.0) < 1e-5
    _idle(llm)


def test_pooling_and_generation_share_steps(tiny_decoder: tuple[Any, Path]) -> None:
    """Pooling requests batched with generation requests (prefill chunks and decodes in the same
    steps) give the vectors they give alone, and the generation requests keep their greedy tokens.
    A cached prefix is no shortcut for mean pooling, and a hit for last pooling changes nothing."""
    hf, out = tiny_decoder
    llm = LLM(str(out), dtype="float32", num_blocks=64, max_num_batched_tokens=24, progress=False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone_tokens = [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)
    ]  # caches LONG_PROMPT's blocks
    last, mean = PoolingParams(normalize=False), PoolingParams("mean", normalize=False)
    alone_vectors = [llm.embed(LONG_PROMPT, p)[0].embedding for p in (last, mean)]
    core = llm.engine
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"gen{i}", prompt, greedy)
    core.add_request("last", LONG_PROMPT, last)
    core.add_request("mean", LONG_PROMPT, mean)
    vectors: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {f"gen{i}": [] for i in range(len(PROMPTS))}
    shared = 0
    while core.has_unfinished_requests():
        outs = core.step()
        kinds = {o.request_id.rstrip("0123456789") for o in outs}
        shared += "gen" in kinds and len(kinds) > 1  # a vector came out of a step that also sampled
        for o in outs:
            if o.embedding is not None:
                vectors[o.request_id] = o.embedding
            elif o.request_id in tokens:
                tokens[o.request_id] += o.new_token_ids
    assert shared  # some step carried both kinds
    assert [tokens[f"gen{i}"] for i in range(len(PROMPTS))] == alone_tokens
    for name, alone in zip(("last", "mean"), alone_vectors):
        assert (torch.tensor(vectors[name]) - torch.tensor(alone)).abs().max().item() < 1e-5
    hidden = _final_hidden(hf, LONG_PROMPT)
    assert (torch.tensor(vectors["mean"]) - hidden.mean(0)).abs().max().item() < 1e-4
    assert (torch.tensor(vectors["last"]) - hidden[-1]).abs().max().item() < 1e-4
    _idle(llm)


def test_matryoshka_dimensions(tiny_decoder: tuple[Any, Path]) -> None:
    hf, out = tiny_decoder
    llm = LLM(str(out), dtype="float32", num_blocks=64, pooling="mean", progress=False)
    full = torch.tensor(llm.embed(PROMPTS[0])[0].embedding)
    ref = F.normalize(_final_hidden(hf, PROMPTS[0]).mean(0), dim=0)  # --pooling mean, normalized
    assert (full - ref).abs().max().item() < 1e-5
    if llm.engine.model_config.pooling.matryoshka:  # qwen3: trained for 16 and 32
        short = torch.tensor(llm.embed(PROMPTS[0], PoolingParams(dimensions=16))[0].embedding)
        assert (short - F.normalize(ref[:16], dim=0)).abs().max().item() < 1e-5
        with pytest.raises(PoolingParamsError, match=r"sizes \(16, 32\)"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=8))
    else:
        with pytest.raises(PoolingParamsError, match="matryoshka"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=16))
    with pytest.raises(PoolingParamsError, match="pooling_type"):
        PoolingParams("max")
    _idle(llm)
