"""Text <-> token ids, and chat templates, for one model.

`Tokenizer` wraps a HF `tokenizers.Tokenizer` built either from a GGUF file's `tokenizer.ggml.*`
metadata or from a HF directory (`tokenizer.json` + `tokenizer_config.json`). BOS/EOS are added by
this wrapper from explicit flags, never by the backend's post-processor, so one rule holds for both
sources. Chat templates render in fornax.chat_template's bounded sandbox, because a template comes
with the model file and must be treated as untrusted code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from fornax.chat_template import ChatTemplateError, flatten_messages, render_chat_template
from fornax.gguf_file import GGUFFile

__all__ = ["ChatTemplateError", "SpecialTokens", "Tokenizer", "read_gguf_fields", "render_chat_template"]

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6


# ---- byte-level BPE alphabet -------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable char map: printable latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to code points 256.. in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = (b for b in range(256) if b not in keep)
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


_CHAR_TO_BYTE = {c: b for b, c in _byte_alphabet().items()}


# ---- pre-tokenizers named by tokenizer.ggml.pre (llama.cpp's names) ------------------------------


def _split_regex(digits: str) -> str:
    """The Llama-3 style split; Qwen2 differs only in taking digits one at a time."""
    return "|".join(
        [
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
            r"[^\r\n\p{L}\p{N}]?\p{L}+",
            digits,
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    )


_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "smaug-bpe", "dbrx"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "megrez"}
# StarCoder-lineage vocabularies were trained with every digit split off before the GPT-2 regex.
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_GPT2_PRE = {"gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "roberta-bpe", "default"}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        regex = _split_regex(r"\p{N}{1,3}" if pre in _LLAMA3_PRE else r"\p{N}")
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, to_bytes])
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRE:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting text with the GPT-2 regex", pre)
    return gpt2


# ---- GGUF metadata ----------------------------------------------------------------------------


def read_gguf_fields(path: str | Path) -> dict[str, Any]:
    """Key/value metadata of a GGUF file, in `GGUFReader.fields[k].contents()` shapes (the
    loader's own header parser; raises GGUFFormatError, a ValueError, for a malformed file)."""
    return GGUFFile(path).metadata


def _tokenizer_from_gguf(meta: dict[str, Any]) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # some files repeat a token; the first id wins, as in llama.cpp
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        ignore_merges = meta.get("tokenizer.ggml.pre") in _LLAMA3_PRE  # Llama 3 looks whole words up first
        hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        hf.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        hf.decoder = decoders.ByteLevel()
    else:
        hf = _sentencepiece_bpe(meta, tokens, vocab)
    types = meta.get("tokenizer.ggml.token_type") or []
    hf.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    hf.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED
        ]
    )
    return hf


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], vocab: dict[str, int]) -> HFTokenizer:
    """SentencePiece BPE as a HF BPE: merges ranked by the score of the token they make, which is
    the order llama.cpp's score-driven merging picks pairs in."""
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    candidates = []
    for tok, idx in vocab.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[idx], idx, vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(candidates)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    has_bytes = any(t == _BYTE for t in meta.get("tokenizer.ggml.token_type") or [])
    unk = tokens[unk_id] if unk_id is not None else None
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, byte_fallback=has_bytes, fuse_unk=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    prepend = "first" if space_prefix else "never"
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return hf


# ---- the tokenizer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecialTokens:
    """Special ids and whether `encode` adds BOS/EOS, from whichever source the tokenizer came."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_ids: tuple[int, ...] = ()  # end-of-turn ids that also stop generation
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False


# Gemma's chat format: turns of <start_of_turn>{user|model}\n ... <end_of_turn>\n after BOS; a
# system message has no turn of its own and is prepended to the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{% if m['role'] == 'user' and ns.system %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ (m['content'] or '') | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class Tokenizer:
    """One model's tokenizer: encode/decode, special ids, and its chat template."""

    def __init__(
        self, hf: HFTokenizer, specials: SpecialTokens, chat_template: str | None, style: str
    ) -> None:
        self.backend = hf  # the HF `tokenizers` object (e.g. for incremental decoding)
        self._specials = specials
        self.chat_template = chat_template
        self._style = style  # "byte_level" | "sentencepiece" | "other": how token strings map to bytes
        self.bos_token_id, self.eos_token_id = specials.bos_token_id, specials.eos_token_id
        self.pad_token_id, self.unk_token_id = specials.pad_token_id, specials.unk_token_id
        eos_ids = (specials.eos_token_id, *specials.extra_eos_ids)
        self.eos_token_ids = frozenset(i for i in eos_ids if i is not None)
        self.bos_token = self._token_or_none(self.bos_token_id)
        self.eos_token = self._token_or_none(self.eos_token_id)
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self._special_added = frozenset(i for i, tok in added.items() if tok.special)
        named = (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
        self.all_special_ids = sorted(self._special_added | {i for i in named if i is not None})

    # -- construction

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        hf = _tokenizer_from_gguf(meta)
        spm = meta.get("tokenizer.ggml.model") == "llama"
        end_of_turn = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        extra = tuple(meta[k] for k in end_of_turn if k in meta)
        specials = SpecialTokens(
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            extra_eos_ids=extra,
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
            # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        )
        style = "sentencepiece" if spm else "byte_level"
        template = meta.get("tokenizer.chat_template")
        if template is None and meta.get("general.architecture") == "gemma3":
            # Gemma's turn format, for files converted without the template (the 270M base
            # model's GGUF); a turn ends with <end_of_turn>, which must stop generation.
            template = GEMMA_CHAT_TEMPLATE
            end_of_turn = hf.token_to_id("<end_of_turn>")
            if end_of_turn is not None and end_of_turn not in specials.extra_eos_ids:
                specials = replace(specials, extra_eos_ids=(*specials.extra_eos_ids, end_of_turn))
        return cls(hf, specials, template, style)

    @classmethod
    def from_gguf_file(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_metadata(read_gguf_fields(path))

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json")
        hf = HFTokenizer.from_file(str(root / "tokenizer.json"))
        # A file may carry padding and truncation for its training batches (sentence-transformers'
        # BERTs pad and cut every text to 128): a prompt is neither padded nor silently cut here.
        hf.no_padding()
        hf.no_truncation()
        config = _read_json(root / "tokenizer_config.json")
        for entry in (config.get("added_tokens_decoder") or {}).values():
            if hf.token_to_id(entry["content"]) is None:  # listed in the config only
                token = AddedToken(entry["content"], special=bool(entry.get("special")), normalized=False)
                (hf.add_special_tokens if entry.get("special") else hf.add_tokens)([token])

        def token_id(name: str) -> int | None:
            token = config.get(name)
            content = token.get("content") if isinstance(token, dict) else token
            return hf.token_to_id(content) if isinstance(content, str) else None

        # Whatever the backend's post-processor adds around a text is what this tokenizer adds.
        bare, full = hf.encode("x", add_special_tokens=False).ids, hf.encode("x", add_special_tokens=True).ids
        at = full.index(bare[0]) if bare and bare[0] in full else 0
        prefix, suffix = full[:at], full[at + len(bare) :]
        bos, eos = token_id("bos_token"), token_id("eos_token")
        extra: list[int] = []
        for name in ("config.json", "generation_config.json"):
            ids = _read_json(root / name).get("eos_token_id")
            extra += ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []
        specials = SpecialTokens(
            bos_token_id=bos if bos is not None else (prefix[0] if prefix else None),
            # BERT's [SEP] is the suffix its post-processor adds, named nowhere else.
            eos_token_id=eos if eos is not None else (extra[0] if extra else (suffix[0] if suffix else None)),
            extra_eos_ids=tuple(extra),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            add_bos=bool(config.get("add_bos_token", bool(prefix))),
            add_eos=bool(config.get("add_eos_token", bool(suffix))),
        )
        template = _read_chat_template(root, config)
        return cls(hf, specials, template, _token_style(hf))

    # -- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True, truncate_to: int | None = None) -> list[int]:
        """truncate_to: at most this many ids, special ones included: the text's first tokens are
        kept, and the special tokens around them (as transformers' truncation does)."""
        return self._wrap(
            self.backend.encode(text, add_special_tokens=False).ids, add_special_tokens, truncate_to
        )

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True, truncate_to: int | None = None
    ) -> list[list[int]]:
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [self._wrap(e.ids, add_special_tokens, truncate_to) for e in encodings]

    def encode_pairs(
        self, pairs: list[tuple[str, str]], truncate_to: int | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """Each (first, second) text pair as one sequence, as the tokenizer's pair template
        writes it (BERT: [CLS] first [SEP] second [SEP]): (ids, token type ids), the types 0
        for the first text's part and 1 for the second's. truncate_to: at most this many ids,
        special ones included, cut from the longer text first (transformers' `longest_first`)."""
        out = []
        firsts = self.backend.encode_batch([a for a, _ in pairs], add_special_tokens=False)
        seconds = self.backend.encode_batch([b for _, b in pairs], add_special_tokens=False)
        for a, b in zip(firsts, seconds):
            if truncate_to is not None:
                budget = max(truncate_to - self.backend.num_special_tokens_to_add(is_pair=True), 0)
                n1, n2 = _longest_first(len(a.ids), len(b.ids), budget)
                a.truncate(n1)
                b.truncate(n2)
            pair = self.backend.post_process(a, b, add_special_tokens=True)
            out.append((pair.ids, pair.type_ids))
        return out

    def _wrap(self, ids: list[int], add_special_tokens: bool, truncate_to: int | None = None) -> list[int]:
        s = self._specials
        bos = add_special_tokens and s.add_bos and s.bos_token_id is not None
        eos = add_special_tokens and s.add_eos and s.eos_token_id is not None
        if truncate_to is not None:
            ids = ids[: max(truncate_to - bos - eos, 0)]
        if bos:
            ids = [s.bos_token_id, *ids]
        if eos:
            ids = [*ids, s.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        token = self.backend.id_to_token(token_id) or ""
        if token_id in self._special_added:
            return token.encode()
        if self._style == "byte_level" and all(c in _CHAR_TO_BYTE for c in token):
            return bytes(_CHAR_TO_BYTE[c] for c in token)
        if self._style == "sentencepiece":
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace("\u2581", " ").encode()
        return token.encode()

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # -- chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        source = chat_template or self.chat_template
        if not source:
            raise ChatTemplateError("this model has no chat template; use completions with a plain prompt")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self._token_or_none(self.pad_token_id) or "",
            "unk_token": self._token_or_none(self.unk_token_id) or "",
            **extra,
            "messages": flatten_messages(messages),
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        text = render_chat_template(source, context)
        # The template writes BOS itself where the model wants it; adding one again would double it.
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """How many tokens of each text of a pair to keep within `budget`, as the tokenizers
    library's `longest_first` truncation chooses: the shorter text whole when the longer one
    can give up enough, else half the budget each (the odd one to the longer)."""
    if n1 + n2 <= budget:
        return n1, n2
    short, long_ = min(n1, n2), max(n1, n2)
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short, long_ = budget // 2, budget // 2 + budget % 2
    return (short, long_) if n1 <= n2 else (long_, short)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _read_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    if (root / "chat_template.jinja").is_file():  # where recent transformers saves it
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_style(hf: HFTokenizer) -> str:
    decoder = repr(hf.decoder)
    if "ByteLevel" in decoder:
        return "byte_level"
    return "sentencepiece" if "\u2581" in decoder or "Metaspace" in decoder else "other"
