"""Checkpoints that survive: written atomically, by one rank, loaded safely on every rank.

A checkpoint written in place (``torch.save(obj, "ckpt.pt")``) that is interrupted — the job is killed,
the disk fills — leaves a truncated file where the last good checkpoint was.  :func:`save_atomic`
writes to a temporary file in the same directory, flushes it to disk, and only then renames it over
the old one: a rename within one filesystem is atomic, so a reader sees the old checkpoint or the new
one, never half of one.
"""
from __future__ import annotations

import glob
import os
import tempfile

import torch


def save_atomic(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, all or nothing."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=directory)
    try:
        os.chmod(tmp, 0o644)               # mkstemp's 0600 would hide the checkpoint from other users
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())           # the bytes are on disk before the name points at them
        os.replace(tmp, path)              # atomic: the old file or the new one, never a mix
        _remove_stale(directory, os.path.basename(path))
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:                                   # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _remove_stale(directory: str, name: str) -> None:
    """Temporary files left by earlier writers that were killed mid-save (one writer per path)."""
    for leftover in glob.glob(os.path.join(glob.escape(directory), glob.escape(".tmp-" + name + "-") + "*")):
        try:
            os.unlink(leftover)
        except FileNotFoundError:
            pass


def load(path: str | os.PathLike, map_location=None):
    """Load a checkpoint of tensors and plain values only (``weights_only=True``: no code runs)."""
    return torch.load(path, map_location=map_location, weights_only=True)
