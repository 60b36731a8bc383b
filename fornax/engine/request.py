"""Per-request state: SamplingParams, Request, RequestStatus.

No torch here: the scheduler and the KV manager work on these objects and must stay
pure bookkeeping (docs/architecture.md, rule 1). One phase model (rule 2): a request's
`num_computed_tokens` catches up with `num_tokens`; prefill, chunked prefill,
prefix-cache hits and decode are all just token counts.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fornax.engine.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from fornax.engine.pooling import PoolingParams
    from fornax.engine.structured.backend import GrammarState
    from fornax.models.lora import LoRAAdapter

# Bounds that keep one request from asking for unbounded work. The server has its own,
# stricter, configurable limits; these are the engine's hard floor.
MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
# A temperature below this samples greedily, as in vLLM: dividing logits by it overflows
# float32 (1e-50 is 0.0 there), and the distribution it asks for is the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# A repetition penalty below this acts as this: a seen token's positive logit divided by
# 1e-6 already outweighs every other token, and a smaller float32 divisor overflows to inf
# (1e-50 becomes 0.0) and turns the row into NaNs.
MIN_REPETITION_PENALTY = 1e-6


class RequestRejected(ValueError):
    """The engine refuses a request for what it asks (a prompt longer than the context or the
    KV cache, a token id out of range, an id in use): the caller's mistake, told as such
    (HTTP 400, one line on the command line), never an internal error."""


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's field names and defaults)."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Speculative decoding: at most this many draft tokens per step for this request
    # (None: the engine's num_speculative_tokens; 0: never speculate). Output is the same.
    num_speculative_tokens: int | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's field; a dict
    # with the same keys is accepted too).
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise SamplingParamsError("structured_outputs", f"structured_outputs: {exc}") from None
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs must be a StructuredOutputsParams"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if 0.0 < self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        if 0.0 < self.repetition_penalty < MIN_REPETITION_PENALTY:
            self.repetition_penalty = MIN_REPETITION_PENALTY
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            bad("seed", f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                bad("logit_bias", f"logit_bias has more than {MAX_LOGIT_BIAS_ENTRIES} entries")
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    bad("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
                if not -100.0 <= bias <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
        assert isinstance(self.stop, list)
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                bad("stop", f"stop strings must be non-empty and at most {MAX_STOP_STRING_CHARS} characters")
        for t in self.stop_token_ids or []:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids", f"stop_token_ids must be token ids, got {t!r}")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or not 0 <= k <= 16):
            bad("num_speculative_tokens", f"num_speculative_tokens must be in [0, 16], got {k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")

    def validate_against_vocab(self, vocab_size: int) -> None:
        if self.top_k >= vocab_size:
            self.top_k = 0  # keeping every token is what "no top-k" means; torch.topk would refuse k > vocab
        for token_id in list((self.logit_bias or {}).keys()) + list(self.stop_token_ids or []):
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    "logit_bias" if token_id in (self.logit_bias or {}) else "stop_token_ids",
                    f"token id {token_id} is out of range for a vocabulary of {vocab_size}",
                )


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # freed and waiting to be recomputed
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context length
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class RequestTimes:
    """Wall-clock (time.time()) and monotonic stamps that the metrics and timings need."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class SpecStats:
    """Speculative decoding per request, as its outputs report it: what was verified and
    accepted (the scheduler counts). What the draft budget learns per request is the
    controller's own (engine/spec_decode/controller.py)."""

    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    num_steps: int = 0  # verification steps (each also yields one target-sampled token)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification step: accepted drafts + the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0


class Request:
    """One sequence being generated. A request with n > 1 is fanned out into n of these."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        whole_prompt: bool = False,
    ) -> None:
        if not prompt_token_ids:
            raise SamplingParamsError("prompt", "the prompt must contain at least one token")
        if not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
            raise SamplingParamsError("priority", f"priority must be a 32-bit integer, got {priority!r}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.priority = priority  # lower value is served first (vLLM's convention)
        # Mixed into the first block's hash (kv/block_pool.py salted_root): requests with
        # different salts never share cached blocks. None: the shared, unsalted chain.
        self.cache_salt = cache_salt
        # The LoRA adapter this sequence runs with (engine/lora/; None: the base model), and
        # the slot its weights sit in while it runs (the scheduler pins it from admission on).
        self.lora: LoRAAdapter | None = None
        self.lora_slot: int | None = None
        self.times = RequestTimes()
        if arrival_time is not None:
            self.times.arrival = arrival_time
        self.arrival_order = 0  # set by the scheduler: FCFS tie-breaker
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; -1 until first scheduled
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # Draft tokens for the next step only: never part of all_token_ids (so hashes, penalties
        # and counts see accepted tokens only). The scheduler may shorten them; the step's
        # verification turns a prefix of them into real tokens and drops the rest.
        self.spec_token_ids: list[int] = []
        self.spec = SpecStats()
        # Where this sequence is in its grammar (constrained decoding only); it follows the
        # accepted output tokens, so it survives preemption with them.
        self.grammar: GrammarState | None = None
        # A pooling request (engine/pooling.py) samples nothing: it ends once its prompt is
        # computed, with a vector. whole_prompt: its prompt is computed in one step, never in
        # chunks (an encoder's attention sees the whole sequence at once).
        self.pooling_params = pooling_params
        self.whole_prompt = whole_prompt
        self.embedding: list[float] | None = None  # the pooled vector, once the prompt is computed
        # Sampled-token budget: max_tokens, capped so prompt + output fits the model context.
        limit = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            limit = room if limit is None else min(limit, room)
        self.max_tokens = max(limit if limit is not None else 2**31, 0)

    # -- token counts (the one phase model) --
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def reads_every_position(self) -> bool:
        """A pooling request whose vector reads more than its last prompt position (mean or cls
        pooling, an encoder): each of its lives computes the prompt from position 0, so it takes
        no prefix-cache hit, no KV tier load and no swap-in after a preemption."""
        p = self.pooling_params
        return p is not None and (self.whole_prompt or p.pooling_type != "last")

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (a stop string found mid-run)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]

    def check_stop_on_token(self) -> bool:
        """After appending a token: finish on EOS, a stop token id or the length limit.

        Stop strings are found by the detokenizer, which calls `finish` itself.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in (params.stop_token_ids or ()):
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def timings(self) -> dict[str, float]:
        """Where the request's time went, in seconds (queue, TTFT, prefill, decode, end to end),
        its preemptions, and its speculative decoding figures when it verified drafts."""
        t = self.times
        end = t.finished or time.monotonic()
        first_sched = t.first_scheduled or end
        first_tok = t.first_token or end
        out = {
            "queue_s": first_sched - t.arrival,
            "ttft_s": first_tok - t.arrival,
            "prefill_s": first_tok - first_sched,
            "decode_s": (t.last_token or first_tok) - first_tok,
            "e2e_s": end - t.arrival,
            "num_preemptions": float(self.num_preemptions),
        }
        spec = self.spec
        if spec.num_steps:
            out |= {
                "spec_acceptance_rate": spec.acceptance_rate,
                "spec_mean_accepted_len": spec.mean_accepted_length,
                "spec_num_draft_tokens": float(spec.num_draft_tokens),
                "spec_num_accepted_tokens": float(spec.num_accepted_tokens),
                "spec_num_steps": float(spec.num_steps),
            }
        return out

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
