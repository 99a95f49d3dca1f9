"""How many chunks (splits) the context is cut into: the heuristic, the measured pick, its cache.

When the row tiles times KV heads cannot fill the GPU (decode with a small batch), the
context is cut into NUM_SPLITS chunks, one program per (row tile, chunk, KV head), and sample b's
buffer goes to chunk b % NUM_SPLITS; each program's partial state is merged exactly
(``merge_states``), flash-decoding style. How many is measured, not guessed: the fastest count
depends on more than the row tiles (the buffer's bytes, how programs fall into waves, the merge's
partial-state traffic): the count ``choose_splits`` (~2 programs per SM) picks is the fastest
at some decode shapes and far from it at others (docs/measurements/shared_context.md). So on
CUDA the first call for a key times the launch at ``split_candidates`` (the heuristic's count and
1, 2, 4, 8) and remembers the fastest (``pick_splits``; ``forget_split_picks`` forgets), as Triton's
autotuner does for tile configs. ``choose_splits`` alone decides where nothing can be timed: the
interpreter, ATTNBENCH_AUTOTUNE=0, and CUDA-graph capture or torch.compile tracing (these two reuse
a pick already measured, so a captured graph splits like the eager calls before it). An explicit
``num_splits`` always wins.
"""
import math

import torch

from .. import interpreting
from ..gpu_time import gpu_time_median_ms
from ..launch import on_device
from ..tuning import autotune_enabled, cdiv, multiprocessors

# Split-K sizing: aim at about two programs per SM, with at least this many keys per split (a
# split must amortize writing and merging its partial state).
NOMINAL_BLOCK_M = 64
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


def _split_cap(n_keys: int, device) -> int:
    """The most chunks with MIN_KEYS_PER_SPLIT keys each (16 under the interpreter), at most MAX_SPLITS."""
    min_keys = 16 if torch.device(device).type == "cpu" else MIN_KEYS_PER_SPLIT
    return max(1, min(n_keys // min_keys, MAX_SPLITS))


def choose_splits(rows_per_head: int, heads_kv: int, n_keys: int, device) -> int:
    """How many chunks to cut the keys into, by heuristic: enough programs for ~2 per SM, within
    ``_split_cap``."""
    sms = multiprocessors(device)
    programs = cdiv(rows_per_head, NOMINAL_BLOCK_M) * heads_kv
    if programs >= sms:
        return 1
    return min(cdiv(2 * sms, programs), _split_cap(n_keys, device))


SPLIT_CANDIDATES = (1, 2, 4, 8)


def split_candidates(rows_per_head: int, heads_kv: int, n_keys: int, device) -> list:
    """The counts a measured pick times: the heuristic's and SPLIT_CANDIDATES, capped like it."""
    cap = _split_cap(n_keys, device)
    heuristic = choose_splits(rows_per_head, heads_kv, n_keys, device)
    return sorted({min(splits, cap) for splits in (heuristic, *SPLIT_CANDIDATES)})


_SPLIT_PICKS = {}


def forget_split_picks():
    """Forget the measured split counts."""
    _SPLIT_PICKS.clear()


def time_ms(fn) -> float:
    """Median GPU time of fn() in ms (host time kept out: gpu_time.py); a module-level hook so that
    tests can time without a GPU."""
    return gpu_time_median_ms(fn)


# Rounds of timing per candidate, interleaved, each candidate's best kept: a guard against a pick
# that flips between processes (host time in the samples flips it, which launchers._repeatable and
# time_ms keep out), costing one more timing per candidate.
PICK_ROUNDS = 2


def pick_splits(key, candidates, runner) -> int:
    """The fastest candidate count for key, timed on first use and then remembered. runner(splits)
    allocates that count's own outputs and returns the launch that writes them (the call to time;
    its first run autotunes the tile config, inside do_bench's warm-up). Ties go to fewer splits."""
    if key not in _SPLIT_PICKS:
        launches = {splits: runner(splits) for splits in candidates}
        times = {splits: math.inf for splits in candidates}
        for _ in range(PICK_ROUNDS):
            for splits in candidates:
                times[splits] = min(times[splits], time_ms(launches[splits]))
        _SPLIT_PICKS[key] = min(candidates, key=times.__getitem__)
    return _SPLIT_PICKS[key]


def _measured_splits_enabled(device) -> bool:
    """Split counts are measured only for compiled kernels on CUDA, with autotuning on (the
    correctness gate turns it off to keep one deterministic launch per shape)."""
    return device.type == "cuda" and not interpreting() and autotune_enabled()


def _split_count(kernel, num_splits, rows, heads_kv, n_keys, q, tune_key, runner) -> int:
    """An explicit count; else, on CUDA, the measured pick; else the heuristic's."""
    if num_splits:
        return num_splits
    heuristic = choose_splits(rows, heads_kv, n_keys, q.device)
    if not _measured_splits_enabled(q.device):
        return heuristic
    key = (kernel, *tune_key, heads_kv, q.dtype, q.device.index)
    cap = _split_cap(n_keys, q.device)  # a shape may allow fewer splits than the one timed for its key
    if key in _SPLIT_PICKS:  # the decode loop's every call after the first: no device switch, no candidate list
        return min(_SPLIT_PICKS[key], cap)
    with on_device(q):  # q's stream is the one that may be capturing, and the one to time on
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return min(_SPLIT_PICKS.get(key, heuristic), cap)  # nothing may be timed here
        candidates = split_candidates(rows, heads_kv, n_keys, q.device)
        if len(candidates) == 1:
            return heuristic
        return min(pick_splits(key, candidates, runner), cap)
