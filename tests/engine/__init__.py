"""End-to-end engine tests: the real scheduler, KV cache, runner, sampler and detokenizer together.

Shared here: a fixed English text to cut prompts of exact token lengths from, so that no
test needs the internet or randomness to build its inputs.
"""

from __future__ import annotations

from typing import Protocol

PARAGRAPHS = [
    "The harbour town woke slowly. Fishing boats that had left before dawn were already "
    "turning back, gulls wheeling over their wakes, while the baker on the corner pulled the "
    "first trays of bread from an oven that had been burning since three in the morning.",
    "A compiler reads a program as a stream of characters, groups them into tokens, builds a "
    "tree that records how the tokens nest, checks that the tree makes sense, and finally "
    "walks it to emit instructions that a machine can execute without any further help.",
    "Mountain weather changes faster than most visitors expect. A clear morning can give way "
    "to fog by noon and to hail by mid-afternoon, which is why experienced hikers carry a "
    "warm layer and a map even on short walks that they have done many times before.",
    "In the library's reading room the only sounds were pages turning and the soft hum of "
    "the ventilation. Students bent over thick volumes, copying passages by hand, and an old "
    "clock above the door marked each quarter hour with a single muted chime.",
    "Bees communicate the direction and distance of food through a dance performed on the "
    "vertical surface of the comb. The angle of the dance relative to gravity encodes the "
    "angle between the sun and the flowers, and its duration encodes how far away they are.",
    "When the river flooded in the spring, the farmers moved their animals to the higher "
    "fields and waited. The water brought silt that made the soil rich, so a flood was both "
    "a danger and a gift, and the old songs of the valley spoke of it in both ways.",
    "A cache keeps recently used data close to where it is needed. When the working set fits, "
    "almost every access is fast; when it does not, the cache spends its time evicting entries "
    "that will be needed again soon, and performance falls off a cliff.",
    "The orchestra tuned for a long minute, each instrument finding the oboe's A and settling "
    "around it. Then the conductor raised both hands, the hall went silent, and the first "
    "quiet notes of the overture drifted up toward the painted ceiling.",
    "Good soup starts with patience. Onions are cooked gently until they are soft and sweet, "
    "vegetables are added in the order of how long they take, and the pot is left to simmer "
    "long enough for the flavours to meet but not so long that everything turns to mush.",
    "Satellites in low orbit circle the planet roughly every ninety minutes. From the ground "
    "they appear as steady points of light crossing the sky shortly after sunset or before "
    "sunrise, when they are still lit by a sun that has already set for the observer.",
]


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


# Open-ended chat prompts (nothing in them to copy from: speculation's hard case).
OPEN = [
    "Write a short poem about the sea.",
    "What are three good habits for programmers?",
    "Explain why the sky is blue.",
    "Tell me a story about a brave mouse.",
    "How do I make a cup of tea?",
    "Give me a name for a pet turtle and explain it.",
]


def corpus_ids(tokenizer: _Encoder) -> list[int]:
    """The paragraphs as one token stream."""
    return tokenizer.encode(" ".join(PARAGRAPHS))


def prompt_ids(tokenizer: _Encoder, length: int, offset: int = 0) -> list[int]:
    """Exactly `length` tokens of real text, starting `offset` tokens into the (cycled) corpus."""
    base = corpus_ids(tokenizer)
    out: list[int] = []
    while len(out) < offset + length:
        out.extend(base)
    return out[offset : offset + length]


def words(count: int, start: int = 0) -> str:
    """The first `count` words of the corpus (cycled), from word `start`."""
    all_words = " ".join(PARAGRAPHS).split()
    picked = [all_words[(start + i) % len(all_words)] for i in range(count)]
    return " ".join(picked)
