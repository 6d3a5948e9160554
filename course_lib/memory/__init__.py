"""How much memory training needs, predicted and measured (notebooks 05, 08 and 10).

* :mod:`.arithmetic`: bytes of weights, gradients, optimizer states and activations per parameter, and
  what a model and its optimizer really hold.
* :mod:`.saved`: the activations a forward pass keeps for its backward, measured through autograd's hooks.
"""
from .arithmetic import (
                         DTYPE_BYTES,
                         OPTIMIZER_STATES,
                         fits,
                         human,
                         measured_state_bytes,
                         mlp_activation_bytes,
                         training_memory,
)
from .saved import Saved, saved_bytes, saved_tensors

__all__ = ["DTYPE_BYTES", "OPTIMIZER_STATES", "training_memory", "fits", "mlp_activation_bytes",
           "measured_state_bytes", "human", "Saved", "saved_tensors", "saved_bytes"]
