"""Prompt validation (errors name the problem and the fix) and rendering through a chat template."""

from pathlib import Path

import pytest

from rlasync import envs
from rlasync.data import is_conversational, render_prompt, row_prompt, validate_prompt, validate_prompt_dataset
from rlasync.data.prompts import leased_row_problem, template_marker

REPO = Path(__file__).resolve().parents[3]
USER = [{"role": "user", "content": "What is 1 + 2?"}]


def test_a_dataset_without_a_prompt_column_is_refused_with_its_columns_and_the_fix():
    with pytest.raises(ValueError) as info:
        validate_prompt_dataset([{"question": "q", "answer": "1"}])
    message = str(info.value)
    assert "'prompt'" in message and "['answer', 'question']" in message and "rename_column" in message


def test_a_plain_string_prompt_is_refused_with_the_conversion():
    with pytest.raises(ValueError) as info:
        validate_prompt_dataset([{"prompt": "What is 1 + 2?"}, {"prompt": USER}])
    message = str(info.value)
    assert "row 0" in message and "plain string" in message and "conversational" in message
    assert '[{"role": "user", "content": row["prompt"]}]' in message


@pytest.mark.parametrize(
    "rendered",
    [
        "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 1 + 2?<|eot_id|>",
        "<s>[INST] What is 1 + 2? [/INST]",
    ],
)
def test_a_pre_templated_string_prompt_is_not_told_to_wrap_it_in_a_user_message(rendered):
    """Wrapping a string that already went through a chat template in a user message would template it twice: the
    hint names the template token and asks for the raw text instead."""
    with pytest.raises(ValueError) as info:
        validate_prompt_dataset([{"prompt": rendered}])
    message = str(info.value)
    assert "row 0" in message and "plain string" in message and "templated twice" in message
    assert template_marker(rendered) in message
    assert '"content": row["prompt"]' not in message  # the wrapping that would template it twice
    assert '"content": row["question"]' in message  # the un-templated column instead
    assert template_marker("What is <|im_start|> for?") == "<|im_start|>" and template_marker("What is 1?") is None


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ([], "empty"),
        ([("user", "hi")], "not a dict"),
        ([{"content": "hi"}], "'role'"),
        ([{"role": "user"}], "'content'"),
        ([{"role": "robot", "content": "hi"}], "role 'robot'"),
        ({"role": "user", "content": "hi"}, "dict, not a list"),
    ],
)
def test_malformed_messages_are_named(prompt, problem):
    assert not is_conversational(prompt)
    with pytest.raises(ValueError, match=problem):
        validate_prompt(prompt)


def test_conversational_prompts_pass():
    assert is_conversational(USER)
    assert is_conversational([{"role": "system", "content": "Be brief."}, *USER])
    assert is_conversational([*USER, {"role": "assistant", "tool_calls": [{"name": "f"}]}])
    validate_prompt_dataset([{"prompt": USER, "answer": "3"}])
    assert row_prompt({"prompt": USER}) == USER
    with pytest.raises(ValueError, match="no 'prompt' column"):
        row_prompt({"question": "q"}, row_index=4)


class TemplateReturning:
    def __init__(self, value):
        self.value = value
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        return self.value


@pytest.mark.parametrize("value", [[5, 6, 7], {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}, [[5, 6, 7]]])
def test_render_prompt_accepts_every_return_type_of_apply_chat_template(value):
    tokenizer = TemplateReturning(value)
    assert render_prompt(tokenizer, USER, {"enable_thinking": False}) == [5, 6, 7]
    messages, kwargs = tokenizer.calls[0]
    assert messages == USER
    assert kwargs == {"add_generation_prompt": True, "tokenize": True, "enable_thinking": False}


def test_render_prompt_with_a_batch_encoding():
    from transformers import BatchEncoding

    assert render_prompt(TemplateReturning(BatchEncoding({"input_ids": [9, 8]})), USER) == [9, 8]


SMOLLM2 = envs.RLASYNC_CACHE / "models" / "smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="SmolLM2 alias not prepared")
def test_render_prompt_with_a_real_chat_template():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    ids = render_prompt(tokenizer, USER)
    assert ids == tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


# ---- images: refused by name before Ray (vision-language training is not supported) --------------------------------


@pytest.mark.parametrize("column", ["image", "images"])
def test_an_image_column_is_refused_by_name(column):
    rows = [{"prompt": [{"role": "user", "content": "Describe it."}], column: ["<PIL image>"]}]
    with pytest.raises(ValueError, match=f"'{column}' column: vision-language training is not supported"):
        validate_prompt_dataset(rows)
    assert "vision-language training is not supported" in leased_row_problem(rows[0], 3)


@pytest.mark.parametrize(
    "part",
    [{"type": "image"}, {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, {"image": "cat.png"}],
)
def test_an_image_content_part_is_refused_by_name(part):
    prompt = [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
    with pytest.raises(ValueError, match=r"row 0: message 0 of the prompt has an image content part.*vision-language"):
        validate_prompt_dataset([{"prompt": prompt}])
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}]}]
    validate_prompt_dataset([{"prompt": text_parts}])  # text parts stay accepted
