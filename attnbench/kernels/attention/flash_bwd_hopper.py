"""The backward's dK/dV pass for Hopper (sm_90) in Gluon, beside flash_fwd_hopper.py's forward.

Same function as flash_bwd.py's ``flash_bwd_dkdv_kernel`` (FlashAttention-2's Algorithm 4 for dK and
dV; the dQ pass and the delta rows stay as they are): a program owns 128 keys of one (batch, KV head)
as two compute warpgroups of 64 keys each and walks every query block of every query head of its GQA
group, which a loader warp brings in through TMA (Q and dO tiles of 64 rows, a ring of STAGES slots
each released by both warpgroups). Per query block, with S^T = K Q^T in base 2:

    S^T and dP^T = V dO^T issued together; P^T = exp2(S^T - L) while dP^T runs;
    dV += P^T dO issued; dS^T = P^T (dP^T - delta) while dV runs; dK += dS^T Q.

Masking as in flash_bwd.py: query rows past N_Q read L = +inf (P = 0) and delta = 0 (their Q and dO
tiles are zero-filled by the copy engine); a row with L = -inf (it sees no key) reads +inf too; blocks
that straddle this warpgroup's causal diagonal keep only keys j <= i + causal_offset. Keys past N_K
are zero-filled and their dK/dV rows are clipped at the store. Head dims and tiles as in the forward
(a tile holds the next power of two of columns). GPU-only, like the forward: the pointer kernel is
the CPU-gated function it must equal (tests/attention/test_gpu_flash.py).
"""
import math

import triton.language as tl

from ..launch import planned
from .flash_fwd_hopper import GLUON, head_block, tile_descriptor

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

# (query rows a tile, STAGES, maxnreg, compute registers) per head-dim block: 12 warps, one program
# an SM. Not 256 columns: dK and dV of 64 keys x 256 would take 256 of the 240 registers; at 128
# columns 64-row query tiles spill (ptxas: 304 bytes), 32-row ones do not.
_TILES = {64: (64, 2, 168, 240), 128: (32, 2, 168, 240)}
HOPPER_DKDV_HEAD_DIMS = (64, 80, 96, 128)
KEYS: tl.constexpr = tl.constexpr(64)  # keys a warpgroup

if GLUON:
    @gluon.jit
    def _query_range(n0, N_Q, causal_offset, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_M: gl.constexpr):
        # flash_bwd_dkdv_kernel's (lo, full_lo) for keys [n0, n0 + BLOCK_N): rows that see any of them
        # start at lo; query blocks from full_lo on see every one of them.
        if CAUSAL:
            lo = gl.maximum(n0 - causal_offset, 0) // BLOCK_M * BLOCK_M
            full_lo = gl.minimum(gl.maximum(gl.cdiv(n0 + BLOCK_N - 1 - causal_offset, BLOCK_M) * BLOCK_M, lo), N_Q)
        else:
            lo = n0 * 0
            full_lo = n0 * 0
        return lo, full_lo

    @gluon.jit
    def _dkdv_half(HALF: gl.constexpr, q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA,
                   q_smem, do_smem, kv_smem, kv_bars, ready, empty, b, hk, n0, lo, n_per_head, GROUP, N_Q,
                   H_Q, causal_offset, qk_scale_log2, dk_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_M: gl.constexpr = q_smem.shape[3]
        HEAD_DIM: gl.constexpr = q_smem.shape[4]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)

        kn0 = n0 + HALF * KEYS
        k_slot = kv_smem.index(2 * HALF)
        v_slot = kv_smem.index(2 * HALF + 1)
        mbarrier.expect(kv_bars.index(HALF), 2 * KEYS * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(k_desc, [b, hk, kn0, 0], kv_bars.index(HALF), k_slot)
        tma.async_copy_global_to_shared(v_desc, [b, hk, kn0, 0], kv_bars.index(HALF), v_slot)
        _, full_lo = _query_range(kn0, N_Q, causal_offset, CAUSAL, KEYS, BLOCK_M)
        offs_n = kn0 + gl.arange(0, KEYS, layout=row_s)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
        k_tile = k_slot._reinterpret(dtype, [KEYS, HEAD_DIM], kv_tile)
        v_tile = v_slot._reinterpret(dtype, [KEYS, HEAD_DIM], kv_tile)
        mbarrier.wait(kv_bars.index(HALF), 0)

        for i in range(GROUP * n_per_head):
            slot = i % STAGES
            h = hk * GROUP + i // n_per_head
            m0 = lo + (i % n_per_head) * BLOCK_M
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=col_s)
            row = (b * H_Q + h).to(gl.int64) * N_Q + offs_m
            # softmax_rows.load_lse_log2: rows past N_Q and blind rows (-inf) read +inf, so P = 0
            lse = gl.load(LSE + row, mask=offs_m < N_Q, other=float("inf"))
            lse = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            delta = gl.load(DELTA + row, mask=offs_m < N_Q, other=0.0)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q_tile = q_smem.index(slot)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], tile)
            do_tile = do_smem.index(slot)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], tile)
            s_token = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_token = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t = warpgroup_mma_wait(1, deps=(s_token, ))
            p_t = gl.exp2(s_t * qk_scale_log2 - gl.expand_dims(lse, 0))
            if m0 < full_lo:  # a block across this warpgroup's diagonal: key j seen by rows i >= j - offset
                p_t = gl.where(gl.expand_dims(offs_m, 0) + causal_offset >= gl.expand_dims(offs_n, 1), p_t, 0.0)
            dv_token = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_tile, dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=(dp_token, ))
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
            dk_token = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), op_layout), q_tile, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_token, dk_token))
            mbarrier.arrive(empty.index(slot), count=1)

        # dS came from base-2 scores: dK = scale * dS^T Q. K's and V's slots take the results once
        # every warp of this warpgroup is past the wgmmas that read them.
        gl.thread_barrier()
        k_tile.store((dk * dk_scale).to(dtype))
        v_tile.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, hk, kn0, 0], k_slot)
        tma.async_copy_shared_to_global(dv_desc, [b, hk, kn0, 0], v_slot)
        tma.store_wait(0)

    # The partitions (worker partitions share one signature): args as _dkdv_half's, less the constexprs.
    @gluon.jit
    def _dkdv_first(args, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        _dkdv_half(0, *args, CAUSAL, STAGES)

    @gluon.jit
    def _dkdv_second(args, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        _dkdv_half(1, *args, CAUSAL, STAGES)

    @gluon.jit
    def _dkdv_loader(args, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, kv_smem, kv_bars, ready,
         empty, b, hk, n0, lo, n_per_head, GROUP, N_Q, H_Q, causal_offset, qk_scale_log2, dk_scale) = args
        BLOCK_M: gl.constexpr = q_smem.shape[3]
        HEAD_DIM: gl.constexpr = q_smem.shape[4]
        for i in range(GROUP * n_per_head):
            slot = i % STAGES
            h = hk * GROUP + i // n_per_head
            m0 = lo + (i % n_per_head) * BLOCK_M
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), 2 * BLOCK_M * HEAD_DIM * 2)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], ready.index(slot), q_smem.index(slot))
            tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], ready.index(slot), do_smem.index(slot))

    @gluon.jit
    def flash_bwd_dkdv_hopper_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA,
                                     N_Q, N_K, H_Q, GROUP, causal_offset, qk_scale_log2, dk_scale,
                                     CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                     num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        n0 = gl.program_id(0) * (2 * KEYS)
        hk = gl.program_id(1)
        b = gl.program_id(2)
        lo, _ = _query_range(n0, N_Q, causal_offset, CAUSAL, 2 * KEYS, BLOCK_M)
        n_per_head = gl.cdiv(N_Q - lo, BLOCK_M)

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        kv_smem = gl.allocate_shared_memory(dtype, [4, 1, 1, KEYS, HEAD_DIM], k_desc.layout)
        kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(kv_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both warpgroups read each Q/dO tile
        fence_async_shared()
        args = (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE, DELTA, q_smem, do_smem, kv_smem, kv_bars,
                ready, empty, b, hk, n0, lo, n_per_head, GROUP, N_Q, H_Q, causal_offset, qk_scale_log2, dk_scale)
        gl.warp_specialize([(_dkdv_first, (args, CAUSAL, STAGES)), (_dkdv_second, (args, CAUSAL, STAGES)),
                            (_dkdv_loader, (args, CAUSAL, STAGES))], [4, 1], [CONSUMER_REGS, 24])


def flash_bwd_dkdv_hopper_launch(q, k, v, do, lse, delta, dk, dv, sm_scale: float, causal_offset, tiles=None):
    """dK and dV of checked inputs into ``dk``/``dv`` (shaped like k/v); ``lse`` and ``delta`` [B, Hq, Nq]
    contiguous fp32 (the forward's LSE and flash_bwd.py's delta rows). ``tiles``: a _TILES entry
    instead of the head dim's."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    block_m, stages, maxnreg, consumer_regs = tiles or _TILES[head_block(head_dim)]
    grid = (-(-n_k // (2 * KEYS.value)), heads_kv, batch)
    planned(flash_bwd_dkdv_hopper_kernel)[grid](
        tile_descriptor(q, block_m), tile_descriptor(do, block_m), tile_descriptor(k, KEYS.value),
        tile_descriptor(v, KEYS.value), tile_descriptor(dk, KEYS.value), tile_descriptor(dv, KEYS.value),
        lse, delta,
        n_q, n_k, heads_q, heads_q // heads_kv, 0 if causal_offset is None else int(causal_offset),
        float(sm_scale) * math.log2(math.e), float(sm_scale),
        CAUSAL=causal_offset is not None, STAGES=stages, CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)
