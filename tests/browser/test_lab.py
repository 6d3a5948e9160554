"""The course as a learner meets it: JupyterLab in a real (headless) Chromium, driven by Playwright.

For every notebook that shows a widget: open it, *Run ▸ Run All Cells* from the menu, and check that every cell
ran without an error, that every widget rendered as a widget (not as text, not as "Error displaying widget"), that
the browser left the values the code set alone (a slider rounding 7 to 7.08 and sending it back fails here, and
only here: nbval has no browser), that no control's label is cut, and that moving each control changes what the
widget shows while the browser and the kernel keep agreeing on every value.

Needs Chromium (Debian: ``apt-get install chromium``) and Playwright for Python (``pip install -e '.[browser]'``);
Playwright's own browser download is not used. Skipped without them, unless ``COURSE_BROWSER_TEST=required``
(``.ci/run`` sets it), which makes their absence a failure. On a failure, a screenshot and the executed notebook
are kept in ``.browser-artifacts/`` (or ``$BROWSER_ARTIFACTS``). Run alone: ``pytest -m browser``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import nbformat
import pytest
from labdriver import ROOT, JupyterLab, KernelProbe, widget_classes, widget_notebooks
from labpage import (
    DISPLAY,
    MARK_ROOTS,
    READ_CONTROLS,
    move,
    run_all_from_menu,
    save_from_menu,
    shown_matches,
    wait_display_changed,
    wait_run_all_done,
)

REQUIRED = os.environ.get("COURSE_BROWSER_TEST") == "required"
ARTIFACTS = Path(os.environ.get("BROWSER_ARTIFACTS", ROOT / ".browser-artifacts"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NOTEBOOKS = widget_notebooks()
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def chromium_path() -> str | None:
    """$CHROMIUM if set, else the first of Debian's chromium and Google Chrome (GitHub's runners) on the PATH."""
    if "CHROMIUM" in os.environ:
        return shutil.which(os.environ["CHROMIUM"])
    return next(filter(None, map(shutil.which, ("chromium", "google-chrome", "google-chrome-stable"))), None)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = [what for what, ok in (("chromium (apt-get install chromium)", chromium_path()),
                                     ("playwright (pip install -e '.[browser]')", sync_playwright)) if not ok]
    if missing:
        (pytest.fail if REQUIRED else pytest.skip)(f"the browser test needs {' and '.join(missing)}")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    server = JupyterLab(tmp_path_factory.mktemp("lab"), NOTEBOOKS)
    yield server
    server.stop()


def test_the_notebooks_with_widgets_are_found():
    assert {"CollectiveExplorer", "RingStepper", "MemoryCalculator", "ScheduleExplorer"} <= widget_classes()
    assert {"01", "02", "06", "07"} <= {p.name[:2] for p in NOTEBOOKS}


def test_reopened_widgets_are_explained_once_in_notebook_00_and_the_readme():
    """A reopened notebook shows "Error displaying widget: model not found": notebook 00's "How to use this course"
    and README's troubleshooting say why and what to do; the notebooks that draw widgets do not repeat it."""
    welcome = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4).cells
    start = next(i for i, c in enumerate(welcome) if c.source.startswith("## How to use this course"))
    end = next(i for i in range(start + 1, len(welcome)) if welcome[i].source.startswith("## "))
    howto = "\n".join(c.source for c in welcome[start:end])
    assert "model not found" in howto and "run its cell again" in howto
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "model not found" in readme and "Run its cell again" in readme
    repeated = [p.name for p in NOTEBOOKS
                if any("model not found" in c.source for c in nbformat.read(p, as_version=4).cells)]
    assert repeated == [], f"say it in notebook 00 only: {repeated}"


@pytest.mark.browser
@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS])
def test_run_all_in_jupyterlab_and_use_every_widget(name, lab, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    probe, spot = None, None
    try:
        page.goto(lab.url(name))
        page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=90_000)
        lab.wait_idle(name, timeout=90)
        probe = KernelProbe(lab, name)
        run_all_from_menu(page)
        prompts = wait_run_all_done(page, timeout_s=300)
        lab.wait_idle(name, timeout=60, settle=2)
        save_from_menu(page)
        nb = nbformat.read(lab.dir / name, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        errors = [f"cell {c.execution_count}: {o.ename}: {o.evalue}" for c in code for o in c.outputs
                  if o.output_type == "error"]
        assert not errors, f"error outputs: {errors}"
        assert all(c.execution_count for c in code), f"cells that did not run (prompts {prompts})"
        ids = [o.data[WIDGET_MIME]["model_id"] for c in code for o in c.outputs if WIDGET_MIME in o.get("data", {})]
        assert ids, "the notebook displayed no widget"

        broken = page.locator(".jp-OutputArea-output", has_text="Error displaying widget")
        assert broken.count() == 0, f"'Error displaying widget' shown: {broken.first.inner_text()}"
        assert page.evaluate(MARK_ROOTS) == len(ids), "a widget was shown as text, not rendered as a widget"
        drift = probe.json("drift()")
        if drift:   # the screenshot shows the widget whose value moved
            spot = page.locator("[data-bt-root]").filter(
                has=page.locator(".widget-label", has_text=drift[0]["description"])).first
        assert not drift, ("the browser changed values the code set, without anyone touching them: " + "; ".join(
            f"{d['description']!r} {d['set_by_code']!r} -> {d['now']!r}" for d in drift))

        for i, model_id in enumerate(ids):
            spot = root = page.locator(f"[data-bt-root='{i}']")
            root.scroll_into_view_if_needed()
            assert root.evaluate(DISPLAY).strip(), f"widget {i} shows nothing besides its controls"
            controls = root.evaluate(READ_CONTROLS)
            assert controls, f"widget {i} has no control"
            cut = [c["description"] for c in controls if c["truncated"]]
            assert not cut, f"widget {i}: labels cut short in the page (give them room): {cut}"
            check_browser_equals_kernel(probe, model_id, controls, f"widget {i} as displayed")
            for index in range(len(controls)):
                before = root.evaluate(DISPLAY)
                control = root.evaluate(READ_CONTROLS)[index]            # as shown now: earlier moves change it
                now = {c["description"]: c for c in probe.json(f"controls({model_id!r})")}   # and its bounds
                move(page, root, {**control, "max": now[control["description"]]["max"]})
                assert wait_display_changed(root, before), f"moving {control['description']!r} changed nothing shown"
                lab.wait_idle(name, timeout=30, settle=0.5)
                check_browser_equals_kernel(probe, model_id, root.evaluate(READ_CONTROLS),
                                            f"widget {i} after moving {control['description']!r}")
    except BaseException:
        keep_evidence(page, spot, lab.dir / name)
        raise
    finally:
        if probe:
            probe.close()
        with contextlib.suppress(OSError):     # a server that died has said why in the failure above
            lab.shutdown_kernel(name)
        page.close()


def check_browser_equals_kernel(probe: KernelProbe, model_id: str, shown: list[dict], when: str) -> None:
    kernel = {c["description"]: c for c in probe.json(f"controls({model_id!r})")}
    in_page = {c["description"]: c for c in shown}
    assert set(kernel) == set(in_page), f"{when}: the kernel's controls {sorted(kernel)}, the page's {sorted(in_page)}"
    differ = [f"{d!r}: browser shows {in_page[d]['shown']!r}, kernel holds {kernel[d]['value']!r}"
              for d in kernel if not shown_matches(in_page[d]["shown"], kernel[d], in_page[d]["kind"])]
    assert not differ, f"{when}: " + "; ".join(differ)


def keep_evidence(page, spot, notebook: Path) -> None:
    """A screenshot (of the widget being checked, if any) and the executed notebook, for CI's artifacts."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        if spot is not None:
            spot.scroll_into_view_if_needed(timeout=5000)
        page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}.png"), timeout=10_000)
    except Exception as e:  # noqa: BLE001 - evidence is best effort; the test's own failure is what matters
        print(f"(no screenshot: {e})")
    if notebook.exists():
        shutil.copy(notebook, ARTIFACTS / notebook.name)
