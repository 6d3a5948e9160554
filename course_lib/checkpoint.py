"""Checkpoints that survive: written atomically, by one rank, loaded safely on every rank.

A checkpoint written in place (``torch.save(obj, "ckpt.pt")``) that is interrupted — the job is killed,
the disk fills — leaves a truncated file where the last good checkpoint was.  :func:`save_atomic`
writes to a temporary file in the same directory, flushes it to disk, and only then renames it over
the old one: a rename within one filesystem is atomic, so a reader sees the old checkpoint or the new
one, never half of one.

Also: :func:`fingerprint`, a short hash of a model's weights (two runs that print the same one ended with
identical weights), and :func:`why_unusable`, why a checkpoint cannot be resumed from, in words.
"""
from __future__ import annotations

import glob
import hashlib
import os
import pickle
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


def fingerprint(state: dict) -> str:
    """A short hash of the weights: two runs with the same fingerprint ended with identical weights."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def why_unusable(e: Exception) -> str:
    """Why a checkpoint cannot be resumed from (damaged, not tensors, missing an entry, or another model's
    weights), in words, from the exception loading it raised: for an error that says what to do."""
    text = str(e)
    mismatch = [line.strip() for line in text.splitlines() if "size mismatch" in line or "Missing key" in line]
    if mismatch:
        return "another model's weights (" + mismatch[0].rstrip(".") + ")"
    if "Weights only load failed" in text or isinstance(e, (EOFError, pickle.UnpicklingError)) or "zip archive" in text:
        return "the file is damaged or is not a torch.save file of tensors"
    if isinstance(e, KeyError):
        return f"it has no {e.args[0]} entry"
    return f"{type(e).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
