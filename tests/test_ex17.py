"""Notebook 17's exercises: the check of a 3-D mesh's groups passes the reference and names each known mistake;
the layout check passes the planner's best and names a layout that does not fit, is slow or is outside the space."""
import pytest

from course_lib.composed import peers
from course_lib.exercises import ex17
from course_lib.layout import PRESETS, Layout, h100_cluster, rank


def test_the_reference_is_the_mesh_and_passes():
    for shape in ex17.MESHES:
        for r in range(shape[0] * shape[1] * shape[2]):
            assert ex17.reference(r, *shape) == peers(r, *shape)
    feedback = ex17.check_groups(ex17.reference)
    assert feedback, feedback
    assert "every rank of 5 meshes" in feedback.message


def test_a_stub_is_not_attempted_and_errors_are_reported():
    def stub(rank, pp, dp, tp):
        raise NotImplementedError
    assert ex17.check_groups(stub).status == "not attempted"
    assert "raised ZeroDivisionError" in ex17.check_groups(lambda r, pp, dp, tp: 1 / 0).message
    assert "return a dict" in ex17.check_groups(lambda r, pp, dp, tp: [r]).message
    assert "without calling it" in ex17.check_groups(ex17.reference(0, 2, 2, 2)).message


def test_the_library_is_off_while_the_learner_runs():
    from course_lib import composed
    feedback = ex17.check_groups(lambda r, pp, dp, tp: composed.peers(r, pp, dp, tp))
    assert not feedback and "coords, rank_at, groups and peers are off" in feedback.message
    assert composed.peers(5, 2, 2, 2) == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}     # and back on afterwards


@pytest.mark.parametrize("name", list(ex17.MISTAKES))
def test_each_known_mistake_fails_with_its_own_message(name):
    fn, message = ex17.MISTAKES[name]
    feedback = ex17.check_groups(fn)
    assert feedback.status == "wrong" and feedback.message == message, (name, feedback.message)


def test_the_named_mistakes_are_the_usual_ones():
    assert ex17.MISTAKES["pp fastest"][0](1, 2, 2, 2)["pp"] == [0, 1]          # column-major: pp neighbours
    assert ex17.MISTAKES["tp outermost"][0](0, 2, 2, 2)["tp"] == [0, 4]
    assert ex17.MISTAKES["xor"][0](3, 2, 2, 2) == ex17.reference(3, 2, 2, 2)   # right on 2×2×2 only
    assert ex17.MISTAKES["dp stride dp"][0](5, 2, 2, 2) == ex17.reference(5, 2, 2, 2)
    assert len(ex17.MISTAKES) == 9         # 7 named, and the two other numberings (dp outermost)


def test_an_unknown_mistake_is_located():
    def off_by_one(r, pp, dp, tp):
        g = ex17.reference(r, pp, dp, tp)
        return {**g, "pp": [x for x in g["pp"]] if r else [0, 5]}
    feedback = ex17.check_groups(off_by_one)
    assert not feedback and "rank 0's pp group is [0, 5], but the mesh's is [0, 4]" in feedback.message


MODEL, CLUSTER = PRESETS["llama-3-70b"], h100_cluster(8)


def test_the_planners_best_passes_the_layout_check():
    best = rank(MODEL, CLUSTER, 512, micro_batches=(1, 2, 4))[0]
    feedback = ex17.check_layout_choice(best["layout"])
    assert feedback, feedback
    assert ex17.check_layout_choice(None).status == "not attempted"


def test_layouts_that_break_a_rule_are_told_which():
    assert "use all of them" in ex17.check_layout_choice(Layout(4, 8, 1, 1, 1, "none", 1, 128)).message
    assert "global batch is 512" in ex17.check_layout_choice(Layout(8, 8, 1, 1, 1, "none", 1, 32)).message
    pp32 = ex17.check_layout_choice(Layout(2, 1, 32, 1, 1, "none", 1, 256))
    assert "pp = 32 must divide the 80 layers" in pp32.message
    outside = ex17.check_layout_choice(Layout(4, 16, 1, 1, 1, "none", 1, 128))
    assert "outside the planner's space" in outside.message and "tp = 16" in outside.message
    assert "pass a Layout" in ex17.check_layout_choice((8, 8, 1)).message


def test_a_layout_that_does_not_fit_is_told_its_largest_part():
    ddp = ex17.check_layout_choice(Layout(64, 1, 1, 1, 0, "none", 1, 8))   # 70 B replicated on every GPU
    assert not ddp and "GiB a GPU, more than the" in ddp.message and "largest part" in ddp.message


def test_a_slow_layout_is_told_where_its_time_goes():
    rows = rank(MODEL, CLUSTER, 512, micro_batches=(1, 2, 4))
    slow = next(r for r in rows if r["time"]["step"] > 1.5 * rows[0]["time"]["step"])
    feedback = ex17.check_layout_choice(slow["layout"])
    assert not feedback and "fits, but its step is" in feedback.message and "s in " in feedback.message
    assert feedback.message.count("Why it wins") == 1 and "It wins on" not in feedback.message
    assert rows[0]["name"] not in feedback.message          # the check does not give the answer away


def test_ranks_must_be_integers():
    import numpy as np
    as_str = ex17.check_groups(lambda r, pp, dp, tp: {d: [str(x) for x in g]
                                                      for d, g in ex17.reference(r, pp, dp, tp).items()})
    as_float = ex17.check_groups(lambda r, pp, dp, tp: {d: [float(x) for x in g]
                                                        for d, g in ex17.reference(r, pp, dp, tp).items()})
    for feedback in (as_str, as_float):
        assert feedback.status == "wrong" and "integer ranks" in feedback.message
    as_bool = ex17.check_groups(lambda r, pp, dp, tp: {"pp": [True], "dp": [False], "tp": [True]})
    assert as_bool.status == "wrong" and "integer ranks" in as_bool.message
    as_numpy = ex17.check_groups(lambda r, pp, dp, tp: {d: list(np.array(g))
                                                        for d, g in ex17.reference(r, pp, dp, tp).items()})
    assert as_numpy, as_numpy.message                       # NumPy integers are integers


def test_practitioner_layouts_pass_and_a_slow_one_is_shown_its_degrees_best():
    for lay in (Layout(4, 8, 2, 1, 1, "none", 1, 128), Layout(4, 4, 4, 1, 1, "none", 1, 128)):
        feedback = ex17.check_layout_choice(lay)                 # TP 8 × PP 2 × DP 4 and TP 4 × PP 4 × DP 4
        assert feedback, feedback.message
    slow = ex17.check_layout_choice(Layout(4, 8, 2, 1, 1, "full", 1, 128))   # its degrees, recomputing
    assert not slow and "With your degrees, the fastest variant is TP 8 × PP 2 × DP 4" in slow.message


def test_an_unknown_recompute_or_zero_says_so():
    bad = ex17.check_layout_choice(Layout(4, 8, 2, 1, 1, "selective", 1, 128))
    assert not bad and "recompute must be one of ('none', 'full'), got 'selective'" in bad.message
    z = ex17.check_layout_choice(Layout(4, 8, 2, 1, 4, "none", 1, 128))
    assert not z and "zero must be one of (0, 1, 2, 3), got 4" in z.message
    single = ex17.check_layout_choice(Layout(1, 8, 8, 1, 1, "none", 1, 512))
    assert not single and "ZeRO needs dp·cp > 1" in single.message
