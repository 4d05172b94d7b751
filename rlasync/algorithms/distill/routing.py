"""MOPD routing (docs/algorithms.md §9.4): which teacher scores a dataset row.

* One teacher: it scores every row, whatever the row's `teacher_id` column says (plain on-policy distillation).
* Several teachers: the row's `teacher_id` column names its teacher; a missing or unknown id raises `ValueError`
  (never a silent fallback, never an ensemble).

Teacher indices are stable: the position of the id in the mapping's (insertion) order. The collator broadcasts a
sample's index over its tokens (`teacher_id_idx`) only when there is more than one teacher.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

TEACHER_ID_COLUMN = "teacher_id"

T = TypeVar("T")


class TeacherRouter(Generic[T]):
    """Routes rows to `teachers` (teacher id -> a teacher: an engine, a URL, ...)."""

    def __init__(self, teachers: Mapping[str, T]) -> None:
        if not isinstance(teachers, Mapping) or not teachers:
            raise ValueError("teachers must be a non-empty mapping of teacher id -> teacher (teacher_server_urls)")
        for teacher_id in teachers:
            if not isinstance(teacher_id, str) or not teacher_id:
                raise ValueError(f"teacher ids must be non-empty strings, got {teacher_id!r}")
        self.teachers: dict[str, T] = dict(teachers)
        self.teacher_ids: tuple[str, ...] = tuple(self.teachers)
        self._index = {teacher_id: index for index, teacher_id in enumerate(self.teacher_ids)}

    @property
    def num_teachers(self) -> int:
        return len(self.teacher_ids)

    @property
    def is_multi_teacher(self) -> bool:
        """Several teachers (MOPD): rows are routed by their `teacher_id` column."""
        return self.num_teachers > 1

    def teacher_id_for(self, row: Mapping[str, Any]) -> str:
        """The id of the teacher that scores `row` (docs/algorithms.md §9.4)."""
        if not self.is_multi_teacher:
            return self.teacher_ids[0]
        teacher_id = row.get(TEACHER_ID_COLUMN)
        if not isinstance(teacher_id, str) or teacher_id not in self._index:
            raise ValueError(
                f"Example has `{TEACHER_ID_COLUMN}={teacher_id!r}`, which is not among the teachers "
                f"{list(self.teacher_ids)} of teacher_server_urls. With several teachers every example needs a "
                f"{TEACHER_ID_COLUMN!r} column naming one of them."
            )
        return teacher_id

    def route(self, row: Mapping[str, Any]) -> tuple[str, T]:
        """`(teacher_id, teacher)` for `row`."""
        teacher_id = self.teacher_id_for(row)
        return teacher_id, self.teachers[teacher_id]

    def index_of(self, teacher_id: str) -> int:
        """The stable index of `teacher_id` (mapping order); `ValueError` for an unknown id."""
        try:
            return self._index[teacher_id]
        except KeyError:
            raise ValueError(f"unknown teacher id {teacher_id!r}: the teachers are {list(self.teacher_ids)}") from None


def teacher_indices(teacher_ids: Mapping[str, Any] | list[str] | tuple[str, ...]) -> dict[str, int]:
    """Teacher id -> stable index (the given order)."""
    return {teacher_id: index for index, teacher_id in enumerate(teacher_ids)}


__all__ = ["TEACHER_ID_COLUMN", "TeacherRouter", "teacher_indices"]
