"""A local teacher must share the student's vocabulary (docs/algorithms.md §9.4): its candidate ids index the student's."""

import pytest

from rlasync.trainers.distill import check_same_vocabulary


def save_tokenizer(folder, words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    return str(folder)


WORDS = ["<unk>", "<eos>", "a", "b", "c", "d"]


def test_the_same_vocabulary_passes(tmp_path):
    student = save_tokenizer(tmp_path / "student", WORDS)
    teacher = save_tokenizer(tmp_path / "teacher", list(WORDS))
    check_same_vocabulary(student, teacher, "default")


@pytest.mark.parametrize("words", [WORDS[:2] + ["b", "a", "c", "d"], WORDS + ["e"]], ids=["reordered", "larger"])
def test_a_different_vocabulary_is_refused_naming_the_teacher(tmp_path, words):
    student = save_tokenizer(tmp_path / "student", WORDS)
    teacher = save_tokenizer(tmp_path / "teacher", words)
    with pytest.raises(ValueError, match=r"teacher_model\['math'\].*different vocabulary"):
        check_same_vocabulary(student, teacher, "math")
