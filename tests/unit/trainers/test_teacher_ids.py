"""The `teacher_id` column of a multi-teacher distillation dataset is checked before Ray starts (preflight), not
when the first unknown id is leased mid-run."""

import pytest

from rlasync.config import AsyncDistillationConfig
from rlasync.trainers import AsyncDistillationTrainer
from rlasync.trainers.preflight import check_teacher_ids


def rows(*ids):
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "teacher_id": t} for i, t in enumerate(ids)]


def test_unknown_and_missing_ids_are_named_with_their_rows():
    check_teacher_ids(rows("math", "code", "math"), ["math", "code"])
    with pytest.raises(ValueError, match=r"teacher_id: 'chem' \(row 1\) is not among the configured teachers"):
        check_teacher_ids(rows("math", "chem", "chem"), ["math", "code"])
    with pytest.raises(ValueError, match=r"None \(row 0\)"):
        check_teacher_ids([{"prompt": [{"role": "user", "content": "q"}]}], ["math", "code"])
    check_teacher_ids(rows("anything"), ["only"])  # one teacher scores every row


def test_a_datasets_column_is_read_whole():
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(rows(*(["math"] * 100 + ["bio"])))
    with pytest.raises(ValueError, match=r"'bio' \(row 100\)"):
        check_teacher_ids(dataset, ["math", "code"])


def test_the_trainer_preflight_refuses_an_unknown_teacher_id(tmp_path):
    args = AsyncDistillationConfig(output_dir=str(tmp_path), max_steps=2)
    trainer = AsyncDistillationTrainer(
        model="some/model",
        args=args,
        train_dataset=rows("math", "physics"),
        teacher_model={"math": "some/teacher-a", "code": "some/teacher-b"},
    )
    with pytest.raises(ValueError, match=r"'physics' \(row 1\).*\['math', 'code'\]"):
        trainer.preflight()
