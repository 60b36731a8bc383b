"""Cross-encoders (BertForSequenceClassification) through LLM.score, against transformers and
sentence-transformers' CrossEncoder; text-pair tokenization against transformers' tokenizer;
LLM.score on an embedding model (cosine); the refusals; no KV block held after any of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fornax import LLM, PoolingParams
from fornax.engine.pooling import PoolingParamsError
from fornax.engine.scoring import ScoringError, cosine
from tests.model.tiny_models import TRAIN_TEXT, build_tiny_cross_encoder, make_wordpiece_files

QUERY = "the quick brown fox"
DOCS = [
    "jumps over the lazy dog",
    "def add(a, b): return a + b",
    "Prefill reads the whole prompt at once; decode writes one token at a time.",
    "batching",
    TRAIN_TEXT[3],
]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, LLM]:
    out = tmp_path_factory.mktemp("cross_encoder")
    hf = build_tiny_cross_encoder(out)
    return hf, out, LLM(str(out), dtype="float32", progress=False)


def _reference(hf: Any, out: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """transformers' scores: the pair through its tokenizer (token types 0 then 1) and the model,
    its one logit through a sigmoid (sentence-transformers' CrossEncoder default)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    assert enc["token_type_ids"].max().item() == 1  # the pair's second text is of type 1
    with torch.inference_mode():
        return torch.sigmoid(hf(**enc).logits[:, 0])


def _idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_cache_usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_scores_match_transformers_and_sentence_transformers(cross_encoder: tuple[Any, Path, LLM]) -> None:
    hf, out, llm = cross_encoder
    config = llm.engine.model_config
    assert config.pooling.cross_encoder and config.pooling.score_activation == "sigmoid"
    one_to_many = llm.score(QUERY, DOCS)  # one query against every document, in one batch
    ref = _reference(hf, out, [(QUERY, d) for d in DOCS])
    ours = torch.tensor([r.score for r in one_to_many])
    print(f"cross-encoder vs transformers: max |diff| {(ours - ref).abs().max().item():.1e}")
    assert (ours - ref).abs().max().item() < 1e-4
    assert [(r.text_1, r.text_2) for r in one_to_many] == [(QUERY, d) for d in DOCS]
    # Pairwise, and one pair at a time: the same scores (the batch shares steps, not types).
    firsts = [DOCS[-1], QUERY, "hardware", TRAIN_TEXT[1], "fox"]
    pairwise = torch.tensor([r.score for r in llm.score(firsts, DOCS)])
    assert (pairwise - _reference(hf, out, list(zip(firsts, DOCS)))).abs().max().item() < 1e-4
    alone = torch.tensor([llm.score(QUERY, d)[0].score for d in DOCS])
    assert (alone - ours).abs().max().item() < 1e-6
    st = pytest.importorskip("sentence_transformers")
    model = st.CrossEncoder(str(out), device="cpu", local_files_only=True)
    predicted = torch.tensor(model.predict([(QUERY, d) for d in DOCS]))
    assert (ours - predicted).abs().max().item() < 1e-4
    _idle(llm)


def test_pair_tokens_and_types_match_transformers(cross_encoder: tuple[Any, Path, LLM]) -> None:
    from transformers import AutoTokenizer

    _, out, llm = cross_encoder
    tok = AutoTokenizer.from_pretrained(str(out))
    pairs = [(QUERY, d) for d in DOCS] + [(TRAIN_TEXT[0], TRAIN_TEXT[3])]
    ours = llm.get_tokenizer().encode_pairs(pairs)
    ref = tok([a for a, _ in pairs], [b for _, b in pairs])
    assert [ids for ids, _ in ours] == ref["input_ids"]
    assert [types for _, types in ours] == ref["token_type_ids"]
    for limit in (8, 11, 16, 25):  # longest_first: the longer text gives way first
        cut = llm.get_tokenizer().encode_pairs(pairs, truncate_to=limit)
        ref = tok([a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first", max_length=limit)
        assert [ids for ids, _ in cut] == ref["input_ids"], limit
        assert [types for _, types in cut] == ref["token_type_ids"], limit
    scored = llm.score(TRAIN_TEXT[0], TRAIN_TEXT[3], truncate_prompt_tokens=16)
    assert scored[0].num_prompt_tokens == 16


def test_refusals(cross_encoder: tuple[Any, Path, LLM]) -> None:
    _, _, llm = cross_encoder
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.embed("hello")
    with pytest.raises(ScoringError, match="as many as text_2"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ScoringError, match="must not be empty"):
        llm.score([], ["c"])
    core = llm.engine
    with pytest.raises(PoolingParamsError, match="3 values for a prompt of 4 tokens"):
        core.add_request("bad-len", [2, 50, 3, 3], PoolingParams(token_type_ids=(0, 0, 1)))
    with pytest.raises(PoolingParamsError, match="type_vocab_size of 2"):
        core.add_request("bad-type", [2, 50, 3], PoolingParams(token_type_ids=(0, 0, 2)))
    with pytest.raises(PoolingParamsError, match="not an embedding"):
        core.add_request("bad-dims", [2, 50, 3], PoolingParams(dimensions=8))
    with pytest.raises(PoolingParamsError, match="pooling_type must be cls"):
        core.add_request("bad-type", [2, 50, 3], PoolingParams("mean"))
    with pytest.raises(PoolingParamsError, match="non-negative"):
        PoolingParams(token_type_ids=(0, -1))
    _idle(llm)


def test_score_on_an_embedding_model_is_the_cosine(tmp_path: Path) -> None:
    import transformers

    config = transformers.BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    torch.manual_seed(1)
    transformers.BertModel(config, add_pooling_layer=False).eval().save_pretrained(str(tmp_path))
    make_wordpiece_files(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", progress=False)
    vectors = [o.embedding for o in llm.embed([QUERY, *DOCS])]
    scores = [r.score for r in llm.score(QUERY, DOCS)]
    assert scores == pytest.approx([cosine(vectors[0], v) for v in vectors[1:]], abs=1e-6)
    _idle(llm)
