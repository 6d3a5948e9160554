"""The course's colours: one per rank (so data that moves keeps its colour), grey for a computed value."""
from __future__ import annotations

import matplotlib.pyplot as plt

REDUCED = "#bbbbbb"


def rank_color(rank: int):
    """Rank ``rank``'s colour, the same in every picture of the course."""
    return plt.get_cmap("tab10")(rank % 10)
