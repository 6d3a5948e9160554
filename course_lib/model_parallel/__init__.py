"""Model parallelism in one process: a model's layers split across devices (notebook 06).

* :mod:`.split`: :func:`split_model` cuts an ``nn.Sequential`` across ``cuda:0``/``cuda:1`` (mapped onto
  the devices that exist), :class:`PipelinedSplit` adds micro-batches, and a CUDA-event timeline shows
  who worked when (:func:`timed_forward`: the timeline, the wall time, and how long the host took to issue
  the work).
"""
from .split import PipelinedSplit, SplitModel, overlapped, same_outputs_and_grads, split_model, timed_forward

__all__ = ["split_model", "SplitModel", "PipelinedSplit", "timed_forward", "overlapped", "same_outputs_and_grads"]
