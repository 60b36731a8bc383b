"""Tiny random-weight models built by transformers itself, saved as HF directories.

Each test builds the reference model in-process (no hub, no internet) and compares fornax
against it. Weights are drawn larger than transformers' default init so logits are peaked
and greedy argmax is not decided by float noise between near-equal candidates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 384
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. Inference turns static weights into answers.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Prefill reads the whole prompt at once; decode writes one token at a time.",
    "Continuous batching keeps the hardware busy: when one request finishes, another fills its place.",
]


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_tokenizer_files(
    out: Path, added_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
) -> None:
    """A small byte-level BPE tokenizer, trained here, saved as tokenizer.json + config.
    `added_tokens` (text tokens, not special: a reasoning model's `<think>`) take the last ids
    of the model's vocabulary, so the trained part is smaller by as many."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - len(added_tokens),
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAIN_TEXT * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))


def build_tiny_model(arch: str, out: Path, seed: int = 0, **tokenizer: Any) -> torch.nn.Module:
    """Build, randomize and save a tiny model of `arch`; returns the fp32 HF model.
    `tokenizer`: make_tokenizer_files' options (added tokens, the chat template)."""
    import transformers

    common = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
    elif arch == "llama3":  # Llama 3.1-style RoPE scaling, tied embeddings
        config = transformers.LlamaConfig(
            **{**common, "tie_word_embeddings": True},
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=24, head_dim=16)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32, use_sliding_window=False)
    elif arch == "gemma3":  # sliding and global layers alternating, each with its RoPE base
        config = transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True},
            head_dim=16,
            sliding_window=24,
            sliding_window_pattern=2,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    elif arch == "qwen3_yarn":  # YaRN as Qwen3's long-context configs give it; every prompt runs past 16
        config = transformers.Qwen3Config(
            **common,
            head_dim=32,
            use_sliding_window=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    elif arch == "phi3":  # fused Q/K/V and gate/up tensors; LongRoPE over a 16-position trained context
        config = transformers.Phi3Config(
            **common,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.4, 3.9, 6.0, 9.0, 13.5, 20.0],
                "original_max_position_embeddings": 16,
            },
        )
    elif arch == "mixtral":  # 4 experts of intermediate_size, top 2, renormalized
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    elif arch == "qwen3_moe":  # 8 small experts, top 3 renormalized; layer 1 keeps a dense MLP
        config = transformers.Qwen3MoeConfig(
            **common,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            use_sliding_window=False,
        )
    elif arch == "qwen2_moe":  # a shared expert behind its sigmoid gate, top 2 not renormalized
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            use_sliding_window=False,
        )
    elif arch == "olmoe":  # Q/K norms over whole projections, values clipped, top 2 unnormalized
        config = transformers.OlmoeConfig(
            **{**common, "num_key_value_heads": 4}, num_experts=8, num_experts_per_tok=2, clip_qkv=2.5
        )
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma scales by 1 + w
                p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.eval()
    model.generation_config.eos_token_id = None  # compare full-length outputs
    model.save_pretrained(str(out))
    make_tokenizer_files(out, **tokenizer)
    return model


def make_wordpiece_files(out: Path) -> None:
    """A small uncased WordPiece tokenizer (BERT's pipeline) with BERT's single and pair
    templates ([CLS] a [SEP] b [SEP], types 0 then 1), trained here, saved beside a model."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        TRAIN_TEXT * 4, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    # BERT's inputs, token types among them (PreTrainedTokenizerFast gives none unless told).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    fast.save_pretrained(str(out))


def build_tiny_bert(out: Path, seed: int = 0, cross_encoder: bool = False) -> torch.nn.Module:
    """A tiny random BERT saved with its WordPiece tokenizer: a BertModel without pooler (an
    embedder), or with `cross_encoder` a BertForSequenceClassification of one label; returns the
    fp32 HF model. LayerNorm weights near 1, everything else near 0."""
    import transformers

    labels = {"num_labels": 1} if cross_encoder else {}
    config = transformers.BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
        **labels,
    )
    torch.manual_seed(seed)
    if cross_encoder:
        model = transformers.BertForSequenceClassification(config)
    else:
        model = transformers.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "LayerNorm.weight" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(out))
    make_wordpiece_files(out)
    return model


def build_tiny_cross_encoder(out: Path, seed: int = 0) -> torch.nn.Module:
    """A tiny random BertForSequenceClassification (one label: a cross-encoder), saved with its
    WordPiece tokenizer; returns the fp32 HF model."""
    return build_tiny_bert(out, seed, cross_encoder=True)
