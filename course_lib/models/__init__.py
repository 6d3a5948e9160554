"""The models the notebooks train: built from a seed, so every rank can build the same one.

* :mod:`.mlp`: multi-layer perceptrons (one builder, :func:`mlp`), the training notebooks' classifier
  :func:`make_mlp`, and :class:`WithExtras` (a buffer and an unused parameter).
* :mod:`.transformer`: a small GPT-style transformer (:func:`transformer`, :class:`TransformerConfig`), its
  blocks usable alone (:class:`MLP`, :class:`CausalSelfAttention`), and its one-process training
  (:func:`train_reference`), the result every parallel layout must reproduce.
* :mod:`.tiny_lm`: :class:`TinyLM`, tied weights, a frozen parameter and a buffer (notebook 09).
"""
from .mlp import WithExtras, make_mlp, mlp
from .tiny_lm import TinyLM
from .transformer import (
    MLP,
    Block,
    CausalSelfAttention,
    LMTrainConfig,
    Transformer,
    TransformerConfig,
    batch_indices,
    lm_loss,
    make_optimizer,
    train_reference,
    transformer,
)

__all__ = ["mlp", "make_mlp", "WithExtras", "TinyLM", "transformer", "Transformer", "TransformerConfig", "Block", "MLP",
           "CausalSelfAttention", "lm_loss", "LMTrainConfig", "batch_indices", "make_optimizer", "train_reference"]
