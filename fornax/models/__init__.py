"""Model architectures and loading: source -> weights -> a ready torch module."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fornax.config import EngineConfig, ModelConfig
from fornax.layers import hugepages
from fornax.layers.embedding import FileEmbedding
from fornax.layers.kernel_plan import FormRequest, Kernels, NoBatchInvariantForm, plan_linear
from fornax.layers.linear import Int4FileBlocks, Linear
from fornax.layers.process_memory import release_free_heap
from fornax.models.base import CausalLM, KVCache
from fornax.models.bert import BertModel
from fornax.models.bert_classifier import BertForSequenceClassification
from fornax.models.gemma3 import Gemma3ForCausalLM
from fornax.models.hf_dir import hf_model_config, load_hf_dir
from fornax.models.llama import LlamaForCausalLM
from fornax.models.loader import (
    CutsFor,
    LoadedWeights,
    ModelLoadError,
    gguf_model_config,
    load_gguf,
    read_gguf,
)
from fornax.models.registry import ModelSourceError, ResolvedModel, resolve_model
from fornax.models.sharding import (
    Cut,
    Shard,
    install_all_reduce,
    install_gathers,
    plan_shards,
    row_parallel_linears,
    shard_cuts,
    split_row_layers_by_output,
)

# HF architecture name -> implementation. The Llama family shares one implementation
# whose config switches cover Mistral, Qwen2/3 and the mixture-of-experts families (Mixtral,
# Qwen2-MoE, Qwen3-MoE, OLMoE: models/moe.py); Gemma 3 reuses its
# layers in a decoder of its own (models/gemma3.py). BERT is an encoder: it serves pooling
# (embedding) requests only (models/bert.py), or with a classifier head scores text pairs as a
# cross-encoder (models/bert_classifier.py).
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

logger = logging.getLogger("fornax.models")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    resolved: ResolvedModel
    metadata: dict[str, Any]  # GGUF metadata ({} for HF directories)
    # A tensor-parallel rank's slice (models/sharding.py): the sizes its layers and KV
    # pools have; None in a single process. `config` stays the whole model's.
    local_config: ModelConfig | None = None

    def kv_cache_bytes_per_block(
        self, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        """What one paged KV-cache block of `block_size` tokens takes, over every layer: what
        the engine sizes its cache by. An encoder keeps no K/V: 0."""
        if self.config.encoder:
            return 0
        return KVCache.bytes_per_block(self.local_config or self.config, block_size, dtype, kv_cache_dtype)


def load_weights(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    progress: bool = True,
    keep_int4_blocks: bool = False,
    cuts_for: CutsFor | None = None,
) -> LoadedWeights:
    if resolved.gguf_path is not None:
        return load_gguf(resolved.gguf_path, dtype, progress, keep_int4_blocks, cuts_for)
    assert resolved.hf_dir is not None
    return load_hf_dir(resolved.hf_dir, dtype, progress, cuts_for)


def read_model_config(source: str | Path) -> ModelConfig:
    """A model's config from its metadata alone (the GGUF header or config.json): no weights
    are read. For checks that must come before a load, such as a tensor-parallel split."""
    resolved = resolve_model(str(source))
    if resolved.gguf_path is not None:
        return gguf_model_config(read_gguf(resolved.gguf_path).metadata, name=resolved.gguf_path.stem)
    assert resolved.hf_dir is not None
    return hf_model_config(resolved.hf_dir)


def load_model(
    source: str | Path,
    dtype: str = "bfloat16",
    progress: bool = True,
    small_step: tuple[str | None, int] | None = None,
    kernel_backend: str = "native",
    large_step: tuple[str | None, int] | None = None,
    keep_dense_weights: bool = False,
    lm_head_int4: bool = False,
    deterministic: bool = False,
    shard: Shard | None = None,
) -> LoadedModel:
    """Resolve, read and build a model; errors are ModelSourceError / ModelLoadError.
    small_step: (method, max_rows): the form of each Linear for steps of at most max_rows
    rows. method "int8" / "int4" / "auto" quantizes; kernel_backend "native" runs that on
    fornax's integer kernel where this CPU can, and gives the Linears left dense (method None,
    or float tensors under "auto") the native bf16 kernel in bf16 models (layers/linear.py).
    None: torch's dense linear for every step. large_step: (method, min_rows): "w8a8" serves
    steps of at least min_rows rows (past the small-step limit) by int8 x int8 matmuls.
    deterministic: each Linear then keeps one of those forms for every step (kernel_plan.py);
    ModelLoadError where no batch-invariant form runs on this CPU. shard: only this rank's slice
    of each layer (models/sharding.py), read alone from the file, its row-parallel
    outputs completed by shard.all_reduce; the forms are then built per slice.

    Each weight is then held only in the forms some step reads (docs/memory.md): a Linear's
    dense weight goes when its forms cover every row count (keep_dense_weights keeps it, for
    a self-draft that quantizes from it), and a GGUF's embedding table stays in the file
    (layers/embedding.py) when no LM head shares it dense."""
    resolved = resolve_model(str(source))
    torch_dtype = DTYPES[dtype]
    auto = small_step is not None and small_step[0] == "auto"
    cuts_for = None
    if shard is not None:  # read only this rank's parts of the file (models/sharding.py)

        def cuts_for(config: ModelConfig) -> dict[str, Cut]:
            return shard_cuts(config, plan_shards(config, shard.world)[shard.rank], shard.exact)

    weights = load_weights(resolved, torch_dtype, progress, keep_int4_blocks=auto, cuts_for=cuts_for)
    if shard is not None and weights.config.encoder:
        raise ModelLoadError("an encoder model runs in one process: tensor parallelism does not split it")
    cls = ARCHITECTURES[weights.config.architecture]
    model_config = weights.config
    plan = None if shard is None else plan_shards(weights.config, shard.world)[shard.rank]
    if plan is not None:
        model_config = plan.local_config(weights.config)
    # Built straight on the CPU: the modules allocate their weights with torch.empty (no
    # initialisation to overwrite). Not on the meta device: materialising meta tensors goes
    # through torch's Python reference ops, which import sympy and torch.fx (~30 MiB held for
    # the process's life, docs/memory.md).
    model = cls(model_config, torch_dtype)
    if shard is not None and shard.exact:
        assert plan is not None
        split_row_layers_by_output(model, weights.config, plan, torch_dtype)
    with torch.no_grad():
        model.load_weights(weights.tensors)
    model.eval()
    request = FormRequest(
        small_method=small_step[0] if small_step is not None else None,
        small_max_rows=small_step[1] if small_step is not None else 0,
        large_method=large_step[0] if large_step is not None else None,
        large_min_rows=large_step[1] if large_step is not None else 0,
        lm_head_int4=lm_head_int4,
        deterministic=deterministic,
        keep_dense=keep_dense_weights,
    )
    # a rank's row-parallel projections hold slices of each int8 row: their scales come from
    # the whole row (a max across the ranks), as one process would round them
    cut_rows = (
        {id(x) for x in row_parallel_linears(model)} if shard is not None and not shard.exact else set()
    )
    build_planned_forms(model, weights, request, Kernels.here(kernel_backend), cut_rows, shard)
    if shard is not None and shard.exact:
        assert shard.all_gather is not None
        install_gathers(model, weights.config, shard.world, shard.all_gather)
    elif shard is not None:
        install_all_reduce(model, shard.all_reduce)
    embedding_from_file(model, weights)
    weights.tensors.clear()  # the model holds what it needs; the rest goes before packing
    weights_on_huge_pages(model)
    release_free_heap()  # loading's float32 intermediates, freed but still held by malloc
    local = model_config if shard is not None else None
    return LoadedModel(
        model=model, config=weights.config, resolved=resolved, metadata=weights.metadata, local_config=local
    )


def load_engine_model(config: EngineConfig, progress: bool = True, shard: Shard | None = None) -> LoadedModel:
    """load_model as an engine's config asks: its weight forms, kernels and mode, and (shard)
    one tensor-parallel rank's slice. The engine process and its worker ranks both load this way."""
    spec = config.speculative
    loaded = load_model(
        config.model,
        config.dtype,
        progress=progress,
        small_step=(config.small_step_method, config.small_step_max_rows),
        large_step=(config.large_step_quantization, config.large_step_min_rows),
        kernel_backend=config.kernel_backend,
        lm_head_int4=config.lm_head_quantization == "int4",
        deterministic=config.deterministic,
        shard=shard,
        # a quantized self-draft derives its forms from the dense weights (engine/spec_decode/self_draft.py)
        keep_dense_weights=spec is not None and spec.method == "self" and spec.quantization is not None,
    )
    # An encoder keeps no K/V and samples nothing (models/bert.py): KV tiers and drafts have
    # nothing to work on, and its padded attention is not batch-invariant.
    asked = {
        "KV cache tiers": config.offload.enabled,
        "speculative decoding": spec is not None,
        "deterministic mode": config.deterministic,
    }
    if loaded.config.encoder and any(asked.values()):
        names = ", ".join(name for name, on in asked.items() if on)
        raise ModelLoadError(f"an encoder (embedding) model does not run with {names}")
    return loaded


def embedding_from_file(model: LlamaForCausalLM, weights: LoadedWeights) -> None:
    """Look token rows up in the memory-mapped GGUF instead of a dense table, when the table is
    not also the LM head's dense weight (tied, and kept because some step reads it)."""
    source = weights.embedding_rows
    if source is None or (model.config.tie_word_embeddings and model.lm_head.weight is not None):
        return
    model.embed_tokens = FileEmbedding(source.data, source.qtype, model.config.hidden_size, model.dtype)


def weights_on_huge_pages(model: nn.Module) -> None:
    """Every parameter and every tensor of the Linears' step forms, packed into one mapping on
    huge pages (layers/hugepages.py: a step streams all of them). A tensor held twice (a
    dense form holds its Linear's weight) is packed once and stays shared."""
    holders: list[tuple[object, str]] = [(p, "data") for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, Linear):
            for form in (f for f in (module.small, module.mid, module.large) if f is not None):
                holders += [(form, name) for name, v in vars(form).items() if isinstance(v, torch.Tensor)]
    held = [getattr(holder, name) for holder, name in holders]
    keys = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in held]
    first = dict(zip(keys, held))  # the same view of the same memory: one tensor
    packed = dict(zip(first, hugepages.pack(list(first.values()))))
    for (holder, name), key in zip(holders, keys):
        setattr(holder, name, packed[key])


def build_planned_forms(
    model: CausalLM,
    weights: LoadedWeights,
    request: FormRequest,
    kernels: Kernels,
    cut_rows: set[int],
    shard: Shard | None,
) -> None:
    """Each Linear's forms as layers/kernel_plan.py plans them for its shape and the file's
    quantization of its tensors (quantization="auto": Q4_0/Q4_1 tensors become int4 from the
    file's own blocks, so no second rounding; other quantized types are requantized to the int
    form of at least their precision; float tensors keep their dense weights)."""
    head = getattr(model, "lm_head", None)
    sources = {id(linear): names for linear, names in model.linear_sources()}
    plans = []
    for linear in (m for m in model.modules() if isinstance(m, Linear)):
        names = sources.get(id(linear), [])
        blocks = None
        if names and all(n in weights.int4_blocks for n in names):  # all Q4 blocks: group 32
            parts = [weights.int4_blocks[n] for n in names]
            cat = [torch.cat([getattr(b, f) for b in parts]) for f in ("q", "scale", "zero")]
            blocks = Int4FileBlocks(*cat, parts[0].group_size)
        shape = linear.shape(
            file_kinds=frozenset(weights.file_quantization.get(n) for n in names) or frozenset({None}),
            file_int4_blocks=blocks is not None,
            is_lm_head=linear is head,
        )
        try:
            plan = plan_linear(shape, kernels, request)
        except NoBatchInvariantForm as exc:
            size = f"{linear.in_features}, {linear.out_features}"
            raise ModelLoadError(f"deterministic mode: Linear({size}): {exc}") from exc
        whole_row_max = shard.all_reduce_max if shard is not None and id(linear) in cut_rows else None
        linear.build_forms(plan, blocks, whole_row_max)
        plans.append(plan)
        for note in plan.notes:
            logger.warning("%s", note)
    weights.int4_blocks.clear()  # the packed forms hold what is needed
    if request.large_method == "w8a8" and all(p.large is None for p in plans):
        logger.warning("w8a8 large steps cannot run here (no native kernels): dense weights serve them")


__all__ = [
    "ARCHITECTURES",
    "LoadedModel",
    "ModelLoadError",
    "ModelSourceError",
    "load_model",
    "resolve_model",
]
