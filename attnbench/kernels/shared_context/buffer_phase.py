"""The buffer phase: each sample's rows against that sample's own keys, written as states (O, LSE).

Each sample's rows see only that sample's keys, so the buffer is not a matmul of the
tile. The buffer phase walks the samples of the tile in a software-pipelined loop (the next
samples' keys stream in while these compute): per step a [BLOCK_R, D] x [D, BLOCK_NB] tensor-core
product of a few samples' G*Lq rows each (padded to BLOCK_R >= 16 on a GPU) with their keys,
masked block-diagonally. Padding wastes tensor-core work, not bytes: the buffer is memory-bound
(each element serves G*Lq rows), as long as its instructions per byte are few. Short buffers
(TabPFN's) take whole samples a step (``_buffer_whole``: one softmax, offsets advanced by a
constant); long ones are walked in key blocks with an online softmax (``_buffer_keyblocks``, ONE
flat loop over (sample group, row chunk, key block)). Where both apply, whole samples are the
faster: they spend fewer instructions on each byte (docs/measurements/shared_context.md).

``buffer_rows`` and ``buffer_steps`` are the host side: the step geometry the launchers pass in
as compile-time constants.
"""
import torch
import triton
import triton.language as tl

from ..precision import ROW_MAX_START
from ..tuning import cdiv, next_pow2
from .packed_rows import _normalized, _rows, _store_state


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
    clamped, so that they never read out of bounds: in the lengths' own dtype first (an int64 of 2**32 + 1
    cast to int32 first read as 1)."""
    return tl.minimum(tl.maximum(tl.load(LENS + b, mask=mask, other=0), 0), N_BUF).to(tl.int32)


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
    m_i = tl.full([BLOCK_R], ROW_MAX_START, dtype=ACC_DTYPE)
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
        m_i = tl.where(fresh, ROW_MAX_START, m_i)
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
