"""Launching ranks: a function on N processes from a notebook cell, or a script under ``torchrun``.

* :mod:`.runner`: the notebook's side. :func:`run` starts the ranks, hosts the rendezvous store, relays
  each rank's output in rank order and turns failures into exceptions.
* :mod:`.processes`: the rank processes, started from a forkserver that imported torch once, and killed.
* :mod:`.worker`: the rank's side, what each process does (what ``torchrun`` does for every worker).
* :mod:`.errors`: the exceptions :func:`run` raises, and a rank's traceback pointed back at the cell.
* :mod:`.commands`: commands and ``torchrun`` jobs from a cell that fail the cell when they fail.
* :mod:`.slurm`: a SLURM batch job from a cell (submit, wait, its output), that fails the cell when it fails.

``from course_lib.launch import run`` is all most notebooks need.
"""
from .errors import LaunchError, RankDiedError, RankError, RunTimeoutError
from .runner import DEFAULT_TIMEOUT, HOST, free_port, print_outputs, run

__all__ = ["run", "free_port", "print_outputs", "DEFAULT_TIMEOUT", "HOST",
           "LaunchError", "RankError", "RankDiedError", "RunTimeoutError"]
