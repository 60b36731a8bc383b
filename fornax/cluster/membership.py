"""What the router should be told: the diff between the replicas' URLs and its member list.

Pure, so it is tested without Ray or a router. The controller only removes URLs it added
itself (`managed`): a replica an operator added by hand stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MembershipDiff:
    add: dict[str, dict[str, str]] = field(default_factory=dict)  # url -> tags
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.remove)


def normalize(url: str) -> str:
    return url.rstrip("/")


def diff_membership(
    desired: Mapping[str, Mapping[str, str]], current: Iterable[str], managed: AbstractSet[str]
) -> MembershipDiff:
    """`desired`: URL -> tags of the replicas that should take requests (ready, not draining);
    `current`: the router's members; `managed`: the URLs this controller added."""
    want = {normalize(url): dict(tags) for url, tags in desired.items()}
    have = {normalize(url) for url in current}
    add = {url: tags for url, tags in want.items() if url not in have}
    remove = tuple(sorted(url for url in have if url in managed and url not in want))
    return MembershipDiff(add, remove)
