"""The library's shape, as its package docstring states it: layers that each use only those above them, and no
module over 300 lines. A new module must be placed in the table (``course_lib/__init__.py``) to pass."""
import ast
import re
from pathlib import Path

import pytest

import course_lib

ROOT = Path(course_lib.__file__).parent
MAX_LINES = 300


def layer_table() -> dict[str, int]:
    """``{top-level module or package: its row}`` from the package docstring's table, rows counted from the top."""
    table = course_lib.__doc__.split("The layers")[1].split("Notebook")[0]
    rows = re.findall(r"^((?:``[\w/]+``,?\s*)+)\s", table, re.M)
    layers = {name.rstrip("/"): row for row, names in enumerate(rows) for name in re.findall(r"``([\w/]+)``", names)}
    layers["__main__"] = layers["doctor"]        # ``python -m course_lib map|doctor``: the last row's command line
    return layers


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
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
            source = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:      # ``from pkg import sub`` imports the submodule when there is one
                sub = ROOT.parent.joinpath(*f"{source}.{a.name}".split("."))
                out.append((f"{source}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else source,
                            node.lineno))
    return [(m, line) for m, line in out if m.startswith("course_lib.")]


def test_the_table_places_every_top_level_module():
    layers = layer_table()
    assert len(set(layers.values())) > 10 and list(layers)[0] == "hardware"
    tops = {name.split(".")[1] for name, _ in modules() if "." in name}
    assert tops - set(layers) == set(), "place these in course_lib/__init__.py's table of layers"


@pytest.mark.parametrize("name, path", modules(), ids=[name for name, _ in modules()])
def test_each_layer_uses_only_those_above_it(name, path):
    layers = layer_table()
    if "." not in name:
        return                                    # course_lib/__init__.py: the docstring only
    mine = name.split(".")[1]
    below = [(target, line) for target, line in imported(name, path)
             if target.split(".")[1] != mine and layers[target.split(".")[1]] > layers[mine]]
    assert below == [], f"{name} ({mine}) uses layers below its own: {below}"


def test_a_lower_layer_used_is_found():
    """The check itself: the layers are in the order the docstring gives, and imports of every form are found."""
    layers = layer_table()
    assert layers["hardware"] < layers["launch"] < layers["comm"] < layers["zero"] < layers["tensor_parallel"] \
        < layers["memory"] < layers["precision"] < layers["viz"] < layers["recipes"]
    source = ("import os\nfrom .launch import runner\n"
              "def f():\n    from .zero.fsdp2 import x\n    import course_lib.viz\n")
    assert imported("course_lib.hardware", ROOT / "hardware.py", source) == [
        ("course_lib.launch.runner", 2), ("course_lib.zero.fsdp2", 4), ("course_lib.viz", 5)]
    assert imported("course_lib.zero.fsdp2", ROOT / "zero" / "fsdp2.py", "from ..comm.record import CollectiveLog\n"
                    "from . import flat\n") == [("course_lib.comm.record", 1), ("course_lib.zero.flat", 2)]


def test_no_module_is_over_300_lines():
    long = {name: n for name, path in modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concept (at most {MAX_LINES} lines each): {long}"
