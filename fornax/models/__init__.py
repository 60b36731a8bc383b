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
from fornax.layers.linear import DENSE_BF16_MAX_ROWS, BlockInt4, Int4Grouped, Linear, native_matmul_for
from fornax.layers.memory import release_free_heap
from fornax.models.gemma3 import Gemma3ForCausalLM
from fornax.models.llama import KVCache, LlamaForCausalLM
from fornax.models.loader import (
    CutsFor,
    LoadedWeights,
    ModelLoadError,
    gguf_model_config,
    hf_model_config,
    load_gguf,
    load_hf_dir,
    read_gguf,
)
from fornax.models.registry import ModelSourceError, ResolvedModel, resolve_model
from fornax.models.tensor_parallel import (
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
# whose config switches cover Mistral and Qwen2/3 (see models/llama.py); Gemma 3 reuses its
# layers in a decoder of its own (models/gemma3.py).
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

logger = logging.getLogger("fornax.models")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    resolved: ResolvedModel
    metadata: dict[str, Any]  # GGUF metadata ({} for HF directories)
    # A tensor-parallel rank's slice (models/tensor_parallel.py): the sizes its layers and KV
    # pools have; None in a single process. `config` stays the whole model's.
    local_config: ModelConfig | None = None

    def kv_cache_bytes_per_block(
        self, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        """What one paged KV-cache block of `block_size` tokens takes, over every layer: what
        the engine sizes its cache by."""
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
    deterministic: each Linear then keeps one of those forms for every step (Linear.use_one_form);
    ModelLoadError where no batch-invariant form runs on this CPU. shard: only this rank's slice
    of each layer (models/tensor_parallel.py), read alone from the file, its row-parallel
    outputs completed by shard.all_reduce; the forms are then built per slice.

    Each weight is then held only in the forms some step reads (docs/memory.md): a Linear's
    dense weight goes when its forms cover every row count (keep_dense_weights keeps it, for
    a self-draft that quantizes from it), and a GGUF's embedding table stays in the file
    (layers/embedding.py) when no LM head shares it dense."""
    resolved = resolve_model(str(source))
    torch_dtype = DTYPES[dtype]
    auto = small_step is not None and small_step[0] == "auto"
    cuts_for = None
    if shard is not None:  # read only this rank's parts of the file (models/tensor_parallel.py)

        def cuts_for(config: ModelConfig) -> dict[str, Cut]:
            return shard_cuts(config, plan_shards(config, shard.world)[shard.rank], shard.exact)

    weights = load_weights(resolved, torch_dtype, progress, keep_int4_blocks=auto, cuts_for=cuts_for)
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
    if small_step is not None and small_step[1] > 0:
        method, max_rows = small_step
        if auto:
            set_small_step_from_file(model, weights, max_rows, kernel_backend)
        elif method is not None:
            for module in model.modules():
                if isinstance(module, Linear):
                    module.set_small_step_method(method, max_rows, kernel_backend)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if large_step is not None and large_step[0] == "w8a8":
        # a rank's row-parallel projections hold slices of each int8 row: their scales come
        # from the whole row (a max across the ranks), as one process would round them
        cut_rows = (
            {id(x) for x in row_parallel_linears(model)} if shard is not None and not shard.exact else set()
        )
        for linear in linears:
            whole_row_max = shard.all_reduce_max if shard is not None and id(linear) in cut_rows else None
            linear.set_large_step_int8(large_step[1], kernel_backend, whole_row_max)
        if all(linear.large is None for linear in linears):
            logger.warning(
                "w8a8 large steps cannot run here (no AVX-512 VNNI or no C compiler): dense weights serve them"
            )
    if small_step is not None and small_step[1] > 0:
        # dense bf16 forms: alone, or past the quantized limit; not where int8 x int8 runs
        # (it beats them at every row count, benchmarks/int8_matmul.py)
        for linear in linears:
            if linear.large is None:
                linear.set_dense_small_step(max(small_step[1], DENSE_BF16_MAX_ROWS), kernel_backend)
    if lm_head_int4:
        lm_head_int4_form(model.lm_head, kernel_backend)
    if deterministic:
        try:
            for linear in linears:
                linear.use_one_form(kernel_backend)
        except ValueError as exc:
            raise ModelLoadError(f"deterministic mode: {exc}") from exc
    if not keep_dense_weights:
        for linear in linears:
            linear.release_dense_weight()
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
    return load_model(
        config.model,
        config.dtype,
        progress=progress,
        small_step=(config.small_step_method, config.small_step_max_rows),
        large_step=(config.large_step_quantization, config.large_step_min_rows),
        kernel_backend=config.kernel_backend,
        lm_head_int4=config.lm_head_quantization == "int4",
        deterministic=config.deterministic,
        shard=shard,
        # a quantized self-draft derives its forms from the dense weights (spec_decode/self_draft.py)
        keep_dense_weights=spec is not None and spec.method == "self" and spec.quantization is not None,
    )


# The LM head's int4 form (lm_head_int4) serves steps of at most this many rows: Gemma 3's
# 262k x 640 head, one row 3.1 ms against 6.8 for int8 x int8, two 4.3 against ~7; from four
# rows on the int8 forms win (native int4 vs int8 kernels, 2026-12-05).
LM_HEAD_INT4_MAX_ROWS = 2


def lm_head_int4_form(head: Linear, kernel_backend: str) -> None:
    """An int4 small form for the LM head (requantized from its weight, per 32 values), where the
    native integer kernel runs; the head's other forms serve the larger steps."""
    kernel = native_matmul_for(head.in_features, kernel_backend)
    if kernel is None or head.weight is None:
        logger.warning("the int4 LM head needs the native integer kernel (AVX-512 VNNI and a C compiler)")
        return
    head.set_small(BlockInt4(head.weight.data, kernel), LM_HEAD_INT4_MAX_ROWS)


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


def set_small_step_from_file(
    model: LlamaForCausalLM, weights: LoadedWeights, max_rows: int, kernel_backend: str = "native"
) -> None:
    """quantization="auto": each Linear's small-step form is what its GGUF tensors carry.

    Q4_0/Q4_1 tensors become int4 from the file's own blocks (its 4-bit values and per-block
    scales, only the scales rounded to bf16), so no second rounding of the weights; other
    quantized types are requantized to the int form of at least their precision; float
    tensors (and HF directories) keep the dense weights alone."""
    for linear, names in model.linear_sources():
        kinds = {weights.file_quantization.get(n) for n in names}
        if all(n in weights.int4_blocks for n in names):
            blocks = [weights.int4_blocks[n] for n in names]  # all Q4 blocks: group 32
            cat = [torch.cat([getattr(b, f) for b in blocks]) for f in ("q", "scale", "zero")]
            kernel = native_matmul_for(linear.in_features, kernel_backend)
            form = (
                Int4Grouped.from_blocks(*cat, blocks[0].group_size)
                if kernel is None
                else BlockInt4.from_blocks(*cat, kernel)
            )
            linear.set_small(form, max_rows)
        elif None not in kinds:  # quantized in the file, in some other form
            linear.set_small_step_method("int8" if "int8" in kinds else "int4", max_rows, kernel_backend)
    weights.int4_blocks.clear()  # the packed forms hold what is needed


__all__ = [
    "ARCHITECTURES",
    "LoadedModel",
    "ModelLoadError",
    "ModelSourceError",
    "load_model",
    "resolve_model",
]
