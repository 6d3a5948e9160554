"""The library's shape, as its package docstring states it: layers that each use only themselves and the layers
above them, and no module over 300 lines. A new module must be placed in the table (``course_lib/__init__.py``)."""
import ast
import functools
import re
from pathlib import Path

import pytest

import course_lib

ROOT = Path(course_lib.__file__).parent
MAX_LINES = 300


@functools.cache
def layer_table() -> dict[str, int]:
    """``{top-level module or package: its row}`` from the package docstring's table, rows counted from the top."""
    table = course_lib.__doc__.split("The layers")[1].split("Notebook")[0]
    rows = re.findall(r"^((?:``[\w/]+``(?:, )?)+) ", table, re.M)
    assert len(rows) == sum(line.startswith("``") for line in table.splitlines()), "a row of the table not read"
    layers = {name.rstrip("/"): row for row, names in enumerate(rows) for name in re.findall(r"``([\w/]+)``", names)}
    layers["__main__"] = max(layers.values())    # ``python -m course_lib map|doctor``: the last row's command line
    return layers


def modules() -> list[tuple[str, Path]]:
    """Every module of the package as ``(dotted name, path)`` (editor and JupyterLab copies in dot-folders left out)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if any(part.startswith(".") for part in parts):
            continue
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def imported(name: str, path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """The ``course_lib`` modules ``name`` (at ``path``) imports, at the top or inside a function, with the line."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:      # ``from pkg import sub`` imports the submodule when there is one
                sub = ROOT.parent.joinpath(*f"{module}.{a.name}".split("."))
                out.append((f"{module}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else module,
                            node.lineno))
    return [(m, line) for m, line in out if m == "course_lib" or m.startswith("course_lib.")]


def below(name: str, path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """What ``name`` imports from layers below its own (its own layer and those above are allowed)."""
    layers, mine = layer_table(), name.split(".")[1]
    return [(target, line) for target, line in imported(name, path, source)
            if target == "course_lib" or layers[target.split(".")[1]] > layers[mine]]


def test_the_table_places_every_top_level_module_and_only_those():
    layers = layer_table()
    assert list(layers)[0] == "hardware" and len(set(layers.values())) == 22
    tops = {name.split(".")[1] for name, _ in modules() if "." in name}
    assert tops - set(layers) == set(), "place these in course_lib/__init__.py's table of layers"
    assert set(layers) - tops == set(), "these rows of the table name no module"


def test_the_package_itself_imports_nothing_of_its_own():
    assert imported("course_lib", ROOT / "__init__.py") == []    # else every import of course_lib.x would run it


SUBMODULES = [(name, path) for name, path in modules() if "." in name]


@pytest.mark.parametrize("name, path", SUBMODULES, ids=[name for name, _ in SUBMODULES])
def test_each_layer_uses_only_itself_and_those_above_it(name, path):
    assert below(name, path) == [], f"{name} uses layers below its own (course_lib/__init__.py's table)"


def test_the_check_finds_every_form_of_import():
    layers = layer_table()
    assert layers["hardware"] < layers["launch"] < layers["comm"] < layers["zero"] < layers["tensor_parallel"] \
        < layers["memory"] < layers["precision"] < layers["viz"] < layers["recipes"]
    source = ("import os\nfrom .launch import runner\nfrom . import data\nimport course_lib.viz as v\n"
              "def f():\n    from .zero.fsdp2 import x\n    from course_lib import faults\n")
    assert imported("course_lib.hardware", ROOT / "hardware.py", source) == [
        ("course_lib.launch.runner", 2), ("course_lib.data", 3), ("course_lib.viz", 4), ("course_lib.zero.fsdp2", 6),
        ("course_lib.faults", 7)]
    assert below("course_lib.hardware", ROOT / "hardware.py", source) == imported(
        "course_lib.hardware", ROOT / "hardware.py", source)                     # all of them lie below hardware
    fsdp2 = ROOT / "zero" / "fsdp2.py"
    assert imported("course_lib.zero.fsdp2", fsdp2, "from ..comm.record import CollectiveLog\nfrom . import flat\n"
                    "from .. import hardware\n") == [("course_lib.comm.record", 1), ("course_lib.zero.flat", 2),
                                                     ("course_lib.hardware", 3)]
    assert below("course_lib.zero.fsdp2", fsdp2, "from ..comm.record import CollectiveLog\nfrom . import flat\n") == []
    assert below("course_lib.zero.fsdp2", fsdp2, "from ..tensor_parallel.comm import CollectiveLog\n") == [
        ("course_lib.tensor_parallel.comm", 1)]                                  # where CollectiveLog used to live


def test_no_module_is_over_300_lines():
    long = {name: n for name, path in modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concept (at most {MAX_LINES} lines each): {long}"
