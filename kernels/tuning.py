"""Launch-configuration lists shared by the kernels.

On a GPU each kernel autotunes over a short list of Hopper-friendly configurations, after
dropping those whose tiles cannot fit in shared memory for the head dimension at hand; the first
survivor is the default. ``ATTNBENCH_AUTOTUNE=0`` keeps only that default, which the correctness
gate uses so that tens of shapes do not each pay for a tuning sweep. Under the interpreter the
blocks are tiny, so that tiny test shapes still span several blocks and hit every masking path.
"""
import os

import torch
import triton

from . import interpreting
from .gpu_time import gpu_time_quantiles

# Hopper gives a block up to 227 KiB of shared memory; leave room for the compiler's own buffers.
SHARED_MEMORY_BUDGET = 200 * 1024


def autotune_enabled() -> bool:
    return os.environ.get("ATTNBENCH_AUTOTUNE", "1") != "0"


def autotune(configs, key, **options):
    """``triton.autotune`` comparing configs by GPU time (``gpu_time.gpu_time_quantiles``): Triton's
    default bench times through the autotuner's own launcher, whose host time is as long as the
    small kernels it compares (see gpu_time.py), so its picks varied between processes."""
    return triton.autotune(configs, key=key, do_bench=gpu_time_quantiles, **options)


def cfg(num_warps: int, num_stages: int, **blocks) -> triton.Config:
    return triton.Config(dict(blocks), num_warps=num_warps, num_stages=num_stages)


def config_list(gpu_configs, interpreter_config):
    """The configurations a kernel may use on this machine, default first."""
    return [interpreter_config] if interpreting() else list(gpu_configs)


def pruner(shared_bytes, fits=None):
    """An ``early_config_prune`` hook keeping configs whose estimated shared memory fits.

    ``shared_bytes(config, element_size, block_d)`` estimates a config's staged tiles; ``fits(config,
    constexprs)``, when given, is a further test (e.g. registers, for a tile size the launcher picks).
    """

    def prune(configs, named_args, **constexprs):
        if interpreting():
            return configs
        element_size = named_args["Q"].element_size()
        block_d = constexprs["BLOCK_D"]
        fitting = [c for c in configs if shared_bytes(c, element_size, block_d) <= SHARED_MEMORY_BUDGET
                   and (fits is None or fits(c, constexprs))]
        fitting = fitting or configs[-1:]  # the last entry is the smallest: always try it
        return fitting if autotune_enabled() else fitting[:1]

    return prune


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' grids. triton.cdiv and triton.next_power_of_2 are
    constexpr functions in recent Triton: ~5 us a host call (triton 3.9), paid several times per
    launch, which the decode loop's small launches cannot afford."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), on the host."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def seq_bucket(n: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, so odd lengths share a tuning."""
    return next_pow2(max(int(n), 16))


# Under the interpreter the "device" has this many multiprocessors, so that the launchers' occupancy rules
# (split the work when the grid is too small to fill the GPU) are taken by tiny CPU-gate shapes too.
INTERPRETER_SMS = 4
_SM_COUNT = {}


def multiprocessors(device) -> int:
    """Streaming multiprocessors of ``device`` (cached: a property query per launch is host time)."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
