"""The one-call small step (layers/kernels/decode_step.c) for a Llama-family model.

A step whose every sequence attends through the paged-attention kernel (decodes, speculative
verification, prompts over a short context: layers/attention.py) and whose rows fit one of
the tiers below runs every layer in one native
call instead of ~360 module and kernel calls. It computes what the op-by-op native path
computes, to the bit (tests/model/test_native_step.py), so the runner may pick either per
step. Built only when every projection of the model has a native small-step form (BlockInt4 /
BlockInt8, or DenseBf16 in a dense bf16 model; in a quantized bf16 model DenseBf16 is a
second tier for larger steps; with int8 large steps Int8Rotated takes every step past the
tiers before it) and no layer needs what the C step leaves out (Qwen3's per-head Q/K norms);
`NativeStep.build` returns None otherwise and the model runs op by op.
"""

from __future__ import annotations

import torch

from fornax.layers.attention import AttentionMetadata
from fornax.layers.linear import AmxBf16, BlockInt4, BlockInt8, DenseBf16, Int8Rotated, Linear
from fornax.layers.lora import LoRAStep
from fornax.layers.native import (
    QLINEAR_AMX,
    QLINEAR_BF16,
    QLINEAR_I8,
    QLINEAR_Q4,
    QLINEAR_Q8,
    DecoderLayerDesc,
    DecoderModelDesc,
    DecodeStepKernel,
    QLinearDesc,
    load_decode_step,
    step_rows,
)
from fornax.layers.native import data_ptr_or_none as _ptr
from fornax.models.base import KVCache
from fornax.models.llama import LlamaForCausalLM


def _qlinear(linear: Linear, form: object) -> QLinearDesc | None:
    """`form` (one of linear's small-step forms) as the C step's descriptor; None if it has none."""
    if isinstance(form, BlockInt4):
        w, d, m, kind = form.packed, form.d, form.m, QLINEAR_Q4
    elif isinstance(form, BlockInt8):
        w, d, m, kind = form.qweight, form.d, None, QLINEAR_Q8
    elif isinstance(form, DenseBf16):
        w, d, m, kind = form.weight, None, None, QLINEAR_BF16
    elif isinstance(form, AmxBf16):
        w, d, m, kind = form.packed, None, None, QLINEAR_AMX
    elif isinstance(form, Int8Rotated):
        w, d, m, kind = form.packed, form.colsum, form.scale, QLINEAR_I8
    else:
        return None
    bias = None if linear.bias is None else linear.bias.data
    desc = QLinearDesc(_ptr(w), _ptr(d), _ptr(m), _ptr(bias), linear.out_features, linear.in_features, kind)
    lora = linear.lora
    if lora is not None and lora.kernel is not None:  # the slots' tensors never move (written in place)
        desc.lora_a, desc.lora_b, desc.lora_bounds = _ptr(lora.a), _ptr(lora.b), _ptr(lora.bounds_tensor)
        desc.lora_parts, desc.lora_max_rank = len(lora.parts), lora.max_rank
    return desc


# The large tier has no upper limit on rows
UNBOUNDED_ROWS = 1 << 30


def _tier_bounds(linear: Linear, attr: str) -> tuple[int, int] | None:
    """The rows [lo, hi] for which linear.forward takes its `attr` form; None if it has none."""
    if getattr(linear, attr) is None:
        return None
    after_small = linear.small_max_rows + 1 if linear.small is not None else 1
    if attr == "small":
        return 1, linear.small_max_rows
    if attr == "mid":
        return after_small, linear.mid_max_rows
    return max(after_small, linear.large_min_rows), UNBOUNDED_ROWS


class NativeStep:
    """Up to three tiers, as the linears have them: the small forms (quantized, or dense bf16 in
    a dense model) up to their row limit, then the dense bf16 mid forms up to theirs, then the
    int8 large forms. A step takes the first tier its rows fit, as every projection op by op
    would; tiers must follow each other without a gap, or the step stops at the gap."""

    def __init__(
        self,
        kernel: DecodeStepKernel,
        model: LlamaForCausalLM,
        tiers: list[tuple[int, list]],
        kv_cache: KVCache,
    ) -> None:
        c = model.config
        self.kernel, self.model = kernel, model
        self._kv_cache = kv_cache  # the descriptors point into its pools
        first = model.layers[0].self_attn
        self._layer_arrays = []  # kept alive with the pointers in the descriptors
        self.tiers: list[tuple[int, DecoderModelDesc]] = []
        for max_rows, layers in tiers:
            array = (DecoderLayerDesc * len(layers))(*layers)
            self._layer_arrays.append(array)
            desc = DecoderModelDesc(
                array,
                _ptr(model.norm.weight),
                len(layers),
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.intermediate_size,
                kv_cache.block_size,
                c.sliding_window or 0,
                int(kv_cache.kv_cache_dtype == "int8"),
                0,
                c.rms_norm_eps,
                first.scale,
            )
            self.tiers.append((max_rows, desc))
        self.max_rows = max(rows for rows, _ in self.tiers)
        # Whether the projections' LoRA slots are in the descriptors (built after attach_slots,
        # with the native LoRA kernel): then adapted steps run here too.
        self.adapts = all(
            m.lora is not None and m.lora.kernel is not None
            for layer in model.layers
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_cache: KVCache) -> NativeStep | None:
        kernel = load_decode_step()
        # the Llama layer's layout only: Qwen3's per-head norms and Gemma's four norms per layer,
        # GeGLU and per-layer windows are not in the C step
        if (
            kernel is None
            or not kernel.supports(model.dtype)
            or model.config.qk_norm
            or model.config.qk_norm_whole
            or model.config.moe is not None  # its experts are chosen per token, in Python
            or type(model) is not LlamaForCausalLM
        ):
            return None
        linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
        tiers: list[tuple[int, list]] = []
        for attr in ("small", "mid", "large"):
            bounds = {_tier_bounds(m, attr) for m in linears}
            # one range for every projection, so a step's tier is what each would pick op by op
            if len(bounds) != 1:
                break
            (span,) = bounds
            if span is None:
                continue  # no such tier: the next one must start where the last ended
            lo, hi = span
            if hi < lo:
                continue  # a tier that never serves (a mid tier cut to nothing)
            if lo != (tiers[-1][0] if tiers else 0) + 1:
                break
            layers = cls._layer_descs(model, kv_cache, attr)
            if layers is None:
                break
            tiers.append((hi, layers))
        return cls(kernel, model, tiers, kv_cache) if tiers else None

    @staticmethod
    def _layer_descs(model: LlamaForCausalLM, kv_cache: KVCache, attr: str) -> list[DecoderLayerDesc] | None:
        layers = []
        for layer, kv in zip(model.layers, kv_cache.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            projections = [_qlinear(x, getattr(x, attr)) for x in linears]
            if any(p is None for p in projections):
                return None
            layers.append(
                DecoderLayerDesc(
                    _ptr(layer.input_layernorm.weight),
                    _ptr(layer.post_attention_layernorm.weight),
                    *projections,
                    _ptr(kv.k),
                    _ptr(kv.v),
                    _ptr(kv.k_scale),
                    _ptr(kv.v_scale),
                )
            )
        return layers

    def covers(self, meta: AttentionMetadata, num_tokens: int, lora: LoRAStep | None = None) -> bool:
        kr = meta.kernel_rows
        adapted_ok = lora is None or self.adapts
        return kr is not None and kr.token_index is None and num_tokens <= self.max_rows and adapted_ok

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], as LlamaForCausalLM.forward returns."""
        kr = meta.kernel_rows
        assert kr is not None
        desc = next(d for rows, d in self.tiers if input_ids.shape[0] <= rows)
        desc.part_keys = kr.part_keys  # the attention split the op-by-op path would take
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.cos_sin(positions, x.dtype, meta.seq_lens)
        kv = self._kv_cache
        rows = step_rows(
            meta.slot_mapping,
            kr.block_tables,
            kr.row_seq,
            kr.row_pos,
            x.shape[0],
            num_slots=kv.num_blocks * kv.block_size,
            block_size=kv.block_size,
            lora_row_slot=None if lora is None else lora.row_slot,
            lora_rank=0 if lora is None else lora.rank,
        )
        return self.kernel(desc, x, cos.contiguous(), sin.contiguous(), rows)
