"""FlashAttention forward for Hopper (sm_90) in Gluon: explicit warpgroup MMA (wgmma) and TMA.

Why a second kernel: Triton 3.6 lowers ``tl.dot`` on Hopper to wgmma but waits for each one before
the next instruction, so a key block's Q K^T, softmax and P V run one after another inside a
warpgroup (docs/measurements/flash.md, "Item 1, first pass"). Here the MMAs are
issued asynchronously and waited for by hand, as in FlashAttention-3's intra-warpgroup overlap:

    S_j = Q K_j^T        issued
    O  += P_{j-1} V_{j-1} issued on top of it
    wait until only the P V is in flight -> softmax of S_j runs while the tensor cores do P V
    wait for P V, rescale O by this block's alpha

K and V come through TMA into rings of STAGES slots (one mbarrier per slot and operand). Two kernels
(the pick per head dim and mask is _TILES, measured):
- ``flash_fwd_hopper_kernel``: one warpgroup of 64 query rows a program, two or three programs an SM.
  The warps refill a slot once all of them are past the MMA that read it (K's with block j + STAGES
  once S_j is done, V's with block j - 1 + STAGES once P_{j-1} V_{j-1} is), or, with
  WARP_SPECIALIZE, hand it back through an "empty" mbarrier to a loader warp.
- ``flash_fwd_hopper_pair_kernel``: two such warpgroups a program (128 rows) sharing one ring that a
  loader warp fills, each slot released by both; the halves are not kept in step.
Q is read once, O written through TMA over Q's shared memory (rows past N_Q are clipped by the copy
engine), the LSE through pointers.

Same function as flash_fwd_kernel: O, the natural-log LSE, blind rows (O = 0, LSE = -inf), NaN for
a visible row whose sum is zero or NaN (softmax_rows.py). 16-bit inputs, the measured head dims
(HOPPER_HEAD_DIMS; a tile holds the next power of two, the copy engine zero-filling the rest; the
default route takes HOPPER_DEFAULT_HEAD_DIMS),
16-byte aligned strides, sm_90, Triton 3.6: ``hopper_applies`` says where; elsewhere the pointer
tiles run. Gluon has no interpreter, so these kernels are proven on the GPU (tests/attention/test_gpu_flash.py),
with the pointer tiles as the CPU-gated function they must equal.
"""
import functools
import math

import torch

from ..launch import Tiles, planned
from ..precision import LN2, ROW_MAX_START
from ..tuning import gpu_property

# Head dims the Gluon forward takes when asked for (forward_route("hopper")): a tile holds head_block(D)
# columns, 64 to 256 (the tiles in _TILES), the copy engine zero-filling the columns past D on loads and
# clipping them on stores, so any D whose 16-bit rows are whole 16-byte groups computes the same function
# with the same compiled kernels. The default route takes the ones timed beside the pointer tiles
# (docs/measurements/flash.md; results/nvidia-h100/flash/route-hopper.md): every D 56-128 (the 64- and
# 128-column tiles; D 72 and 112 measured 1.1-4x the pointer tiles, which pad such heads with copies) and
# D 160, 192, 256; D 40 and 48 (a 64-column tile for 40 or 48 columns) only below HOPPER_NARROW_MAX_PAIRS
# visible (query, key) pairs in all heads: there the pointer tiles' padding copies cost more than the
# wasted columns (1.1-4x), while at exponential-bound sizes the pointer tiles are 1.6x faster at D 40 (and
# even at D 48 from 1.5e9 pairs). D 136-152, 168-184 and 200-248 (the 256-column tile) are not timed yet.
HOPPER_HEAD_DIMS = tuple(range(40, 257, 8))
HOPPER_DEFAULT_HEAD_DIMS = tuple(range(56, 129, 8)) + (160, 192, 256)
HOPPER_NARROW_HEAD_DIMS, HOPPER_NARROW_MAX_PAIRS = (40, 48), 5e8
HOPPER_DTYPES = (torch.float16, torch.bfloat16)
# Tiles per (head dim, causal): (BLOCK_M, BLOCK_N, STAGES, num_warps, Q in registers[, loader warp,
# maxnreg[, "pair", compute registers]]), 64 query rows a warpgroup; each pick is the fastest of
# the layouts timed beside it (docs/measurements/flash.md):
# - D 64: one warpgroup a program, two or three programs an SM. Two warpgroups a program in step
#   (M 128, one key loop, barriers between them) are slower than the pointer tiles, and the pair
#   below gains nothing over them at D 64.
# - D 128: a pair of warpgroups a program, each on its own 64 rows, not kept in step, sharing K/V
#   blocks of 128 keys that a loader warp brings in (each block crosses L2 once per 128 query rows),
#   ahead of one warpgroup a program with a loader; Q as the register operand (each S wgmma then
#   reads only K from shared memory).
# - 256 columns (D 160-256): the pair on 64-key blocks, Q from shared memory (its registers go to the
#   64 x 256 accumulator). It gains most at D 256 and little at D 160 and 192, whose columns past D
#   are zeros the MMAs still multiply; three stages do not fit.
_PAIR = (True, 168, "pair", 240)  # 12 warps (one program an SM): maxnreg 168, 240 for the compute warps
_TILES = {(64, False): (64, 128, 2, 4, False), (64, True): (64, 128, 2, 4, False),
          (128, False): (128, 128, 2, 4, True) + _PAIR, (128, True): (128, 128, 2, 4, True) + _PAIR,
          (256, False): (128, 64, 2, 4, False) + _PAIR, (256, True): (128, 64, 2, 4, False) + _PAIR}


# Gluon is experimental and its API moves between releases (3.9 renamed the TMA copies and dropped
# shared_memory_descriptor._reinterpret; 3.5 lacks the list form of warp_specialize): these kernels
# run only on the Triton they are written and measured with; elsewhere the pointer tiles run.
GLUON_TRITON = "3.6."
try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (launch.Tiles makes them)
    GLUON = triton.__version__.startswith(GLUON_TRITON)
except Exception:  # ImportError, or a Gluon without these names
    GLUON = False


def _aligned(t) -> bool:
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 for s in t.stride()[:-1]))


_CAPABILITY = {}


def _capability(device):
    """The GPU's compute capability, asked once per device (a driver query every call is host time)."""
    return gpu_property(_CAPABILITY, device, None, torch.cuda.get_device_capability)


def hopper_applies(q, k, v) -> bool:
    """Whether the Gluon forward takes these (checked) inputs: an sm_90 GPU, fp16/bf16, a head dim
    in HOPPER_HEAD_DIMS, tensors TMA can address (16-byte base and strides), Triton GLUON_TRITON."""
    return (q.is_cuda and torch.version.hip is None and q.dtype in HOPPER_DTYPES
            and q.shape[-1] in HOPPER_HEAD_DIMS and _capability(q.device) == (9, 0)
            and all(_aligned(t) for t in (q, k, v)) and GLUON)


if GLUON:
    @gluon.jit
    def _softmax_step(s, m_i, l_i, n0, offs_m, N_K, causal_offset, qk_scale_log2,
                      MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        # key_block.key_weights in Gluon: the row max on raw scores, one FMA a score before exp2.
        if MASKED:
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            keep = gl.expand_dims(offs_n, 0) < N_K
            if CAUSAL:
                keep = keep & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1) + causal_offset)
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
        p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, l_i, m_new

    @gluon.jit
    def _scores(s, m_i, l_i, n0, full_hi, offs_m, N_K, causal_offset, qk_scale_log2,
                CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        # Blocks inside [0, full_hi) are visible to every row of the tile: no mask arithmetic.
        if n0 + BLOCK_N <= full_hi:
            p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, n0, offs_m, N_K, causal_offset, qk_scale_log2,
                                               False, CAUSAL, BLOCK_N)
        else:
            p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, n0, offs_m, N_K, causal_offset, qk_scale_log2,
                                               True, CAUSAL, BLOCK_N)
        return p, alpha, l_i, m_i

    @gluon.jit
    def _refill(desc, bars, smem, block, STAGES: gl.constexpr, b, hk, n_blocks, BLOCK_N: gl.constexpr,
                nbytes: gl.constexpr):
        # Slot block % STAGES, just read by block `block`, takes block + STAGES (if there is one).
        slot = block % STAGES
        nxt = block + STAGES
        mbarrier.expect(bars.index(slot), nbytes, pred=nxt < n_blocks)
        tma.async_copy_global_to_shared(desc, [b, hk, nxt * BLOCK_N, 0], bars.index(slot), smem.index(slot),
                                        pred=nxt < n_blocks)

    @gluon.jit
    def _release(desc, ready, empty, smem, block, STAGES: gl.constexpr, b, hk, n_blocks, BLOCK_N: gl.constexpr,
                 nbytes: gl.constexpr, WARP_SPECIALIZE: gl.constexpr):
        # The MMA that read block `block`'s slot is done (in every warp): hand the slot back.
        if WARP_SPECIALIZE:  # to the loader warp, which waits for it
            mbarrier.arrive(empty.index(block % STAGES), count=1)
        else:  # refill it here
            _refill(desc, ready, smem, block, STAGES, b, hk, n_blocks, BLOCK_N, nbytes)

    @gluon.jit
    def _load_keys(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, hk, n_blocks,
                   STAGES: gl.constexpr, BLOCK_N: gl.constexpr, nbytes: gl.constexpr):
        # The loader warp: block i into slot i % STAGES once the consumers have released the slot
        # (a new mbarrier counts as released: the first STAGES waits pass at parity 1).
        for i in range(n_blocks):
            slot = i % STAGES
            parity = ((i // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), parity)
            mbarrier.expect(k_ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, i * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), parity)
            mbarrier.expect(v_ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, hk, i * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _attend(q_op, o, l_i, m_i, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                b, hk, n_blocks, full_hi, offs_m, N_K, causal_offset, qk_scale_log2,
                CAUSAL: gl.constexpr, STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr):
        # The key loop: (o, l, m) over the tile's n_blocks key blocks (at least one).
        BLOCK_M: gl.constexpr = o.shape[0]
        HEAD_DIM: gl.constexpr = o.shape[1]
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        dtype: gl.constexpr = k_smem.dtype
        nbytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2
        s_layout: gl.constexpr = m_i.type.layout.parent
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o.type.layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o.type.layout)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        # Block 0: its scores alone (nothing to overlap with yet).
        mbarrier.wait(k_ready.index(0), 0)
        k_tile = k_smem.index(0)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        s = warpgroup_mma(q_op, k_tile.permute((1, 0)), s_zero, use_acc=False)
        if not WARP_SPECIALIZE:
            gl.thread_barrier()
        _release(k_desc, k_ready, k_empty, k_smem, 0, STAGES, b, hk, n_blocks, BLOCK_N, nbytes, WARP_SPECIALIZE)
        p, alpha, l_i, m_i = _scores(s, m_i, l_i, 0, full_hi, offs_m, N_K, causal_offset, qk_scale_log2,
                                     CAUSAL, BLOCK_N)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_blocks):
            slot = j % STAGES
            prev = (j - 1) % STAGES  # the V slot of block j - 1
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            k_tile = k_smem.index(slot)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
            s_token = warpgroup_mma(q_op, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            v_tile = v_smem.index(prev)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
            o_token = warpgroup_mma(p_op, v_tile, o, is_async=True)
            # S_j was issued first, so one group left in flight is P_{j-1} V_{j-1}.
            s = warpgroup_mma_wait(1, deps=(s_token, ))
            if WARP_SPECIALIZE:
                _release(k_desc, k_ready, k_empty, k_smem, j, STAGES, b, hk, n_blocks, BLOCK_N, nbytes, True)
            p, alpha, l_i, m_i = _scores(s, m_i, l_i, j * BLOCK_N, full_hi, offs_m, N_K, causal_offset,
                                         qk_scale_log2, CAUSAL, BLOCK_N)
            o = warpgroup_mma_wait(0, deps=(o_token, ))
            if WARP_SPECIALIZE:
                _release(v_desc, v_ready, v_empty, v_smem, j - 1, STAGES, b, hk, n_blocks, BLOCK_N, nbytes, True)
            else:
                # Every warp is past S_j (K slot j % STAGES) and P V of block j - 1 (its V slot):
                # refill both, each a whole iteration ahead of its use.
                gl.thread_barrier()
                _refill(k_desc, k_ready, k_smem, j, STAGES, b, hk, n_blocks, BLOCK_N, nbytes)
                _refill(v_desc, v_ready, v_smem, j - 1, STAGES, b, hk, n_blocks, BLOCK_N, nbytes)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        v_tile = v_smem.index(last)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        o = warpgroup_mma(p_op, v_tile, o)
        return o, l_i, m_i

    @gluon.jit
    def _visible_keys(m0, N_K, causal_offset, CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        # tiling.visible_keys for rows [m0, m0 + ROWS): keys [0, full_hi) need no mask, none at or
        # past hi is visible.
        if CAUSAL:
            hi = gl.minimum(gl.maximum(m0 + ROWS + causal_offset, 0), N_K)
            full_hi = gl.minimum(gl.maximum(m0 + 1 + causal_offset, 0), N_K) // BLOCK_N * BLOCK_N
        else:
            hi = N_K
            full_hi = N_K // BLOCK_N * BLOCK_N
        return full_hi, hi

    @gluon.jit
    def _ring_barriers(STAGES: gl.constexpr, RELEASERS: gl.constexpr):
        # The K and V rings' mbarriers: "ready" (the copy landed) and "empty" (RELEASERS warpgroups
        # are done with the slot) per slot.
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=RELEASERS)
            mbarrier.init(v_empty.index(i), count=RELEASERS)
        return k_bars, v_bars, k_empty, v_empty

    @gluon.jit
    def _finish_rows(o, l_i, m_i, offs_m, causal_offset, CAUSAL: gl.constexpr):
        # softmax_rows.finish_rows: blind rows O = 0, LSE = -inf; a zero or NaN sum elsewhere: NaN.
        if CAUSAL:
            blind = offs_m + causal_offset < 0
        else:
            blind = offs_m < 0
        l_safe = gl.where(blind, 1.0, l_i)
        inv_l = gl.where(blind, 0.0, 1.0 / l_safe)
        lse = gl.where(blind, float("-inf"), gl.where(l_i > 0.0, (m_i + gl.log2(l_safe)) * LN2, float("nan")))
        o = o * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o.type.layout)), 1)
        return o, lse

    @gluon.jit
    def _store_rows(o, l_i, m_i, offs_m, q_tile, q_alloc, o_desc, LSE, b, h, row0, N_Q, H_Q, causal_offset,
                    CAUSAL: gl.constexpr):
        # Normalize the rows, then O through the shared memory Q came in by (``q_tile``, a 2-D view of
        # the TMA allocation ``q_alloc``) once every warp is past the wgmmas that read Q; the LSE by
        # pointers.
        o, lse = _finish_rows(o, l_i, m_i, offs_m, causal_offset, CAUSAL)
        gl.thread_barrier()
        q_tile.store(o.to(q_tile.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_alloc)
        gl.store(LSE + (b * H_Q + h).to(gl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)
        tma.store_wait(0)

    @gluon.jit
    def flash_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE,
                                N_Q, N_K, H_Q, GROUP, causal_offset, qk_scale_log2,
                                CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr,
                                WARP_SPECIALIZE: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype

        pid_m = gl.program_id(0)
        if CAUSAL:  # longest rows first, for a better tail (tiling.query_tile)
            pid_m = gl.num_programs(0) - 1 - pid_m
        h = gl.program_id(1)
        b = gl.program_id(2)
        hk = h // GROUP
        m0 = pid_m * BLOCK_M

        full_hi, hi = _visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
        n_blocks = gl.cdiv(hi, BLOCK_N)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)

        q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars, v_bars, k_empty, v_empty = _ring_barriers(STAGES, 1)
        mbarrier.init(q_bar, count=1)
        fence_async_shared()

        kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2
        mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_bar, q_smem)
        if not WARP_SPECIALIZE:  # the first STAGES key blocks (the loader warp does its own)
            for i in gl.static_range(STAGES):
                mbarrier.expect(k_bars.index(i), kv_bytes, pred=i < n_blocks)
                tma.async_copy_global_to_shared(k_desc, [b, hk, i * BLOCK_N, 0], k_bars.index(i), k_smem.index(i),
                                                pred=i < n_blocks)
                mbarrier.expect(v_bars.index(i), kv_bytes, pred=i < n_blocks)
                tma.async_copy_global_to_shared(v_desc, [b, hk, i * BLOCK_N, 0], v_bars.index(i), v_smem.index(i),
                                                pred=i < n_blocks)

        q_tile = q_smem._reinterpret(dtype, [BLOCK_M, HEAD_DIM], tile_layout)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
        m_i = gl.full([BLOCK_M], ROW_MAX_START, gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)
        if Q_IN_REGS:  # Q as the register operand: each S wgmma then reads only K from shared memory
            q_op = q_tile.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q_op = q_tile

        if n_blocks > 0:
            if WARP_SPECIALIZE:  # these warps compute; one more warp issues the K and V copies
                o, l_i, m_i = gl.warp_specialize([
                    (_attend, (q_op, o, l_i, m_i, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty,
                               b, hk, n_blocks, full_hi, offs_m, N_K, causal_offset, qk_scale_log2, CAUSAL, STAGES,
                               True)),
                    (_load_keys, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, b, hk, n_blocks,
                                  STAGES, BLOCK_N, kv_bytes)),
                ], [1], [24])
            else:
                o, l_i, m_i = _attend(q_op, o, l_i, m_i, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty,
                                      v_empty, b, hk, n_blocks, full_hi, offs_m, N_K, causal_offset, qk_scale_log2,
                                      CAUSAL, STAGES, False)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_empty.index(i))

        _store_rows(o, l_i, m_i, offs_m, q_tile, q_smem, o_desc, LSE, b, h, m0, N_Q, H_Q, causal_offset, CAUSAL)

    @gluon.jit
    def _pair_half(HALF: gl.constexpr, q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bars, k_bars,
                   v_bars, k_empty, v_empty, b, h, hk, m0, n_blocks, N_Q, N_K, H_Q, causal_offset, qk_scale_log2,
                   CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr):
        # One compute warpgroup of the pair: rows m0 + 64 HALF .. + 63 over the tile's n_blocks key blocks
        # (the pair's; blocks past this half's own diagonal are masked out), then its O and LSE.
        ROWS: gl.constexpr = q_smem.shape[3]
        HEAD_DIM: gl.constexpr = q_smem.shape[4]
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        row0 = m0 + HALF * ROWS
        q_slot = q_smem.index(HALF)
        mbarrier.expect(q_bars.index(HALF), ROWS * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(q_desc, [b, h, row0, 0], q_bars.index(HALF), q_slot)
        full_hi, _ = _visible_keys(row0, N_K, causal_offset, CAUSAL, ROWS, BLOCK_N)
        offs_m = row0 + gl.arange(0, ROWS, layout=row_s)
        m_i = gl.full([ROWS], ROW_MAX_START, gl.float32, layout=row_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
        o = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        q_tile = q_slot._reinterpret(dtype, [ROWS, HEAD_DIM], tile_layout)
        mbarrier.wait(q_bars.index(HALF), 0)
        if Q_IN_REGS:
            q_op = q_tile.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q_op = q_tile
        if n_blocks > 0:
            o, l_i, m_i = _attend(q_op, o, l_i, m_i, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty,
                                  b, hk, n_blocks, full_hi, offs_m, N_K, causal_offset, qk_scale_log2, CAUSAL, STAGES,
                                  True)
        _store_rows(o, l_i, m_i, offs_m, q_tile, q_slot, o_desc, LSE, b, h, row0, N_Q, H_Q, causal_offset, CAUSAL)

    # The partitions' functions (worker partitions share one signature): args as _pair_half's, less the constexprs.
    @gluon.jit
    def _pair_first(args, CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr):
        _pair_half(0, *args, CAUSAL, STAGES, Q_IN_REGS)

    @gluon.jit
    def _pair_second(args, CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr):
        _pair_half(1, *args, CAUSAL, STAGES, Q_IN_REGS)

    @gluon.jit
    def _pair_loader(args, CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr):
        (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, k_empty, v_empty,
         b, h, hk, m0, n_blocks, N_Q, N_K, H_Q, causal_offset, qk_scale_log2) = args
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        nbytes: gl.constexpr = BLOCK_N * k_smem.shape[4] * 2
        _load_keys(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, b, hk, n_blocks, STAGES,
                   BLOCK_N, nbytes)

    @gluon.jit
    def flash_fwd_hopper_pair_kernel(q_desc, k_desc, v_desc, o_desc, LSE,
                                     N_Q, N_K, H_Q, GROUP, causal_offset, qk_scale_log2,
                                     CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_IN_REGS: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """flash_fwd_hopper_kernel with two compute warpgroups a program (64 query rows each) sharing
        one K/V ring filled by a loader warp: each key block crosses L2 once per 128 rows, not per 64.
        Each slot is released by both warpgroups (empty barriers count 2); they are not kept in step."""
        ROWS: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.program_id(0)
        if CAUSAL:
            pid_m = gl.num_programs(0) - 1 - pid_m
        h = gl.program_id(1)
        b = gl.program_id(2)
        hk = h // GROUP
        m0 = pid_m * (2 * ROWS)
        _, hi = _visible_keys(m0, N_K, causal_offset, CAUSAL, 2 * ROWS, BLOCK_N)
        n_blocks = gl.cdiv(hi, BLOCK_N)

        q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_bars, v_bars, k_empty, v_empty = _ring_barriers(STAGES, 2)  # both warpgroups release each slot
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        fence_async_shared()
        args = (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, k_empty,
                v_empty, b, h, hk, m0, n_blocks, N_Q, N_K, H_Q, causal_offset, qk_scale_log2)
        gl.warp_specialize([(_pair_first, (args, CAUSAL, STAGES, Q_IN_REGS)),
                            (_pair_second, (args, CAUSAL, STAGES, Q_IN_REGS)),
                            (_pair_loader, (args, CAUSAL, STAGES, Q_IN_REGS))], [4, 1], [CONSUMER_REGS, 24])

def head_block(head_dim: int) -> int:
    """The head-dim columns a tile holds: the next power of two (Triton's tensors and TMA boxes are
    powers of two); the copy engine zero-fills the columns past D on loads and clips them on stores."""
    return 1 << (head_dim - 1).bit_length()


def tile_descriptor(t, block_rows):
    """A host TMA descriptor of a [B, H, N, D] tensor read or written in tiles of ``block_rows`` rows
    of one (batch, head), head_block(D) columns wide; made at launch (launch.Tiles), so that a
    planned launch fills it from the pointer alone."""
    columns = head_block(t.shape[-1])
    return Tiles(t, (1, 1, block_rows, columns), _tile_layout(block_rows, columns, t.dtype))


@functools.lru_cache(maxsize=None)
def _tile_layout(block_rows, block_cols, dtype):
    """The shared-memory layout of a tile (computed once: Gluon's default takes host time every call)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_rows, block_cols], element)


def flash_fwd_hopper_launch(q, k, v, o, lse, sm_scale: float, causal_offset, tiles=None):
    """Write O and the LSE of checked inputs into ``o`` [B, Hq, Nq, D] and ``lse`` [B, Hq, Nq]
    (fp32, contiguous); ``causal_offset`` None means no mask, else row i sees keys j <= i + offset.
    ``tiles``: a _TILES entry to use instead of the shape's (scripts measure them): (BLOCK_M, BLOCK_N,
    STAGES, num_warps, Q in registers[, warp-specialized loader, maxnreg[, "pair", compute registers]])
    with 64 rows a warpgroup; "pair": two compute warpgroups a program (BLOCK_M 128) sharing the keys."""
    batch, heads_q, n_q, head_dim = q.shape
    shape_tiles = _TILES.get((head_block(head_dim), causal_offset is not None))
    block_m, block_n, stages, num_warps, q_in_regs, *ws = tiles or shape_tiles
    grid = (-(-n_q // block_m), heads_q, batch)
    pair = len(ws) > 2 and ws[2] == "pair"
    rows = block_m // 2 if pair else block_m
    args = (tile_descriptor(q, rows), tile_descriptor(k, block_n), tile_descriptor(v, block_n),
            tile_descriptor(o, rows), lse,
            n_q, k.shape[2], heads_q, heads_q // k.shape[1], 0 if causal_offset is None else int(causal_offset),
            float(sm_scale) * math.log2(math.e))
    causal = causal_offset is not None
    if pair:
        planned(flash_fwd_hopper_pair_kernel)[grid](*args, CAUSAL=causal, STAGES=stages, Q_IN_REGS=q_in_regs,
                                                    CONSUMER_REGS=ws[3], num_warps=num_warps, maxnreg=ws[1])
    else:
        planned(flash_fwd_hopper_kernel)[grid](*args, CAUSAL=causal, STAGES=stages, Q_IN_REGS=q_in_regs,
                                      WARP_SPECIALIZE=bool(ws and ws[0]), num_warps=num_warps,
                                      **({"maxnreg": ws[1]} if ws and ws[0] else {}))
