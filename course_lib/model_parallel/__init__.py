"""Model parallelism in one process: a model's layers split across devices (notebook 05).

* :mod:`.split`: :func:`split_model` cuts an ``nn.Sequential`` across ``cuda:0``/``cuda:1`` (mapped onto
  the devices that exist), :class:`PipelinedSplit` adds micro-batches, and a CUDA-event timeline shows
  who worked when.
"""
from .split import PipelinedSplit, SplitModel, same_outputs_and_grads, split_model

__all__ = ["split_model", "SplitModel", "PipelinedSplit", "same_outputs_and_grads"]
