"""Presentation: the pictures, the interactive explorers and the source listings the notebooks show.

* :mod:`.collectives`: what ranks hold before and after a collective; the ring's steps; all-reduce sweeps.
* :mod:`.costs`: the α-β model next to measured all-reduce times.
* :mod:`.training`: how a sampler shards the data, bucket timelines, overlap, torchrun's ranks, loss curves.
* :mod:`.pipeline`: Gantt charts of pipeline schedules, simulated or measured.
* :mod:`.tensor_parallel`: matrices split by columns and rows, DTensor placements, who holds what on a mesh.
* :mod:`.sharding`: ZeRO's stages: which rank holds which shard, before and after each collective.
* :mod:`.widgets`: explorers (ipywidgets) wired to tested pure functions; each keeps ``.state``.
* :mod:`.source`: :func:`show_source`, the real code of what a notebook runs.
* :mod:`.style`: one colour per rank.

``from course_lib import viz`` gives every drawing function and ``show_source``.
"""
from .collectives import (
                          collective_texts,
                          draw_barrier,
                          draw_collective,
                          draw_hierarchical_all_reduce,
                          draw_rendezvous,
                          draw_ring_state,
                          hierarchical_state,
                          owner,
                          plot_all_reduce_sweep,
                          plot_flat_vs_two_level,
)
from .pipeline import draw_pipeline
from .sharding import draw_zero_step, zero_step_states
from .source import show_source
from .style import rank_color
from .tensor_parallel import draw_holdings, draw_local_parts, draw_matmul_split, holders
from .training import (
                          draw_bucket_timeline,
                          draw_epoch_orders,
                          draw_overlap,
                          draw_sampler,
                          draw_torchrun,
                          overlap_schedule,
                          plot_losses,
)

__all__ = ["draw_collective", "collective_texts", "draw_barrier", "draw_ring_state", "plot_all_reduce_sweep",
           "draw_hierarchical_all_reduce", "hierarchical_state", "plot_flat_vs_two_level", "draw_rendezvous",
           "owner", "draw_pipeline", "draw_sampler", "draw_epoch_orders", "draw_bucket_timeline", "plot_losses",
           "draw_overlap", "overlap_schedule", "draw_torchrun",
           "show_source", "rank_color", "draw_matmul_split", "draw_local_parts", "draw_holdings", "holders",
           "draw_zero_step", "zero_step_states"]
