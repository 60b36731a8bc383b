"""The offline API: `LLM(model).generate(prompts, params)`, `.chat(...)`, `.embed(inputs)` and
`.score(text_1, text_2)`, vLLM's shapes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from fornax.engine.build import build_engine_core
from fornax.engine.core import EngineCore
from fornax.engine.lora import LoRARequest
from fornax.engine.outputs import EngineOutput
from fornax.engine.pooling import PoolingParams
from fornax.engine.request import SamplingParams
from fornax.engine.scoring import check_cross_encoder, cosine, pair_up, paired
from fornax.engine_args import EngineArgs
from fornax.request_output import (
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from fornax.tokenizer import Tokenizer
from fornax.tools import ToolPlan, parse_complete, plan_tools, prepare_messages, tool_finish_reason

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Load a model once, then run batches of prompts through the continuous-batching engine."""

    def __init__(
        self,
        model: str = EngineArgs.model,
        dtype: str = EngineArgs.dtype,
        *,
        progress: bool = True,
        **engine_args: Any,
    ) -> None:
        """`engine_args`: any field of EngineArgs (fornax/engine_args.py), the same settings as
        the engine flags of the command line (`max_num_seqs=8` is `--max-num-seqs 8`), with
        the same defaults. `progress`: show the model's loading progress."""
        unknown = sorted(set(engine_args) - EngineArgs.names())
        if unknown:
            raise TypeError(
                f"LLM() got unknown engine argument(s) {unknown}: the engine's settings are "
                "the fields of EngineArgs (fornax/engine_args.py)"
            )
        self.engine_args = EngineArgs(model=model, dtype=dtype, **engine_args)
        self.engine: EngineCore = build_engine_core(
            self.engine_args.create_engine_config(), progress=progress
        )
        self._ids = itertools.count()

    def close(self) -> None:
        """Persist what the KV disk tier still holds in memory (pending writes); the engine stays
        usable. A no-op without tiers."""
        self.engine.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together; one RequestOutput per prompt, in input order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs `enable_lora=True` or `lora=[...]` (docs/lora.md)."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        adapters = _as_lora_list(lora_request, len(prompt_list))
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params)):
                request_id = str(next(self._ids))
                ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.add_request(request_id, ids, p, priority[i] if priority else 0, lora=adapters[i])
                results[request_id] = _new_output(request_id, prompt, ids, p.n)
                order.append(request_id)
        except Exception:
            # One bad prompt rejects the whole call: the ones already queued must not linger
            # in the engine (a later call would meet their outputs and no result to put them in).
            for request_id in order:
                self.engine.abort_request(request_id)
            for _ in self._run():
                pass
            raise
        for out in self._run():
            if out.request_id in results:  # a request of an unfinished stream may run along
                _accumulate(results[out.request_id], out)
        return [results[r] for r in order]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate.

        With `tools`, each output also carries `tool_calls` and `content` as the server's
        message does (OpenAI's semantics for tool_choice; tools/plan.py)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        plan = plan_tools(tools, tool_choice, parallel_tool_calls, tok.chat_template, tool_call_parser)
        template_tools = plan.tools if plan.template_supports_tools else None
        prompts: list[Prompt] = [
            tok.apply_chat_template(
                prepare_messages(list(conv), plan.tools, plan.template_supports_tools),
                add_generation_prompt=add_generation_prompt,
                tools=template_tools,
                tokenize=True,
            )
            for conv in conversations
        ]
        params = _as_params_list(sampling_params, len(prompts))
        forced = plan.forced_constraint()  # the grammar makes a forced call's arguments valid
        if forced is not None:
            params = [replace(p, structured_outputs=forced) for p in params]
        results = self.generate(prompts, params, lora_request=lora_request)
        if plan.parser_name is not None:
            for result in results:
                for output in result.outputs:
                    _read_tool_calls(plan, output)
        return results

    def embed(
        self,
        inputs: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed each input (a text or token ids): all of them are pooling requests of the
        engine at once, batched by its scheduler like any prompts. One output per input, in
        order, with its vector and prompt tokens. `pooling_params`: one for all, or one per
        input (None: the engine's defaults, engine/pooling.py). An input longer than the
        model's limit is refused (ValueError) unless `truncate_prompt_tokens` cuts each input to
        at most that many tokens: a text keeps its first tokens and its special ones, token ids
        their first ones. A cross-encoder embeds nothing (ValueError): it scores pairs (`score`)."""
        config = self.engine.model_config
        if config.pooling.cross_encoder:
            raise ValueError(
                f"{config.name} is a cross-encoder: it scores text pairs (LLM.score), not embeds"
            )
        prompt_list = _as_prompt_list(inputs)
        if isinstance(pooling_params, PoolingParams) or pooling_params is None:
            params = [pooling_params or PoolingParams()] * len(prompt_list)
        elif len(pooling_params) != len(prompt_list):
            raise ValueError(f"got {len(pooling_params)} PoolingParams for {len(prompt_list)} inputs")
        else:
            params = list(pooling_params)
        k = truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {k!r}")
        texts = [p for p in prompt_list if isinstance(p, str)]
        encoded = iter(self.engine.tokenizer.encode_batch(texts, truncate_to=k) if texts else [])
        ids = [next(encoded) if isinstance(prompt, str) else list(prompt)[:k] for prompt in prompt_list]
        texts_of = [prompt if isinstance(prompt, str) else None for prompt in prompt_list]
        return self._pool(texts_of, ids, params, priority)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs, vLLM's `LLM.score`: one `text_1` against each `text_2`, or as many
        of each, pairwise (ValueError otherwise). One output per pair, in order. An embedding
        model's score is the cosine similarity of the two embeddings; a cross-encoder's is its
        classifier's on the pair read as one sequence (engine/scoring.py: for one label the
        logit through a sigmoid, sentence-transformers' CrossEncoder.predict default).
        `truncate_prompt_tokens`: as in `embed`, per text for an embedding model, per pair for a
        cross-encoder (the longer text cut first)."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        pairs = pair_up(first, second)  # ScoringError, a ValueError
        config = self.engine.model_config
        if not config.pooling.cross_encoder:
            outs = self.embed([*first, *second], truncate_prompt_tokens=truncate_prompt_tokens)
            left, right = outs[: len(first)], outs[len(first) :]
            return [
                ScoringRequestOutput(
                    a, b, cosine(x.embedding, y.embedding), x.num_prompt_tokens + y.num_prompt_tokens
                )
                for (a, b), (x, y) in zip(pairs, paired(left, right))
            ]
        check_cross_encoder(config)
        k = truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {k!r}")
        encoded = self.engine.tokenizer.encode_pairs(pairs, truncate_to=k)
        params = [PoolingParams(token_type_ids=tuple(types)) for _, types in encoded]
        outs = self._pool([None] * len(pairs), [ids for ids, _ in encoded], params, None)
        return [
            ScoringRequestOutput(a, b, out.embedding[0], out.num_prompt_tokens)
            for (a, b), out in zip(pairs, outs)
        ]

    def _pool(
        self,
        texts: list[str | None],
        prompts: list[list[int]],
        params: list[PoolingParams],
        priority: Sequence[int] | None,
    ) -> list[EmbeddingRequestOutput]:
        """Run pooling requests together (batched by the scheduler like any prompts); one
        output per prompt, in order, with its vector (a cross-encoder's: its scores)."""
        results: dict[str, EmbeddingRequestOutput] = {}
        try:
            for i, (text, ids, p) in enumerate(zip(texts, prompts, params)):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, p, priority[i] if priority else 0)
                results[request_id] = EmbeddingRequestOutput(request_id, text, ids)
        except Exception:
            for request_id in results:  # as in generate: nothing of a refused call stays queued
                self.engine.abort_request(request_id)
            for _ in self._run():
                pass
            raise
        errors = []
        for out in self._run():
            result = results.get(out.request_id)
            if result is not None and out.finished:
                result.finished = True
                if out.embedding is None:
                    errors.append(
                        f"request {out.request_id} ended without a vector: {out.error or out.finish_reason}"
                    )
                else:
                    result.embedding = out.embedding
        if errors:
            raise RuntimeError(errors[0])
        return list(results.values())

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[EngineOutput]:
        """Yield this request's per-step deltas (each of its n samples') as they are produced,
        until all its samples finish (used by `fornax chat`). Requests added by other calls
        keep stepping meanwhile, but their outputs are not this stream's. Closing the
        iterator early aborts the request, so its KV blocks are freed."""
        params = sampling_params or SamplingParams()
        request_id = str(next(self._ids))
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.add_request(request_id, ids, params)
        unfinished = params.n
        try:
            while unfinished and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        unfinished -= out.finished
                        yield out
        finally:
            if unfinished:
                self.engine.abort_request(request_id)
                self.engine.step()  # hands back the abort's outputs, which no later call expects

    def _run(self) -> Iterator[EngineOutput]:
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()


def _as_lora_list(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"{len(lora)} lora_request values for {n} prompts")
    return list(lora)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)


def _new_output(request_id: str, prompt: Prompt, ids: list[int], n: int) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=ids,
        outputs=[CompletionOutput(index=i) for i in range(n)],
    )


def _accumulate(result: RequestOutput, out: EngineOutput) -> None:
    comp = result.outputs[out.index]
    comp.text += out.new_text
    comp.token_ids.extend(out.new_token_ids)
    if out.new_logprobs:
        comp.logprobs = (comp.logprobs or []) + out.new_logprobs
        comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + sum(
            lp.logprob for lp in out.new_logprobs
        )
    if out.prompt_logprobs is not None and result.prompt_logprobs is None:
        result.prompt_logprobs = [None, *out.prompt_logprobs]
    result.num_cached_tokens = out.num_cached_tokens
    if out.finished:
        comp.finish_reason, comp.stop_reason, comp.error = out.finish_reason, out.stop_reason, out.error
        if out.timings:
            result.timings = out.timings
        result.finished = all(c.finished for c in result.outputs)


def _read_tool_calls(plan: ToolPlan, output: CompletionOutput) -> None:
    parser = plan.new_parser()
    assert parser is not None
    output.content, calls = parse_complete(parser, output.text)
    output.tool_calls = calls or None
    output.finish_reason = tool_finish_reason(bool(calls), output.finish_reason)
