"""Embeddings, reranking and scoring: `POST /v1/embeddings` (OpenAI's shape), `POST /v1/rerank`
(the Jina/Cohere shape vLLM and llama.cpp serve) and `POST /v1/score` (vLLM's).

Every input is one pooling request to the engine (engine/pooling.py): prefill-only, scheduled
with everything else, admitted, limited per key and recorded like a generation (a Generation
with `pooling` set, one sequence of one token per input for the budgets). Rerank and score
compare embeddings by cosine similarity; a cross-encoder head (a sequence-classification
model scoring the pair together) is not served yet. What is and is not: docs/usage.md.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from fornax.engine.async_engine import AsyncEngine
from fornax.engine.pooling import POOLING_SAMPLING, PoolingParams, PoolingParamsError
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
    gen = await _embed(request, state, engine, req, [req.query, *req.documents], "documents", PoolingParams())
    query, *docs = [c.embedding or [] for c in gen.choices]
    results = [{"index": i, "relevance_score": _cosine(query, d)} for i, d in enumerate(docs)]
    results.sort(key=lambda r: -r["relevance_score"])
    for r in results:
        if req.return_documents:
            r["document"] = {"text": req.documents[r["index"]]}
    top = results[: req.top_n] if req.top_n is not None else results
    body = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": gen.num_prompt_tokens},
            "results": top}  # fmt: skip
    return JSONResponse(body)


@router.post("/v1/score")
async def score(request: Request) -> Response:
    state, engine, req, model = await parse_request(request, ScoreRequest)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not first or not second:
        raise bad_request(
            "'text_1' and 'text_2' must not be empty", param="text_1" if not first else "text_2"
        )
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(f"'text_1' holds {len(first)} texts and 'text_2' {len(second)}: give one text_1, or "
                          "as many as text_2 (scored pairwise)", param="text_1")  # fmt: skip
    gen = await _embed(request, state, engine, req, [*first, *second], "text_2", PoolingParams())
    vectors = [c.embedding or [] for c in gen.choices]
    left, right = vectors[: len(first)], vectors[len(first) :]
    pairs = [(left[0] if len(left) == 1 else left[i], v) for i, v in enumerate(right)]
    data = [{"index": i, "object": "score", "score": _cosine(a, b)} for i, (a, b) in enumerate(pairs)]
    usage = {"prompt_tokens": gen.num_prompt_tokens, "total_tokens": gen.num_prompt_tokens}
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": usage})  # fmt: skip


# ---- the work ----------------------------------------------------------------------------------


async def _embed(
    request: Request, state: ServerState, engine: AsyncEngine, req: _Request, inputs: Any, param: str,
    pooling: PoolingParams,
) -> Generation:  # fmt: skip
    """Tokenize, bound and run one pooling request per input; the finished Generation (one
    choice per input, in order, each with its `embedding`)."""
    prompts = check_prompts(inputs, state.config, param)
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad_request(f"'{param}' holds an empty string: there is nothing to embed", param=param)
    max_len = engine.max_model_len
    truncate = req.truncate_prompt_tokens
    if truncate is not None and truncate > max_len:
        raise bad_request(f"'truncate_prompt_tokens' must be at most the model's context of {max_len}",
                          param="truncate_prompt_tokens")  # fmt: skip
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
    gen = start_generation(state, request, engine, "embd", "embeddings", ids, POOLING_SAMPLING, req.priority,
                           False, pooling=pooling)  # fmt: skip
    await run_to_end(request, gen)
    return gen


def _usage(gen: Generation) -> dict[str, int]:
    return {"prompt_tokens": gen.num_prompt_tokens, "total_tokens": gen.num_prompt_tokens}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the little-endian float32 values, as its client decodes them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
