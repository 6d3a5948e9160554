"""How a failed run is reported: the exceptions :func:`course_lib.launch.run` raises, and a rank's traceback
rendered so that it points at the notebook cell the failing function came from.
"""
from __future__ import annotations

import linecache
import os
import signal

from . import worker

PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class LaunchError(RuntimeError):
    """A run on N ranks failed. ``outputs`` holds each rank's captured output."""

    def __init__(self, message: str, outputs: list[str] | None = None):
        super().__init__(message)
        self.outputs = outputs or []


class RankError(LaunchError):
    """A rank raised an exception: ``rank``, ``exc_type`` (its class name), ``exc_message``, ``remote_traceback``."""

    def __init__(self, rank, world_size, exc_type, exc_message, remote_traceback, outputs=None):
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.remote_traceback = remote_traceback
        hint = ""
        if any(s in exc_message for s in PEER_GONE):
            hint = ("\nHint: another rank exited or crashed while this one waited for it in a collective or a "
                    "send/recv. Every rank must call the same collectives, in the same order.")
        super().__init__(f"rank {rank} of {world_size} raised {exc_type}: {exc_message}{hint}\n\n"
                         f"Traceback from rank {rank}:\n{remote_traceback}", outputs)


class RankDiedError(LaunchError):
    """A rank's process ended without returning (killed, ``os._exit``, a crash): ``rank``, ``exitcode``."""

    def __init__(self, rank, world_size, exitcode, outputs=None):
        self.rank, self.exitcode = rank, exitcode
        how = f"exit code {exitcode}"
        if exitcode is not None and exitcode < 0:
            how = f"signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        super().__init__(f"rank {rank} of {world_size} died with {how} before returning a result; "
                         "the other ranks were stopped", outputs)


class RunTimeoutError(LaunchError, TimeoutError):
    """The run took longer than ``timeout``; ``pending`` lists the ranks that had not finished."""

    def __init__(self, timeout, pending, world_size, outputs=None):
        self.pending = pending
        super().__init__(
            f"ranks {pending} of {world_size} had not finished after {timeout:g} s and were stopped. A common cause "
            "is a collective that only some ranks call: the others wait for it forever. Each rank's stack at "
            "the moment it was stopped is printed above.", outputs)


def _code_files(fn) -> dict[str, str]:
    """Function name -> source file, for the code cloudpickle sends by value.

    cloudpickle renames the file of such code ``<dynamic-code>``; this index lets a rank's traceback
    point back at the notebook cell (whose lines this kernel keeps in ``linecache``)."""
    files, todo, seen = {}, [fn], set()
    while todo:
        obj = todo.pop()
        code = getattr(obj, "__code__", obj)
        if not hasattr(code, "co_filename") or id(code) in seen:
            continue
        seen.add(id(code))
        files.setdefault(code.co_name, code.co_filename)
        todo.extend(c for c in code.co_consts if hasattr(c, "co_filename"))
        if hasattr(obj, "__globals__"):  # helpers the function calls, defined beside it
            todo.extend(obj.__globals__.get(n) for n in code.co_names
                        if getattr(obj.__globals__.get(n), "__module__", None) == obj.__module__)
    return files


def remote_traceback(frames, text: str, fn=None) -> str:
    """Re-render a rank's traceback from the user's function down, with source lines from this kernel."""
    if not frames:
        return text
    files = _code_files(fn) if fn is not None else {}
    worker_file = os.path.normcase(worker.__file__)
    while len(frames) > 1 and os.path.normcase(frames[0][0]) == worker_file:
        frames = frames[1:]  # the launcher's own frame tells the reader nothing
    lines = ["Traceback (most recent call last):"]
    for filename, lineno, name, line in frames:
        if filename == "<dynamic-code>":
            filename = files.get(name, filename)
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        line = line or linecache.getline(filename, lineno).strip()
        if line:
            lines.append(f"    {line}")
    lines.append(text.rstrip().splitlines()[-1] if text.strip() else "")
    return "\n".join(lines)
