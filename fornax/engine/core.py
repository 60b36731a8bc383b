"""EngineCore.step(): schedule -> execute -> update. No I/O, no threads, no asyncio.

The core owns the scheduler (bookkeeping), the model runner (tensors) and the per-sequence
detokenizers (text, stop strings). A request with n > 1 is fanned out into n sequences;
siblings 1..n-1 are held back until the first has prefilled its prompt, so they find the
prompt's full blocks in the prefix cache and share them instead of recomputing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from fornax.config import EngineConfig
from fornax.engine.detokenizer import IncrementalDetokenizer
from fornax.engine.event_tap import EventTap
from fornax.engine.events import EventBus
from fornax.engine.executor import Executor, LocalExecutor
from fornax.engine.kv.sizing import kv_cache_blocks
from fornax.engine.lora.serving import EngineLoRA, resolve_adapter
from fornax.engine.memory_report import MemoryReport, engine_tensors, memory_report
from fornax.engine.outputs import EngineOutput, ModelRunnerOutput, TokenLogprobs
from fornax.engine.pooling import POOLING_SAMPLING, PoolingParams, pooling_request
from fornax.engine.request import Request, RequestRejected, RequestStatus, SamplingParams
from fornax.engine.runner.model_runner import ModelRunner
from fornax.engine.scheduler import Scheduler
from fornax.engine.spec_decode import TargetInfo
from fornax.engine.spec_decode.controller import SpecController
from fornax.engine.stats import EngineStats, SequenceView
from fornax.engine.structured.backend import GrammarBackend
from fornax.engine.structured.spec import StructuredOutputsError
from fornax.models import DTYPES, LoadedModel
from fornax.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fornax.engine.kv.offload.tiered import OffloadStats
    from fornax.engine.lora import LoRARequest

logger = logging.getLogger("fornax.engine")


@dataclass
class _Sequence:
    """Engine-side companions of one Request: its parent id, index and detokenizer."""

    parent_id: str
    index: int
    detok: IncrementalDetokenizer
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    sent_prompt_logprobs: bool = False


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        tokenizer: Tokenizer,
        executor: Executor | None = None,
    ) -> None:
        self.executor = executor = executor or LocalExecutor()  # how steps run beyond this process
        self.config, self.model_config, self.tokenizer = config, loaded.config, tokenizer
        dtype = DTYPES[config.dtype]
        cache = config.cache
        max_len = min(config.scheduler.max_model_len, loaded.config.max_sequence_length)
        num_blocks = kv_cache_blocks(config, loaded, dtype, max_len)
        self.cache_config = replace(cache, num_blocks=num_blocks)
        self.scheduler_config = replace(config.scheduler, max_model_len=max_len)
        self.max_model_len = max_len
        # LoRA adapters (engine/lora/): slots on the model's projections, a registry by name. Before
        # the runner, so that its one-call step's descriptors point at the slots (models/native_step.py).
        native = config.kernel_backend == "native"
        self.lora = (
            EngineLoRA(config.lora, loaded.model, loaded.config, native) if config.lora is not None else None
        )
        self.runner = ModelRunner(
            loaded.model,
            loaded.local_config or loaded.config,
            num_blocks,
            cache.block_size,
            dtype,
            config.kernel_backend,
            cache.kv_cache_dtype,
            deterministic=config.deterministic,
            executor=executor,
        )
        self.kernels = self.runner.kernels  # what runs here, in one line (layers/kernel_plan.py)
        if self.lora is not None:
            self.runner.lora_state = self.lora.state
        logger.info("%s", self.kernels)
        connector = None
        if config.offload.enabled:  # KV tiers: the scheduler plans the copies, the runner makes them
            from fornax.engine.kv.offload.build import build_connector

            connector = build_connector(config, loaded)
            self.runner.kv_connector = connector
        # other ranks allocate as many blocks and slots for their heads
        executor.share_sizes(num_blocks, 0 if connector is None else connector.num_host_slots)
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.cache_config,
            num_blocks,
            connector,
            swap=config.offload.swap,
            lora_slots=self.lora and self.lora.slots,
        )
        target = TargetInfo(
            loaded,
            dtype,
            num_blocks,
            cache.block_size,
            max_len,
            self.runner.attention_kernel,
            config.small_step_max_rows or 0,
            executor.draft_step_to_ranks,
        )
        self.spec = SpecController.for_target(config.speculative, target) if config.speculative else None
        # Constrained decoding; thread-safe, so the server compiles grammars before submitting.
        self.grammars = GrammarBackend(tokenizer, loaded.config.vocab_size)
        self.seqs: dict[str, _Sequence] = {}  # child request id -> companions
        self.children: dict[str, list[str]] = {}  # parent id -> child request ids
        self.held: dict[str, list[Request]] = {}  # leader child id -> siblings waiting for its prefill
        self._pending: list[EngineOutput] = []  # outputs produced outside step() (aborts)
        self._last_step_tokens = self._last_step_seqs = 0  # batched tokens, sequences (stats())
        # Memory breakdown (engine/memory_report.py): what the tokenizer took as it loaded (set by
        # engine/build.py, which measures it), and the files whose pages hold weights.
        self.tokenizer_bytes = 0
        path = loaded.resolved.gguf_path
        self.model_files = {str(path.resolve())} if path is not None else set()
        # Lifecycle events for live views (engine/events.py). The tap builds events only while
        # the bus has a subscriber; None removes even that check (the overhead benchmark's baseline).
        self.events = EventBus()
        self.event_tap: EventTap | None = EventTap(self.events, cache.block_size)
        torch.manual_seed(config.seed)

    def memory_report(self) -> MemoryReport:
        """The process's resident memory by owner (engine/memory_report.py); call between steps."""
        proposer = self.spec.proposer if self.spec is not None else None
        tensors = engine_tensors(self.runner, proposer)
        return memory_report(tensors, self.tokenizer_bytes, self.model_files)

    # -- requests in and out --
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | LoRARequest | None = None,
    ) -> None:
        """Queue a request (fanned out to params.n sequences; with PoolingParams, one prefill-only
        sequence whose final output carries its vector). Raises ValueError on bad input.

        `cache_salt`: requests reuse each other's cached prompt blocks only if their salts are
        equal (None is the shared, unsalted cache); the server salts by API key (tenancy.py).
        `lora`: the adapter it runs with, by name (engine/lora/; None: the base model)."""
        if request_id in self.children:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestRejected(
                f"prompt token id {bad[0]} is out of range for a vocabulary of {self.model_config.vocab_size}"
            )
        if isinstance(params, PoolingParams):  # one sequence, prefill only (engine/pooling.py)
            children = [
                pooling_request(
                    request_id,
                    prompt_token_ids,
                    params,
                    self.model_config,
                    self.config.pooling,
                    self.max_model_len,
                    priority,
                    cache_salt,
                )
            ]
            params = POOLING_SAMPLING  # what the detokenizer and the event tap read of it
        elif self.model_config.encoder:
            raise RequestRejected(
                f"{self.model_config.name} is an encoder (embedding) model: it serves "
                "pooling requests (LLM.embed, /v1/embeddings), not generation"
            )
        else:
            children = self._sampling_children(request_id, prompt_token_ids, params, priority, cache_salt)
        adapter = resolve_adapter(self.lora, lora)  # its slot is taken at admission (scheduler)
        for child in children:
            child.lora = adapter
        self.scheduler.add_request(children[0])  # validates length; raises before any state changes
        self.children[request_id] = [c.request_id for c in children]
        for index, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.sampling_params)
            self.seqs[child.request_id] = _Sequence(request_id, index, detok)
        if len(children) > 1:
            self.held[children[0].request_id] = children[1:]
        if self.event_tap is not None and self.events.active:
            self._to_tap(
                self.event_tap.on_add, request_id, prompt_token_ids, params, adapter and adapter.name
            )

    def _sampling_children(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> list[Request]:
        """A generation request's n sequences."""
        params.validate_against_vocab(self.model_config.vocab_size)
        structured = params.structured_outputs
        compiled = self.grammars.compile(structured) if structured is not None else None  # cached by content
        starts_after = structured.starts_after if structured is not None else None
        gate = tuple(self.tokenizer.encode(starts_after, add_special_tokens=False)) if starts_after else ()
        children = []
        for index in range(params.n):
            child_params = params if params.n == 1 else _child_params(params, index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            req = Request(
                child_id,
                prompt_token_ids,
                child_params,
                self.tokenizer.eos_token_ids,
                self.max_model_len,
                priority,
                cache_salt=cache_salt,
            )
            if compiled is not None:
                req.grammar = self.grammars.new_state(compiled, gate)  # each sample follows its own tokens
            children.append(req)
        return children

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
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts ride on this step's decodes
        sched = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.drop(sched.finished_request_ids)  # the draft model frees their KV too
        self._last_step_tokens, self._last_step_seqs = sched.num_batched_tokens, len(sched.scheduled)
        tap = self.event_tap if self.event_tap is not None and self.events.active else None
        if tap is not None:
            self._to_tap(tap.on_schedule, sched)
        if sched.is_empty:
            self.runner.execute(sched)  # still drops finished requests' RNG state
            if tap is not None:
                self._to_tap(tap.on_outputs, outputs)
            return outputs
        result = self.runner.execute(sched)
        for request_id, entries in result.prompt_logprobs.items():
            self.seqs[request_id].prompt_logprobs.extend(entries)
        num_before = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        for req in self.scheduler.update_from_output(sched, result):
            if req.request_id not in self.seqs:
                continue  # a sibling failed earlier in this loop and took the request down
            try:
                if req.grammar is not None:
                    self._advance_grammar(req, num_before[req.request_id])
                tokens, logprobs = self._detokenize(req, num_before[req.request_id], result)
                outputs.append(self._output(req, tokens, logprobs))
            except Exception as exc:
                outputs.extend(self._fail_request(req.request_id, exc))
        if self.spec is not None:
            self.spec.observe(sched, result)
            self.spec.observe_step(sched, time.perf_counter() - start)  # what the draft budget plans on
        self._release_siblings()
        if tap is not None:
            self._to_tap(tap.on_outputs, outputs)
        return outputs

    def _detokenize(
        self, req: Request, num_before: int, result: ModelRunnerOutput
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """Feed this step's new tokens (one, or several after accepted drafts) to the detokenizer.

        A stop string found before the last of them ends the request right there: the tokens
        after it are dropped, exactly as if they had never been generated.
        """
        rid = req.request_id
        tokens = req.output_token_ids[num_before:]
        logprobs = result.spec_logprobs.get(rid) or ([result.logprobs[rid]] if rid in result.logprobs else [])
        seq = self.seqs[rid]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            # A token that ended the request (EOS, a stop token id) stays out of the text unless
            # asked for, like a stop string (vLLM's semantics); it is still in the token ids.
            on_stop_token = last and req.status == RequestStatus.FINISHED_STOPPED
            hide = on_stop_token and not req.sampling_params.include_stop_str_in_output
            stop = None if hide else seq.detok.update([token])
            if stop is None:
                continue
            if not last:
                req.truncate_output(num_before + i + 1)
                tokens, logprobs = tokens[: i + 1], logprobs[: i + 1]
                if req.is_finished:  # finished (and freed) on a later token that is now dropped
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            if not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            break
        return tokens, logprobs

    def _advance_grammar(self, req: Request, num_before: int) -> None:
        """Move the sequence's grammar past this step's tokens; a grammar that is complete ends
        the request (even with ignore_eos: nothing may follow it)."""
        assert req.grammar is not None
        req.grammar.accept(req.output_token_ids[num_before:])
        if req.grammar.terminated and not req.is_finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _to_tap(self, method: Callable[..., None], *args: Any) -> None:
        """Call the event tap; one that raises is logged once and detached, so live views stop
        instead of the engine."""
        try:
            method(self, *args)
        except Exception:
            logger.exception("the event tap failed and was detached: live events stop")
            self.event_tap = None

    def _fail_request(self, child_id: str, exc: Exception) -> list[EngineOutput]:
        """End every sequence of the request that `child_id` belongs to on an internal error.

        Its KV blocks are freed through the scheduler's one free path; each sequence gets a
        final output carrying the error, built here rather than by `_output` (which may be what
        failed). The rest of the batch is untouched, so it decodes exactly as it would have.
        """
        seq = self.seqs.get(child_id)
        parent_id = seq.parent_id if seq is not None else child_id
        invalid = isinstance(exc, StructuredOutputsError)  # the request's own fault, not the engine's
        message = str(exc) if invalid else f"{type(exc).__name__}: {exc}"
        if invalid:
            logger.warning("request %s ended: %s", parent_id, message)
        else:
            logger.error("request %s failed and was ended: %s", parent_id, message, exc_info=exc)
        outputs = []
        for cid in self.children.pop(parent_id, [child_id]):
            req = self.scheduler.get_request(cid)
            if req is not None and not req.is_finished:
                self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
            self.held.pop(cid, None)  # siblings never admitted hold no blocks
            sibling = self.seqs.pop(cid, None)
            index = sibling.index if sibling is not None else 0
            outputs.append(
                EngineOutput(
                    request_id=parent_id,
                    index=index,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason="abort",
                    error=message,
                    invalid_request=invalid,
                )
            )
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
            embedding=req.embedding,
        )
        if req.sampling_params.prompt_logprobs is not None and not seq.sent_prompt_logprobs:
            out.prompt_logprobs, seq.sent_prompt_logprobs = seq.prompt_logprobs, True
        if finished:
            out.timings = req.timings()
            self._forget(req.request_id)
        return out

    def _forget(self, child_id: str) -> None:
        seq = self.seqs.pop(child_id)
        siblings = self.children.get(seq.parent_id, [])
        if all(c not in self.seqs for c in siblings):
            self.children.pop(seq.parent_id, None)

    def close(self) -> None:
        """Flush what must outlive the process: blocks finished requests left for the KV disk
        tier, and its queued writes. Call with the engine idle (the server's drain, LLM.close)."""
        connector = self.scheduler.connector
        if connector is not None:
            connector.close(self.runner.kv_cache)

    # -- what observers read (engine/stats.py); the event tap's view (engine/event_tap.py) --
    def stats(self) -> EngineStats:
        """Queues, KV cache and counters, as of the end of the last step. No side effects."""
        sched, kv = self.scheduler, self.scheduler.kv
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_preemptions_total=sched.num_preemptions_total,
            block_size=kv.block_size,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            spec_num_draft_tokens_total=sched.spec_num_draft_tokens_total,
            spec_num_accepted_tokens_total=sched.spec_num_accepted_tokens_total,
            last_step_num_batched_tokens=self._last_step_tokens,
            last_step_num_seqs=self._last_step_seqs,
        )

    def take_offload_stats(self) -> OffloadStats | None:
        """The KV tiers' counters and occupancy (None without tiers). Takes the transfer times
        recorded since the previous call: one reader (the metrics' scrape) should call it."""
        connector = self.scheduler.connector
        return connector.stats() if connector is not None else None

    def sequences(self) -> list[SequenceView]:
        """Every admitted, unfinished sequence: the running batch in admission order, then the
        waiting queue (in the order it is served, for the fcfs policy)."""
        sched = self.scheduler
        return [self._view(req) for req in sched.running] + [self._view(req) for req in sched.waiting]

    def _view(self, req: Request) -> SequenceView:
        parent, index = self.sequence_key(req.request_id)
        return SequenceView(
            request_id=parent,
            index=index,
            status=req.status,
            num_prompt_tokens=req.num_prompt_tokens,
            num_computed_tokens=req.num_computed_tokens,
            num_tokens=req.num_tokens,
            num_blocks=len(self.scheduler.kv.get_block_ids(req.request_id)),
        )

    def sequence_key(self, child_id: str) -> tuple[str, int]:
        """(the user's request id, sample index) of an engine sequence id; a sequence already
        forgotten maps to itself, index 0."""
        seq = self.seqs.get(child_id)
        return (seq.parent_id, seq.index) if seq is not None else (child_id, 0)

    def find_sequence(self, request_id: str, index: int) -> Request | None:
        """Sample `index` of request `request_id`, while the scheduler holds it."""
        for child_id in self.children.get(request_id, []):
            seq = self.seqs.get(child_id)
            if seq is not None and seq.index == index:
                return self.scheduler.get_request(child_id)
        return None

    def block_ids(self, child_id: str) -> list[int]:
        """The KV block table of an engine sequence (empty once it holds none)."""
        return self.scheduler.kv.get_block_ids(child_id)

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()
        connector = self.scheduler.connector
        if connector is not None:
            connector.check_integrity()

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n-th sample of a request: n=1, and a distinct seed so samples differ but stay reproducible."""
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)
