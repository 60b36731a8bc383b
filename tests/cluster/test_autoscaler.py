"""The autoscaler's decisions on synthetic load sequences, with an injected clock (no Ray)."""

from __future__ import annotations

import pytest

from fornax.cluster.autoscaler import Autoscaler, Load, pick_victim
from fornax.cluster.config import ScalingPolicy
from fornax.config import ConfigError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def scaler(**policy: float) -> tuple[Autoscaler, Clock]:
    clock = Clock()
    base = {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_waiting": 2.0,
        "scale_down_waiting": 0.0,
        "scale_up_delay_s": 5.0,
        "scale_down_cooldown_s": 30.0,
    }
    return Autoscaler(ScalingPolicy(**(base | policy)), clock), clock


def run(
    a: Autoscaler, clock: Clock, replicas: int, waiting: list[float], until: float, step: float = 0.5
) -> list:
    """Feed the same loads every `step` seconds up to `until` seconds from now; (t, delta) of
    each non-zero decision."""
    start, out = clock.t, []
    while clock.t - start <= until + 1e-9:
        d = a.decide(replicas, [Load(w, 1.0) for w in waiting])
        if d.delta:
            out.append((round(clock.t - start, 3), d.delta))
        clock.t += step
    return out


def test_scale_up_after_the_delay_not_before() -> None:
    a, clock = scaler()
    for t in (0.0, 2.5, 4.9):
        clock.t = 1000.0 + t
        assert a.decide(1, [Load(5, 1)]).delta == 0, t
    clock.t = 1005.0
    d = a.decide(1, [Load(5, 1)])
    assert d.delta == 1 and "waiting per replica" in d.reason


def test_the_delay_restarts_after_each_step() -> None:
    a, clock = scaler()
    # The second step is timed from the first sample after the first step (0.5 s later).
    assert run(a, clock, 1, [5.0], until=12.0) == [(5.0, 1), (10.5, 1)]


def test_a_burst_shorter_than_the_delay_buys_nothing() -> None:
    a, clock = scaler()
    assert run(a, clock, 1, [5.0], until=4.0) == []
    assert run(a, clock, 1, [1.0], until=0.0) == []  # back within the band: the clock restarts
    assert run(a, clock, 1, [5.0], until=4.5) == []
    assert a.decide(1, [Load(5, 1)]).delta == 1  # 5 s after the second rise


def test_the_average_per_replica_is_what_counts() -> None:
    a, _ = scaler(scale_up_delay_s=0.0)
    assert a.decide(2, [Load(4, 1), Load(0, 1)]).delta == 0  # average 2: not above the target
    assert a.decide(2, [Load(5, 1), Load(0, 1)]).delta == 1  # average 2.5


def test_never_above_the_maximum() -> None:
    a, clock = scaler(scale_up_delay_s=1.0)
    assert run(a, clock, 3, [50.0], until=60.0) == []
    assert "maximum" in a.decide(3, [Load(50, 1)]).reason


def test_scale_down_after_the_cooldown() -> None:
    a, clock = scaler()
    assert run(a, clock, 3, [0.0, 0.0, 0.0], until=29.5) == []
    assert a.decide(3, [Load(0, 0)] * 3).delta == -1  # 30 s idle
    assert run(a, clock, 2, [0.0, 0.0], until=29.5) == []  # the next step waits a full cooldown again
    assert a.decide(2, [Load(0, 0)] * 2).delta == -1


def test_a_queue_during_the_cooldown_restarts_it() -> None:
    a, clock = scaler()
    assert run(a, clock, 2, [0.0, 0.0], until=20.0) == []
    assert run(a, clock, 2, [1.0, 1.0], until=0.0) == []  # within the band: nobody is idle
    assert run(a, clock, 2, [0.0, 0.0], until=29.0) == []
    clock.t += 1.0
    assert a.decide(2, [Load(0, 0)] * 2).delta == -1


def test_never_below_the_minimum() -> None:
    a, clock = scaler(min_replicas=2, scale_down_cooldown_s=1.0)
    assert run(a, clock, 2, [0.0, 0.0], until=120.0) == []


def test_out_of_bounds_steps_at_once() -> None:
    a, _ = scaler(min_replicas=2, max_replicas=3)
    assert a.decide(1, [Load(0, 0)]).delta == 1  # one died for good
    assert a.decide(0, []).delta == 1
    assert a.decide(4, [Load(9, 1)] * 4).delta == -1


def test_busy_holds_and_restarts_the_clocks() -> None:
    a, clock = scaler()
    assert run(a, clock, 1, [5.0], until=4.5) == []
    d = a.decide(2, [Load(5, 1)], busy=True)  # the new replica is loading
    assert d.delta == 0 and "starting" in d.reason
    clock.t += 0.5
    assert run(a, clock, 2, [5.0, 5.0], until=4.5) == []  # timed from the end of the step
    assert a.decide(2, [Load(5, 1)] * 2).delta == 1


def test_no_load_reported_is_no_decision() -> None:
    a, _ = scaler(scale_up_delay_s=0.0, scale_down_cooldown_s=0.0)
    d = a.decide(2, [])
    assert d.delta == 0 and d.reason == "no load reported"


def test_pick_victim_is_the_least_loaded_then_the_newest() -> None:
    assert pick_victim({"r0": Load(0, 3), "r1": Load(0, 1), "r2": Load(1, 2)}) == "r1"
    assert pick_victim({"r0": Load(0, 0), "r1": Load(0, 0), "r2": Load(0, 0)}) == "r2"
    with pytest.raises(ValueError):
        pick_victim({})


@pytest.mark.parametrize(
    "bad",
    [
        {"min_replicas": 0},
        {"min_replicas": 3, "max_replicas": 2},
        {"target_waiting": 1.0, "scale_down_waiting": 2.0},
        {"scale_up_delay_s": -1},
    ],
)
def test_policy_checks(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ScalingPolicy(**bad)
