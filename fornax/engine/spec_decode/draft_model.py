"""Draft-model proposer: a smaller model with the target's tokenizer guesses k tokens greedily.

The draft runs inside the same engine with its own paged KV cache and its own block tables
(a private KVCacheManager, no prefix caching). Per request it remembers how many of the
request's real tokens its cache holds; each step it first catches up on the tokens accepted
since (one chunk, batched over requests), which also yields its first guess, then decodes
k - 1 more tokens one batched step at a time. The K/V it writes for its own guesses is
scratch: the next catch-up starts from the last real token it had and overwrites it, so a
rejected guess never needs rolling back here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from fornax.config import ConfigError, ModelConfig, SpeculativeConfig
from fornax.engine.executor import DraftStep
from fornax.engine.kv.manager import KVCacheManager
from fornax.engine.request import Request
from fornax.engine.spec_decode import TargetInfo, register_proposer
from fornax.layers.attention import SeqSpan, build_attention_metadata
from fornax.layers.native import PagedAttentionKernel
from fornax.layers.ops import layer_ops
from fornax.models.base import CausalLM, KVCache

# A prompt token in a prefill chunk costs ~1/40 of a one-token decode step: a chunk's rows
# share one read of the weights (benchmarks/spec_decode.py; docs/speculative-decoding.md).
PREFILL_TOKEN_COST = 0.025


@dataclass
class _DraftSeq:
    """The draft's view of one request: a kv.manager.SlotHolder."""

    request_id: str
    num_computed_tokens: int = 0  # real tokens of the request whose K/V the draft holds
    num_tokens: int = 0


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        attention_kernel: PagedAttentionKernel | None = None,
        cost_per_token: float = 1.0,
        dense_fraction: float = 1.0,
        step_to_ranks: DraftStep | None = None,
    ) -> None:
        self.model, self.config, self.block_size = model, config, block_size
        self.step_to_ranks = step_to_ranks  # a self-draft under tensor parallelism (TargetInfo)
        self.cost_per_token = cost_per_token  # one draft forward, relative to a target decode step
        # Catching up runs as a chunk on the dense weights: per token, the target's prefill cost
        # (~1/40 of a decode step here) scaled by the draft's share of the weights.
        self.catch_up_cost_per_token = PREFILL_TOKEN_COST * dense_fraction
        self.attention_kernel = attention_kernel
        self.kv_cache = KVCache(config, num_blocks, block_size, dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[str, _DraftSeq] = {}

    def setup_cost(self, request: Request) -> float:
        seq = self.seqs.get(request.request_id)
        gap = request.num_tokens - (seq.num_computed_tokens if seq is not None else 0)
        return max(gap - 1, 0) * self.catch_up_cost_per_token  # the last token is computed anyway

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.kv.free(seq)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live: list[int] = []  # indices of requests the draft can serve this step
        spans: list[SeqSpan] = []
        ids: list[int] = []
        for i, (request, k) in enumerate(zip(requests, num_tokens)):
            span = self._catch_up_span(request, k)
            if span is None:
                continue
            live.append(i)
            spans.append(span)
            ids.extend(request.all_token_ids[span.start :])
        if not live:
            return drafts
        served = list(live)
        # Step 1: the catch-up chunk of each request; its last row guesses draft token 0.
        last = self._forward(ids, spans)  # [len(live)] long
        for i, token in zip(live, last.tolist()):
            drafts[i].append(token)
        # Steps 2..k: one token per request still asking for more.
        for j in range(1, max(num_tokens[i] for i in live)):
            live = [i for i in live if num_tokens[i] > j]
            if not live:
                break
            spans = [self._next_span(requests[i], j) for i in live]
            last = self._forward([drafts[i][-1] for i in live], spans)
            for i, token in zip(live, last.tolist()):
                drafts[i].append(token)
        for i in served:  # only real tokens count as held; the guesses' K/V is scratch
            self.seqs[requests[i].request_id].num_computed_tokens = requests[i].num_tokens
        return drafts

    def _catch_up_span(self, request: Request, k: int) -> SeqSpan | None:
        """Allocate room for the catch-up plus k - 1 guesses; None when the draft cannot serve."""
        if request.num_tokens + k > self.config.max_position_embeddings:
            return None
        seq = self.seqs.get(request.request_id)
        if seq is None:
            seq = self.seqs[request.request_id] = _DraftSeq(request.request_id)
        # Tokens only grow while a request lives, so what the draft holds stays valid; the
        # last real token is always recomputed so its row yields the first guess.
        seq.num_computed_tokens = min(seq.num_computed_tokens, request.num_tokens - 1)
        seq.num_tokens = request.num_tokens
        num_new = request.num_tokens - seq.num_computed_tokens
        block_ids = self.kv.allocate_slots(seq, num_new + k - 1)
        if block_ids is None:
            return None  # the draft's cache is full: no guesses for this request this step
        return SeqSpan(seq.num_computed_tokens, num_new, block_ids)

    def _next_span(self, request: Request, j: int) -> SeqSpan:
        """Guess j - 1 sits at position num_tokens + j - 1; its row guesses token j."""
        block_ids = self.kv.get_block_ids(request.request_id)
        return SeqSpan(request.num_tokens + j - 1, 1, block_ids)

    def _forward(self, ids: list[int], spans: list[SeqSpan]) -> torch.Tensor:
        """Run the draft on a flat batch; greedy token at each span's last row -> [len(spans)]."""
        positions = np.concatenate([np.arange(s.start, s.start + s.num_new) for s in spans])
        window, kernel = self.config.sliding_window, self.attention_kernel
        meta = build_attention_metadata(
            spans, self.block_size, window, kernel, self.config.interleaves_sliding_window
        )
        input_ids, positions_t = torch.tensor(ids, dtype=torch.long), torch.from_numpy(positions)
        if self.step_to_ranks is not None:
            self.step_to_ranks(input_ids, positions_t, spans)
        hidden = self.model(input_ids, positions_t, self.kv_cache, meta)  # [T, hidden]
        ends = torch.from_numpy(np.cumsum([s.num_new for s in spans]) - 1)
        return self.model.compute_logits(hidden[ends]).argmax(dim=-1)  # [len(spans)]


def check_compatible(draft: ModelConfig, target: ModelConfig) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a draft model must share the target's tokenizer"
        )


@register_proposer("draft")
def _build(config: SpeculativeConfig, target: TargetInfo) -> DraftModelProposer:
    from fornax.models import DTYPES, load_model

    assert config.model is not None  # SpeculativeConfig validates this
    dtype_name = next(name for name, dtype in DTYPES.items() if dtype == target.dtype)
    draft = load_model(config.model, dtype_name, progress=False)
    check_compatible(draft.config, target.loaded.config)
    # A decode step reads every weight once: cost scales with the parameter count.
    cost = _num_params(draft.model) / _num_params(target.loaded.model)
    kernel = target_kernel(target)
    if kernel is not None:  # the target runs native kernels: so does its draft
        draft.model.use_ops(layer_ops("native", target.dtype))
    shape = (target.num_blocks, target.block_size, target.dtype)
    return DraftModelProposer(draft.model, draft.config, *shape, kernel, cost, dense_fraction=cost)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def target_kernel(target: TargetInfo) -> PagedAttentionKernel | None:
    kernel = target.attention_kernel
    return kernel if isinstance(kernel, PagedAttentionKernel) else None
