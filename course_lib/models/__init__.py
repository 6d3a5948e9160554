"""The models the notebooks train: built from a seed, so every rank can build the same one.

* :mod:`.mlp`: multi-layer perceptrons (one builder, :func:`mlp`), the training notebooks' classifier
  :func:`make_mlp`, and :class:`WithExtras` (a buffer and an unused parameter).
"""
from .mlp import WithExtras, make_mlp, mlp

__all__ = ["mlp", "make_mlp", "WithExtras"]
