"""Show the real source of course_lib code in a notebook: what you read is what runs and is tested."""
from __future__ import annotations

import inspect


def show_source(*objects) -> None:
    """Display the source of functions, classes or modules, highlighted (plain text outside Jupyter)."""
    from IPython.display import Code, display
    for obj in objects:
        display(Code(inspect.getsource(obj), language="python"))
