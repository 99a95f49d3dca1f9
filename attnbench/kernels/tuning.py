"""Launch-configuration lists shared by the kernels.

On a GPU each kernel autotunes over a short list of Hopper-friendly configurations, after
dropping those whose tiles cannot fit in shared memory for the head dimension at hand; the first
survivor is the default. ``ATTNBENCH_AUTOTUNE=0`` keeps only that default, which the correctness
gate uses so that tens of shapes do not each pay for a tuning sweep. Under the interpreter the
blocks are tiny, so that tiny test shapes still span several blocks and hit every masking path.
"""

import torch
import triton

from . import env_value, interpreting
from .gpu_time import gpu_time_quantiles

# A block's shared memory when the device cannot be asked.
SHARED_MEMORY_BUDGET = 200 * 1024
# Room left for the compiler's own buffers (barriers, scratch): what the flash backward's compiled
# kernels need beyond the staged tiles that the kernels' estimates count fits in it
# (docs/measurements/flash.md).
COMPILER_SHARED_BYTES = 2 * 1024
# fp32 accumulator registers a thread may hold before the rest of a tile's state spills (255 in all);
# a kernel whose measurements put its limit elsewhere keeps its own (flash_bwd.py).
ACCUMULATOR_REGISTERS = 128


def autotune_enabled() -> bool:
    return env_value("ATTNBENCH_AUTOTUNE", "1") != "0"


def autotune(configs, key, **options):
    """``triton.autotune`` comparing configs by GPU time (``gpu_time.gpu_time_quantiles``): Triton's
    default bench times through the autotuner's own launcher, whose host time is as long as the
    small kernels it compares (see gpu_time.py), so its picks varied between processes."""
    return triton.autotune(configs, key=key, do_bench=gpu_time_quantiles, **options)


def cfg(num_warps: int, num_stages: int, **blocks) -> triton.Config:
    return triton.Config(dict(blocks), num_warps=num_warps, num_stages=num_stages)


def configs(blocks: str, *rows) -> list:
    """A table of configurations: each row (num_warps, num_stages, then one size per name in ``blocks``)."""
    names = blocks.split()
    return [cfg(warps, stages, **dict(zip(names, sizes))) for warps, stages, *sizes in rows]


def config_list(gpu_configs, interpreter_config):
    """The configurations a kernel may use on this machine, default first."""
    return [interpreter_config] if interpreting() else list(gpu_configs)


def pruner(shared_bytes, fits=None, more_shared=None):
    """An ``early_config_prune`` hook keeping configs whose estimated shared memory fits.

    ``shared_bytes(config, element_size, block_d)`` estimates a config's staged tiles; ``more_shared(config,
    constexprs)``, when given, adds what a specialization stages besides; ``fits(config, constexprs)``, when
    given, is a further test (e.g. registers, for a tile size the launcher picks).
    """

    def prune(configs, named_args, **constexprs):
        if interpreting():
            return configs
        element_size = named_args["Q"].element_size()
        block_d = head_width(constexprs)
        budget = shared_memory_budget(named_args["Q"].device)
        staged = [shared_bytes(c, element_size, block_d) + (more_shared(c, constexprs) if more_shared else 0)
                  for c in configs]
        fitting = [c for c, size in zip(configs, staged) if size <= budget and (fits is None or fits(c, constexprs))]
        if not fitting:  # nothing fits the estimates: the config staging the least (the later on a tie)
            fitting = [configs[min(range(len(configs)), key=lambda i: (staged[i], -i))]]
        return fitting if autotune_enabled() else fitting[:1]

    return prune


def tile_pruner(limits: dict, smallest: int = 16, fits=None):
    """An ``early_config_prune`` hook keeping the configs whose tiles fit the launch: ``limits`` maps a tile's
    constexpr to the size argument it covers ({"BLOCK_K": "K"}), and a tile may be as large as that size's power of
    two (at least ``smallest``: tl.dot wants 16). Where none fits, the config of the smallest tiles stays.
    ``fits(config, constexprs)``, when given, is a further test (e.g. registers), the first tile-fitting config
    staying where none passes it. ATTNBENCH_AUTOTUNE=0 keeps the first survivor."""

    def prune(configs, named_args, **constexprs):
        if interpreting():
            return configs
        caps = {block: max(smallest, next_pow2(named_args[size])) for block, size in limits.items()}
        kept = [c for c in configs if all(c.kwargs[block] <= cap for block, cap in caps.items())]
        kept = kept or [min(configs, key=lambda c: tuple(c.kwargs[block] for block in limits))]
        if fits is not None:
            kept = [c for c in kept if fits(c, constexprs)] or kept[:1]
        return kept if autotune_enabled() else kept[:1]

    return prune


def head_width(constexprs) -> int:
    """The padded head dim a launch tiles: its one or two column blocks (head_dim_blocks)."""
    return constexprs["BLOCK_D"] + constexprs.get("BLOCK_D2", 0)


def registers_per_thread(elements: int, num_warps: int, itemsize: int = 4) -> float:
    """32-bit registers a thread holds for ``elements`` values of ``itemsize`` bytes spread over a
    program's threads (an accumulator tile's share)."""
    return elements * itemsize / 4 / (32 * num_warps)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' grids. triton.cdiv and triton.next_power_of_2 are
    constexpr functions in recent Triton, microseconds of host time a call, paid several times per
    launch, which the decode loop's small launches cannot afford (docs/measurements/shared_context.md)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), on the host."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def head_dim_blocks(head_dim: int) -> tuple:
    """(BLOCK_D, BLOCK_D2): the power-of-two column blocks a kernel tiles the head dimension with.
    A power of two is one block (BLOCK_D2 = 0); otherwise the largest power of two below it and the
    rest rounded up, when that is narrower than the next power of two: 80 = 64 + 16, 96 = 64 + 32,
    160 = 128 + 32, 192 = 128 + 64, so the matmuls cost in proportion to D, not to 128 or 256.
    Blocks are at least 16 wide (tl.dot's minimum): 24 stays one block of 32."""
    whole = max(16, next_pow2(head_dim))
    first = max(16, whole // 2)
    second = max(16, next_pow2(head_dim - first)) if head_dim > first else 0
    if second == 0 or first + second >= whole:
        return whole, 0
    return first, second


def seq_bucket(n: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, so odd lengths share a tuning."""
    return next_pow2(max(int(n), 16))


# Under the interpreter the "device" has this many multiprocessors, so that the launchers' occupancy rules
# (split the work when the grid is too small to fill the GPU) are taken by tiny CPU-gate shapes too.
INTERPRETER_SMS = 4
_SM_COUNT = {}
_SHARED_BUDGET = {}


def gpu_property(cache, device, off_gpu, query):
    """``query(index)`` of a CUDA device, cached by index (a property query per launch is host
    time); ``off_gpu`` on any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return off_gpu
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in cache:
        cache[index] = query(index)
    return cache[index]


def _shared_budget_of(index) -> int:
    try:  # the limit Triton's compiler checks ("Hardware limit: 232448" on Hopper)
        limit = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    except (AttributeError, KeyError, RuntimeError):  # another driver or Triton version
        return SHARED_MEMORY_BUDGET
    return limit - COMPILER_SHARED_BYTES


def shared_memory_budget(device) -> int:
    """Bytes of shared memory a config's staged tiles may take on ``device``: its per-block opt-in
    limit (227 KiB on Hopper, 163 KiB on an A100, ~99 KiB on consumer parts) less the compiler's own."""
    return gpu_property(_SHARED_BUDGET, device, SHARED_MEMORY_BUDGET, _shared_budget_of)


def multiprocessors(device) -> int:
    """Streaming multiprocessors of ``device``."""
    return gpu_property(_SM_COUNT, device, INTERPRETER_SMS,
                         lambda index: torch.cuda.get_device_properties(index).multi_processor_count)
