"""The teaching conventions of CONTRIBUTING.md ("The lesson and the proof"), checked where a machine can check them.

A notebook enters ``STANDARD`` once the issue that rewrites its content has brought it to the standard; from then
on every rule below holds for it. The frame every notebook has (title, links, learner time, runtime, summary,
exercises) is checked for all notebooks in ``tests/test_setup.py``.
"""
import re
from pathlib import Path

import nbformat
import pytest

from course_lib import course_map

ROOT = Path(__file__).resolve().parent.parent
STANDARD = ["00_welcome.ipynb"]
FOLDED = "<details><summary>"


def cells(name):
    return nbformat.read(ROOT / "notebooks" / name, as_version=4).cells


def markdown(name):
    return [c.source for c in cells(name) if c.cell_type == "markdown"]


def test_the_standard_list_names_notebooks_of_the_map():
    assert set(STANDARD) <= {nb.file for nb in course_map.NOTEBOOKS}


@pytest.mark.parametrize("name", STANDARD)
def test_at_least_two_predictions_come_before_the_cells_that_measure_them(name):
    nb = cells(name)
    asks = [i for i, c in enumerate(nb)
            if c.cell_type == "markdown" and re.search(r"^\*\*Predict\.\*\*", c.source, re.M)]
    assert len(asks) >= 2, f"{name}: ask the learner for a number before at least two measurements"
    for i in asks:
        assert i + 1 < len(nb) and nb[i + 1].cell_type == "code", f"{name}, cell {i}: the cell after a prediction runs"


@pytest.mark.parametrize("name", STANDARD)
def test_check_your_understanding_has_two_to_four_questions_with_folded_answers(name):
    found = [s for s in markdown(name) if s.startswith("## Check your understanding")]
    assert len(found) == 1, f"{name}: one 'Check your understanding' section"
    questions, answers = found[0].split(FOLDED, 1) if FOLDED in found[0] else (found[0], "")
    assert 2 <= len(re.findall(r"^\d+\. ", questions, re.M)) <= 4
    assert answers.startswith("Answers</summary>") and "</details>" in answers, f"{name}: fold the answers"


@pytest.mark.parametrize("name", STANDARD)
def test_behind_the_asserts_notes_are_folded(name):
    for s in markdown(name):
        for m in re.finditer(r"(?<!\*)Behind the asserts(?!\*)", s):   # *Behind the asserts* names a note
            assert s[:m.start()].endswith(FOLDED), f"{name}: 'Behind the asserts' goes in a folded note"


@pytest.mark.parametrize("name", STANDARD)
def test_every_end_exercise_has_a_folded_solution(name):
    last = markdown(name)[-1]
    exercises = last.split("## Exercises", 1)[1]
    numbered = re.findall(r"^\d+\. ", exercises, re.M)
    solutions = exercises.count(FOLDED + "Solution</summary>")
    assert numbered and solutions == len(numbered), f"{name}: {len(numbered)} exercises, {solutions} solutions"


@pytest.mark.parametrize("name", STANDARD)
def test_no_reference_is_shown_before_the_learners_attempt_is_checked(name):
    code = [c.source for c in cells(name) if c.cell_type == "code"]
    module = f"ex{name[:2]}"
    checks = [i for i, s in enumerate(code) if re.search(rf"\b{module}\.check_", s)]
    for i, s in enumerate(code):
        for shown in re.findall(rf"show_source\(([^)]*\b{module}\.\w+)", s):
            assert checks and i > checks[0], f"{name}: {shown} is shown before the learner's attempt is checked"


def test_the_rules_catch_what_they_are_for(tmp_path):
    """Each rule fails a notebook that breaks it (a rule that cannot fail proves nothing)."""
    good = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("**Predict.** How many?"), nbformat.v4.new_code_cell("ex05.check_it(f)"),
        nbformat.v4.new_code_cell("show_source(ex05.reference)"),
        nbformat.v4.new_markdown_cell("## Summary\n\n## Exercises\n\n1. Do.\n\n<details><summary>Solution</summary>"
                                      "\nDone.\n</details>")])
    bad = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("show_source(ex05.reference)"), nbformat.v4.new_code_cell("ex05.check_it(f)"),
        nbformat.v4.new_markdown_cell("Behind the asserts: tolerances."),
        nbformat.v4.new_markdown_cell("## Summary\n\n## Exercises\n\n1. Do.\n2. Again.\n\n"
                                      "<details><summary>Solution</summary>\nDone.\n</details>")])
    folder = tmp_path / "notebooks"
    folder.mkdir()
    nbformat.write(good, folder / "05_good.ipynb")
    nbformat.write(bad, folder / "05_bad.ipynb")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        test_every_end_exercise_has_a_folded_solution("05_good.ipynb")
        test_no_reference_is_shown_before_the_learners_attempt_is_checked("05_good.ipynb")
        test_behind_the_asserts_notes_are_folded("05_good.ipynb")
        for rule in (test_every_end_exercise_has_a_folded_solution,
                     test_no_reference_is_shown_before_the_learners_attempt_is_checked,
                     test_behind_the_asserts_notes_are_folded,
                     test_at_least_two_predictions_come_before_the_cells_that_measure_them,
                     test_check_your_understanding_has_two_to_four_questions_with_folded_answers):
            with pytest.raises(AssertionError):
                rule("05_bad.ipynb")
    finally:
        ROOT = saved
