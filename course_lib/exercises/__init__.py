"""Automatic checks for the notebooks' exercises.

A learner's cell starts as a stub that raises ``NotImplementedError``; its check says *not attempted
yet*.  A wrong answer gets a message that names the likely mistake; a right one passes.  The reference
solutions live beside the checks (``ex01.py`` for notebook 01, ...), and the tests prove that each
check passes its reference and fails the known wrong answers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..launch import RankDiedError, RankError, RunTimeoutError, run

NOT_ATTEMPTED, PASSED, WRONG = "not attempted", "passed", "wrong"


@dataclass
class Feedback:
    """The verdict of a check: ``status`` is one of ``not attempted``, ``passed``, ``wrong``."""

    status: str
    message: str

    def __bool__(self) -> bool:
        return self.status == PASSED

    def __repr__(self) -> str:
        mark = {PASSED: "PASSED", WRONG: "NOT YET RIGHT", NOT_ATTEMPTED: "not attempted yet"}[self.status]
        return f"{mark}: {self.message}"


def passed(message: str) -> Feedback:
    return Feedback(PASSED, message)


def wrong(message: str) -> Feedback:
    return Feedback(WRONG, message)


def run_attempt(fn, world_size: int, *args, timeout: float = 20, timeout_hint: str = "",
                error_hints: dict[str, str] | None = None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks: ``(results, None)`` or ``(None, Feedback)``.

    ``fn`` is the learner's worker, or a course worker whose ``args`` carry the learner's function; every
    callable among them must be one (a learner passing ``f()`` instead of ``f`` is told so).
    """
    for f in (fn, *args):
        if not callable(f):
            return None, wrong(f"pass your function itself (without calling it), got {f!r}")
    try:
        # CPU tensors, so Gloo on every machine (NCCL would want them on the GPU)
        return run(fn, world_size, *args, backend="gloo", timeout=timeout, show_output=False), None
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            return None, Feedback(NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code, "
                                                 "then run this cell again")
        hint = next((h for key, h in (error_hints or {}).items() if key in e.exc_message), "")
        return None, wrong(f"on {world_size} ranks, rank {e.rank} raised {e.exc_type}: {e.exc_message}"
                           + (f"\nHint: {hint}" if hint else ""))
    except RunTimeoutError:
        return None, wrong(f"on {world_size} ranks, the ranks did not finish within {timeout:g} s. {timeout_hint}")
    except RankDiedError as e:
        return None, wrong(f"on {world_size} ranks, rank {e.rank} died (exit code {e.exitcode})")


def as_number(value):
    """A one-element tensor, a number or a 1-element list as a float; ``None`` when it is not one."""
    try:
        import torch
        t = torch.as_tensor(value, dtype=torch.float64).flatten()
        return float(t[0]) if t.numel() == 1 else None
    except (TypeError, ValueError, RuntimeError):
        return None
