"""Shared-context attention: one context K/V for the whole batch, per-sample buffers, exact merge.

The modules, from the device code up:

- ``packed_rows``: the batch's query rows packed per KV head, and how a row's state is written;
- ``buffer_phase``: each sample's rows against its own buffer keys, and the step geometry for it;
- ``context_phase``: a tile's rows over (a split's chunk of) the shared context;
- ``kernels``: the fused, context and buffer kernels, their configurations and autotuners;
- ``split_count``: how many chunks the context is cut into (heuristic, measured pick, picks cache);
- ``scratch``: the fused kernel's buffer states, split partials and merge tickets;
- ``launchers``: the launches (fused, context, buffer, composed) and the plans that repeat them.
"""
from .. import interpreting
from ..tuning import multiprocessors
from .buffer_phase import buffer_rows, buffer_steps
from .kernels import FUSED, _head_dim_class, autotuners
from .launchers import buffer_launch, clear_split_picks, composed_launch, context_launch, fused_launch
from .scratch import _COUNTERS
from .split_count import (PICK_ROUNDS, _SPLIT_PICKS, _measured_splits_enabled, _split_count, choose_splits,
                          pick_splits, split_candidates)

__all__ = ["autotuners", "buffer_rows", "buffer_steps", "buffer_launch", "choose_splits", "clear_split_picks",
           "composed_launch", "context_launch", "fused_launch", "interpreting", "multiprocessors", "pick_splits",
           "split_candidates"]
