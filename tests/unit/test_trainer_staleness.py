"""StalenessManager alone: the admission invariant under random drop patterns (seeded loops).

The model of the pipeline here is the trainer's: jobs are admitted within ``capacity()``, every
job resolves once (kept for the batch, or dropped and its slot released), a step consumes
exactly ``batch_prompts`` kept groups and advances the version by one.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from services.trainer.staleness import StalenessManager


def test_release_returns_slots_but_never_below_what_was_trained():
    m = StalenessManager(batch_prompts=4, max_staleness=1)
    assert m.admit(10) == 8 and m.capacity() == 0
    assert m.release(3) == 3 and m.capacity() == 3 and m.in_flight(held=0) == 5
    m.admit(3)
    m.advance(1)  # 4 groups trained
    assert m.trained == 4 and m.in_flight(held=0) == 4
    assert m.release(100) == 4  # junk cannot open more room than was admitted
    assert m.admitted == 4 and m.capacity() == 8
    with pytest.raises(ValueError, match="n must be >= 0"):
        m.release(-1)


def _simulate(rng: random.Random, batch_prompts: int, max_staleness: int, prompts: int,
              p_drop: float) -> None:
    m = StalenessManager(batch_prompts, max_staleness)
    cursor = 0
    in_flight: deque[int] = deque()
    held = dropped = steps = 0
    while True:
        granted = m.admit(prompts - cursor)
        in_flight.extend(range(cursor, cursor + granted))
        cursor += granted
        outstanding = m.admitted - m.trained
        assert outstanding <= (max_staleness + 1) * batch_prompts
        assert m.in_flight(held) == len(in_flight)
        if held == batch_prompts:
            steps += 1
            held = 0
            m.advance(m.version + 1)
            continue
        if not in_flight:  # the batch is short and nothing can arrive: only legal with no prompts left
            assert cursor == prompts, f"deadlock at step {steps}: {held} held, capacity {m.capacity()}"
            assert m.in_flight(held) == 0
            break
        # resolve a random in-flight job (out of order, like several rollout workers)
        in_flight.rotate(-rng.randrange(len(in_flight)))
        in_flight.popleft()
        if rng.random() < p_drop:
            dropped += 1
            m.release(1)
        else:
            held += 1
    assert steps * batch_prompts + held + dropped == prompts  # every job resolved exactly once
    assert steps == (prompts - dropped) // batch_prompts


@pytest.mark.parametrize("seed", range(40))
def test_random_drop_patterns_never_deadlock(seed):
    rng = random.Random(seed)
    _simulate(
        rng,
        batch_prompts=rng.randint(1, 8),
        max_staleness=rng.randint(0, 3),
        prompts=rng.randint(1, 200),
        p_drop=rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]),
    )


def test_checkpointed_state_round_trips():
    m = StalenessManager(4, 1)
    m.admit(8)
    m.release(2)
    clone = StalenessManager(4, 1)
    clone.load_state_dict(m.state_dict())
    assert (clone.capacity(), clone.in_flight(0)) == (m.capacity(), m.in_flight(0)) == (2, 6)


def test_during_an_update_the_next_batch_is_judged_as_after_it_and_nothing_is_admitted():
    """The overlapped feed (``begin_update`` .. ``advance``): the running step's batch counts as
    trained and staleness is the one at the version the next batch trains at, as after ``advance``."""
    m = StalenessManager(batch_prompts=2, max_staleness=1)
    assert m.admit(10) == 4  # versions 0 and 1 may be in flight
    m.begin_update()  # step 1 trains its 2 groups
    assert m.capacity() == 0 and m.admit(5) == 0  # the sequential loop admits nothing here either
    assert m.trained == 2 and m.in_flight(held=1) == 1
    assert m.staleness(0) == 1 and not m.is_stale(0) and m.is_stale(-1)
    assert m.release(100) == 2  # the floor is what the running step consumes
    sequential = StalenessManager(batch_prompts=2, max_staleness=1, admitted=4)
    sequential.advance(1)
    sequential.release(100)
    m.advance(1)
    assert (m.ahead, m.trained, m.capacity(), m.staleness(0)) == (
        0, sequential.trained, sequential.capacity(), sequential.staleness(0))
    assert m.state_dict() == sequential.state_dict()


def test_a_release_the_floor_refuses_during_an_update_is_settled_after_the_top_up():
    """A group of a job this state never admitted (a crashed predecessor's push) dropped during the
    update: the sequential loop drops it after its top-up, when the floor lets the slot go."""
    m = StalenessManager(batch_prompts=1, max_staleness=0)
    assert m.admit(5) == 1
    m.begin_update()
    assert m.release(1) == 0 and m.owed == 1  # nothing in flight: the floor refuses it now
    m.advance(1)
    assert m.admit(5) == 1  # the top-up after the update
    assert m.settle() == 1 and m.owed == 0 and m.capacity() == 1
    sequential = StalenessManager(batch_prompts=1, max_staleness=0, admitted=1)
    sequential.advance(1)
    sequential.admit(5)
    sequential.release(1)
    assert m.state_dict() == sequential.state_dict()
