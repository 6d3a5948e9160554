"""The α-β model next to measured all-reduce times (notebook 02)."""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..comm import costmodel


def plot_model_fit(sizes, measured: dict, world_size: int, fit: dict, names=("ring", "recursive doubling")):
    """Log-log plot of ``measured[name]`` (seconds per size) as points and the model's prediction with
    ``fit["alpha"]`` and ``fit["beta"]`` as lines, one colour per algorithm of ``names``."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, name in enumerate(names):
        ax.loglog(sizes, measured[name], "o", color=f"C{k}", label=f"{name}, measured")
        ax.loglog(sizes, costmodel.predict(name, sizes, world_size, fit["alpha"], fit["beta"]), "-",
                  color=f"C{k}", label=f"{name}, α-β model (fitted on the ring)")
    ax.set(xlabel="message size (bytes)", ylabel="seconds",
           title=f"{world_size} ranks: measurements and the fitted model")
    ax.legend(fontsize=8, loc="upper left")
    return fig
