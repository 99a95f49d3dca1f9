"""Tile choices made on the host (attnbench/kernels/tuning.py and the flash backward's config filters): the
head dim's column blocks, the register filter that keeps accumulator tiles from spilling, and the
shared-memory budget. Pure functions: no kernel runs here."""
import pytest
import torch
import triton.language as tl

from attnbench.kernels.attention import flash_bwd
from attnbench.kernels import tuning
from attnbench.kernels.tuning import cfg, head_dim_blocks


@pytest.mark.parametrize("head_dim,blocks", [
    (16, (16, 0)), (24, (32, 0)), (48, (32, 16)), (64, (64, 0)), (80, (64, 16)), (96, (64, 32)),
    (112, (128, 0)), (128, (128, 0)), (160, (128, 32)), (192, (128, 64)), (200, (256, 0)), (256, (256, 0)),
])
def test_head_dim_blocks_named_cases(head_dim, blocks):
    assert head_dim_blocks(head_dim) == blocks


def test_head_dim_blocks_cover_the_head_in_power_of_two_blocks_no_wider_than_padding():
    for head_dim in range(1, 513):
        first, second = head_dim_blocks(head_dim)
        padded = max(16, tuning.next_pow2(head_dim))
        assert first >= 16 and first & (first - 1) == 0, head_dim
        assert second == 0 or (second >= 16 and second & (second - 1) == 0 and second < first), head_dim
        assert first + second >= head_dim, head_dim  # every column is in a block
        assert first + second <= padded, head_dim  # never wider than one power-of-two block
        if second:
            assert first < head_dim and first + second < padded, head_dim  # the second block pays


def _fits(fit, config, block_d, block_d2=0, acc=tl.float32):
    return fit(config, {"BLOCK_D": block_d, "BLOCK_D2": block_d2, "ACC_DTYPE": acc})


def test_register_filter_drops_the_tiles_that_spilled_at_d256():
    """The H200 study: dK/dV at 4 warps x 64 keys (256 registers a thread) ran at 89 TF/s at D 256,
    4 warps x 32 keys (128) at 249; the same 64-key tile at D 160 (128 + 32 columns, 160 registers)
    was the fastest there. The filter drops the first and keeps the others."""
    dkdv, dq = flash_bwd._dkdv_accumulators_fit, flash_bwd._dq_accumulator_fits
    assert not _fits(dkdv, cfg(4, 2, BLOCK_M=32, BLOCK_N=64), 256)
    assert _fits(dkdv, cfg(4, 2, BLOCK_M=64, BLOCK_N=32), 256)
    assert _fits(dkdv, cfg(8, 2, BLOCK_M=64, BLOCK_N=64), 256)
    assert _fits(dkdv, cfg(4, 2, BLOCK_M=32, BLOCK_N=64), 128, 32)
    assert not _fits(dq, cfg(4, 3, BLOCK_M=128, BLOCK_N=32), 256)
    assert _fits(dq, cfg(8, 3, BLOCK_M=128, BLOCK_N=32), 256)
    # D 192 as 128 + 64 columns keeps a tile that its power-of-two padding (256) would spill
    assert _fits(dkdv, cfg(4, 2, BLOCK_M=32, BLOCK_N=64), 128, 64)
    # fp64 accumulators take two registers a value
    assert _fits(dkdv, cfg(8, 3, BLOCK_M=64, BLOCK_N=128), 128)
    assert not _fits(dkdv, cfg(8, 3, BLOCK_M=64, BLOCK_N=128), 128, acc=tl.float64)


def test_registers_per_thread():
    assert tuning.registers_per_thread(128 * 256, 8) == 128
    assert tuning.registers_per_thread(128 * 256, 8, itemsize=8) == 256


def test_shared_memory_budget_without_a_gpu_is_the_fixed_one():
    assert tuning.shared_memory_budget(torch.device("cpu")) == tuning.SHARED_MEMORY_BUDGET


def test_pruner_falls_back_to_the_config_staging_the_least(monkeypatch):
    """When no config fits (fp32 at D 256 on a GPU), the fallback is the one with the smallest
    shared-memory estimate, not whichever is listed last."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    configs = [cfg(4, 2, BLOCK_M=64, BLOCK_N=32), cfg(4, 1, BLOCK_M=16, BLOCK_N=16), cfg(8, 2, BLOCK_M=64, BLOCK_N=64)]
    prune = tuning.pruner(lambda c, size, d: 10**9 * c.kwargs["BLOCK_N"])  # nothing fits

    class Q:
        device = torch.device("cpu")

        @staticmethod
        def element_size():
            return 4

    kept = prune(configs, {"Q": Q}, BLOCK_D=256)
    assert kept == [configs[1]]


def test_environment_flags_follow_every_way_of_setting_them(monkeypatch):
    """interpreting() and autotune_enabled() read os.environ's own store (host time per launch): setenv, delenv,
    item assignment and a replaced os.environ (mock.patch.object) are all seen at the next call."""
    import os
    from unittest import mock

    from attnbench.kernels.tuning import autotune_enabled

    monkeypatch.setenv("ATTNBENCH_AUTOTUNE", "0")
    assert not autotune_enabled()
    monkeypatch.delenv("ATTNBENCH_AUTOTUNE")
    assert autotune_enabled()
    os.environ["ATTNBENCH_AUTOTUNE"] = "0"
    try:
        assert not autotune_enabled()
    finally:
        del os.environ["ATTNBENCH_AUTOTUNE"]
    with mock.patch.object(os, "environ", {"ATTNBENCH_AUTOTUNE": "0"}):
        assert not autotune_enabled()
    assert autotune_enabled()
