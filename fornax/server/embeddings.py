"""Embeddings, reranking and scoring: `POST /v1/embeddings` (OpenAI's shape), `POST /v1/rerank`
(the Jina/Cohere shape vLLM and llama.cpp serve) and `POST /v1/score` (vLLM's).

Every input is one pooling request to the engine (engine/pooling.py): prefill-only, scheduled
with everything else, admitted, limited per key and recorded like a generation (a Generation
with `pooling` set, one sequence of one token per input for the budgets). Rerank and score
compare embeddings by cosine similarity, or, on a cross-encoder (a sequence-classification
model: models/bert_classifier.py), score each (query, document) pair read as one sequence with
the model's head: for one label the logit through a sigmoid, as sentence-transformers'
CrossEncoder.predict returns it (engine/scoring.py). A cross-encoder embeds nothing:
/v1/embeddings on one is a 400. What is and is not: docs/usage.md, docs/models.md.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fornax.engine.async_engine import AsyncEngine
from fornax.engine.pooling import POOLING_SAMPLING, PoolingParams, PoolingParamsError
from fornax.engine.scoring import ScoringError, check_cross_encoder, cosine, pair_up, paired
from fornax.server.errors import bad_request
from fornax.server.generation import Generation
from fornax.server.limits import check_prompts, check_text_fits, check_token_count, check_token_ids
from fornax.server.serving import parse_request, run_to_end, start_generation
from fornax.server.state import ServerState

router = APIRouter()


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    user: str | None = None
    priority: int = 0
    # vLLM's: keep at most this many tokens of each input (its first ones, special tokens kept);
    # absent, an input longer than the model's context is a 400.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)


class EmbeddingRequest(_Request):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka truncation, for models trained for it


class RerankRequest(_Request):
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class ScoreRequest(_Request):
    text_1: str | list[str]
    text_2: str | list[str]


# ---- routes ------------------------------------------------------------------------------------


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    state, engine, req, model = await parse_request(request, EmbeddingRequest)
    if engine.model_config.pooling.cross_encoder:
        raise bad_request(
            f"the model '{model}' is a cross-encoder: it scores text pairs (/v1/rerank, "
            "/v1/score) and gives no embeddings",
            param="model",
        )
    try:
        pooling = PoolingParams(dimensions=req.dimensions)
    except PoolingParamsError as exc:  # dimensions that no model takes (0, negative)
        raise bad_request(str(exc), param=exc.param) from None
    gen = await _embed(request, state, engine, req, req.input, "input", pooling)
    data = [
        {
            "object": "embedding",
            "index": c.index,
            "embedding": _encode(c.embedding or [], req.encoding_format),
        }
        for c in gen.choices
    ]
    return JSONResponse({"object": "list", "data": data, "model": model, "usage": _usage(gen)})


@router.post("/v1/rerank")
async def rerank(request: Request) -> Response:
    state, engine, req, model = await parse_request(request, RerankRequest)
    if not req.documents:
        raise bad_request("'documents' must not be empty", param="documents")
    pairs = [(req.query, d) for d in req.documents]
    scores, gen = await _scores(request, state, engine, req, pairs, "documents")
    results = [{"index": i, "relevance_score": score} for i, score in enumerate(scores)]
    results.sort(key=lambda r: -r["relevance_score"])
    for r in results:
        if req.return_documents:
            r["document"] = {"text": req.documents[r["index"]]}
    top = results[: req.top_n] if req.top_n is not None else results
    body = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"total_tokens": gen.num_prompt_tokens},
        "results": top,
    }
    return JSONResponse(body)


@router.post("/v1/score")
async def score(request: Request) -> Response:
    state, engine, req, model = await parse_request(request, ScoreRequest)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    try:
        pairs = pair_up(first, second)
    except ScoringError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    scores, gen = await _scores(request, state, engine, req, pairs, "text_2", first)
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    usage = {"prompt_tokens": gen.num_prompt_tokens, "total_tokens": gen.num_prompt_tokens}
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": usage,
        }
    )


# ---- the work ----------------------------------------------------------------------------------


async def _scores(
    request: Request,
    state: ServerState,
    engine: AsyncEngine,
    req: _Request,
    pairs: list[tuple[str, str]],
    param: str,
    firsts: list[str] | None = None,
) -> tuple[list[float], Generation]:
    """Each pair's score, and the finished Generation: a cross-encoder's head on the pair, else
    the cosine of the two texts' embeddings (each first text embedded once: `firsts`, else the
    pairs' one shared first text)."""
    if engine.model_config.pooling.cross_encoder:
        return await _cross_encode(request, state, engine, req, pairs, param)
    left = firsts if firsts is not None else [pairs[0][0]]
    gen = await _embed(request, state, engine, req, [*left, *(b for _, b in pairs)], param, PoolingParams())
    vectors = [c.embedding or [] for c in gen.choices]
    return [cosine(a, b) for a, b in paired(vectors[: len(left)], vectors[len(left) :])], gen


async def _cross_encode(
    request: Request,
    state: ServerState,
    engine: AsyncEngine,
    req: _Request,
    pairs: list[tuple[str, str]],
    param: str,
) -> tuple[list[float], Generation]:
    """One pooling request per pair, the pair tokenized as one sequence with its token types
    (Tokenizer.encode_pairs); each request's pooled "vector" is the head's one score."""
    try:
        check_cross_encoder(engine.model_config)
    except ScoringError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    check_prompts([b for _, b in pairs], state.config, param)  # the count bound
    if any(not a or not b for a, b in pairs):
        raise bad_request(f"'{param}' holds an empty string: there is nothing to score", param=param)
    max_len, truncate = engine.max_model_len, _truncation(req, engine.max_model_len)
    if truncate is None:
        for a, b in pairs:  # refused before the tokenizer spends time on it
            check_text_fits([a, b], max_len, param)
    encoded = await asyncio.to_thread(engine.tokenizer.encode_pairs, pairs, truncate)
    vocab = engine.model_config.vocab_size
    for ids, _ in encoded:
        check_token_ids(ids, vocab, param)
        check_token_count(ids, max_len, param)
    pooling = [PoolingParams(token_type_ids=tuple(types)) for _, types in encoded]
    gen = start_generation(
        state,
        request,
        engine,
        "embd",
        "embeddings",
        [ids for ids, _ in encoded],
        POOLING_SAMPLING,
        req.priority,
        False,
        pooling=pooling,
    )
    await run_to_end(request, gen)
    scores = [c.embedding[0] for c in gen.choices if c.embedding]
    if len(scores) != len(pairs):  # the engine ends every pooling request with its vector
        raise RuntimeError(f"{len(pairs) - len(scores)} pairs ended without a score")
    return scores, gen


def _truncation(req: _Request, max_len: int) -> int | None:
    truncate = req.truncate_prompt_tokens
    if truncate is not None and truncate > max_len:
        raise bad_request(
            f"'truncate_prompt_tokens' must be at most the model's context of {max_len}",
            param="truncate_prompt_tokens",
        )
    return truncate


async def _embed(
    request: Request,
    state: ServerState,
    engine: AsyncEngine,
    req: _Request,
    inputs: Any,
    param: str,
    pooling: PoolingParams,
) -> Generation:
    """Tokenize, bound and run one pooling request per input; the finished Generation (one
    choice per input, in order, each with its `embedding`)."""
    prompts = check_prompts(inputs, state.config, param)
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad_request(f"'{param}' holds an empty string: there is nothing to embed", param=param)
    max_len, truncate = engine.max_model_len, _truncation(req, engine.max_model_len)
    texts = [p for p in prompts if isinstance(p, str)]
    if truncate is None:
        for text in texts:  # refused before the tokenizer spends time on it
            check_text_fits([text], max_len, param)
    encoded = iter(
        await asyncio.to_thread(engine.tokenizer.encode_batch, texts, True, truncate) if texts else []
    )
    ids = [next(encoded) if isinstance(p, str) else (p[:truncate] if truncate else p) for p in prompts]
    vocab = engine.model_config.vocab_size
    for one in ids:
        check_token_ids(one, vocab, param)
        check_token_count(one, max_len, param)
    # What the model cannot serve (dimensions of a model without Matryoshka training, a model
    # that pools nothing) the engine refuses at submission: run_to_end answers it as a 400.
    gen = start_generation(
        state,
        request,
        engine,
        "embd",
        "embeddings",
        ids,
        POOLING_SAMPLING,
        req.priority,
        False,
        pooling=pooling,
    )
    await run_to_end(request, gen)
    return gen


def _usage(gen: Generation) -> dict[str, int]:
    return {"prompt_tokens": gen.num_prompt_tokens, "total_tokens": gen.num_prompt_tokens}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the little-endian float32 values, as its client decodes them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
