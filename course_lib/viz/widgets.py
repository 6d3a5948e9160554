"""Interactive explorers.  The logic lives in tested functions; a widget only wires controls to them.

Each explorer keeps what it drew last in ``.state``, so a notebook can drive it in code (set a
control's value, then assert on ``.state``) and no later cell depends on a human moving a slider.

A widget lives in the kernel that drew it: reopen a saved notebook and JupyterLab shows "Error displaying
widget: model not found" until the cell runs again (ipywidgets has no fallback there). Front ends without
widgets (nbconvert, a notebook viewer) show the text of ``Explorer._repr_mimebundle_`` instead, which says so.
"""
from __future__ import annotations

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import display

from ..comm import collectives
from .collectives import draw_collective, draw_ring_state
from .pipeline import draw_pipeline


class Explorer:
    """What every explorer shares: ``self.widget`` is displayed, with a text fallback that says what to do."""

    widget: W.Widget

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (f"{type(self).__name__}: an interactive explorer. It needs the kernel that drew it: "
                                "run this cell in JupyterLab to use it.")
        return bundle


def collective_state(name: str, world_size: int) -> dict:
    """What the explorer shows for ``name`` on ``world_size`` ranks: the reference before and after."""
    if not 1 <= world_size <= 16:
        raise ValueError(f"world_size must be between 1 and 16, got {world_size}")
    before = [collectives.initial(name, r, world_size) for r in range(world_size)]
    return {"name": name, "world_size": world_size, "before": before, "after": collectives.expected(name, before)}


class CollectiveExplorer(Explorer):
    """Pick a collective and a world size; see every rank's data before and after it."""

    def __init__(self, name: str = "all_reduce", world_size: int = 4, max_world_size: int = 8):
        moving = [c for c in collectives.COLLECTIVES if c != "barrier"]  # barrier moves no data
        self.name = W.Dropdown(options=moving, value=name, description="collective")
        self.world_size = W.IntSlider(value=world_size, min=1, max=max_world_size, description="ranks")
        self.out = W.Output()
        self.state: dict = {}
        self.widget = W.VBox([W.HBox([self.name, self.world_size]), self.out])
        self.name.observe(self._redraw, names="value")
        self.world_size.observe(self._redraw, names="value")
        self._redraw()

    def _redraw(self, *_):
        self.state = collective_state(self.name.value, self.world_size.value)
        with self.out:
            self.out.clear_output(wait=True)
            fig = draw_collective(self.name.value, self.state["before"], self.state["after"])
            display(fig)
            plt.close(fig)


class RingStepper(Explorer):
    """Step through the ring all-reduce: world size and step number, drawn by :func:`.collectives.draw_ring_state`."""

    def __init__(self, world_size: int = 4, step: int = 0, max_world_size: int = 8):
        from ..comm.allreduce import ring_state
        self._ring_state = ring_state
        self.world_size = W.IntSlider(value=world_size, min=2, max=max_world_size, description="ranks")
        self.step = W.IntSlider(value=step, min=0, max=2 * (world_size - 1), description="step")
        self.out = W.Output()
        self.state: list = []
        self.widget = W.VBox([W.HBox([self.world_size, self.step]), self.out])
        self.world_size.observe(self._resize, names="value")
        self.step.observe(self._redraw, names="value")
        self._redraw()

    def _resize(self, *_):
        self.step.max = 2 * (self.world_size.value - 1)  # clamps step.value, which redraws if it changed
        self._redraw()

    def _redraw(self, *_):
        self.state = self._ring_state(self.world_size.value, self.step.value)
        with self.out:
            self.out.clear_output(wait=True)
            fig = draw_ring_state(self.world_size.value, self.step.value)
            display(fig)
            plt.close(fig)


class MemoryCalculator(Explorer):
    """Model size, precision, optimizer, device memory, ZeRO stage and number of GPUs in; does it fit on
    each GPU, and what takes the space, out."""

    def __init__(self, billions: float = 7.0, dtype: str = "bf16", optimizer: str = "adam", device_gib: float = 80.0,
                 zero_stage: int = 0, world_size: int = 1):
        from .. import memory
        self._memory = memory
        # A text box, not a slider: a slider shows and sends back only the values on its steps (a log slider with
        # step 0.05 turns 7 into 7.08 as soon as a browser draws it), and a learner wants exactly 7 or 70.
        self.billions = W.BoundedFloatText(value=billions, min=0, max=100_000, step=1, description="params (B)",
                                           tooltip="billions of parameters: type any number, e.g. 7 or 70")
        self.dtype = W.Dropdown(options=list(memory.DTYPE_BYTES), value=dtype, description="precision")
        self.optimizer = W.Dropdown(options=list(memory.OPTIMIZER_STATES), value=optimizer, description="optimizer")
        self.device_gib = W.BoundedFloatText(value=device_gib, min=0, max=100_000, step=8, description="device GiB")
        self.zero_stage = W.Dropdown(options=[("none", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3)],
                                     value=zero_stage, description="sharding")
        counts = sorted({2**k for k in range(13)} | {world_size})          # 1, 2, 4, ... 4096 GPUs
        self.world_size = W.Dropdown(options=counts, value=world_size, description="GPUs")
        self.out = W.HTML()
        self.state: dict = {}
        controls = (self.billions, self.dtype, self.optimizer, self.device_gib, self.zero_stage, self.world_size)
        self.widget = W.VBox([W.HBox(list(controls[:2])), W.HBox(list(controls[2:4])), W.HBox(list(controls[4:])),
                              self.out])
        for c in controls:
            c.observe(self._update, names="value")
        self._update()

    def _update(self, *_):
        m = self._memory
        billions, dtype, optimizer = self.billions.value, self.dtype.value, self.optimizer.value
        parts = m.training_memory(round(billions * 1e9), dtype, optimizer,
                                  zero_stage=self.zero_stage.value, world_size=self.world_size.value)
        ok = m.fits(parts, self.device_gib.value)
        self.state = {"breakdown": parts, "fits": ok}
        rows = "".join(f"<tr><td>{k}</td><td>{m.human(v)}</td></tr>" for k, v in parts.items() if v)
        verdict = "fits" if ok else "does NOT fit"
        stage, gpus = self.zero_stage.value, self.world_size.value
        sharding = f"ZeRO-{stage}" if stage else "not sharded"
        self.out.value = (f"{billions:g} B parameters, {dtype}, {optimizer}; {sharding}, {gpus} GPU{'s' * (gpus != 1)}:"
                          f"<table>{rows}</table><b>{verdict}</b> in {self.device_gib.value:g} GiB per GPU "
                          "(90% usable; activations not included)")


class ScheduleExplorer(Explorer):
    """Pick a schedule, a number of stages and of micro-batches; see who works when, and the bubble."""

    def __init__(self, kind: str = "gpipe", stages: int = 4, micro_batches: int = 8):
        from .. import pipeline_parallel as pipeline
        self._pipeline = pipeline
        self.kind = W.Dropdown(options=list(pipeline.KINDS), value=kind, description="schedule")
        self.stages = W.IntSlider(value=stages, min=1, max=8, description="stages")
        self.micro_batches = W.IntSlider(value=micro_batches, min=1, max=16, description="micro-batches",
                                         style={"description_width": "initial"})   # the default width cuts it
        self.out = W.Output()
        self.state: dict = {}
        self.widget = W.VBox([W.HBox([self.kind, self.stages, self.micro_batches]), self.out])
        for c in (self.kind, self.stages, self.micro_batches):
            c.observe(self._redraw, names="value")
        self._redraw()

    def _redraw(self, *_):
        p = self._pipeline
        k, s, m = self.kind.value, self.stages.value, self.micro_batches.value
        sim = p.simulate(k, s, m)
        self.state = {**sim, "formula": p.bubble_formula(s, m), "peak_in_flight": p.peak_in_flight(k, s, m)}
        with self.out:
            self.out.clear_output(wait=True)
            fig = draw_pipeline(sim["times"], f"{k}: {s} stages, {m} micro-batches, bubble {sim['bubble']:.0%} "
                                    f"(formula {self.state['formula']:.0%}); activations held at most "
                                    f"{self.state['peak_in_flight']}", unit="time (forward = 1, backward = 2)")
            display(fig)
            plt.close(fig)


def layout_state(preset: str, nodes: int, global_batch: int, largest_micro_batch: int = 4, top: int = 8) -> dict:
    """What :class:`LayoutPlanner` shows: the layouts of :func:`course_lib.layout.rank` for the preset model
    (:data:`course_lib.layout.PRESETS`) on ``nodes`` nodes of 8 H100s, ``global_batch`` sequences a step and
    micro-batches of 1, 2, 4... up to ``largest_micro_batch``: ``"rows"`` (the ``top`` fastest that fit),
    ``"fitting"`` (how many fit), ``"layouts"`` (how many were priced), ``"best"`` (the winner's name, ``None``
    when nothing fits) and ``"why"`` (:func:`course_lib.layout.explain` of the winner against the fastest layout of
    other degrees, :func:`course_lib.layout.other_degrees`)."""
    from .. import layout
    if preset not in layout.PRESETS:
        raise ValueError(f"unknown model {preset!r}: pick one of {list(layout.PRESETS)}")
    if nodes < 1 or global_batch < 1 or largest_micro_batch < 1:
        raise ValueError(f"need at least one node, sequence and micro-batch, got {nodes}, {global_batch}, "
                         f"{largest_micro_batch}")
    sizes = tuple(m for m in (1, 2, 4, 8, 16, 32) if m <= largest_micro_batch)
    model, cluster = layout.PRESETS[preset], layout.h100_cluster(nodes)
    every = layout.rank(model, cluster, global_batch, micro_batches=sizes, keep_all=True)
    fitting = [r for r in every if r["fits"]]
    other = layout.other_degrees(fitting) if fitting else None
    why = layout.explain(fitting[0], other) if other is not None else ""
    return {"model": model, "cluster": cluster, "rows": fitting[:top], "fitting": len(fitting),
            "layouts": len(every), "best": fitting[0]["name"] if fitting else None, "why": why,
            "leanest_gib": min((r["gib"] for r in every), default=None)}


class LayoutPlanner(Explorer):
    """The course's layout planner (notebook 17): a model, nodes of 8 H100s, a global batch and the largest
    micro-batch in; the layouts that fit, ranked by predicted step time, with each term and the MFU, out."""

    def __init__(self, preset: str = "llama-3-70b", nodes: int = 8, global_batch: int = 512,
                 largest_micro_batch: int = 4):
        from .. import layout
        self.preset = W.Dropdown(options=list(layout.PRESETS), value=preset, description="model",
                                 layout=W.Layout(width="260px"))
        wide = {"description_width": "initial"}                       # labels shown whole, not cut
        self.nodes = W.BoundedIntText(value=nodes, min=1, max=512, description="nodes of 8 GPUs", style=wide)
        self.batch = W.BoundedIntText(value=global_batch, min=1, max=65_536, description="global batch", style=wide)
        self.micro = W.Dropdown(options=[1, 2, 4, 8], value=largest_micro_batch, description="largest micro-batch",
                                style=wide)
        self.out = W.HTML()
        self.state: dict = {}
        controls = (self.preset, self.nodes, self.batch, self.micro)
        self.widget = W.VBox([W.HBox(list(controls[:2])), W.HBox(list(controls[2:])), self.out])
        for c in controls:
            c.observe(self._update, names="value")
        self._update()

    def _update(self, *_):
        from ..layout.ranking import COLUMNS
        try:
            self.state = layout_state(self.preset.value, self.nodes.value, self.batch.value, self.micro.value)
        except ValueError as e:                   # e.g. a batch that no layout divides
            self.state, self.out.value = {"error": str(e), "best": None}, f"<b>{e}</b>"
            return
        s = self.state
        n = s["model"].params()
        size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
        inputs = (f"{s['model'].name}, {size} parameters, on {s['cluster'].name}; "
                  f"{self.batch.value} sequences of {s['model'].seq} a step, micro-batches up to {self.micro.value}: "
                  f"{s['fitting']} of {s['layouts']} layouts fit")
        if s["best"] is None:
            lean = "" if s["leanest_gib"] is None else f" (the leanest needs {s['leanest_gib']:.0f} GiB a GPU)"
            self.out.value = (f"{inputs}. <b>nothing fits</b>{lean}: more nodes, or a batch with more divisors")
            return
        head = "<tr><th>layout</th><th>GiB</th>" + "".join(f"<th>{c} s</th>" for c in COLUMNS) + \
               "<th>step s</th><th>MFU</th></tr>"
        body = "".join(f"<tr><td>{r['name']}</td><td>{r['gib']:.1f}</td>"
                       + "".join(f"<td>{sum(r['time'][t] for t in terms):.3f}</td>" for terms in COLUMNS.values())
                       + f"<td>{r['time']['step']:.3f}</td><td>{r['time']['mfu']:.0%}</td></tr>" for r in s["rows"])
        self.out.value = f"{inputs}. Fastest: <b>{s['best']}</b>. {s['why']}<table>{head}{body}</table>"
