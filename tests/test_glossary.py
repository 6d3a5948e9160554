"""The glossary (notebooks/glossary.md) holds every term a notebook defines, and names only notebooks that exist.

The convention (CONTRIBUTING.md): a notebook puts a term in **bold** where it defines it, and uses *italics* for
emphasis. Bold that ends in ':' '.' or '?' is a label ("**Fix:**", "**Exercise 1.**"), and so is bold that opens a
list item (a lead-in such as "1. **No launcher named**: ..."); everything else in bold is a definition.
"""
import re
from pathlib import Path

import nbformat
import pytest

from course_lib import course_map

ROOT = Path(__file__).resolve().parent.parent
GLOSSARY = ROOT / "notebooks" / "glossary.md"
BOLD = re.compile(r"\*\*([^*]+)\*\*")


def normal(term: str) -> set[str]:
    """The forms a term is looked up by: lower case, no backticks, one space; singular and plural alike."""
    t = " ".join(term.replace("`", "").lower().split())
    forms = {t}
    if t.endswith("es"):
        forms.add(t[:-2])
    if t.endswith("s"):
        forms.add(t[:-1])
    return forms


def is_label(text: str, line_before: str) -> bool:
    return text.rstrip().endswith((":", ".", "?")) or re.fullmatch(r"\s*(\d+\.|[*-])\s+", line_before) is not None


def definitions(source: str) -> list[str]:
    """The terms a Markdown cell puts in bold as definitions."""
    found = []
    for m in BOLD.finditer(source):
        before = source[source.rfind("\n", 0, m.start()) + 1:m.start()]
        if not is_label(m.group(1), before):
            found.append(m.group(1))
    return found


def glossary_terms() -> set[str]:
    """Every bold term in the head of a glossary entry ("- **store** (also **TCPStore**): ..."), aliases included."""
    terms = set()
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        head = line.split(": ", 1)[0] if line.startswith("- **") else ""
        for t in BOLD.findall(head):
            terms |= normal(t)
    return terms


def test_the_rules_tell_definitions_from_labels_and_emphasis():
    cell = ("Each process is a **rank**. **Fix:** set it.\n1. **No launcher named**: it fails.\n"
            "* **Exercise.** Write it.\nThe **idle problem** (below) and *emphasis*.")
    assert definitions(cell) == ["rank", "idle problem"]
    assert normal("micro-batches") >= {"micro-batch"} and "bucket" in normal("`buckets`")


def test_the_glossary_names_the_terms_the_issue_asks_for():
    asked = ("rank", "local rank", "world size", "process group", "backend", "collective", "rendezvous", "store",
             "agent", "communicator", "watchdog", "bucket", "micro-batch", "bubble", "shard", "placement", "mesh")
    terms = glossary_terms()
    assert [t for t in asked if not normal(t) & terms] == []


@pytest.mark.parametrize("nb", course_map.NOTEBOOKS, ids=[nb.number for nb in course_map.NOTEBOOKS])
def test_every_term_a_notebook_defines_is_in_the_glossary(nb):
    terms = glossary_terms()
    cells = nbformat.read(ROOT / "notebooks" / nb.file, as_version=4).cells
    missing = sorted({d for c in cells if c.cell_type == "markdown" for d in definitions(c.source)
                      if not normal(d) & terms})
    assert missing == [], (f"{nb.file} puts {missing} in bold as definitions: add them to notebooks/glossary.md, "
                           "or write them in *italics* if they are only emphasis")


def test_the_glossary_names_only_notebooks_that_exist():
    text = GLOSSARY.read_text(encoding="utf-8")
    files = {nb.file for nb in course_map.NOTEBOOKS}
    linked = re.findall(r"\]\(([^)#]+\.ipynb)", text)
    assert linked and set(linked) <= files, sorted(set(linked) - files)
    for number, target in re.findall(r"\[(\d\d)\]\(([^)#]+)\)", text):
        assert target.startswith(number + "_"), f"[{number}] links to {target}"
    numbers = {nb.number for nb in course_map.NOTEBOOKS}
    said = set(re.findall(r"[Nn]otebooks? (\d\d)", text))
    assert said <= numbers, sorted(said - numbers)


def test_every_entry_names_the_notebook_that_teaches_it():
    entries = [ln for ln in GLOSSARY.read_text(encoding="utf-8").split("\n- ")[1:]]
    assert len(entries) >= 60
    assert [e[:40] for e in entries if ".ipynb)" not in e] == []
