"""Flash-decoding: the forward for few query rows (Nq <= DECODE_MAX_NQ), split across the keys.

FA2's forward (flash_fwd.py) gives a program BLOCK_M query rows of one query head. At Nq = 1 that
tile holds one useful row, every query head of a GQA group re-reads its KV head, and B x Hq
programs of one key loop each cannot keep the memory system busy (they take several times as long
as one read of K and V: docs/measurements/flash.md). Here a program owns the rows of one
(batch, KV head): every query head of the group times every query row, packed into one tile, so
each K/V head is read once; and the keys are split over NUM_SPLITS programs so that B x Hkv alone
need not fill the GPU. Each split writes its partial state (O, LSE) in fp32 (fp64 for fp64), and
merge_states' stack kernel reduces the splits in a fixed order: the result is deterministic.
"""
import functools

import triton
import triton.language as tl

from .. import interpreting
from .key_block import attend_key_block
from ..merge_states import merge_stack_launch
from ..outputs import new_output
from ..precision import (ROW_MAX_START, STATE_LSE_DTYPE, accumulator_dtype, accumulator_torch_dtype, dot_precision,
                         lse_dtype, softmax_scale_log2, split_scale)
from .softmax_rows import finish_rows_where
from ..launch import planned
from ..tiling import aligned, aligned_rows, row_strides, stride_align, visible_key_count
from ..tuning import (autotune, cdiv, cfg, configs, config_list, head_dim_blocks, head_width, multiprocessors,
                      next_pow2, pruner, registers_per_thread, seq_bucket)

DECODE_MAX_NQ = 64  # query rows per head up to which the forward takes this path
# Packed rows a program holds (more rows: several row tiles, each reading K/V again). A config
# runs only if the fp32 accumulator takes <= 64 registers a thread: at D 256 and 64 rows, 8 warps.
MAX_BLOCK_M = 64
ACC_REGISTERS = 64
# A split gets at least this many keys: fewer and the partial states' round trip and the merge
# outweigh the parallelism they buy. Under the interpreter tiny test shapes must still split.
MIN_KEYS_PER_SPLIT = 256
INTERPRETER_MIN_KEYS_PER_SPLIT = 16
WAVES = 2  # programs to aim for, in multiples of the multiprocessors
MAX_SPLITS = 64
# ... and no more than this many an SM: balance alone asked 18 splits of 133 programs at Nk 32K
MAX_PROGRAMS_PER_SM = 8
WIDE_BLOCK = 128  # two head-dim blocks from this first block's width up (decode_head_blocks)


@triton.jit
def _packed_query_rows(pid_m, N_Q, GROUP, BLOCK_M: tl.constexpr):
    """(valid, query head within the group, query row) of the tile's packed rows r = g * N_Q + i."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = r < GROUP * N_Q
    g = r // N_Q
    return valid, g, r - g * N_Q


@triton.jit
def _split_range(i, valid, split, N_K, NUM_SPLITS, causal_offset, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, mid, hi): this split's keys are [lo, hi), and [lo, mid) need no mask for any row of the
    tile. The visible keys (row i sees j <= i + causal_offset) are cut into NUM_SPLITS runs of
    whole blocks; a split past the visible end gets lo >= hi (no key)."""
    if CAUSAL:
        i_lo = tl.min(tl.where(valid, i, 2147483647), 0)
        i_hi = tl.max(tl.where(valid, i, -1), 0)
        visible = tl.minimum(tl.maximum(i_hi + causal_offset + 1, 0), N_K)
        full = tl.minimum(tl.maximum(i_lo + causal_offset + 1, 0), N_K) // BLOCK_N * BLOCK_N
    else:
        visible = N_K
        full = N_K // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(visible, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, visible)
    mid = tl.maximum(tl.minimum(full, hi), lo)
    return lo, mid, hi


def _decode_shared_bytes(config, element_size, block_d):
    return (MAX_BLOCK_M * block_d + config.num_stages * 2 * config.kwargs["BLOCK_N"] * block_d) * element_size


def _accumulator_fits(config, constexprs):
    return registers_per_thread(constexprs["BLOCK_M"] * head_width(constexprs), config.num_warps) <= ACC_REGISTERS


_DECODE_CONFIGS = config_list(
    configs("BLOCK_N",
            (4, 3, 64), (4, 4, 64), (4, 3, 128),
            (8, 3, 128), (4, 2, 128), (4, 2, 64),
            # D 256: 32-key stages leave room for two programs an SM
            (4, 4, 32),
            # D 256 at 64 rows: the accumulator needs 8 warps
            (8, 2, 64), (8, 3, 32), (4, 2, 32)),
    cfg(1, 1, BLOCK_N=16))


@autotune(_DECODE_CONFIGS, key=["ROWS_BUCKET", "SEQ_BUCKET", "BLOCK_D", "BLOCK_D2", "CAUSAL"],
          prune_configs_by={"early_config_prune": pruner(_decode_shared_bytes, _accumulator_fits)})
@triton.jit
def flash_decode_kernel(Q, K, V, O, LSE,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_os, stride_ob, stride_oh, stride_on,
                        stride_ls, stride_lb, stride_lh,
                        N_Q, N_K, HEAD_DIM, H_KV, GROUP, causal_offset, scale_hi, scale_lo, NUM_SPLITS,
                        ROWS_BUCKET, SEQ_BUCKET,
                        BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        ALIGN: tl.constexpr):
    # every stride and the head dim are multiples of ALIGN (tiling.aligned: 16-byte loads at D 40 or 72)
    stride_qb, stride_qh, stride_qn = aligned_rows(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_rows(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_rows(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_ob, stride_oh, stride_on = aligned_rows(stride_ob, stride_oh, stride_on, ALIGN)
    stride_os = aligned(stride_os, ALIGN)
    HEAD_DIM = aligned(HEAD_DIM, ALIGN)
    # batch and KV heads on axes of their own (CUDA caps axes 1 and 2 at 65535 each; the launch
    # layer keeps the batch under that)
    pid_m = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    valid, g, i = _packed_query_rows(pid_m, N_Q, GROUP, BLOCK_M)
    h = hk * GROUP + g.to(tl.int64)
    q_rows = b * stride_qb + h * stride_qh + i * stride_qn
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    # a second column block where two fit a wide head exactly (decode_head_blocks): 160 = 128 + 32 stages 160 columns
    # a key in shared memory, not 256; without one, the placeholders are the first block's (key_block.py)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = tl.load(Q + q_rows[:, None] + offs_d2[None, :], mask=valid[:, None], other=0.0)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=ACC_DTYPE)
    else:
        offs_d2, q2, acc2 = offs_d, q, acc
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh

    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=ACC_DTYPE)  # finite: see key_block.attend_key_block
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    lo, mid, hi = _split_range(i, valid, split, N_K, NUM_SPLITS, causal_offset, CAUSAL, BLOCK_N)
    for n0 in range(lo, mid, BLOCK_N):
        acc, acc2_next, l_i, m_i = attend_key_block(acc, acc2, l_i, m_i, q, q2, K_head, V_head, stride_kn, stride_vn,
                                                    n0, i, offs_d, offs_d2, N_K, HEAD_DIM, causal_offset,
                                                    qk_scale_log2, BLOCK_N, BLOCK_D2, False, CAUSAL, ACC_DTYPE,
                                                    DOT_PRECISION)
        if BLOCK_D2 > 0:  # (one block: no second accumulator carried through the loop)
            acc2 = acc2_next
    for n0 in range(mid, hi, BLOCK_N):
        acc, acc2_next, l_i, m_i = attend_key_block(acc, acc2, l_i, m_i, q, q2, K_head, V_head, stride_kn, stride_vn,
                                                    n0, i, offs_d, offs_d2, N_K, HEAD_DIM, causal_offset,
                                                    qk_scale_log2, BLOCK_N, BLOCK_D2, True, CAUSAL, ACC_DTYPE,
                                                    DOT_PRECISION)
        if BLOCK_D2 > 0:
            acc2 = acc2_next

    # a row sees a key of this split iff the split is not empty and (causal) its first key is visible
    sees = valid & (lo < hi)  # a [BLOCK_M] mask (padding rows are never stored)
    if CAUSAL:
        sees = sees & (i + causal_offset >= lo)
    # With one split this is the row's whole state, and a zero sum where keys were seen is a
    # non-finite input: NaN. With several, a split's keys may all score -inf (an infinite input)
    # while other splits' do not: that share is empty, not NaN, or the answer would depend on the
    # split count; a row that sees keys and merges to empty is NaN there (merge's see_from). A NaN
    # sum stays NaN either way.
    blind = ~sees
    if NUM_SPLITS > 1:
        blind = blind | (l_i == 0.0)
    o, lse, inv_l = finish_rows_where(acc, l_i, m_i, blind, ACC_DTYPE, LSE.dtype.element_ty)  # float64 for a partial
    state = split.to(tl.int64)
    o_rows = state * stride_os + b * stride_ob + h * stride_oh + i * stride_on
    tl.store(O + o_rows[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=valid[:, None] & d_mask[None, :])
    if BLOCK_D2 > 0:
        tl.store(O + o_rows[:, None] + offs_d2[None, :], (acc2 * inv_l[:, None]).to(O.dtype.element_ty),
                 mask=valid[:, None])
    tl.store(LSE + state * stride_ls + b * stride_lb + h * stride_lh + i, lse.to(LSE.dtype.element_ty), mask=valid)


def decode_applies(n_q: int) -> bool:
    """Whether the forward of ``n_q`` query rows per head takes the split-KV path."""
    return n_q <= DECODE_MAX_NQ


def decode_head_blocks(head_dim: int) -> tuple:
    """(BLOCK_D, BLOCK_D2) of the split-KV kernel: two column blocks where they cover the head exactly and the first
    is at least WIDE_BLOCK wide (160 = 128 + 32, 192 = 128 + 64: shared memory, registers and matmuls for D columns,
    not 256), else one block of the next power of two with its extra columns masked (a second block's masked columns
    are what head_padding.py keeps the pointer kernels away from). Measured on an H200 against one block: 0.90-0.94x
    the time at the random set's D 160 and 192 shapes, but 1.34x at B19 H8/4 N10x6964 D96 (64 + 32 at 32 rows a
    program compiles to 255 registers and spills), so narrower heads keep one block (docs/measurements/flash.md)."""
    block_d, block_d2 = head_dim_blocks(head_dim)
    if block_d2 and block_d + block_d2 == head_dim and block_d >= WIDE_BLOCK:
        return block_d, block_d2
    return max(16, next_pow2(head_dim)), 0


def decode_block_m(rows: int) -> int:
    """Packed rows a program holds: all GROUP x Nq rows of its KV head when they fit."""
    return max(16, min(MAX_BLOCK_M, next_pow2(rows)))


def decode_splits(programs: int, n_k: int, device) -> int:
    """Key splits for ``programs`` (row tiles x batch x KV heads) over ``n_k`` visible keys: the fewest
    splits, none shorter than the minimum, within 4% of the best balance of programs over the
    multiprocessors at >= WAVES programs an SM (an SM with one program more than another is what
    costs). A function of the shape and the GPU only, so a run is bitwise repeatable. Counts near
    the best balance take nearly the same time, so the fewest of them is taken
    (docs/measurements/flash.md)."""
    min_keys = INTERPRETER_MIN_KEYS_PER_SPLIT if interpreting() else MIN_KEYS_PER_SPLIT
    sms = multiprocessors(device)
    programs = max(programs, 1)
    most = max(1, min(cdiv(n_k, min_keys), MAX_SPLITS, MAX_PROGRAMS_PER_SM * sms // programs))

    def score(splits):
        total = programs * splits
        balance = total / (sms * cdiv(total, sms))
        return balance * min(1.0, total / (WAVES * sms))

    scores = {splits: score(splits) for splits in range(1, most + 1)}
    best = max(scores.values())
    return min(splits for splits, value in scores.items() if value >= 0.96 * best)  # fewest merges


def decode_plan(batch: int, heads_q: int, n_q: int, heads_kv: int, n_k: int, device) -> tuple:
    """(packed rows a program, row tiles, key splits) of the launch for these sizes (``n_k``: the visible keys,
    tiling.visible_key_count: split as all 15778 keys, a top-left decode of 12 rows took 0.020 ms against 0.008);
    worked out once per sizes and device (the split search scores every candidate count: host time a decode step
    would pay on every call)."""
    return _decode_plan(batch, heads_q, n_q, heads_kv, n_k, device, interpreting())


@functools.lru_cache(maxsize=4096)  # a sweep of shapes, not a decode loop, runs past it
def _decode_plan(batch, heads_q, n_q, heads_kv, n_k, device, _interpreting):
    rows = heads_q // heads_kv * n_q
    block_m = decode_block_m(rows)
    row_tiles = cdiv(rows, block_m)
    return block_m, row_tiles, decode_splits(row_tiles * batch * heads_kv, n_k, device)


def flash_decode_launch(q, k, v, sm_scale: float, causal_offset, num_splits=None):
    """The split-KV forward on checked inputs ([B, H, N, D], head dimension contiguous).
    ``causal_offset`` as in flash_fwd_launch. Returns (o, lse) with lse of shape [B, Hq, Nq]."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    visible = visible_key_count(n_q, n_k, causal_offset)
    block_m, row_tiles, splits = decode_plan(batch, heads_q, n_q, heads_kv, visible, q.device)
    splits = num_splits or splits
    # the one state is the result, written in place with no merge (tensors of their own, not views of a
    # one-split stack: autograd refuses in-place edits of a view a Function returns); several are kept in fp32
    # (fp64), their LSEs in fp64 (precision.STATE_LSE_DTYPE), a split's stride first
    if splits == 1:
        o_part, l_part = new_output(q.shape, q.dtype, q.device), new_output(q.shape[:3], lse_dtype(q.dtype), q.device)
        strides = (0, *o_part.stride()[:3], 0, *l_part.stride()[:2])
    else:
        o_part = new_output((splits, *q.shape), accumulator_torch_dtype(q.dtype), q.device)
        l_part = new_output((splits, batch, heads_q, n_q), STATE_LSE_DTYPE, q.device)
        strides = (*o_part.stride()[:4], *l_part.stride()[:3])
    inputs = (*row_strides(q), *row_strides(k), *row_strides(v))
    block_d, block_d2 = decode_head_blocks(head_dim)
    planned(flash_decode_kernel)[(row_tiles * splits, heads_kv, batch)](
        q, k, v, o_part, l_part, *inputs, *strides,
        n_q, n_k, head_dim, heads_kv, heads_q // heads_kv, 0 if causal_offset is None else int(causal_offset),
        *split_scale(sm_scale), splits, block_m, seq_bucket(cdiv(visible, splits)),
        BLOCK_D=block_d, BLOCK_D2=block_d2, CAUSAL=causal_offset is not None,
        ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype), BLOCK_M=block_m,
        ALIGN=stride_align(head_dim, *inputs, *strides[:4]),
    )
    if splits == 1:
        return o_part, l_part
    # rows i >= -offset see at least one key (Nk >= 1): an empty merge there is a non-finite input
    see_from = 0 if causal_offset is None else max(0, -int(causal_offset))
    return merge_stack_launch(o_part, l_part, q.dtype, see_from=see_from, out_lse_dtype=lse_dtype(q.dtype),
                              state_lse=True)
