"""Data for the training notebooks: generated on the spot, so nothing is downloaded.

* :func:`make_dataset`: points to classify, for the MLPs.
* :func:`make_token_dataset`: token sequences that repeat a pattern, for the small transformer.

The classification data set is a clear-structured classification problem: each class is a cloud of points around
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


def make_token_dataset(n: int = 512, seq_len: int = 32, vocab: int = 32, periods: tuple[int, int] = (2, 6),
                       seed: int = 0) -> TensorDataset:
    """``n`` token sequences for a language model: ``(inputs, targets)``, targets = inputs shifted by one.

    Each sequence repeats a random pattern of ``p`` tokens (``p`` drawn from ``periods``, both ends
    included), e.g. ``7 19 3 7 19 3 7 ...``. The first ``p`` tokens cannot be predicted; every later one is
    the token ``p`` places back, which a model learns by attending to earlier positions: a task a small
    transformer learns in a few hundred CPU steps, its loss falling from ``ln(vocab)`` towards zero.
    """
    lo, hi = periods
    if n < 1 or seq_len < 2 or vocab < 2 or not 1 <= lo <= hi:
        raise ValueError(f"need n >= 1, seq_len >= 2, vocab >= 2 and 1 <= periods[0] <= periods[1], "
                         f"got n={n}, seq_len={seq_len}, vocab={vocab}, periods={periods}")
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(lo, hi + 1, (n, 1), generator=g)
    patterns = torch.randint(vocab, (n, hi), generator=g)
    position = torch.arange(seq_len + 1).expand(n, -1)
    tokens = patterns.gather(1, position % p)       # token t is the pattern's token t mod p
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
