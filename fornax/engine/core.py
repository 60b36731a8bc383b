"""EngineCore.step(): schedule -> execute -> update. No I/O, no threads, no asyncio.

The core owns the scheduler (bookkeeping), the model runner (tensors) and the per-sequence
detokenizers (text, stop strings). A request with n > 1 is fanned out into n sequences;
siblings 1..n-1 are held back until the first has prefilled its prompt, so they find the
prompt's full blocks in the prefix cache and share them instead of recomputing them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from fornax.config import EngineConfig
from fornax.engine.detokenizer import IncrementalDetokenizer
from fornax.engine.outputs import EngineOutput, TokenLogprobs
from fornax.engine.request import Request, RequestStatus, SamplingParams
from fornax.engine.runner.model_runner import ModelRunner
from fornax.engine.scheduler import Scheduler
from fornax.models import DTYPES, LoadedModel
from fornax.models.llama import KVCache
from fornax.tokenizer import Tokenizer


@dataclass
class _Sequence:
    """Engine-side companions of one Request: its parent id, index and detokenizer."""

    parent_id: str
    index: int
    detok: IncrementalDetokenizer
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    sent_prompt_logprobs: bool = False


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, tokenizer: Tokenizer) -> None:
        self.config, self.model_config, self.tokenizer = config, loaded.config, tokenizer
        dtype = DTYPES[config.dtype]
        cache = config.cache
        num_blocks = cache.num_blocks or max(
            1, cache.kv_cache_memory // KVCache.bytes_per_block(loaded.config, cache.block_size, dtype)
        )
        self.cache_config = replace(cache, num_blocks=num_blocks)
        max_len = min(config.scheduler.max_model_len, loaded.config.max_position_embeddings)
        self.scheduler_config = replace(config.scheduler, max_model_len=max_len)
        self.max_model_len = max_len
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, num_blocks)
        self.runner = ModelRunner(loaded.model, loaded.config, num_blocks, cache.block_size, dtype)
        self.seqs: dict[str, _Sequence] = {}  # child request id -> companions
        self.children: dict[str, list[str]] = {}  # parent id -> child request ids
        self.held: dict[str, list[Request]] = {}  # leader child id -> siblings waiting for its prefill
        self._pending: list[EngineOutput] = []  # outputs produced outside step() (aborts)
        self.last_step: tuple[int, int] = (0, 0)  # (batched tokens, sequences) of the last step
        torch.manual_seed(config.seed)

    # -- requests in and out --
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Queue a request (fanned out to params.n sequences). Raises ValueError on bad input."""
        if request_id in self.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate_against_vocab(self.model_config.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range for a vocabulary of "
                             f"{self.model_config.vocab_size}")  # fmt: skip
        children = []
        for index in range(params.n):
            child_params = params if params.n == 1 else _child_params(params, index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            req = Request(
                child_id, prompt_token_ids, child_params, self.tokenizer.eos_token_ids, self.max_model_len, priority
            )
            children.append(req)
        self.scheduler.add_request(children[0])  # validates length; raises before any state changes
        self.children[request_id] = [c.request_id for c in children]
        for index, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params)
            self.seqs[child.request_id] = _Sequence(request_id, index, detok)
        if len(children) > 1:
            self.held[children[0].request_id] = children[1:]

    def abort_request(self, request_id: str) -> None:
        """Abort every sequence of a request, wherever it is; emits final 'abort' outputs."""
        for child_id in self.children.get(request_id, []):
            req = self.scheduler.get_request(child_id)
            if req is not None:
                self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
                self._pending.append(self._output(req, []))
            for sibling in self.held.pop(child_id, []):
                sibling.status = RequestStatus.FINISHED_ABORTED
                self._pending.append(self._output(sibling, []))

    def has_unfinished_requests(self) -> bool:
        return bool(self.children) or bool(self._pending)

    # -- the step --
    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.last_step = (sched.num_batched_tokens, len(sched.scheduled))
        if sched.is_empty:
            self.runner.execute(sched)  # still drops finished requests' RNG state
            return outputs
        result = self.runner.execute(sched)
        for request_id, entries in result.prompt_logprobs.items():
            self.seqs[request_id].prompt_logprobs.extend(entries)
        for req in self.scheduler.update_from_output(sched, result):
            token = req.output_token_ids[-1]
            seq = self.seqs[req.request_id]
            # A token that ended the request (EOS, a stop token id) stays out of the text unless
            # asked for, like a stop string (vLLM's semantics); it is still in the token ids.
            on_stop_token = req.status == RequestStatus.FINISHED_STOPPED
            hide = on_stop_token and not req.sampling_params.include_stop_str_in_output
            stop = None if hide else seq.detok.update([token])
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            logprobs = [result.logprobs[req.request_id]] if req.request_id in result.logprobs else []
            outputs.append(self._output(req, [token], logprobs))
        self._release_siblings()
        return outputs

    def _release_siblings(self) -> None:
        for leader_id in list(self.held):
            leader = self.scheduler.get_request(leader_id)
            if leader is None or leader.num_computed_tokens >= leader.num_prompt_tokens - 1:
                for sibling in self.held.pop(leader_id):
                    self.scheduler.add_request(sibling)

    def _output(self, req: Request, new_tokens: list[int], logprobs: list | None = None) -> EngineOutput:
        seq = self.seqs[req.request_id]
        finished = req.is_finished
        if finished:
            seq.detok.finish()
        out = EngineOutput(
            request_id=seq.parent_id,
            index=seq.index,
            new_token_ids=new_tokens,
            new_text=seq.detok.get_next_delta(),
            finished=finished,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            new_logprobs=logprobs or [],
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        if req.sampling_params.prompt_logprobs is not None and not seq.sent_prompt_logprobs:
            out.prompt_logprobs, seq.sent_prompt_logprobs = seq.prompt_logprobs, True
        if finished:
            out.timings = _timings(req)
            self._forget(req.request_id)
        return out

    def _forget(self, child_id: str) -> None:
        seq = self.seqs.pop(child_id)
        siblings = self.children.get(seq.parent_id, [])
        if all(c not in self.seqs for c in siblings):
            self.children.pop(seq.parent_id, None)

    # -- introspection for metrics, tests and the UI --
    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n-th sample of a request: n=1, and a distinct seed so samples differ but stay reproducible."""
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def _timings(req: Request) -> dict[str, float]:
    t = req.times
    end = t.finished or time.monotonic()
    first_sched = t.first_scheduled or end
    first_tok = t.first_token or end
    return {
        "queue_s": first_sched - t.arrival,
        "ttft_s": first_tok - t.arrival,
        "prefill_s": first_tok - first_sched,
        "decode_s": (t.last_token or first_tok) - first_tok,
        "e2e_s": end - t.arrival,
        "num_preemptions": float(req.num_preemptions),
    }


def build_engine_core(config: EngineConfig, progress: bool = True) -> EngineCore:
    """Resolve and load the model and its tokenizer, then size the cache and build the core."""
    from fornax.models import load_model

    method = config.small_step_method
    small_step = (method, config.small_step_max_rows) if method else None
    loaded = load_model(config.model, config.dtype, progress=progress, small_step=small_step)
    if loaded.resolved.gguf_path is not None:
        tokenizer = Tokenizer.from_gguf_metadata(loaded.metadata)
    else:
        assert loaded.resolved.hf_dir is not None
        tokenizer = Tokenizer.from_pretrained_dir(loaded.resolved.hf_dir)
    return EngineCore(config, loaded, tokenizer)
