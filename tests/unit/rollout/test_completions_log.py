import math

from rlasync.rollout.completions_log import format_group


def test_a_group_prints_its_prompt_and_each_completion_with_reward_and_advantage():
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}]
    completions = [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}], "seven"]
    text = format_group(prompt, completions, [1.0, 0.0, None], [0.7, -0.7, 0.0], group_id=3, policy_version=12)
    lines = text.splitlines()
    assert lines[0] == "group 3 (policy v12) prompt: What is 2 + 3?"
    assert lines[1] == "  [0] reward 1 advantage 0.7 | 5"
    assert lines[2] == "  [1] reward 0 advantage -0.7 | 6"
    assert lines[3] == "  [2] reward — advantage 0 | seven"  # unscorable: no reward
    assert len(lines) == 4


def test_num_completions_to_print_caps_the_rows_and_long_texts_are_cut():
    completions = ["x" * 1000, "b", "c", "d"]
    text = format_group("plain prompt", completions, [math.pi] * 4, None, group_id=0, policy_version=0, limit=2)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[-1] == "  ... 2 more (num_completions_to_print=2)"
    assert " … " in lines[1] and len(lines[1]) < 500 and "reward 3.14 advantage —" in lines[1]
