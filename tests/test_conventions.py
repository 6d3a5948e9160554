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
STANDARD = ["00_welcome.ipynb", "01_ranks_and_collectives.ipynb", "02_allreduce_from_scratch.ipynb",
            "03_data_parallel_from_scratch.ipynb", "04_ddp_in_practice.ipynb", "05_ddp_nccl_torchrun.ipynb",
            "06_model_parallel.ipynb",
            "07_pipeline_schedules.ipynb", "08_faults_and_debugging.ipynb", "09_zero_from_scratch.ipynb",
            "10_fsdp2_and_checkpoints.ipynb",
            "11_tensor_parallel.ipynb", "13_activation_memory.ipynb",
            "14_mixed_precision.ipynb", "15_context_parallel.ipynb", "16_expert_parallel.ipynb",
            "12_sequence_parallel_and_dtensor.ipynb", "17_putting_it_together.ipynb"]
FOLDED = "<details><summary>"


def cells(name):
    return nbformat.read(ROOT / "notebooks" / name, as_version=4).cells


def markdown(nb):
    return [c.source for c in nb if c.cell_type == "markdown"]


# Each rule takes a notebook's cells and its file name, and fails with a message that says what to do.

def predictions_come_before_measurements(nb, name):
    asks = [i for i, c in enumerate(nb)
            if c.cell_type == "markdown" and re.search(r"^\*\*Predict\.\*\*", c.source, re.M)]
    assert len(asks) >= 2, f"{name}: ask the learner for a number before at least two measurements"
    for i in asks:
        assert i + 1 < len(nb) and nb[i + 1].cell_type == "code", f"{name}, cell {i}: the cell after a prediction runs"


def check_questions_have_folded_answers(nb, name):
    found = [s for s in markdown(nb) if s.startswith("## Check your understanding")]
    assert len(found) == 1, f"{name}: one 'Check your understanding' section"
    questions, answers = found[0].split(FOLDED, 1) if FOLDED in found[0] else (found[0], "")
    assert 2 <= len(re.findall(r"^\d+\. ", questions, re.M)) <= 4
    assert answers.startswith("Answers</summary>") and "</details>" in answers, f"{name}: fold the answers"


def behind_the_asserts_is_folded(nb, name):
    for s in markdown(nb):
        for m in re.finditer(r"(?<!\*)Behind the asserts(?!\*)", s):   # *Behind the asserts* names a note
            assert s[:m.start()].endswith(FOLDED), f"{name}: 'Behind the asserts' goes in a folded note"


def every_exercise_has_a_folded_solution(nb, name):
    exercises = markdown(nb)[-1].split("## Exercises", 1)[1]
    numbered = re.findall(r"^\d+\. ", exercises, re.M)
    solutions = exercises.count(FOLDED + "Solution</summary>")
    assert numbered and solutions == len(numbered), f"{name}: {len(numbered)} exercises, {solutions} solutions"


def references_come_after_the_attempt(nb, name):
    code = [c.source for c in nb if c.cell_type == "code"]
    module = f"ex{name[:2]}"
    checks = [i for i, s in enumerate(code) if re.search(rf"\b{module}\.check_", s)]
    for i, s in enumerate(code):
        for shown in re.findall(rf"show_source\(([^)]*\b{module}\.\w+)", s):
            assert checks and i > checks[0], f"{name}: {shown} is shown before the learner's attempt is checked"


RULES = [predictions_come_before_measurements, check_questions_have_folded_answers, behind_the_asserts_is_folded,
         every_exercise_has_a_folded_solution, references_come_after_the_attempt]


def test_the_standard_list_names_notebooks_of_the_map():
    assert set(STANDARD) <= {nb.file for nb in course_map.NOTEBOOKS}


@pytest.mark.parametrize("rule", RULES, ids=[r.__name__ for r in RULES])
@pytest.mark.parametrize("name", STANDARD)
def test_the_standard_notebooks_follow_the_rule(name, rule):
    rule(cells(name), name)


def test_the_rules_catch_what_they_are_for():
    """Each rule fails a notebook that breaks it (a rule that cannot fail proves nothing)."""
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    good = [md("**Predict.** How many?"), code("ex05.check_it(f)"), code("show_source(ex05.reference)"),
            md("## Summary\n\n## Exercises\n\n1. Do.\n\n<details><summary>Solution</summary>\nDone.\n</details>")]
    bad = [code("show_source(ex05.reference)"), code("ex05.check_it(f)"), md("Behind the asserts: tolerances."),
           md("## Summary\n\n## Exercises\n\n1. Do.\n2. Again.\n\n<details><summary>Solution</summary>\nDone.\n"
              "</details>")]
    for rule in (every_exercise_has_a_folded_solution, references_come_after_the_attempt,
                 behind_the_asserts_is_folded):
        rule(good, "05_good.ipynb")
    for rule in RULES:
        with pytest.raises(AssertionError):
            rule(bad, "05_bad.ipynb")
