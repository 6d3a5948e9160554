"""The reference meaning of every collective equals what torch.distributed does, on 1 to 8 ranks."""
import pytest

from course_lib import viz
from course_lib.comm import collectives
from course_lib.launch import run
from course_lib.viz.widgets import CollectiveExplorer, collective_state


def run_all(rank, world_size):
    """Every collective demo in one process group (one launch per world size keeps the suite fast)."""
    return {name: demo(rank, world_size) for name, demo in collectives.DEMOS.items()}


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_collective_matches_its_reference(world_size):
    per_rank = run(run_all, world_size, backend="gloo", show_output=False)
    for name in collectives.DEMOS:
        results = [r[name] for r in per_rank]
        collectives.compare(name, results)  # raises on any disagreement


def test_compare_names_the_rank_that_disagrees():
    good = [([1.0], [1.0, 11.0]), ([11.0], [1.0, 11.0])]
    collectives.compare("all_gather", good)
    bad = [([1.0], [1.0, 11.0]), ([11.0], [11.0, 1.0])]
    with pytest.raises(AssertionError, match="rank 1 holds"):
        collectives.compare("all_gather", bad)


def test_reference_semantics_by_hand():
    before = [[1.0, 2.0], [11.0, 12.0]]
    assert collectives.expected("all_reduce", before) == [[12.0, 14.0], [12.0, 14.0]]
    assert collectives.expected("reduce", before) == [[12.0, 14.0], None]
    assert collectives.expected("reduce_scatter", before) == [[12.0], [14.0]]
    assert collectives.expected("all_to_all", before) == [[1.0, 11.0], [2.0, 12.0]]
    assert collectives.expected("broadcast", before) == [[1.0, 2.0], [1.0, 2.0]]


def test_barrier_releases_nobody_before_the_last_arrival():
    times = run(collectives.barrier_demo, 3, backend="gloo", show_output=False)   # one machine-wide clock
    first, last = min(a for a, _ in times), max(a for a, _ in times)
    assert last - first >= 0.25 and all(leave >= last for _, leave in times)


def test_unknown_collective_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of"):
        collectives.initial("allreduce", 0, 2)
    with pytest.raises(ValueError, match="choose one of"):
        collectives.expected("allreduce", [[1.0]])


@pytest.mark.parametrize("name", [n for n in collectives.COLLECTIVES if n != "barrier"])
def test_picture_shows_the_reference_values(name):
    state = collective_state(name, 3)
    fig = viz.draw_collective(name, state["before"], state["after"])
    drawn = viz.collective_texts(fig)
    for rank, row in enumerate(state["after"]):
        assert drawn[rank] == (["no result"] if row is None else [f"{v:g}" for v in row])


def test_owner_colours_moved_data_and_greys_sums():
    before = [[1.0, 2.0], [11.0, 12.0]]
    assert viz.owner(11.0, before) == 1 and viz.owner(12.0 + 2.0, before) is None


def test_explorer_redraws_when_driven_in_code():
    ex = CollectiveExplorer("broadcast", world_size=2)
    assert ex.state["after"] == [[1.0, 2.0, 3.0]] * 2
    ex.world_size.value = 5
    ex.name.value = "reduce_scatter"
    assert ex.state == collective_state("reduce_scatter", 5)
    assert ex.state["after"] == [[sum(10.0 * r + i + 1 for r in range(5))] for i in range(5)]
    with pytest.raises(ValueError, match="between 1 and 16"):
        collective_state("broadcast", 0)


def test_hierarchical_state_follows_the_three_phases():
    nodes, g = 3, 4
    everyone = frozenset((j, k) for j in range(nodes) for k in range(g))
    start, inside, across, end = (viz.hierarchical_state(nodes, g, p) for p in range(4))
    assert start[1][2] == {c: frozenset({(1, 2)}) for c in range(g)}            # only its own data
    assert inside[1][2] == {2: frozenset((1, k) for k in range(g))}              # node 1's sum of chunk 2
    assert across[1][2] == {2: everyone}                                         # everyone's sum of chunk 2
    assert all(cell == {c: everyone for c in range(g)} for row in end for cell in row)
    with pytest.raises(ValueError, match="phase must be"):
        viz.hierarchical_state(nodes, g, 4)


def test_hierarchical_picture_draws_the_state():
    fig = viz.draw_hierarchical_all_reduce(2, 4)
    texts = [sorted(t.get_text() for t in ax.texts if t.get_text()) for ax in fig.axes]   # not the arrows
    assert texts[0] == sorted(f"c{k}: n{j}" for j in range(2) for k in range(4))
    assert texts[1] == sorted(f"c{k}: all" for j in range(2) for k in range(4))
    assert texts[2] == ["all chunks\nall"] * 8


def test_flat_vs_two_level_bars_carry_their_values():
    fig = viz.plot_flat_vs_two_level([8, 64], {"Ethernet": [0.56, 0.63]}, [0.016, 0.035])
    heights = sorted(round(p.get_height(), 3) for p in fig.axes[0].patches)
    assert heights == [0.016, 0.035, 0.56, 0.63]


def test_rendezvous_picture_has_every_rank_and_every_pair():
    fig = viz.draw_rendezvous(4)
    store, direct = fig.axes
    assert sum(t.get_text().startswith("set hello/") for t in store.texts) == 4
    assert len(direct.lines) == 4 * 3 // 2                                       # one connection per pair


def notebook_solution(notebook: str, name: str):
    """The function ``name`` from a code block of ``notebook``'s folded solutions, as printed there."""
    import json
    import re
    from pathlib import Path

    import torch
    import torch.distributed as dist
    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / notebook).read_text())
    text = "".join(nb["cells"][-1]["source"])
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if f"def {name}(" in b)
    namespace = {"dist": dist, "torch": torch}
    exec(block.split("\n\n\nout = ")[0], namespace)            # the definition, not the notebook's own run
    return namespace[name]


@pytest.mark.parametrize("world_size", [2, 5])
def test_notebook_01_exercise_4_all_gather_solution(world_size):
    fn = notebook_solution("01_ranks_and_collectives.ipynb", "my_all_gather")
    out = run(fn, world_size, backend="gloo", show_output=False)
    assert out == collectives.expected("all_gather", [[10.0 * r + 1] for r in range(world_size)])
