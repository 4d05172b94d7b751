import pytest

from rlasync.algorithms.distill.routing import TeacherRouter, teacher_indices


def test_single_teacher_scores_every_row_whatever_its_teacher_id():
    router = TeacherRouter({"default": "http://t:8001"})
    assert router.route({"teacher_id": "other"}) == ("default", "http://t:8001")
    assert router.route({}) == ("default", "http://t:8001")
    assert not router.is_multi_teacher


def test_several_teachers_route_by_the_row_column():
    router = TeacherRouter({"math": "A", "code": "B"})
    assert router.route({"teacher_id": "code"}) == ("code", "B")
    assert router.route({"teacher_id": "math"}) == ("math", "A")
    assert [router.index_of("math"), router.index_of("code")] == [0, 1]
    assert teacher_indices({"math": 1, "code": 2}) == {"math": 0, "code": 1}


@pytest.mark.parametrize("row", [{}, {"teacher_id": "chem"}, {"teacher_id": None}])
def test_missing_or_unknown_teacher_id_raises(row):
    router = TeacherRouter({"math": "A", "code": "B"})
    with pytest.raises(ValueError, match="Example has `teacher_id=.*`, which is not among the teachers"):
        router.route(row)


def test_empty_teacher_mapping_raises():
    with pytest.raises(ValueError, match="non-empty"):
        TeacherRouter({})
