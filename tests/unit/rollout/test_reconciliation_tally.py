"""`reconciliation_tally`: the fork/drift accounting of docs/algorithms.md §3.3, checked against the sequences
`build_training_sequences` actually builds (a fork is exactly a new training sequence)."""

import random

from rlasync.algorithms.grpo.loop import build_training_sequences, reconciliation_tally
from rlasync.records import TurnRecord


def turn(prompt, output):
    return TurnRecord(list(prompt), list(output), [-0.5] * len(output))


def test_a_clean_chain_never_forks():
    turns = [turn([1, 2, 3], [10, 11]), turn([1, 2, 3, 10, 11, 20, 21], [30, 31])]
    assert reconciliation_tally(turns) == (0, 1, 0, 0)


def test_a_re_rendered_last_answer_forks_with_its_drift():
    # the second prompt drops the last answer's final token and what followed: 1 held token re-rendered
    turns = [turn([1, 2, 3], [10, 11]), turn([1, 2, 3, 10, 12], [30, 31])]
    assert reconciliation_tally(turns) == (1, 1, 1, 1)
    # a long answer dropped by the template: all 6 generated tokens are drift
    turns = [turn([1, 2, 3], [10, 11, 12, 13, 14, 15]), turn([1, 2, 3, 99, 88], [30])]
    assert reconciliation_tally(turns) == (1, 1, 6, 6)


def test_a_single_turn_has_no_transition():
    assert reconciliation_tally([turn([1, 2], [3])]) == (0, 0, 0, 0)


def test_forks_match_the_sequences_built_on_random_conversations():
    rng = random.Random(0)
    for _ in range(200):
        turns, held = [], []
        for _ in range(rng.randint(1, 5)):
            if held and rng.random() < 0.6:
                prompt = held + [rng.randint(50, 60) for _ in range(rng.randint(0, 3))]  # clean: extends
            elif held:
                cut = rng.randint(0, len(held) - 1)
                prompt = held[:cut] + [rng.randint(70, 80) for _ in range(rng.randint(1, 4))]  # re-rendered
            else:
                prompt = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
            output = [rng.randint(100, 200) for _ in range(rng.randint(1, 4))]
            turns.append(turn(prompt, output))
            held = prompt + output
        forks, transitions, drift_total, drift_max = reconciliation_tally(turns)
        assert transitions == len(turns) - 1
        assert len(build_training_sequences(turns, "r")) == 1 + forks
        assert 0 <= drift_max <= drift_total and (forks > 0 or drift_total == 0)
