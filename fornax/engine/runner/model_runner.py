"""SchedulerOutput -> tensors -> model -> sampler -> ModelRunnerOutput.

Everything the model needs for one step (token ids, positions, slot mapping, gather
indices, masks) is built here once, in bulk; the layers only index with it. Pooling requests'
rows go to the pooler (pooler.py) instead of the sampler; an encoder model (BERT) runs its
steps on its own metadata (whole sequences, no K/V: layers/encoder_attention.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from fornax.config import ModelConfig
from fornax.engine.executor import Executor, LocalExecutor
from fornax.engine.kv.offload.connector import KVConnector
from fornax.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from fornax.engine.request import Request
from fornax.engine.runner.pooler import Pooler
from fornax.engine.sample.metadata import SamplingMetadata, make_generator
from fornax.engine.sample.rejection import verify_drafts
from fornax.engine.sample.sampler import Sampler, prompt_logprobs, to_token_logprobs
from fornax.engine.structured.masks import GrammarMask, MaskWorker
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.layers.encoder_attention import build_encoder_metadata
from fornax.layers.kernel_plan import DTYPE_NAMES
from fornax.layers.kernel_plan import describe as describe_kernels
from fornax.layers.linear import Linear
from fornax.layers.lora import LoRAStep, LoRAStepState
from fornax.layers.native import load_paged_attention
from fornax.layers.ops import layer_ops
from fornax.models.base import CausalLM, EncoderModel, KVCache
from fornax.models.lora import write_slot
from fornax.models.native_step import NativeStep


class ModelRunner:
    def __init__(
        self,
        model: CausalLM | EncoderModel,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kernel_backend: str = "native",
        kv_cache_dtype: str = "auto",
        deterministic: bool = False,
        executor: Executor | None = None,
    ) -> None:
        # where other processes follow each step (engine/executor.py); called unconditionally
        self.executor = executor = executor or LocalExecutor()
        self.model, self.config, self.block_size = model, config, block_size
        self.deterministic = deterministic
        # An encoder keeps no K/V: its block ids only bound and admit work (engine/core.py), so
        # its pools have no layers.
        kv_config = replace(config, num_hidden_layers=0) if config.encoder else config
        self.kv_cache = KVCache(kv_config, num_blocks, block_size, dtype, kv_cache_dtype)
        kernel = load_paged_attention() if kernel_backend == "native" else None
        self.attention_kernel = kernel if kernel is not None and kernel.supports(dtype) else None
        if deterministic and self.attention_kernel is None:
            raise RuntimeError(
                "deterministic mode needs the native paged-attention kernel, which did not load"
            )
        model.use_ops(layer_ops(kernel_backend, dtype))
        # Small steps in one native call where the model's forms allow (models/native_step.py).
        native = kernel_backend == "native" and executor.runs_native_step and not config.encoder
        self.native_step = NativeStep.build(model, self.kv_cache) if native else None
        # How a step's hidden states are computed. A flag, not a stored bound method: that would
        # make the runner refer to itself, so a dropped engine's KV pools would wait for the
        # cycle collector instead of being freed at once.
        self._encoder = config.encoder
        # What runs, in one line (layers/kernel_plan.py): the start-up log and /v1/models say it.
        kv = "int8" if self.kv_cache.kv_cache_dtype == "int8" else DTYPE_NAMES[dtype]
        attention = "torch" if self.attention_kernel is None else kv
        head = getattr(model, "lm_head", None)
        decoder = [m for m in model.modules() if isinstance(m, Linear) and m is not head]
        self.kernels = describe_kernels([m.plan for m in decoder], attention)
        self.sampler = Sampler()
        self.masks = MaskWorker(config.vocab_size)  # constrained decoding (engine/structured)
        # Per-request RNGs live as long as the request (across preemptions), so a seeded
        # request draws the same numbers whatever else shares its batches.
        self.generators: dict[str, torch.Generator] = {}
        # KV tiers below the primary pool (engine/kv/offload): set by the engine when configured.
        self.kv_connector: KVConnector | None = None
        # pooling requests' running sums live as long as the request; a cross-encoder's head
        # scores its requests (pooler.py)
        self.pooler = Pooler(getattr(model, "classify", None) if config.pooling.cross_encoder else None)
        # LoRA slots on the model's projections (models/lora.py attach_slots): set by the engine.
        self.lora_state: LoRAStepState | None = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_request_ids:
            self.generators.pop(request_id, None)
        self.pooler.drop(sched.finished_request_ids | sched.preempted_request_ids)
        if sched.kv_transfers is not None:  # before the forward: it may write over saved blocks
            assert self.kv_connector is not None
            self.executor.send_transfers(sched.kv_transfers)  # each rank copies its own heads' part
            self.kv_connector.start_load_kv(sched.kv_transfers, self.kv_cache)
        for slot, adapter in sched.lora_writes:  # before the forward, as the scheduler placed them
            assert self.lora_state is not None
            write_slot(self.model, self.config, slot, adapter)
            self.lora_state.version += 1
        if sched.is_empty:
            return ModelRunnerOutput(sampled={})
        items = sched.scheduled
        input_ids, positions = self._flatten_tokens(items)
        pending_masks = self.masks.start(items)  # filled while the forward runs
        forward = self._encoder_forward if self._encoder else self._decoder_forward
        hidden = forward(items, input_ids, positions)  # [T, hidden]

        ends = np.cumsum([s.num_new_tokens for s in items]) - 1
        sampling = [
            (i, s.request)
            for i, s in enumerate(items)
            if s.samples and not s.spec_token_ids and s.request.pooling_params is None
        ]
        out = ModelRunnerOutput(sampled={})
        self.pooler(items, hidden, ends, out)
        self._prompt_logprobs(items, hidden, ends, out)
        masks = self.masks.collect(pending_masks)
        self._verify_drafts(items, hidden, ends, out, masks.verify)
        if not sampling:
            return out
        rows = torch.as_tensor([int(ends[i]) for i, _ in sampling])
        logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab] float32
        requests = [r for _, r in sampling]
        self._ensure_generators(requests)
        sampling_meta = SamplingMetadata.build(requests, self.generators, positional=self.deterministic)
        sampling_meta.grammar_mask = masks.sample
        sampler_out = self.sampler(logits, sampling_meta, consume_logits=True)
        token_ids = sampler_out.sampled_token_ids.tolist()
        for row, request in enumerate(requests):
            out.sampled[request.request_id] = token_ids[row]
            k = request.sampling_params.logprobs
            if k is not None:
                out.logprobs[request.request_id] = to_token_logprobs(sampler_out, row, k)
        return out

    def _decoder_forward(
        self, items: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The step over the paged K/V: [T, hidden] after the final norm."""
        spans = [SeqSpan(s.start, s.num_new_tokens, s.block_ids) for s in items]
        c = self.config
        meta = build_attention_metadata(
            spans,
            self.block_size,
            c.sliding_window,
            self.attention_kernel,
            c.interleaves_sliding_window,
            deterministic=self.deterministic,
        )
        self.executor.send_step(input_ids, positions, spans)
        lora = self._lora_step(items)  # which adapter each row runs with (layers/lora.py)
        if self.native_step is not None and self.native_step.covers(meta, len(input_ids), lora):
            return self.native_step(input_ids, positions, meta, lora)  # [T, hidden], same bits as below
        if lora is None:
            return self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        assert self.lora_state is not None
        self.lora_state.current = lora  # the adapted Linears read it
        try:
            return self.model(input_ids, positions, self.kv_cache, meta)
        finally:
            self.lora_state.current = None

    def _lora_step(self, items: list[ScheduledRequest]) -> LoRAStep | None:
        """Which adapter each row of the step runs with; None when none does (nor can)."""
        if self.lora_state is None:
            return None
        slots = [s.request.lora_slot for s in items]
        ranks = {s.request.lora_slot: s.request.lora.rank for s in items if s.request.lora is not None}
        return LoRAStep.build(slots, [s.num_new_tokens for s in items], ranks, self.lora_state.version)

    def _encoder_forward(
        self, items: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """An encoder's step: every sequence whole (the scheduler never splits one), attending
        within itself; [T, hidden]."""
        meta = build_encoder_metadata([s.num_new_tokens for s in items])
        types = [p.token_type_ids if (p := s.request.pooling_params) else None for s in items]
        if all(t is None for t in types):  # one text per sequence: all type 0, no table gather
            return self.model(input_ids, positions, meta)  # [T, hidden]
        # A text pair's types, whole (an encoder's prompt is never split); other sequences' all 0.
        flat = [t for s, ts in zip(items, types) for t in (ts or (0,) * s.num_new_tokens)]
        return self.model(input_ids, positions, meta, torch.tensor(flat))  # [T, hidden]

    def _verify_drafts(
        self,
        items: list[ScheduledRequest],
        hidden: torch.Tensor,
        ends: np.ndarray,
        out: ModelRunnerOutput,
        grammar_mask: GrammarMask | None = None,
    ) -> None:
        """Requests with drafts: target logits at their last k + 1 positions, then accept/reject
        (constrained ones against their grammar-masked target: rejection.verify_drafts)."""
        verifying = [(i, s) for i, s in enumerate(items) if s.spec_token_ids]
        if not verifying:
            return
        rows = np.concatenate([np.arange(ends[i] - len(s.spec_token_ids), ends[i] + 1) for i, s in verifying])
        logits = self.model.compute_logits(hidden[torch.from_numpy(rows)])  # [sum(k + 1), vocab] float32
        requests = [s.request for _, s in verifying]
        self._ensure_generators(requests)
        drafts = [s.spec_token_ids for _, s in verifying]
        result = verify_drafts(logits, requests, drafts, self.generators, grammar_mask, self.deterministic)
        for request, tokens, logprobs in zip(requests, result.tokens, result.logprobs):
            out.spec_sampled[request.request_id] = tokens
            if logprobs is not None:
                out.spec_logprobs[request.request_id] = logprobs

    def _flatten_tokens(self, items: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos_parts = []
        for s in items:
            ids.extend(s.request.all_token_ids[s.start : s.start + s.num_new_tokens])
            ids.extend(s.spec_token_ids)  # drafts follow the known tokens (one phase model)
            pos_parts.append(np.arange(s.start, s.start + s.num_new_tokens))
        return torch.tensor(ids, dtype=torch.long), torch.from_numpy(np.concatenate(pos_parts))

    def _ensure_generators(self, requests: list[Request]) -> None:
        for r in requests:
            seed = r.sampling_params.seed
            if seed is not None and r.request_id not in self.generators:
                self.generators[r.request_id] = make_generator(seed)

    def _prompt_logprobs(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, ends: np.ndarray, out: ModelRunnerOutput
    ) -> None:
        """Logprobs of each prompt token given its prefix, for requests that asked for them."""
        for i, s in enumerate(items):
            r = s.request
            k = r.sampling_params.prompt_logprobs
            # Position p predicts token p + 1; prompt tokens 1 .. P-1 are scored.
            stop = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
            if k is None or stop <= s.start:
                continue
            first_row = int(ends[i]) - s.num_new_tokens + 1
            rows = slice(first_row, first_row + stop - s.start)
            logits = self.model.compute_logits(hidden[rows])
            next_ids = torch.tensor(r.all_token_ids[s.start + 1 : stop + 1])
            out.prompt_logprobs[r.request_id] = prompt_logprobs(logits, next_ids, k)
