"""The picture of a 3-D mesh (``course_lib.viz.mesh``) shows the mesh the code builds: every rank at its
coordinates, one line per pair of neighbours in each group, nodes framed."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_lib.composed import coords, groups  # noqa: E402
from course_lib.viz.mesh import GROUP_STYLE, draw_mesh, mesh_positions  # noqa: E402


def test_every_rank_is_drawn_with_its_coordinates_and_every_group_as_lines():
    for shape in ((2, 2, 2), (2, 3, 2), (1, 2, 4)):
        fig = draw_mesh(*shape, gpus_per_node=4)
        texts = [t.get_text() for t in fig.axes[0].texts]
        n = shape[0] * shape[1] * shape[2]
        for r in range(n):
            c = coords(r, *shape)
            assert f"rank {r}" in texts and f"({c['pp']}, {c['dp']}, {c['tp']})" in texts
        lines = fig.axes[0].get_lines()
        for dim, (color, _) in GROUP_STYLE.items():
            drawn = sum(1 for ln in lines if ln.get_color() == color)
            assert drawn == sum(len(g) - 1 for g in groups(*shape)[dim]), (shape, dim)
        assert sum(t.startswith("node ") for t in texts) == -(-n // 4)
        plt.close(fig)


def test_a_tp_group_is_a_row_and_a_dp_group_a_column():
    pos = mesh_positions(2, 2, 2)
    assert pos[0][1] == pos[1][1] and pos[0][0] != pos[1][0]     # tp partners: same row
    assert pos[0][0] == pos[2][0] and pos[0][1] != pos[2][1]     # dp partners: same column
    assert pos[4][0] > pos[1][0]                                 # stage 1 to the right of stage 0
