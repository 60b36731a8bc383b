"""The cache-aware policy's prefix tree: matches, splits, LRU eviction, the size cap."""

from __future__ import annotations

import random

import pytest

from fornax.router.radix import NODE_CHARS, Match, PrefixTree, common_prefix_len


def recount(tree: PrefixTree) -> tuple[int, int]:
    """(size, nodes) recomputed from the tree itself."""
    size = nodes = 0
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        size += len(node.label) + NODE_CHARS
        nodes += 1
        stack.extend(node.children.values())
    return size, nodes


def test_common_prefix_len() -> None:
    assert common_prefix_len("hello", "hello world", 0) == 5
    assert common_prefix_len("help", "hello", 0) == 3
    assert common_prefix_len("xyz", "abc", 0) == 0
    assert common_prefix_len("world", "hello wor", 6) == 3
    assert common_prefix_len("abc", "ab", 0) == 2


def test_match_and_split() -> None:
    tree = PrefixTree(10_000)
    assert tree.match("anything") == Match(0, ())
    tree.insert("hello world", "a")
    assert tree.size == 11 + NODE_CHARS and tree.num_nodes == 1
    m = tree.match("hello there")
    assert m == Match(6, ("a",)) and m.ratio(11) == pytest.approx(6 / 11)
    tree.insert("hello there", "b")  # splits "hello world" after "hello "
    assert tree.leaves() == ["hello there", "hello world"]
    assert tree.size == len("hello ") + len("world") + len("there") + 3 * NODE_CHARS and tree.num_nodes == 3
    assert tree.match("hello world!") == Match(11, ("a",))
    assert tree.match("hello th") == Match(8, ("b",))
    assert tree.match("hello ") == Match(6, ("a", "b"))
    assert tree.match("help") == Match(3, ("a", "b"))
    # Only the allowed replicas count; ownership is prefix-closed.
    assert tree.match("hello world", allowed={"b"}) == Match(6, ("b",))
    assert tree.match("hello world", allowed={"c"}) == Match(0, ())
    assert recount(tree) == (tree.size, tree.num_nodes)


def test_same_prompt_two_replicas_and_prefix_of_existing() -> None:
    tree = PrefixTree(10_000)
    tree.insert("system prompt: be brief", "a")
    tree.insert("system prompt: be brief", "b")
    assert tree.match("system prompt: be brief. Hi") == Match(23, ("a", "b"))
    tree.insert("system", "c")  # a prefix of a recorded prompt: a split, no new leaf
    assert tree.leaves() == ["system prompt: be brief"]
    assert tree.match("system prompt") == Match(13, ("a", "b"))
    assert tree.match("systematic") == Match(6, ("a", "b", "c"))
    assert recount(tree) == (tree.size, tree.num_nodes)


def test_lru_eviction_order_and_cap() -> None:
    cost = 50 + NODE_CHARS
    tree = PrefixTree(3 * cost - 1)  # room for two 50-character prompts, not three
    tree.insert("a" * 50, "x")
    tree.insert("b" * 50, "x")
    assert tree.size == 2 * cost
    tree.insert("c" * 50, "x")  # over the cap: the least recently used ("a...") goes
    assert tree.leaves() == ["b" * 50, "c" * 50] and tree.size == 2 * cost
    tree.insert("b" * 50, "y")  # touches "b...": now "c..." is the oldest
    tree.insert("d" * 50, "x")
    assert tree.leaves() == ["b" * 50, "d" * 50]
    assert tree.match("b" * 60) == Match(50, ("x", "y"))
    assert recount(tree) == (tree.size, tree.num_nodes)


def test_eviction_turns_a_childless_parent_into_a_leaf() -> None:
    tree = PrefixTree(10_000)
    tree.insert("shared-prefix/one", "a")
    tree.insert("shared-prefix/two", "a")
    tree.insert("zzz", "b")
    tree.max_chars = tree.size - 1  # force one eviction on the next insert
    tree.insert("zzz", "b")  # "zzz" is now the newest; the oldest leaf is ".../one"
    assert tree.leaves() == ["shared-prefix/two", "zzz"]
    tree.max_chars = NODE_CHARS + 3  # only "zzz" fits: "two" goes, then its parent
    tree.insert("zzz", "b")
    assert tree.leaves() == ["zzz"] and tree.num_nodes == 1
    assert recount(tree) == (tree.size, tree.num_nodes)


def test_size_cap_holds_under_random_load() -> None:
    rng = random.Random(7)
    cap = 4_000
    tree = PrefixTree(cap)
    prefixes = ["".join(rng.choice("abcd") for _ in range(rng.randint(1, 120))) for _ in range(40)]
    for i in range(3_000):
        text = rng.choice(prefixes) + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(0, 60)))
        tree.insert(text, f"r{i % 5}")
        assert tree.size <= cap
        if i % 100 == 0:
            assert recount(tree) == (tree.size, tree.num_nodes)
    assert len(tree._heap) <= 2 * tree.num_nodes + 1024  # the lazy heap is compacted


def test_long_prompt_is_recorded_by_its_head() -> None:
    tree = PrefixTree(1_000)
    tree.insert("p" * 5_000, "a")
    assert tree.leaves() == ["p" * 500] and tree.size <= 1_000
    assert tree.match("p" * 5_000) == Match(500, ("a",))


def test_remove_owner() -> None:
    tree = PrefixTree(10_000)
    tree.insert("abc", "a")
    tree.insert("abd", "b")
    tree.insert("xyz", "a")
    tree.remove_owner("a")
    assert tree.leaves() == ["abd"]
    assert tree.match("abc") == Match(2, ("b",))
    assert tree.match("xyz") == Match(0, ())
    assert recount(tree) == (tree.size, tree.num_nodes)


def test_too_small_cap_is_refused() -> None:
    with pytest.raises(ValueError):
        PrefixTree(10)
