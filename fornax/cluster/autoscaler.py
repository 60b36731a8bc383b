"""The autoscaler's decision: pure logic over load samples and an injected clock.

The controller feeds it, once per poll, the number of replicas and the load each ready one
reports; it answers +1, -1 or 0. Rules (ScalingPolicy):

- below min or above max: one step toward the bounds at once (a replica that died for good);
- while a replica starts or drains, hold: the last step has not shown its effect yet, and
  the clocks restart, so the next step is judged on the new size's own queues;
- average waiting per ready replica above `target_waiting` for `scale_up_delay_s`: +1;
- at or below `scale_down_waiting` for `scale_down_cooldown_s`: -1;
- anything in between restarts both clocks (no step on a signal that did not hold).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fornax.cluster.config import ScalingPolicy


@dataclass(frozen=True)
class Load:
    """One replica's engine queue, read from its /metrics."""

    waiting: float
    running: float


@dataclass(frozen=True)
class Decision:
    delta: int  # +1, -1 or 0
    reason: str


class Autoscaler:
    def __init__(self, policy: ScalingPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._above_since: float | None = None
        self._below_since: float | None = None

    def decide(self, replicas: int, loads: Sequence[Load], busy: bool = False) -> Decision:
        """`replicas`: the cluster's size (starting and ready, not draining); `loads`: those of
        the ready replicas; `busy`: one is starting or draining."""
        p = self.policy
        if replicas < p.min_replicas:
            return self._step(+1, f"{replicas} replicas, below the minimum {p.min_replicas}")
        if replicas > p.max_replicas:
            return self._step(-1, f"{replicas} replicas, above the maximum {p.max_replicas}")
        if busy or not loads:
            self._reset()
            return Decision(0, "a replica is starting or draining" if busy else "no load reported")
        avg = sum(load.waiting for load in loads) / len(loads)
        now = self._clock()
        if avg > p.target_waiting:
            self._below_since = None
            self._above_since = now if self._above_since is None else self._above_since
            if now - self._above_since >= p.scale_up_delay_s:
                if replicas < p.max_replicas:
                    return self._step(
                        +1,
                        f"{avg:.1f} waiting per replica > {p.target_waiting:g} for {p.scale_up_delay_s:g}s",
                    )
                return Decision(0, f"{avg:.1f} waiting per replica, but at the maximum {p.max_replicas}")
            return Decision(0, "above target, within the scale-up delay")
        if avg <= p.scale_down_waiting:
            self._above_since = None
            self._below_since = now if self._below_since is None else self._below_since
            if now - self._below_since >= p.scale_down_cooldown_s and replicas > p.min_replicas:
                return self._step(
                    -1,
                    f"{avg:.1f} waiting per replica <= {p.scale_down_waiting:g} "
                    f"for {p.scale_down_cooldown_s:g}s",
                )
            return Decision(0, "below the scale-down mark")
        self._reset()
        return Decision(0, "within the band")

    def _step(self, delta: int, reason: str) -> Decision:
        self._reset()  # the next step is timed from this one
        return Decision(delta, reason)

    def _reset(self) -> None:
        self._above_since = self._below_since = None


def pick_victim(loads: Mapping[str, Load]) -> str:
    """The replica to drain: the least loaded, the newest among equals (the mapping's order is
    the start order), so the long-lived ones keep their warm prefix caches."""
    if not loads:
        raise ValueError("no replica to drain")
    newest_first = list(reversed(loads.items()))
    return min(newest_first, key=lambda item: item[1].waiting + item[1].running)[0]
