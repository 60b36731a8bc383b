"""An approximate record of which replica has which prompt prefix in its KV cache.

One shared radix tree over characters (edges hold strings, split where prompts diverge).
Each node carries the set of replicas ("owners") that were sent a prompt passing through
it. Inserting marks every node on the prompt's path, so ownership is prefix-closed: a
replica that owns a node owns all its ancestors. Matching walks the prompt down the tree
and stops where no allowed replica owns the next node; the replicas owning the deepest
node reached have the longest cached prefix.

It is approximate on purpose: it records what was sent, not what each replica still holds
(a replica evicts on its own schedule), and it never asks replicas. It is kept small:

- size = sum over nodes of (characters on the node's edge + NODE_CHARS), where NODE_CHARS
  charges each node's bookkeeping, so a flood of tiny distinct prompts is bounded too;
- after every insert, least recently used leaves are removed until size <= max_chars
  (a node's time is the last insert that passed through it; a parent whose last child goes
  becomes a leaf with its own time). A lazy heap finds the oldest leaf in O(log n).
- a prompt longer than max_chars // 2 is recorded by its first max_chars // 2 characters.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass

NODE_CHARS = 32


class _Node:
    __slots__ = ("attached", "children", "label", "last", "owners", "parent")

    def __init__(self, label: str, parent: _Node | None, owners: set[str], last: int) -> None:
        self.label = label
        self.children: dict[str, _Node] = {}  # first character of the child's label -> child
        self.owners = owners
        self.parent = parent
        self.last = last
        self.attached = True


@dataclass(frozen=True)
class Match:
    length: int  # characters of the prompt covered by the best replicas' recorded prefixes
    owners: tuple[str, ...]  # the allowed replicas with that prefix (empty: none)

    def ratio(self, total: int) -> float:
        return self.length / total if total > 0 else 0.0


def common_prefix_len(label: str, text: str, pos: int) -> int:
    """How many leading characters of `label` equal text[pos:...] (binary search on
    startswith, so the comparisons run in C)."""
    if text.startswith(label, pos):
        return len(label)
    lo, hi = 0, min(len(label), len(text) - pos)  # label[:lo] matches; label[:hi+1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    def __init__(self, max_chars: int) -> None:
        if max_chars < 2 * NODE_CHARS + 2:
            raise ValueError(f"max_chars must be at least {2 * NODE_CHARS + 2}")
        self.max_chars = max_chars
        self.root = _Node("", None, set(), 0)
        self.size = 0  # see the module docstring
        self.num_nodes = 0  # the root excluded
        self._tick = 0
        self._seq = 0
        self._heap: list[tuple[int, int, _Node]] = []  # (last, seq, leaf); stale entries skipped

    # -- queries --
    def match(self, text: str, allowed: Collection[str] | None = None) -> Match:
        """The longest recorded prefix of `text` owned by an allowed replica (any if None)."""
        node, pos, best = self.root, 0, Match(0, ())
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            owners = child.owners if allowed is None else child.owners.intersection(allowed)
            if not owners:
                break  # prefix-closed: nobody allowed owns anything deeper either
            n = common_prefix_len(child.label, text, pos)
            best = Match(pos + n, tuple(sorted(owners)))
            if n < len(child.label):
                break
            node, pos = child, pos + n
        return best

    # -- updates --
    def insert(self, text: str, owner: str) -> None:
        """Record that `owner` was sent `text`, then evict down to the cap."""
        text = text[: self.max_chars // 2]
        if not text:
            return
        self._tick += 1
        tick, node, pos = self._tick, self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node = self._add_leaf(node, text[pos:], owner, tick)
                break
            n = common_prefix_len(child.label, text, pos)
            if n < len(child.label):
                child = self._split(child, n)
            child.owners.add(owner)
            child.last = tick
            node, pos = child, pos + n
        self._push(node)
        self._evict()

    def remove_owner(self, owner: str) -> None:
        """Forget a replica: drop it from every node, and every node left without owners."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                child.owners.discard(owner)
                if child.owners:
                    stack.append(child)
                else:
                    self._detach(child)

    # -- internals --
    def _add_leaf(self, parent: _Node, label: str, owner: str, tick: int) -> _Node:
        leaf = _Node(label, parent, {owner}, tick)
        parent.children[label[0]] = leaf
        self.size += len(label) + NODE_CHARS
        self.num_nodes += 1
        return leaf

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node`'s edge after n characters; the new upper node is returned. The lower
        part keeps the node object, so its heap entry (if it is a leaf) stays valid."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.label)
        upper = _Node(node.label[:n], parent, set(node.owners), node.last)
        parent.children[upper.label[0]] = upper
        node.label, node.parent = node.label[n:], upper
        upper.children[node.label[0]] = node
        self.size += NODE_CHARS
        self.num_nodes += 1
        return upper

    def _detach(self, node: _Node) -> None:
        """Remove `node` and its subtree; a parent left childless becomes an evictable leaf."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.label[0]]
        stack = [node]
        while stack:
            gone = stack.pop()
            gone.attached = False
            self.size -= len(gone.label) + NODE_CHARS
            self.num_nodes -= 1
            stack.extend(gone.children.values())
        if parent is not self.root and not parent.children:
            self._push(parent)

    def _push(self, node: _Node) -> None:
        if node is self.root or node.children:
            return
        self._seq += 1
        heapq.heappush(self._heap, (node.last, self._seq, node))
        if len(self._heap) > 2 * self.num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children:
                self._seq += 1
                leaves.append((node.last, self._seq, node))
        heapq.heapify(leaves)
        self._heap = leaves

    def _evict(self) -> None:
        while self.size > self.max_chars and self._heap:
            last, _, node = heapq.heappop(self._heap)
            if node.attached and not node.children and node.last == last:
                self._detach(node)

    def leaves(self) -> list[str]:
        """Every recorded path from the root to a leaf (for tests and debugging)."""
        out: list[str] = []
        stack: list[tuple[_Node, str]] = [(self.root, "")]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.label
            if node is not self.root and not node.children:
                out.append(path)
            stack.extend((child, path) for child in node.children.values())
        return sorted(out)
