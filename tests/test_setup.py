"""Set-up that cannot drift: one dependency list, README's map and commands, notebooks without outputs."""
import re
import sys
from pathlib import Path

import nbformat

from course_lib import course_map

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name, where they differ

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def requirement(spec: str) -> tuple[str, str]:
    name, version = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", spec.split(";")[0].strip()).groups()
    return CONDA_NAMES.get(name.lower(), name.lower()), version.replace(" ", "")


def runtime_requirements() -> list[str]:
    lines = (line.split("#")[0].strip() for line in (ROOT / "course_lib" / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line]


def test_one_dependency_list_and_one_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "dependencies" not in project and "version" not in project      # both dynamic, read from one place
    assert set(project["dynamic"]) == {"dependencies", "version"}
    from course_lib import __version__, doctor
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert doctor.requirements() == [requirement(s)[0].replace("pytorch", "torch") for s in runtime_requirements()]
    makefile = (ROOT / "Makefile").read_text()
    assert "torch>=" not in makefile and "requirements.txt" in makefile       # make installs torch from the list


def test_environment_yml_lists_exactly_pyprojects_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = runtime_requirements() + project["optional-dependencies"]["test"] + project["optional-dependencies"]["lab"]
    wanted = dict(requirement(s) for s in specs if "python_version" not in s)
    conda, in_deps = {}, False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            in_deps = True
        elif in_deps and re.match(r"  - [A-Za-z]", line):
            name, version = requirement(line[4:])
            if name not in ("python", "pip"):
                conda[name] = version
    assert conda == wanted
    assert "      - -e ." in (ROOT / "environment.yml").read_text()  # course_lib in development mode


def test_readme_course_map_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- course-map[^>]*-->\n(.*?)\n<!-- /course-map -->", readme, re.S)
    assert block, "README lost its course-map markers"
    assert block.group(1).strip() == course_map.markdown_table().strip(), "run: python -m course_lib map"


def test_ci_runs_readmes_lint_and_test_commands():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert "make test    #" in readme and "make lab     #" in readme and "make lint" in readme
    assert re.search(r"^make lint\b", ci, re.M) and re.search(r"^make test\b", ci, re.M)
    assert re.search(r'TORCH="torch==[0-9.]+"', ci)  # a pinned CPU build, not a multi-GB CUDA download
    workflow = (ROOT / ".github" / "workflows" / "test.yml").read_text()
    assert "make test" in workflow and "ruff check" in workflow


def test_the_workflow_tests_the_oldest_python_and_torch_we_claim():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest_python = re.fullmatch(r">=(\d+\.\d+)", project["requires-python"]).group(1)
    oldest_torch = next(re.fullmatch(r"torch>=(\d+\.\d+)", r).group(1) for r in runtime_requirements()
                        if r.startswith("torch"))
    workflow = (ROOT / ".github" / "workflows" / "test.yml").read_text()
    assert f'python: "{oldest_python}", torch: "torch=={oldest_torch}.*"' in workflow


def test_every_notebook_is_in_the_map_and_committed_without_outputs():
    files = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert files == [nb.file for nb in course_map.NOTEBOOKS]
    for name in files:
        nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear the outputs"


def test_every_notebook_opens_with_its_frame_and_ends_with_summary_and_exercises():
    for nb_info in course_map.NOTEBOOKS:
        nb = nbformat.read(ROOT / "notebooks" / nb_info.file, as_version=4)
        first = nb.cells[0].source
        for word in ("**You will:**", "**Prerequisites:**", "**Hardware:**", "**Runtime:**"):
            assert word in first, f"{nb_info.file}: the first cell lacks {word}"
        last = nb.cells[-1].source
        assert "## Summary" in last and "## Exercises" in last, f"{nb_info.file}: end with a summary and exercises"
        assert "hardware.summary()" in "".join(c.source for c in nb.cells[:3]), f"{nb_info.file}: say what it ran on"
        # one place for the runtime and the learner's time: the course map; the header repeats its figures
        assert f"**Runtime:** about {nb_info.runtime_s} s on a 2-core CPU machine" in first, \
            f"{nb_info.file}: the header's runtime must be the course map's ({nb_info.runtime_s} s)"
        assert course_map.time_line(nb_info) in first and course_map.nav_line(nb_info) in first, \
            f"{nb_info.file}: run python -m course_lib map --frames"


def test_the_map_links_each_notebook_to_the_ones_before_and_after_and_times_every_one():
    files = [nb.file for nb in course_map.NOTEBOOKS]
    for i, nb_info in enumerate(course_map.NOTEBOOKS):
        nav = course_map.nav_line(nb_info)
        assert ("](" + files[i - 1] + ")" in nav) == (i > 0) and ("](" + files[(i + 1) % len(files)] + ")" in nav) \
            == (i + 1 < len(files))
        assert "(glossary.md)" in nav and "(00_welcome.ipynb#The-course-map)" in nav
        assert 0 < nb_info.core_min <= nb_info.all_min and nb_info.runtime_s
    welcome = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4).cells
    assert any(c.source.startswith("## The course map") for c in welcome)  # the anchor every nav line links to
    assert course_map.write_frames(ROOT / "notebooks", write=False) == [], "run: python -m course_lib map --frames"


def test_the_instructors_plan_quotes_the_maps_learner_times():
    plan = (ROOT / "notebooks" / "INSTRUCTORS.md").read_text(encoding="utf-8")
    core = {nb.number: nb.core_min for nb in course_map.NOTEBOOKS}
    quoted = re.findall(r"\b(\d\d)(?: · [^(|]*?)? \((?:[^()|]*?, )?(\d+) min", plan)
    assert len(quoted) >= len(core) - 1
    assert [(n, int(m)) for n, m in quoted if core[n] != int(m)] == [], "copy the times from the course map"
