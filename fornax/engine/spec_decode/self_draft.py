"""Self-drafting: the target model, cut down, is its own draft model.

Useful when no separate draft model exists (the case for the default model). Two cuts,
combinable:

* layer skipping: the first `draft_layers` decoder layers, then the target's final norm and
  LM head (shared), so the draft reads a fraction of the weights per token;
* weight-only quantization ("int8" | "int4") of every linear of the draft, which on this CPU
  makes a one-row matmul several times cheaper than the dense bf16 one.

The draft is a second module tree over the *same* weight tensors (nothing is copied but the
quantized forms), run by DraftModelProposer with its own KV cache for its own layers.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torch import nn

from fornax.config import ConfigError, SpeculativeConfig
from fornax.engine.spec_decode import TargetInfo, register_proposer
from fornax.engine.spec_decode.draft_model import DraftModelProposer, target_kernel
from fornax.layers.linear import SMALL_STEP_METHODS, Linear
from fornax.models.llama import LlamaForCausalLM

# A one-row step with quantized weights, relative to the dense bf16 one, as measured with
# benchmarks/spec_decode.py (docs/speculative-decoding.md).
QUANTIZED_STEP_COST = {"int4": 0.35, "int8": 0.6}

# Quantized draft linears serve steps of up to this many rows; a longer catch-up chunk
# (the first one after a prompt) uses the shared dense weights, which win there.
QUANTIZED_MAX_ROWS = 64


def make_self_draft(
    target: LlamaForCausalLM, num_layers: int | None, quantization: str | None
) -> LlamaForCausalLM:
    """A LlamaForCausalLM sharing `target`'s tensors, with fewer layers and/or quantized linears."""
    total = target.config.num_hidden_layers
    num_layers = total if num_layers is None else num_layers
    if num_layers > total:
        raise ConfigError(f"draft_layers ({num_layers}) exceeds the model's {total} layers")
    # Deep-copy the module tree but not the data: every parameter, buffer and quantized form
    # maps to itself, so the copy owns new Module objects over the very same tensors.
    memo: dict[int, object] = {id(t): t for t in list(target.parameters()) + list(target.buffers())}
    for module in target.modules():
        if isinstance(module, Linear):
            for form in (module.small, module.mid, module.large):
                if form is not None:
                    memo[id(form)] = form
    draft = copy.deepcopy(target, memo)
    draft.layers = nn.ModuleList(list(draft.layers)[:num_layers])
    draft.config = replace(target.config, num_hidden_layers=num_layers, name=f"{target.config.name}-draft")
    if quantization is not None:
        for module in draft.modules():
            if isinstance(module, Linear):
                module.set_small(SMALL_STEP_METHODS[quantization](module.weight.data), QUANTIZED_MAX_ROWS)
    return draft


@register_proposer("self")
def _build(config: SpeculativeConfig, target: TargetInfo) -> DraftModelProposer:
    draft = make_self_draft(target.loaded.model, config.draft_layers, config.quantization)
    kernel = target_kernel(target)
    layers = draft.config.num_hidden_layers / target.loaded.config.num_hidden_layers
    cost = layers * QUANTIZED_STEP_COST.get(config.quantization or "", 1.0)
    if target.loaded.model.has_small_step_forms():
        # The target's own small steps run on native kernels already (quantized, or dense bf16
        # streamed at full bandwidth), as one native call: the draft's op-by-op steps cost
        # about as much as the target's, not a third (docs/speculative-decoding.md).
        cost = layers
    shape = (target.num_blocks, target.block_size, target.dtype)
    return DraftModelProposer(
        draft,
        draft.config,
        *shape,
        kernel,
        cost,
        dense_fraction=layers,
        step_to_ranks=target.draft_step_to_ranks,
    )
