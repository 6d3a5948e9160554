"""Data for the training notebooks: generated on the spot, so nothing is downloaded.

The data set is a clear-structured classification problem: each class is a cloud of points around
its own centre in ``dim`` dimensions, the clouds overlapping enough that a model needs many steps to
separate them.  A small MLP (:func:`course_lib.models.make_mlp`) learns it in seconds on a CPU, and its
loss falls visibly.
"""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def make_dataset(n: int = 2048, dim: int = 16, classes: int = 4, noise: float = 1.5, seed: int = 0) -> TensorDataset:
    """``n`` points in ``dim`` dimensions, ``classes`` Gaussian clouds; the same for the same ``seed``."""
    if n < 1 or dim < 1 or classes < 2:
        raise ValueError(f"need n >= 1, dim >= 1 and classes >= 2, got n={n}, dim={dim}, classes={classes}")
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 1.5
    labels = torch.randint(classes, (n,), generator=g)
    points = centres[labels] + noise * torch.randn(n, dim, generator=g)
    return TensorDataset(points, labels)
