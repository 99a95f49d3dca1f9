"""Shared-context attention: one context K/V for the whole batch, per-sample buffers, exact merge.

Row packing. For one KV head the queries of all B samples form R_TOTAL = B * G * Lq rows (G query
heads per KV head under GQA), packed sample-major: row r is sample b = r // (G Lq), query head
hk * G + (r // Lq) % G, query i = r % Lq. A program owns BLOCK_M packed rows of one KV head, so
each context K/V tile it loads serves BLOCK_M rows of many samples (the batch is folded into the
matmul, Hydragen-style): the context is read once per tile of rows, not once per sample.

The buffer. Each sample's rows see only that sample's keys, so the buffer is not a matmul of the
tile. The buffer phase walks the samples of the tile in a software-pipelined loop (the next
samples' keys stream in while these compute): per step a [BLOCK_R, D] x [D, BLOCK_NB] tensor-core
product of a few samples' G*Lq rows each (padded to BLOCK_R >= 16 on a GPU) with their keys,
masked block-diagonally. Padding wastes tensor-core work, not bytes: the buffer is memory-bound
(each element serves G*Lq rows), as long as its instructions per byte are few. Short buffers
(TabPFN's) take whole samples a step (``_buffer_whole``: one softmax, offsets advanced by a
constant); long ones are walked in key blocks with an online softmax (``_buffer_keyblocks``, ONE
flat loop over (sample group, row chunk, key block)). On an H200 (bf16, B4096 H4 Lq2 Nbuf32 D32)
the buffer alone took 35.0 us by key blocks and 29.6 us whole (67 MB: 2.3 TB/s).
Each sample's state (O, LSE) goes to a scratch buffer in L2 and, after a CTA barrier, seeds the
online softmax of the context phase for the same rows: the merge of buffer and context is the
online softmax itself.

Split-K. When the row tiles times KV heads cannot fill the GPU (decode with a small batch), the
context is cut into NUM_SPLITS chunks, one program per (row tile, chunk, KV head), and sample b's
buffer goes to chunk b % NUM_SPLITS; each program's partial state is merged exactly
(``merge_states``), flash-decoding style. How many is measured, not guessed: the fastest count
depends on more than the row tiles (the buffer's bytes, how programs fall into waves, the merge's
partial-state traffic). On an H200 (bf16, D 128, H 32/8, Lq 1), B256 Nctx4096 Nbuf512 takes
0.196 ms at 2 splits but 0.328 ms at the 3 that ``choose_splits`` (~2 programs per SM) would pick,
while B512 Nctx8192 Nbuf256 is fastest at its pick of 1 (0.283 ms; 0.319 at 2). So on CUDA the
first call for a key times the launch at ``split_candidates`` (the heuristic's count and 1, 2, 4,
8) and remembers the fastest (``pick_splits``; ``clear_split_picks`` forgets), as Triton's
autotuner does for tile configs. ``choose_splits`` alone decides where nothing can be timed: the
interpreter, ATTNBENCH_AUTOTUNE=0, and CUDA-graph capture or torch.compile tracing (these two reuse
a pick already measured, so a captured graph splits like the eager calls before it). An explicit
``num_splits`` always wins.

Kernels:
- ``shared_context_fused_kernel`` (the shipped path): buffer, context and merge in one launch. With
  NUM_SPLITS > 1 each program writes its partial state to a workspace and takes a per-tile ticket;
  the program that arrives last merges the tile's partials in split order (so the result does not
  depend on scheduling) and resets the ticket for the next launch.
- ``context_attention_kernel`` and ``buffer_attention_kernel``: the two halves alone, each writing
  (O, LSE) (the context kernel one partial per split, reduced by ``merge_stack_kernel``); the
  composed path merges them with ``merge_two_kernel``.

Scores are kept in base 2 (scale * log2 e folded into one multiply). Rows that see no key get
O = 0 and LSE = -inf.
"""
import functools
import math
import types

import torch
import triton
import triton.language as tl

from .. import interpreting
from ..gpu_time import gpu_time_median_ms
from ..merge_states import merge_finish, merge_init, merge_stack_launch, merge_step, merge_two_launch
from ..outputs import new_output
from ..precision import (LN2, LOG2E, accumulator_dtype, accumulator_torch_dtype, dot_precision, lse_dtype,
                        softmax_scale_log2, split_scale)
from ..launch import LaunchPlan, forget_plans, on_device, plan, remember, tensor_signature
from ..tuning import (ACCUMULATOR_REGISTERS, autotune, autotune_enabled, cdiv, cfg, config_list, multiprocessors,
                     next_pow2, pruner, registers_per_thread, seq_bucket)

# ---------------------------------------------------------------- device functions


@triton.jit
def _packed_rows(pid_m, R_TOTAL, ROWS_PER_SAMPLE, N_Q, BLOCK_M: tl.constexpr):
    """(valid, sample, query head within the group, query index) of the tile's packed rows."""
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_r < R_TOTAL
    r = tl.where(valid, offs_r, 0)
    b = r // ROWS_PER_SAMPLE
    rem = r - b * ROWS_PER_SAMPLE
    g = rem // N_Q
    i = rem - g * N_Q
    return valid, b, g, i


@triton.jit
def _rows(b, h, i, stride_b, stride_h, stride_n):
    """Per-row element offsets (int64: batch x stride can pass 2**31 at decode sizes)."""
    return b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + i.to(tl.int64) * stride_n


@triton.jit
def _normalized(acc, l_i, m_i):
    """(O, LSE natural log) of an online-softmax state in base 2; (0, -inf) where no key was seen."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    return o, lse


@triton.jit
def _store_state(O, LSE, o, lse, o_rows, lse_rows, mask, offs_d, HEAD_DIM: tl.constexpr):
    tl.store(O + o_rows[:, None] + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=mask[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + lse_rows, lse.to(LSE.dtype.element_ty), mask=mask)


@triton.jit
def _tile_samples(tile, split, R_TOTAL, ROWS_PER_SAMPLE, NUM_SPLITS, BLOCK_M: tl.constexpr):
    """(row_lo, row_hi, b0, mine): the tile's packed rows [row_lo, row_hi), and the samples with rows
    in it that this split handles (every NUM_SPLITS-th): the first, b0, and how many."""
    row_lo = tile * BLOCK_M
    row_hi = tl.minimum(row_lo + BLOCK_M, R_TOTAL)
    first = row_lo // ROWS_PER_SAMPLE
    end = tl.cdiv(row_hi, ROWS_PER_SAMPLE)  # one past the last sample with rows in the tile
    b0 = first + (split - first % NUM_SPLITS + NUM_SPLITS) % NUM_SPLITS
    return row_lo, row_hi, b0, tl.maximum(tl.cdiv(end - b0, NUM_SPLITS), 0)


@triton.jit
def _buffer_lengths(LENS, b, mask, N_BUF):
    """Samples b's buffer lengths; values outside [0, N_BUF] (unchecked on the hot path) are
    clamped, so that they never read out of bounds."""
    return tl.minimum(tl.maximum(tl.load(LENS + b, mask=mask, other=0).to(tl.int32), 0), N_BUF)


@triton.jit
def _visible_keys(len_r, i, valid, N_Q, CAUSAL: tl.constexpr):
    """How many of its sample's buffer keys each row sees (0 for rows not handled here)."""
    limit = len_r
    if CAUSAL:  # the Lq queries are the sample's last Lq valid entries
        limit = tl.minimum(len_r, tl.maximum(len_r - N_Q + i + 1, 0))
    return tl.where(valid, limit, 0)


@triton.jit
def _buffer_keyblocks(Q, KB, VB, LENS, OUT_O, OUT_L, tile, split, hk,
                      stride_qb, stride_qh, stride_qn, stride_kbb, stride_kbh, stride_kbn,
                      stride_vbb, stride_vbh, stride_vbn, stride_ob, stride_oh, stride_on,
                      stride_lb, stride_lh, stride_ln,
                      R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, NUM_SPLITS, qk_scale_log2,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FULL_LENS: tl.constexpr, CAUSAL: tl.constexpr,
                      ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_R: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_NB: tl.constexpr):
    """``_buffer_phase`` for any buffer: each sample's keys in blocks, an online softmax per sample.

    A step takes SAMPLES = BLOCK_R // ROWS_PAD samples at once: row rr belongs to the step's
    sample rr // ROWS_PAD, key kk to sample kk // (BLOCK_NB // SAMPLES), and the [BLOCK_R, BLOCK_NB]
    scores are masked block-diagonally. More samples per step means more bytes in flight per
    pipelined iteration; the masked-off products are tensor-core work, not memory traffic.
    Samples with more than ROWS_PAD rows (ROWS_PAD == BLOCK_R) are walked in row chunks."""
    SAMPLES: tl.constexpr = BLOCK_R // ROWS_PAD
    KEYS: tl.constexpr = BLOCK_NB // SAMPLES  # keys of one sample per step
    row_lo, row_hi, b0, mine = _tile_samples(tile, split, R_TOTAL, ROWS_PER_SAMPLE, NUM_SPLITS, BLOCK_M)
    groups = tl.cdiv(mine, SAMPLES)
    chunks = tl.cdiv(ROWS_PER_SAMPLE, ROWS_PAD)
    key_blocks = tl.cdiv(N_BUF, KEYS)
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_NB)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    hk64 = hk.to(tl.int64)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_R], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC_DTYPE)
    # One flat loop over (sample group, row chunk, key block), so that the next group's loads are
    # pipelined behind this one's math; the state restarts at each (group, chunk).
    for step in range(0, groups * chunks * key_blocks):
        kb = step % key_blocks
        gc = step // key_blocks
        chunk = gc % chunks
        j0 = (gc // chunks) * SAMPLES  # index of the step's first sample among this program's
        # rows: sample, row within the sample, validity
        j_r = j0 + rr // ROWS_PAD
        b_r = b0 + j_r * NUM_SPLITS
        r_in = chunk * ROWS_PAD + rr % ROWS_PAD
        r = b_r * ROWS_PER_SAMPLE + r_in
        valid = (j_r < mine) & (r_in < ROWS_PER_SAMPLE) & (r >= row_lo) & (r < row_hi)
        g = r_in // N_Q
        i = r_in - g * N_Q
        h = hk * GROUP + g
        # keys: sample, position, validity
        j_k = j0 + kk // KEYS
        b_k = b0 + j_k * NUM_SPLITS
        n_k = kb * KEYS + kk % KEYS
        if FULL_LENS:
            len_r = tl.zeros([BLOCK_R], dtype=tl.int32) + N_BUF
            len_k = tl.zeros([BLOCK_NB], dtype=tl.int32) + N_BUF
        else:
            len_r = _buffer_lengths(LENS, b_r, valid, N_BUF)
            len_k = _buffer_lengths(LENS, b_k, j_k < mine, N_BUF)
        limit = _visible_keys(len_r, i, valid, N_Q, CAUSAL)
        key_ok = (j_k < mine) & (n_k < len_k)
        fresh = kb == 0
        m_i = tl.where(fresh, -1.0e30, m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        q = tl.load(Q + _rows(b_r, h, i, stride_qb, stride_qh, stride_qn)[:, None] + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)
        kv_rows = b_k.to(tl.int64) * stride_kbb + hk64 * stride_kbh + n_k.to(tl.int64) * stride_kbn
        k = tl.load(KB + kv_rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
        same = (rr // ROWS_PAD)[:, None] == (kk // KEYS)[None, :]  # block diagonal: a row sees its own sample
        s = tl.where(same & (n_k[None, :] < limit[:, None]), s, float("-inf"))
        # m starts finite, so rows with nothing visible yet keep alpha = 1 and p = 0, never NaN
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vb_rows = b_k.to(tl.int64) * stride_vbb + hk64 * stride_vbh + n_k.to(tl.int64) * stride_vbn
        v = tl.load(VB + vb_rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        m_i = m_new
        o, lse = _normalized(acc, l_i, m_i)
        done = (tl.zeros([BLOCK_R], dtype=tl.int32) + kb) == key_blocks - 1  # the samples' last key block
        _store_state(OUT_O, OUT_L, o, lse, _rows(b_r, h, i, stride_ob, stride_oh, stride_on),
                     _rows(b_r, h, i, stride_lb, stride_lh, stride_ln), valid & done, offs_d, HEAD_DIM)


@triton.jit
def _buffer_whole(Q, KB, VB, LENS, OUT_O, OUT_L, tile, split, hk,
                  stride_qb, stride_qh, stride_qn, stride_kbb, stride_kbh, stride_kbn,
                  stride_vbb, stride_vbh, stride_vbn, stride_ob, stride_oh, stride_on,
                  stride_lb, stride_lh, stride_ln,
                  R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, NUM_SPLITS, qk_scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FULL_LENS: tl.constexpr, CAUSAL: tl.constexpr,
                  ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_R: tl.constexpr, ROWS_PAD: tl.constexpr, SAMPLES: tl.constexpr, KEYS: tl.constexpr):
    """``_buffer_keyblocks`` for buffers short enough that a step takes SAMPLES whole samples, every
    key of each (KEYS >= N_BUF; all of a sample's rows fit ROWS_PAD). Then a step is a complete
    softmax (no running state to carry or rescale) and the loop is over sample groups only, with
    the rows' and keys' offsets advanced by a constant per step instead of recomputed from the
    step index: the general path spends most of its instructions on that index arithmetic, and
    the buffer phase is memory-bound only if its instructions per byte are few."""
    BLOCK_NB: tl.constexpr = SAMPLES * KEYS
    row_lo, row_hi, b0, mine = _tile_samples(tile, split, R_TOTAL, ROWS_PER_SAMPLE, NUM_SPLITS, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    slot_r = rr // ROWS_PAD  # the step's sample of each row ...
    r_in = rr % ROWS_PAD
    g = r_in // N_Q
    i = r_in - g * N_Q
    h = hk * GROUP + g
    row_used = (slot_r < SAMPLES) & (r_in < ROWS_PER_SAMPLE)
    kk = tl.arange(0, BLOCK_NB)
    slot_k = kk // KEYS  # ... and of each key
    n_k = kk % KEYS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    same = slot_r[:, None] == slot_k[None, :]  # block diagonal: a row sees its own sample's keys
    # offsets at the first step; each step moves SAMPLES samples on (this split's every NUM_SPLITS-th)
    b_r = b0 + slot_r * NUM_SPLITS
    b_k = b0 + slot_k * NUM_SPLITS
    q_off = _rows(b_r, h, i, stride_qb, stride_qh, stride_qn)
    o_off = _rows(b_r, h, i, stride_ob, stride_oh, stride_on)
    l_off = _rows(b_r, h, i, stride_lb, stride_lh, stride_ln)
    hk64 = hk.to(tl.int64)
    k_off = b_k.to(tl.int64) * stride_kbb + hk64 * stride_kbh + n_k.to(tl.int64) * stride_kbn
    v_off = b_k.to(tl.int64) * stride_vbb + hk64 * stride_vbh + n_k.to(tl.int64) * stride_vbn
    hop = tl.full([], SAMPLES, tl.int64) * NUM_SPLITS  # (an argument equal to 1 arrives as a plain int)
    for j0 in range(0, mine, SAMPLES):
        r = (b_r + j0 * NUM_SPLITS) * ROWS_PER_SAMPLE + r_in
        valid = row_used & (j0 + slot_r < mine) & (r >= row_lo) & (r < row_hi)
        key_in = (j0 + slot_k < mine) & (n_k < N_BUF)
        if FULL_LENS:
            len_r = tl.zeros([BLOCK_R], dtype=tl.int32) + N_BUF
            key_ok = key_in
        else:
            len_r = _buffer_lengths(LENS, b_r + j0 * NUM_SPLITS, valid, N_BUF)
            key_ok = key_in & (n_k < _buffer_lengths(LENS, b_k + j0 * NUM_SPLITS, key_in, N_BUF))
        limit = _visible_keys(len_r, i, valid, N_Q, CAUSAL)
        q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        k = tl.load(KB + k_off[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(VB + v_off[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        s = tl.where(same & (n_k[None, :] < limit[:, None]), s, float("-inf"))
        m = tl.max(s, 1)
        m = tl.where(m > float("-inf"), m, 0.0) * qk_scale_log2  # a row that sees nothing: p = 0, l = 0
        p = tl.math.exp2(s * qk_scale_log2 - m[:, None])
        acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        o, lse = _normalized(acc, tl.sum(p, 1), m)
        _store_state(OUT_O, OUT_L, o, lse, o_off, l_off, valid, offs_d, HEAD_DIM)
        q_off += hop * stride_qb
        o_off += hop * stride_ob
        l_off += hop * stride_lb
        k_off += hop * stride_kbb
        v_off += hop * stride_vbb


@triton.jit
def _buffer_phase(Q, KB, VB, LENS, OUT_O, OUT_L, tile, split, hk,
                  stride_qb, stride_qh, stride_qn, stride_kbb, stride_kbh, stride_kbn,
                  stride_vbb, stride_vbh, stride_vbn, stride_ob, stride_oh, stride_on,
                  stride_lb, stride_lh, stride_ln,
                  R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, NUM_SPLITS, qk_scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FULL_LENS: tl.constexpr, CAUSAL: tl.constexpr,
                  ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_R: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_NB: tl.constexpr,
                  SAMPLES: tl.constexpr, KEYS: tl.constexpr):
    """Buffer attention of this tile's rows, for the samples b with b % NUM_SPLITS == split:
    each sample's rows against its own valid keys, written as states (O, LSE) to OUT. KEYS > 0
    (the launcher's ``buffer_steps``): every buffer fits one step, ``_buffer_whole``; else
    ``_buffer_keyblocks``."""
    if KEYS > 0:
        _buffer_whole(Q, KB, VB, LENS, OUT_O, OUT_L, tile, split, hk, stride_qb, stride_qh, stride_qn,
                      stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
                      stride_ob, stride_oh, stride_on, stride_lb, stride_lh, stride_ln,
                      R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, NUM_SPLITS, qk_scale_log2,
                      HEAD_DIM, BLOCK_D, FULL_LENS, CAUSAL, ACC_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_R, ROWS_PAD,
                      SAMPLES, KEYS)
    else:
        _buffer_keyblocks(Q, KB, VB, LENS, OUT_O, OUT_L, tile, split, hk, stride_qb, stride_qh, stride_qn,
                          stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
                          stride_ob, stride_oh, stride_on, stride_lb, stride_lh, stride_ln,
                          R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, NUM_SPLITS, qk_scale_log2,
                          HEAD_DIM, BLOCK_D, FULL_LENS, CAUSAL, ACC_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_R, ROWS_PAD,
                          BLOCK_NB)


@triton.jit
def _load_context_block(ptrs, offs_n, offs_d, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=(offs_n[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)  # a full block and no head-dim padding: no mask at all
    else:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _attend_context_block(acc, l_i, m_i, q, KC_head, VC_head, stride_kcn, stride_vcn, n0, offs_d, N_CTX,
                          qk_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                          MASKED: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_context_block(KC_head + offs_n[:, None] * stride_kcn + offs_d[None, :], offs_n, offs_d, N_CTX,
                            HEAD_DIM, BLOCK_D, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if MASKED:
        s = tl.where(offs_n[None, :] < N_CTX, s, float("-inf"))
    # the scale is applied inside the exponent's FMA (and to the row max, which it commutes with:
    # it is positive), not as a multiply of its own per score: one instruction less per element
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_context_block(VC_head + offs_n[:, None] * stride_vcn + offs_d[None, :], offs_n, offs_d, N_CTX,
                            HEAD_DIM, BLOCK_D, MASKED)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, l_i, m_new


@triton.jit
def _context_phase(acc, l_i, m_i, q, KC, VC, split, hk, stride_kch, stride_kcn, stride_vch, stride_vcn,
                   N_CTX, NUM_SPLITS, qk_scale_log2, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Continue the online softmax of the tile's rows over this split's chunk of the context."""
    per_split = tl.cdiv(tl.cdiv(N_CTX, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, N_CTX)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # blocks that need no length mask
    KC_head = KC + hk.to(tl.int64) * stride_kch
    VC_head = VC + hk.to(tl.int64) * stride_vch
    for n0 in range(lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_context_block(acc, l_i, m_i, q, KC_head, VC_head, stride_kcn, stride_vcn, n0, offs_d,
                                              N_CTX, qk_scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, False, ACC_DTYPE,
                                              DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):  # at most one: the context's ragged end
        acc, l_i, m_i = _attend_context_block(acc, l_i, m_i, q, KC_head, VC_head, stride_kcn, stride_vcn, n0, offs_d,
                                              N_CTX, qk_scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, True, ACC_DTYPE,
                                              DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _load_q_tile(Q, pid_m, hk, stride_qb, stride_qh, stride_qn, R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    valid, b, g, i = _packed_rows(pid_m, R_TOTAL, ROWS_PER_SAMPLE, N_Q, BLOCK_M)
    h = hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + _rows(b, h, i, stride_qb, stride_qh, stride_qn)[:, None] + offs_d[None, :],
                mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return q, valid, b, h, i, offs_d


# ---------------------------------------------------------------- launch configurations


def _fits(config, element_size, block_d):
    """Staged shared memory of a config: the larger of the context and buffer phases (compiled
    for sm_90 the two phases' buffers share the same memory: 112 KB at D = 128, BLOCK_M = 64, three
    stages, which is the context phase alone), or inf when the context tile's fp32 accumulator and
    scores would take more than ~128 registers a thread (they would spill)."""
    kw = config.kwargs
    block_m, block_n, block_nb = kw["BLOCK_M"], kw.get("BLOCK_N", 0), kw.get("BLOCK_NB", 0)
    if block_n and registers_per_thread(block_m * (block_d + block_n), config.num_warps) > ACCUMULATOR_REGISTERS:
        return float("inf")
    context = (block_m * block_d + config.num_stages * 2 * block_n * block_d) if block_n else 0
    buffer = config.num_stages * (16 * block_d + 2 * block_nb * block_d)
    return max(context, buffer) * element_size


# BLOCK_NB counts the keys of one buffer step over all the samples it takes (see _buffer_phase).
# Few configurations per head-dim class (D <= 64: the TabPFN regime; D > 64: LLM heads), so that
# autotuning a new shape compiles three to five kernels, not ten. The small-D lists' last two (four
# warps for 128 rows; 128-key context blocks) were added after an H200 study of 11 tile configs at
# nine cases (shared_context-ctxloop-*): each is the fastest at some D32 cases, 3-10% ahead of the
# first three (B4096 Lq2 ctx512 buf32: 41.8 against 46.1 us; B1024 ctx10000 buf0: 49.9 against
# 53.0). Under the interpreter: 16-row tiles, 16-key context blocks, 8-key buffer steps and 4-row
# buffer tiles (BLOCK_R, set by the launcher), so that tiny cases span several of each. The pruner
# drops what does not fit.
_FUSED_CONFIGS = {
    "small_d": config_list([cfg(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_NB=128),
                            cfg(8, 2, BLOCK_M=256, BLOCK_N=64, BLOCK_NB=256),
                            cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_NB=128),
                            cfg(4, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_NB=128),
                            cfg(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_NB=128)],
                           cfg(1, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_NB=8)),
    "large_d": config_list([cfg(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_NB=64),
                            cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_NB=64),
                            cfg(4, 2, BLOCK_M=32, BLOCK_N=32, BLOCK_NB=16)],
                           cfg(1, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_NB=8)),
}
# The context kernel has no buffer phase (BLOCK_NB unused).
_CONTEXT_CONFIGS = {
    "small_d": config_list([cfg(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_NB=16),
                            cfg(8, 2, BLOCK_M=256, BLOCK_N=64, BLOCK_NB=16),
                            cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_NB=16),
                            cfg(4, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_NB=16),
                            cfg(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_NB=16)],
                           cfg(1, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_NB=8)),
    "large_d": config_list([cfg(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_NB=16),
                            cfg(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_NB=16),
                            cfg(4, 2, BLOCK_M=32, BLOCK_N=32, BLOCK_NB=16)],
                           cfg(1, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_NB=8)),
}
# The buffer kernel has no context phase (BLOCK_N unused): BLOCK_M only sets how many samples'
# rows one program streams through.
_BUFFER_CONFIGS = {
    "small_d": config_list([cfg(4, 3, BLOCK_M=128, BLOCK_NB=128),
                            cfg(8, 4, BLOCK_M=512, BLOCK_NB=256),
                            cfg(4, 3, BLOCK_M=256, BLOCK_NB=64)],
                           cfg(1, 1, BLOCK_M=16, BLOCK_NB=8)),
    "large_d": config_list([cfg(4, 3, BLOCK_M=128, BLOCK_NB=64),
                            cfg(8, 3, BLOCK_M=256, BLOCK_NB=64),
                            cfg(4, 2, BLOCK_M=64, BLOCK_NB=16)],
                           cfg(1, 1, BLOCK_M=16, BLOCK_NB=8)),
}
_KEY = ["R_BUCKET", "CTX_BUCKET", "BUF_BUCKET", "NUM_SPLITS", "BLOCK_D", "BLOCK_R", "CAUSAL", "FULL_LENS"]
_PRUNE = {"early_config_prune": pruner(_fits)}

# Split-K sizing: aim at about two programs per SM, with at least this many keys per split (a
# split must amortize writing and merging its partial state).
NOMINAL_BLOCK_M = 64
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


# ---------------------------------------------------------------- kernels


@triton.jit
def shared_context_fused_kernel(
        Q, KC, VC, KB, VB, LENS, O, LSE, WB_O, WB_L, WS_O, WS_L, COUNTERS,
        stride_qb, stride_qh, stride_qn, stride_kch, stride_kcn, stride_vch, stride_vcn,
        stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
        stride_ob, stride_oh, stride_on, stride_lb, stride_lh, stride_ln,
        stride_wbo_b, stride_wbo_h, stride_wbo_n, stride_wbl_b, stride_wbl_h, stride_wbl_n,
        stride_ws_s, stride_ws_b, stride_ws_h, stride_ws_n, stride_wl_s, stride_wl_b, stride_wl_h, stride_wl_n,
        R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_CTX, N_BUF, NUM_SPLITS, scale_hi, scale_lo,
        R_BUCKET, CTX_BUCKET, BUF_BUCKET,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_CONTEXT: tl.constexpr, HAS_BUFFER: tl.constexpr,
        FULL_LENS: tl.constexpr, CAUSAL: tl.constexpr, IN_KERNEL_MERGE: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, ROWS_PAD: tl.constexpr,
        SAMPLES: tl.constexpr, KEYS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_NB: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    hk = tl.program_id(2)
    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    if HAS_BUFFER:
        _buffer_phase(Q, KB, VB, LENS, WB_O, WB_L, pid_m, split, hk,
                      stride_qb, stride_qh, stride_qn, stride_kbb, stride_kbh, stride_kbn,
                      stride_vbb, stride_vbh, stride_vbn, stride_wbo_b, stride_wbo_h, stride_wbo_n,
                      stride_wbl_b, stride_wbl_h, stride_wbl_n,
                      R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, NUM_SPLITS, qk_scale_log2,
                      HEAD_DIM, BLOCK_D, FULL_LENS, CAUSAL, ACC_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_R, ROWS_PAD,
                      BLOCK_NB, SAMPLES, KEYS)
        tl.debug_barrier()  # this CTA's buffer states are written before any thread reads them back
    q, valid, b, h, i, offs_d = _load_q_tile(Q, pid_m, hk, stride_qb, stride_qh, stride_qn, R_TOTAL,
                                             ROWS_PER_SAMPLE, N_Q, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)
    if HAS_BUFFER:
        # Seed the online softmax with the buffer state of the rows whose sample is this split's:
        # (O, LSE) is (acc, l = 1) at m = LSE in base 2.
        mine = valid & (b % NUM_SPLITS == split)
        lse_b = tl.load(WB_L + _rows(b, h, i, stride_wbl_b, stride_wbl_h, stride_wbl_n), mask=mine,
                        other=float("-inf"), cache_modifier=".cg").to(ACC_DTYPE)
        o_b = tl.load(WB_O + _rows(b, h, i, stride_wbo_b, stride_wbo_h, stride_wbo_n)[:, None] + offs_d[None, :],
                      mask=mine[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
        seen = lse_b > float("-inf")
        m_i = tl.where(seen, lse_b * tl.full([], LOG2E, ACC_DTYPE), -1.0e30)
        l_i = seen.to(ACC_DTYPE)
        acc = tl.where(seen[:, None], o_b.to(ACC_DTYPE), 0.0)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=ACC_DTYPE)
        l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    if HAS_CONTEXT:
        acc, l_i, m_i = _context_phase(acc, l_i, m_i, q, KC, VC, split, hk, stride_kch, stride_kcn, stride_vch,
                                       stride_vcn, N_CTX, NUM_SPLITS, qk_scale_log2, offs_d, HEAD_DIM, BLOCK_D,
                                       ACC_DTYPE, DOT_PRECISION, BLOCK_N)
    # the rows' coordinates again, rather than keeping them alive in registers through the loop
    valid, b, g, i = _packed_rows(pid_m, R_TOTAL, ROWS_PER_SAMPLE, N_Q, BLOCK_M)
    h = hk * GROUP + g
    o, lse = _normalized(acc, l_i, m_i)
    o_rows = _rows(b, h, i, stride_ob, stride_oh, stride_on)
    lse_rows = _rows(b, h, i, stride_lb, stride_lh, stride_ln)
    if IN_KERNEL_MERGE:
        ws_rows = _rows(b, h, i, stride_ws_b, stride_ws_h, stride_ws_n)
        wl_rows = _rows(b, h, i, stride_wl_b, stride_wl_h, stride_wl_n)
        split64 = split.to(tl.int64)
        _store_state(WS_O + split64 * stride_ws_s, WS_L + split64 * stride_wl_s, o, lse, ws_rows, wl_rows,
                     valid, offs_d, HEAD_DIM)
        # Every thread's partial is written before the ticket is taken (barrier, then a release
        # atomic); the last arrival reads the others' partials after its acquire, bypassing L1.
        tl.debug_barrier()
        counter = COUNTERS + hk * tl.num_programs(0) + pid_m
        ticket = tl.atomic_add(counter, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:
            tl.debug_barrier()
            d_mask = offs_d < HEAD_DIM
            m, s, merged = merge_init(BLOCK_M, BLOCK_D, ACC_DTYPE)
            for k in range(0, NUM_SPLITS):  # split order: bitwise independent of who merges
                k64 = tl.zeros([], dtype=tl.int64) + k
                part_lse = tl.load(WS_L + k64 * stride_wl_s + wl_rows, mask=valid, other=float("-inf"),
                                   cache_modifier=".cg")
                part_o = tl.load(WS_O + k64 * stride_ws_s + ws_rows[:, None] + offs_d[None, :],
                                 mask=valid[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
                m, s, merged = merge_step(m, s, merged, part_lse.to(ACC_DTYPE), part_o.to(ACC_DTYPE))
            o, lse = merge_finish(m, s, merged)
            _store_state(O, LSE, o, lse, o_rows, lse_rows, valid, offs_d, HEAD_DIM)
            tl.store(counter, 0)  # ready for the next launch
    else:
        _store_state(O, LSE, o, lse, o_rows, lse_rows, valid, offs_d, HEAD_DIM)


@triton.jit
def context_attention_kernel(
        Q, KC, VC, O, LSE,
        stride_qb, stride_qh, stride_qn, stride_kch, stride_kcn, stride_vch, stride_vcn,
        stride_os, stride_ob, stride_oh, stride_on, stride_ls, stride_lb, stride_lh, stride_ln,
        R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_CTX, NUM_SPLITS, scale_hi, scale_lo,
        R_BUCKET, CTX_BUCKET, BUF_BUCKET,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FULL_LENS: tl.constexpr, CAUSAL: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, ROWS_PAD: tl.constexpr,
        SAMPLES: tl.constexpr, KEYS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_NB: tl.constexpr):
    """Attention over the shared context alone: one state (O, LSE) per split, O [S, B, H, Lq, D]."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    hk = tl.program_id(2)
    q, valid, b, h, i, offs_d = _load_q_tile(Q, pid_m, hk, stride_qb, stride_qh, stride_qn, R_TOTAL,
                                             ROWS_PER_SAMPLE, N_Q, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    acc, l_i, m_i = _context_phase(acc, l_i, m_i, q, KC, VC, split, hk, stride_kch, stride_kcn, stride_vch,
                                   stride_vcn, N_CTX, NUM_SPLITS, softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE),
                                   offs_d, HEAD_DIM, BLOCK_D, ACC_DTYPE, DOT_PRECISION, BLOCK_N)
    valid, b, g, i = _packed_rows(pid_m, R_TOTAL, ROWS_PER_SAMPLE, N_Q, BLOCK_M)  # recomputed: see the fused kernel
    h = hk * GROUP + g
    o, lse = _normalized(acc, l_i, m_i)
    split64 = split.to(tl.int64)
    _store_state(O + split64 * stride_os, LSE + split64 * stride_ls, o, lse,
                 _rows(b, h, i, stride_ob, stride_oh, stride_on), _rows(b, h, i, stride_lb, stride_lh, stride_ln),
                 valid, offs_d, HEAD_DIM)


@triton.jit
def buffer_attention_kernel(
        Q, KB, VB, LENS, O, LSE,
        stride_qb, stride_qh, stride_qn, stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
        stride_ob, stride_oh, stride_on, stride_lb, stride_lh, stride_ln,
        R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, scale_hi, scale_lo,
        R_BUCKET, CTX_BUCKET, BUF_BUCKET, NUM_SPLITS,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FULL_LENS: tl.constexpr, CAUSAL: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, ROWS_PAD: tl.constexpr,
        SAMPLES: tl.constexpr, KEYS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Attention of each sample's rows over its own buffer alone: (O, LSE)."""
    _buffer_phase(Q, KB, VB, LENS, O, LSE, tl.program_id(0), 0, tl.program_id(2),
                  stride_qb, stride_qh, stride_qn, stride_kbb, stride_kbh, stride_kbn,
                  stride_vbb, stride_vbh, stride_vbn, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, stride_ln,
                  R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP, N_BUF, 1, softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE),
                  HEAD_DIM, BLOCK_D, FULL_LENS, CAUSAL, ACC_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_R, ROWS_PAD, BLOCK_NB,
                  SAMPLES, KEYS)


def _autotuned(kernel, configs):
    return {cls: autotune(cfgs, key=_KEY, prune_configs_by=_PRUNE)(kernel) for cls, cfgs in configs.items()}


# Each kernel autotuned over its head-dim class's list (the same compiled kernel underneath).
FUSED = _autotuned(shared_context_fused_kernel, _FUSED_CONFIGS)
CONTEXT = _autotuned(context_attention_kernel, _CONTEXT_CONFIGS)
BUFFER = _autotuned(buffer_attention_kernel, _BUFFER_CONFIGS)


def autotuners():
    """Every autotuner of this module (tests clear their remembered picks)."""
    return [tuner for table in (FUSED, CONTEXT, BUFFER) for tuner in table.values()]


def _head_dim_class(head_dim):
    return "small_d" if head_dim <= 64 else "large_d"


# ---------------------------------------------------------------- launchers


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


def clear_split_picks():
    """Forget the measured split counts and the remembered launch configs (tests clear them with
    the autotuners' picks)."""
    global _kept_bytes
    _SPLIT_PICKS.clear()
    forget_plans()
    _kept_bytes = 0  # the forgotten plans' scratch goes with them


def time_ms(fn) -> float:
    """Median GPU time of fn() in ms (host time kept out: gpu_time.py); a module-level hook so that
    tests can time without a GPU."""
    return gpu_time_median_ms(fn)


# Rounds of timing per candidate, interleaved, each candidate's best kept. Added when the pick
# flipped between processes; the flip's cause was host time (see _repeatable), and the second round
# has not been measured on its own since: it is a guard, costing one more timing per candidate.
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


def _tune_key(rows, n_ctx, n_buf, common, config):
    """What the kernels' autotune key (_KEY) buckets, less NUM_SPLITS; plus a forced config."""
    return (seq_bucket(rows), seq_bucket(n_ctx), seq_bucket(n_buf), common["BLOCK_D"], common["BLOCK_R"],
            common["CAUSAL"], common["FULL_LENS"], None if config is None else tuple(sorted(config.items())))


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


_COUNTERS = {}


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _counters(device, count):
    """Zeroed per-tile tickets for the in-kernel merge, kept per device and stream: the last
    program of each tile resets its ticket, so the buffer is zero again after every launch. A
    CUDA graph being captured gets tickets of its own, zeroed by the graph itself: two graphs
    captured on one (recycled) stream and replayed at once must not share them."""
    if _capturing(device):
        return torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < count:
        have = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = have
    return have


def _sizes(q, heads_kv):
    batch, heads_q, n_q, head_dim = q.shape
    group = heads_q // heads_kv
    return batch, heads_q, n_q, head_dim, group, batch * group * n_q


def buffer_rows(rows_per_sample: int, device) -> tuple:
    """(BLOCK_R, ROWS_PAD) of the buffer phase: a step's rows (a tensor-core tile, 16..64; 4 under
    the interpreter, so that the CPU gate walks several samples and row chunks per tile) and the
    rows given to each sample in it (its G * Lq rows padded to a power of two, at most BLOCK_R)."""
    if torch.device(device).type == "cpu":
        block_r = 4
    else:
        block_r = max(16, min(64, next_pow2(rows_per_sample)))
    return block_r, min(block_r, next_pow2(rows_per_sample))


# The most bytes of K and V one whole-buffer step loads (its pipelined stages multiply this in
# shared memory); under the interpreter, the most keys a step takes, small enough that the CPU gate
# has buffers on both paths.
WHOLE_STEP_BYTES = 32 * 1024
INTERPRETER_WHOLE_STEP_KEYS = 16


def buffer_steps(rows_per_sample: int, n_buf: int, head_dim: int, element_size: int, device) -> tuple:
    """(BLOCK_R, ROWS_PAD, SAMPLES, KEYS) of the buffer phase. KEYS > 0: each step takes SAMPLES
    whole samples, KEYS keys each (the buffer padded to a power of two), ``_buffer_whole``; this
    needs all of a sample's rows in one row chunk and SAMPLES * KEYS keys within the step budget.
    KEYS = 0: ``_buffer_keyblocks`` (long buffers, or more than BLOCK_R rows a sample)."""
    block_r, rows_pad = buffer_rows(rows_per_sample, device)
    if not n_buf or rows_per_sample > rows_pad:
        return block_r, rows_pad, 1, 0
    if torch.device(device).type == "cpu":
        step_keys, min_keys = INTERPRETER_WHOLE_STEP_KEYS, 1
    else:  # tl.dot needs 16 along each dim on a GPU
        step_keys, min_keys = WHOLE_STEP_BYTES // (2 * max(16, next_pow2(head_dim)) * element_size), 16
    keys = next_pow2(n_buf)
    samples = min(block_r // rows_pad, step_keys // keys)
    if not samples:
        return block_r, rows_pad, 1, 0
    return block_r, rows_pad, samples, max(keys, cdiv(min_keys, samples))


@functools.lru_cache(maxsize=256)
def _constexprs(dtype, device_type, head_dim, causal, full_lens, rows_per_sample, n_buf):
    """The kernels' compile-time flags for one call signature (read-only; cached, being host time
    paid on every decode step)."""
    block_r, rows_pad, samples, keys = buffer_steps(rows_per_sample, n_buf, head_dim, dtype.itemsize, device_type)
    return types.MappingProxyType(dict(
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)), CAUSAL=bool(causal), FULL_LENS=full_lens,
        ACC_DTYPE=accumulator_dtype(dtype), DOT_PRECISION=dot_precision(dtype), BLOCK_R=block_r, ROWS_PAD=rows_pad,
        SAMPLES=samples, KEYS=keys))


def _common(q, head_dim, causal, full_lens, rows_per_sample, n_buf):
    return _constexprs(q.dtype, q.device.type, head_dim, causal, full_lens, rows_per_sample, n_buf)


def _launch(kernel, grid, args, constexprs, config):
    """Autotuned launch, or one explicit configuration (a dict with BLOCK_M, BLOCK_N, BLOCK_NB,
    num_warps, num_stages) for tuning studies. Returns what a LaunchPlan needs to repeat it:
    (JIT function, compiled kernel or None, grid, keyword arguments)."""
    if config is None:
        compiled = kernel[grid](*args, **constexprs)
        chosen = kernel.best_config
        return kernel.fn, compiled, grid(chosen.kwargs), {**constexprs, **chosen.all_kwargs()}
    config = dict(config)
    launch = dict(num_warps=config.pop("num_warps", 4), num_stages=config.pop("num_stages", 2))
    names = kernel.fn.arg_names
    config = {k: v for k, v in config.items() if k in names}  # e.g. BLOCK_N means nothing to the buffer kernel
    kwargs = {**constexprs, **config, **launch}
    return kernel.fn, kernel.fn[grid](*args, **kwargs), grid(kwargs), kwargs


def _repeatable(made, n_tensors, scalars):
    """A LaunchPlan repeating the launch ``_launch`` made; the split-count candidates are timed
    through it. (Timed through the autotuner's launch path with do_bench, the pick once compared
    host times, not kernels: 2 splits for B4096 H4 Lq2 Nctx512 Nbuf32 on an H200, 56.5 us, over 1,
    45.8 us. time_ms now keeps host time out; the plan keeps the candidates' launches cheap.)"""
    fn, compiled, grid, kwargs = made
    return LaunchPlan(fn, compiled, grid, n_tensors, scalars, kwargs)


def _plan_key(kind, q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, *scalars):
    """A launch plan's key (attnbench/kernels/launch.py): every tensor's signature and the call's scalars;
    None (no plan) under autotuning studies' explicit configs, which the callers pass as a scalar."""
    return (kind, tensor_signature(q), tensor_signature(k_ctx), tensor_signature(v_ctx), tensor_signature(k_buf),
            tensor_signature(v_buf), tensor_signature(buf_lens), autotune_enabled(), *scalars)


def _state_dtype(q):
    return accumulator_torch_dtype(q.dtype)


def _new_scratch(q, heads_kv, n_buf, splits, stand_ins):
    """(wb_o, wb_l, ws_o, ws_l, counters): the buffer states (passed from the buffer phase to the
    context phase through L2), the split partials and their merge tickets. An absent part points at
    the other part's tensors, or at ``stand_ins`` (an (o, lse) pair) when both are absent: never
    read (HAS_BUFFER / IN_KERNEL_MERGE are off)."""
    batch, heads_q, n_q, head_dim = q.shape

    def states(*lead):
        return (new_output((*lead, batch, heads_q, n_q, head_dim), _state_dtype(q), q.device),
                new_output((*lead, batch, heads_q, n_q), lse_dtype(q.dtype), q.device))

    wb = states() if n_buf else None
    ws = states(splits) if splits > 1 else None
    wb = wb or ws or stand_ins
    ws = ws or wb
    counters = _counters(q.device, heads_kv * cdiv(batch * heads_q * n_q // heads_kv, 16)) if splits > 1 else wb[1]
    return (*wb, *ws, counters)


def _fused_tensors(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, splits, out_dtype, scratch=None):
    """The fused kernel's 13 pointer arguments: the inputs (q as the stand-in for an absent part),
    fresh outputs, and the scratch of ``_new_scratch`` (``scratch``: kept from an earlier call)."""
    batch, heads_q, n_q, _ = q.shape
    n_ctx, n_buf = k_ctx.shape[1], 0 if k_buf is None else k_buf.shape[2]
    o = new_output(q.shape, out_dtype, q.device)
    lse = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)
    if scratch is None:
        scratch = _new_scratch(q, k_ctx.shape[0], n_buf, splits, (o, lse))
    return (q, k_ctx if n_ctx else q, v_ctx if n_ctx else q, k_buf if n_buf else q, v_buf if n_buf else q,
            buf_lens if n_buf and buf_lens is not None else q, o, lse, *scratch)


# Bytes of scratch (the fused kernel's buffer states and split partials) that plans keep between
# calls, all plans together: a decode loop's few shapes fit; a sweep of many shapes allocates.
# Keeping them saves four allocations a call (~15 us of host time on an H200 host, measured).
MAX_KEPT_SCRATCH_BYTES = 1 << 30
_kept_bytes = 0


def _kept_scratch(kept, q, heads_kv, n_buf, splits):
    """The scratch a plan keeps for the current stream (made on first use), or None: allocate. Calls
    on one stream are ordered, so they may share it; another stream gets its own, and a CUDA graph
    being captured allocates its own (graph-owned) scratch, as it must for replays on any stream.
    Under the interpreter nothing is kept (one launch is milliseconds of numpy)."""
    global _kept_bytes
    if not (n_buf or splits > 1) or q.device.type != "cuda" or _capturing(q.device):
        return None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    scratch = kept.get(stream)
    if scratch is None:
        scratch = _new_scratch(q, heads_kv, n_buf, splits, None)
        size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in scratch[:4]}.values())
        if _kept_bytes + size > MAX_KEPT_SCRATCH_BYTES:
            return None
        _kept_bytes += size
        kept[stream] = scratch
    return scratch


def fused_launch(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, sm_scale, *, num_splits=None, config=None,
                 out_dtype=None, signature=None):
    """Buffer, context and merge in one launch on checked inputs. Returns (o, lse). ``signature``:
    the caller's key for the tensors as it was given them, when what it passes here is a function
    of it (saves recomputing it on the hot path)."""
    out_dtype = out_dtype or q.dtype
    if config is not None:
        key = None
    elif signature is not None:
        key = ("fused", signature, autotune_enabled(), causal, sm_scale, num_splits, out_dtype)
    else:
        key = _plan_key("fused", q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, sm_scale, num_splits, out_dtype)
    if key is not None and (known := plan(key)) is not None:  # the decode loop's every call after the first
        splits, launch_plan, kept = known
        with on_device(q):
            scratch = _kept_scratch(kept, q, k_ctx.shape[0], 0 if k_buf is None else k_buf.shape[2], splits)
            tensors = _fused_tensors(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, splits, out_dtype, scratch)
            launch_plan(tensors)
        return tensors[6], tensors[7]
    heads_kv, n_ctx = k_ctx.shape[0], k_ctx.shape[1]
    batch, heads_q, n_q, head_dim, group, rows = _sizes(q, heads_kv)
    n_buf = 0 if k_buf is None else k_buf.shape[2]
    full = n_buf == 0 or buf_lens is None
    common = _common(q, head_dim, causal, full, group * n_q, n_buf)
    tune_key = _tune_key(rows, n_ctx, n_buf, common, config)

    def runner(splits, plan_key=None):
        """Fresh outputs for this split count, and the launch that writes them (and, given a
        plan_key, remembers how)."""
        tensors = _fused_tensors(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, splits, out_dtype)
        _, kc, vc, kb, vb, _, o, lse, wb_o, wb_l, ws_o, ws_l, _ = tensors
        merge = splits > 1
        scalars = (*q.stride()[:3], *(kc.stride()[:2] if n_ctx else (0, 0)), *(vc.stride()[:2] if n_ctx else (0, 0)),
                   *(kb.stride()[:3] if n_buf else (0, 0, 0)), *(vb.stride()[:3] if n_buf else (0, 0, 0)),
                   *o.stride()[:3], *lse.stride(), *(wb_o.stride()[:3] if n_buf else (0, 0, 0)),
                   *(wb_l.stride() if n_buf else (0, 0, 0)), *(ws_o.stride()[:4] if merge else (0, 0, 0, 0)),
                   *(ws_l.stride() if merge else (0, 0, 0, 0)), rows, group * n_q, n_q, group, n_ctx, n_buf, splits,
                   *split_scale(sm_scale), seq_bucket(rows), seq_bucket(n_ctx), seq_bucket(n_buf))
        constexprs = dict(common, HAS_CONTEXT=n_ctx > 0, HAS_BUFFER=n_buf > 0, IN_KERNEL_MERGE=merge)
        made = []

        def launch():
            # Every launch runs to completion, so its last arrivals leave the merge tickets at zero.
            with on_device(q):
                if made:  # a timed repeat: the plan's launch (see _repeatable)
                    made[0](tensors)
                    return o, lse
                made.append(_repeatable(_launch(FUSED[_head_dim_class(head_dim)],
                                                lambda meta: (cdiv(rows, meta["BLOCK_M"]), splits, heads_kv),
                                                (*tensors, *scalars), constexprs, config), len(tensors), scalars))
            if plan_key is not None:
                remember(plan_key, (splits, made[0], {}))
            return o, lse

        return launch

    splits = _split_count("fused", num_splits, rows, heads_kv, n_ctx + n_buf, q, tune_key, runner)
    return runner(splits, _plannable(key, q))()  # the caller's own outputs, untouched by any timing run


def _plannable(key, q):
    """``key`` when a plan may be made now: not while a CUDA graph is being captured or
    torch.compile traces (a split count picked there is provisional: nothing could be timed)."""
    if key is None or torch.compiler.is_compiling():
        return None
    with on_device(q):
        return None if _capturing(q.device) else key


def context_launch(q, k_ctx, v_ctx, sm_scale, *, num_splits=None, config=None, out_dtype=None):
    """Attention of every sample's queries over the shared context alone. Returns (o, lse); with
    several splits the partial states are reduced by ``merge_stack_launch`` (a second launch)."""
    out_dtype = out_dtype or q.dtype
    key = None if config is not None else _plan_key("context", q, k_ctx, v_ctx, None, None, None, sm_scale,
                                                    num_splits, out_dtype)
    heads_kv, n_ctx = k_ctx.shape[0], k_ctx.shape[1]
    batch, heads_q, n_q, head_dim, group, rows = _sizes(q, heads_kv)

    def partials(splits):
        part_dtype = _state_dtype(q) if splits > 1 else out_dtype
        return (q, k_ctx, v_ctx, new_output((splits, batch, heads_q, n_q, head_dim), part_dtype, q.device),
                new_output((splits, batch, heads_q, n_q), lse_dtype(q.dtype), q.device))

    def reduced(splits, o, lse):
        return merge_stack_launch(o, lse, out_dtype) if splits > 1 else (o[0], lse[0])

    if key is not None and (known := plan(key)) is not None:
        splits, launch_plan = known
        tensors = partials(splits)
        with on_device(q):
            launch_plan(tensors)
            return reduced(splits, *tensors[3:])
    common = _common(q, head_dim, False, True, group * n_q, 0)
    tune_key = _tune_key(rows, n_ctx, 0, common, config)

    def runner(splits, plan_key=None):
        """Fresh partial states for this split count, and the launches (kernel, then the
        reduction) that write them and return (o, lse)."""
        tensors = partials(splits)
        o, lse = tensors[3:]
        scalars = (*q.stride()[:3], *k_ctx.stride()[:2], *v_ctx.stride()[:2], *o.stride()[:4], *lse.stride(), rows,
                   group * n_q, n_q, group, n_ctx, splits, *split_scale(sm_scale), seq_bucket(rows), seq_bucket(n_ctx),
                   seq_bucket(0))

        made = []

        def launch():
            with on_device(q):
                if made:  # a timed repeat: the plan's launch (see _repeatable)
                    made[0](tensors)
                    return reduced(splits, o, lse)
                made.append(_repeatable(_launch(CONTEXT[_head_dim_class(head_dim)],
                                                lambda meta: (cdiv(rows, meta["BLOCK_M"]), splits, heads_kv),
                                                (*tensors, *scalars), common, config), len(tensors), scalars))
                if plan_key is not None:
                    remember(plan_key, (splits, made[0]))
                return reduced(splits, o, lse)

        return launch

    splits = _split_count("context", num_splits, rows, heads_kv, n_ctx, q, tune_key, runner)
    return runner(splits, _plannable(key, q))()


def buffer_launch(q, k_buf, v_buf, buf_lens, causal, sm_scale, *, config=None, out_dtype=None):
    """Attention of each sample's queries over its own buffer alone. Returns (o, lse)."""
    out_dtype = out_dtype or q.dtype
    heads_kv = k_buf.shape[1]
    batch, heads_q, n_q, head_dim, group, rows = _sizes(q, heads_kv)
    o = new_output(q.shape, out_dtype, q.device)
    lse = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)
    tensors = (q, k_buf, v_buf, buf_lens if buf_lens is not None else q, o, lse)
    key = None if config is not None else _plan_key("buffer", q, None, None, k_buf, v_buf, buf_lens, causal,
                                                    sm_scale, out_dtype)
    if key is not None and (known := plan(key)) is not None:
        with on_device(q):
            known(tensors)
        return o, lse
    n_buf = k_buf.shape[2]
    scalars = (*q.stride()[:3], *k_buf.stride()[:3], *v_buf.stride()[:3], *o.stride()[:3], *lse.stride(), rows,
               group * n_q, n_q, group, n_buf, *split_scale(sm_scale), seq_bucket(rows), seq_bucket(0),
               seq_bucket(n_buf), 1)
    with on_device(q):
        made = _launch(BUFFER[_head_dim_class(head_dim)], lambda meta: (cdiv(rows, meta["BLOCK_M"]), 1, heads_kv),
                       (*tensors, *scalars), _common(q, head_dim, causal, buf_lens is None, group * n_q, n_buf), config)
    if (key := _plannable(key, q)) is not None:
        fn, compiled, grid, kwargs = made
        remember(key, LaunchPlan(fn, compiled, grid, len(tensors), scalars, kwargs))
    return o, lse


def composed_launch(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, sm_scale, *, num_splits=None,
                    context_config=None, buffer_config=None):
    """Path (a): context kernel (+ split reduction), buffer kernel, merge_states kernel. The two
    halves stay in fp32 until the merge, so the composition rounds once, like the fused path."""
    n_ctx = k_ctx.shape[1]
    n_buf = 0 if k_buf is None else k_buf.shape[2]
    if not n_buf:
        return context_launch(q, k_ctx, v_ctx, sm_scale, num_splits=num_splits, config=context_config)
    if not n_ctx:
        return buffer_launch(q, k_buf, v_buf, buf_lens, causal, sm_scale, config=buffer_config)
    o_c, lse_c = context_launch(q, k_ctx, v_ctx, sm_scale, num_splits=num_splits, config=context_config,
                                out_dtype=_state_dtype(q))
    o_b, lse_b = buffer_launch(q, k_buf, v_buf, buf_lens, causal, sm_scale, config=buffer_config,
                               out_dtype=_state_dtype(q))
    return merge_two_launch(o_c, lse_c, o_b, lse_b, q.dtype)


__all__ = ["autotuners", "buffer_rows", "buffer_steps", "buffer_launch", "choose_splits", "clear_split_picks",
           "composed_launch", "context_launch", "fused_launch", "interpreting", "multiprocessors", "pick_splits",
           "split_candidates"]
