"""Loaded into a notebook's kernel by the browser test (never by the course) to see what the kernel holds.

``install()`` records every widget control's value at the end of each cell, and checks at the start of the next
cell (and in ``drift()``) that nothing changed it in between. While "Run All Cells" runs, no person touches a
control, so a change there is the browser rewriting a value the code set: a slider that rounds 7 to 7.08 and sends
it back is caught here and nowhere else. ``controls(model_id)`` lists the controls of a displayed widget, with
their values, for comparison with what the browser shows.
"""
from __future__ import annotations

import json

from IPython import get_ipython
from ipywidgets import ValueWidget, Widget

try:
    from ipywidgets.widgets.widget import _instances  # every live widget, by model id
except ImportError:   # ipywidgets before 8.1
    _instances = Widget.widgets

_last: dict = {}
_drift: list = []


def _values() -> dict:
    """model id -> (description, value) of every live control (a widget with a value and a description)."""
    return {mid: (w.description, w.value) for mid, w in list(_instances.items()) if _is_control(w)}


def _is_control(w) -> bool:
    return isinstance(w, ValueWidget) and bool(getattr(w, "description", ""))


def _jsonable(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def _before_cell(info=None) -> None:
    for mid, (description, value) in _values().items():
        if mid in _last and _last[mid][1] != value:
            _drift.append({"description": description, "set_by_code": _jsonable(_last[mid][1]),
                           "now": _jsonable(value)})
            _last[mid] = (description, value)


def _after_cell(result=None) -> None:
    _last.clear()
    _last.update(_values())


def install() -> None:
    ip = get_ipython()
    ip.events.register("pre_run_cell", _before_cell)
    ip.events.register("post_run_cell", _after_cell)


def drift() -> None:
    """Print, as JSON, the values the browser changed while no one touched them; stop watching."""
    _before_cell()
    ip = get_ipython()
    for event, fn in (("pre_run_cell", _before_cell), ("post_run_cell", _after_cell)):
        if fn in ip.events.callbacks[event]:
            ip.events.unregister(event, fn)
    print(json.dumps(_drift))


def controls(model_id: str) -> None:
    """Print, as JSON, the controls inside the widget ``model_id``: description, class, value, label, format."""
    found = []

    def walk(w):
        if _is_control(w):
            found.append({"description": w.description, "type": type(w).__name__, "value": _jsonable(w.value),
                          "label": getattr(w, "label", None), "readout_format": getattr(w, "readout_format", None),
                          "max": _jsonable(getattr(w, "max", None))})
        for child in getattr(w, "children", ()):
            walk(child)

    walk(_instances[model_id])
    print(json.dumps(found))
