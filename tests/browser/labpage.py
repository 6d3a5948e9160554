"""What the browser shows of a notebook in JupyterLab, read from the page's DOM with Playwright, and how to move
a widget's controls the way a learner does (a slider's handle with the arrow keys, a drop-down, a typed number)."""
from __future__ import annotations

import re
import time

PROMPTS = "[...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent)"

# Mark each displayed widget (not one nested in an Output widget) as data-bt-root=i; return how many.
MARK_ROOTS = """() => {
  const roots = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output > .jupyter-widgets')]
      .filter(e => !e.parentElement.closest('.widget-output'));
  roots.forEach((e, i) => e.setAttribute('data-bt-root', i));
  return roots.length;
}"""

# The controls of one widget (those with a description), marked data-bt-control=j, with what each shows.
READ_CONTROLS = """root => [...root.querySelectorAll('.widget-inline-hbox')]
  .filter(c => !c.closest('.widget-output') && c.querySelector(':scope > .widget-label')?.textContent)
  .map((c, j) => {
    c.setAttribute('data-bt-control', j);
    const label = c.querySelector(':scope > .widget-label'), input = c.querySelector('input'),
          select = c.querySelector('select'), handle = c.querySelector('.noUi-handle');
    const cls = c.classList;
    const kind = cls.contains('widget-slider') ? 'slider' : select ? 'dropdown'
               : cls.contains('widget-checkbox') ? 'checkbox' : input ? 'text' : 'other';
    const shown = kind === 'slider' ? c.querySelector('.widget-readout').textContent.trim()
                : kind === 'dropdown' ? (select.selectedOptions[0]?.textContent ?? '')
                : kind === 'checkbox' ? input.checked : kind === 'text' ? input.value : c.textContent;
    return {index: j, description: label.textContent, kind, shown,
            truncated: label.scrollWidth > label.clientWidth + 1,
            at_max: handle ? handle.getAttribute('aria-valuenow') === handle.getAttribute('aria-valuemax') : false,
            options: select ? select.options.length : 0, selected: select ? select.selectedIndex : -1};
  })"""

# What the widget shows besides its controls: its Output, HTML and Image children.
DISPLAY = """root => [...root.querySelectorAll('.widget-output, .widget-html-content, .widget-image')]
  .map(e => e.tagName === 'IMG' ? e.src : e.innerHTML).join('\\n')"""


def wait_run_all_done(page, timeout_s: float) -> list[str]:
    """After Run All: wait until no cell shows [*] and the first has run; the prompts then."""
    page.wait_for_function(f"() => {{ const p = {PROMPTS}; return p.length && /\\[\\d+\\]/.test(p[0]) && "
                           "!p.some(t => t.includes('*')); }", timeout=timeout_s * 1000, polling=250)
    return page.evaluate(f"() => {PROMPTS}")


def run_all_from_menu(page) -> None:
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")


def save_from_menu(page) -> None:
    page.click(".lm-MenuBar-itemLabel:text-is('File')")
    page.click(".lm-Menu-itemLabel:text-is('Save Notebook')")
    page.wait_for_function("() => !document.querySelector('.lm-TabBar-tab.jp-mod-dirty')", timeout=20_000)


def move(page, root, control: dict) -> None:
    """Change one control as a learner would."""
    c = root.locator(f"[data-bt-control='{control['index']}']")
    if control["kind"] == "slider":
        c.locator(".noUi-handle").focus()
        page.keyboard.press("ArrowLeft" if control["at_max"] else "ArrowRight")
    elif control["kind"] == "dropdown":
        c.locator("select").select_option(index=(control["selected"] + 1) % control["options"])
    elif control["kind"] == "checkbox":
        c.locator("input").click()
    elif control["kind"] == "text":
        box = c.locator("input")
        try:
            doubled = float(control["shown"]) * 2 or 1
            if isinstance(control.get("max"), (int, float)) and doubled > control["max"]:   # at its top: go down
                doubled = float(control["shown"]) / 2
            new = str(int(doubled)) if doubled.is_integer() else str(doubled)   # "4096", as a learner types it
        except ValueError:
            new = control["shown"] + "x"
        box.fill(new)
        box.press("Enter")
    else:
        raise AssertionError(f"the test does not know how to move {control['description']!r} ({control['kind']})")


def wait_display_changed(root, before: str, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if root.evaluate(DISPLAY) != before:
            return True
        time.sleep(0.1)
    return False


def shown_matches(shown, kernel: dict, kind: str) -> bool:
    """Whether what the browser shows for a control is the kernel's value (a slider's readout to its digits)."""
    value = kernel["value"]
    if kernel.get("label") is not None:         # a drop-down draws its labels' spaces as no-break spaces
        return shown.replace("\xa0", " ") == kernel["label"]
    if isinstance(value, (bool, str)):
        return shown == value
    if kind == "text":
        return shown != "" and float(shown) == float(value)
    # a slider's readout is rounded: the value must be within half a unit of its last digit
    m = re.fullmatch(r"(-?\d*)(?:\.(\d*))?(?:e([+-]?\d+))?", str(shown).strip().replace("\u2212", "-"))
    if not m:
        return False
    last_digit = 10.0 ** (int(m.group(3) or 0) - len(m.group(2) or ""))
    return abs(float(shown.replace("\u2212", "-")) - float(value)) <= 0.5 * last_digit * (1 + 1e-9)
