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


def layout_state(preset: str, seq: int, batch: int, gpus: int, gib_per_gpu: float, dtype: str = "bf16") -> dict:
    """What :class:`LayoutPlanner` shows: every layout of :func:`course_lib.memory.planner.plan` for the preset
    model, the ones that fit, and the cheapest that fits (``None`` when none does)."""
    from ..memory import planner
    if preset not in planner.PRESETS:
        raise ValueError(f"unknown model {preset!r}: pick one of {list(planner.PRESETS)}")
    cfg = planner.PRESETS[preset]
    rows = planner.plan(cfg, seq, batch, gpus, gib_per_gpu, dtype)
    fitting = [r for r in rows if r["fits"]]
    return {"params": planner.param_count(cfg), "rows": rows, "fitting": fitting,
            "best": planner.layout_name(fitting[0]) if fitting else None}


class LayoutPlanner(Explorer):
    """The capstone calculator (notebook 14): a model, a sequence length, a micro-batch per GPU, a number of GPUs
    and their memory in; which layouts fit, at what memory, traffic and extra compute, out."""

    def __init__(self, preset: str = "6.7 B (32 x 4096)", seq: int = 2048, batch: int = 1, gpus: int = 8,
                 gib_per_gpu: float = 80.0, dtype: str = "bf16"):
        from ..memory import planner
        self.preset = W.Dropdown(options=list(planner.PRESETS), value=preset, description="model",
                                 layout=W.Layout(width="320px"))
        self._presets = planner.PRESETS
        self.seq = W.BoundedIntText(value=seq, min=1, max=planner.PRESETS[preset].seq_len, description="sequence")
        self.batch = W.BoundedIntText(value=batch, min=1, max=100_000, description="micro-batch")
        self.gpus = W.BoundedIntText(value=gpus, min=1, max=1_000_000, description="GPUs")
        self.gib = W.BoundedFloatText(value=gib_per_gpu, min=1, max=100_000, step=8, description="GiB per GPU")
        self.dtype = W.Dropdown(options=["bf16", "fp16", "fp32"], value=dtype, description="precision")
        self.out = W.HTML()
        self.state: dict = {}
        controls = (self.preset, self.seq, self.batch, self.gpus, self.gib, self.dtype)
        self.widget = W.VBox([W.HBox(list(controls[:3])), W.HBox(list(controls[3:])), self.out])
        self.preset.observe(self._bound_sequence, names="value")   # first: a shorter model clamps the sequence
        for c in controls:
            c.observe(self._update, names="value")
        self._update()

    def _bound_sequence(self, *_):
        """The sequence box goes no further than the chosen model's positions (it clamps a longer value)."""
        self.seq.max = self._presets[self.preset.value].seq_len

    def _update(self, *_):
        from ..memory.planner import layout_name
        try:
            self.state = layout_state(self.preset.value, self.seq.value, self.batch.value, self.gpus.value,
                                      self.gib.value, self.dtype.value)
        except ValueError as e:                   # e.g. a sequence longer than the model's positions
            self.state, self.out.value = {"error": str(e)}, f"<b>{e}</b>"
            return
        from ..memory import human
        head = "<tr><th>layout</th><th>memory per GPU</th><th>fits</th><th>sent per step per GPU (data / tensor)</th>" \
               "<th>extra compute</th></tr>"
        rows = "".join(f"<tr><td>{layout_name(r)}</td><td>{human(r['gib'] * 2**30)}</td>"
                       f"<td>{'yes' if r['fits'] else 'no'}</td><td>{human(r['data_gb'] * 1e9)} / "
                       f"{human(r['tensor_gb'] * 1e9)}</td><td>{r['extra_compute']:.0%}</td></tr>"
                       for r in self.state["rows"])
        best = self.state["best"] or "nothing fits: more GPUs, a shorter sequence or a smaller micro-batch"
        params = self.state["params"]
        size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
        inputs = (f"{size} parameters, sequence {self.seq.value}, micro-batch {self.batch.value}, "
                  f"{self.dtype.value}, on {self.gpus.value} GPUs of {self.gib.value:g} GiB")   # what it computed for
        self.out.value = f"{inputs}. Cheapest that fits: <b>{best}</b><table>{head}{rows}</table>"
