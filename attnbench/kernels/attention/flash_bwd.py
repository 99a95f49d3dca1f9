"""FlashAttention-2 backward (Algorithm 4) as three launches, no atomics, bitwise deterministic
(unless a caller asks for the atomic dQ route: ``dq_route``, at the end).

1. ``delta = rowsum(dO * O) - dLSE`` per query row (row_dot.py; dLSE is the cotangent of the
   logsumexp output, zero unless the caller differentiates through the LSE).
2. dK/dV pass: one program per key block of one (batch, KV head). It walks every query block of
   every query head in its GQA group, recomputes P^T = exp(s K Q^T - L) from the saved
   logsumexp, and accumulates dV += P^T dO and dK += s dS^T Q with dS = P * (dP - delta).
3. dQ pass: one program per query block of one (batch, query head), walking the key blocks and
   accumulating dQ += s dS K.

Splitting dQ into its own pass costs two extra matmuls (recomputing S and dP) but each output is
owned by one program, so there are no atomics and the result does not depend on scheduling.
``dq_route("atomic")`` and ``dq_route("tma_atomic")`` are the measured alternatives: the dK/dV pass
also adds dS K into an fp32 dQ with atomics, or with one bulk reduction of the copy engine a tile
(five matmuls, not seven; not deterministic); off unless asked for.

At head widths of 256 the dK/dV pass runs twice, as a dV pass and a dK pass (``dkdv_route``): two
[keys, 256] fp32 accumulators do not fit a thread's registers together at tiles that reuse K and V
well, one does.

Head dims that are not a power of two are tiled in two column blocks (key_block.py): the scores and
dP sum both blocks' products, and dQ, dK, dV each keep one accumulator a block.

Masking is cheap here: out-of-range query rows load L = +inf (so P = 0 and they add nothing);
out-of-range keys load K = V = 0 and their dK/dV rows are never stored, but in the dQ pass their
P = exp2(0 - L) is masked explicitly, in the last (masked) key block only: for a row whose LSE is
below -88 it would overflow to inf, and inf * 0 is NaN. A fully masked
row has L = -inf from the forward; it is read as +inf so its P is 0, not NaN.
"""
import contextlib
import functools

import torch
import triton
import triton.language as tl

from .. import interpreting
from .flash_bwd_hopper import HOPPER_DKDV_HEAD_DIMS, flash_bwd_dkdv_hopper_launch
from .flash_fwd_hopper import hopper_applies
from .copies import copy_heads_each, sum_shares
from .head_padding import cut_heads, pad_heads, padded_width
from ..launch import descriptor_scratch, kept, planned, tma_capable
from .key_block import head_columns, key_block_mask
from ..outputs import new_output
from ..precision import (LOG2E, accumulator_dtype, accumulator_torch_dtype, dot_precision, softmax_scale_log2,
                        split_scale)
from .routes import RouteSwitch
from .row_dot import row_dot_launch
from .softmax_rows import blind_rows, load_lse_log2
from ..tiling import query_tile, row_strides, visible_key_count, visible_keys
from ..tuning import (autotune, cdiv, cfg, configs, config_list, head_dim_blocks, head_width, multiprocessors,
                      pruner, registers_per_thread, seq_bucket)


# Which of dK and dV a dK/dV-pass program forms (FORM_DK, FORM_DV): both in one pass, or, where the two
# accumulators do not fit a thread's registers together (wide heads), a dV pass (S, P^T dO: two matmuls)
# and a dK pass (S, dP, dS^T Q: three) that each hold one.
BOTH_PASS = {"FORM_DK": True, "FORM_DV": True}
SPLIT_PASSES = ({"FORM_DK": False, "FORM_DV": True}, {"FORM_DK": True, "FORM_DV": False})


@triton.jit
def _dkdv_query_block(dk, dv, dk2, dv2, k, v, k2, v2, Q_head, DO_head, LSE_head, DELTA_head, DQ_head, dq_desc,
                      dq_desc2, bh, stride_qn, stride_don, m0, offs_n, offs_d, offs_d2, N_Q, N_K, HEAD_DIM,
                      causal_offset, qk_scale_log2, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_D2: tl.constexpr, MASKED: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
                      FORM_DK: tl.constexpr, FORM_DV: tl.constexpr):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = offs_m[:, None] < N_Q
    row_mask = rows & head_columns(offs_d, HEAD_DIM)[None, :]
    # A row that sees no key (only in MASKED blocks: full_lo is past them) has dS = 0, but its query, whatever it
    # holds, would still reach dK through dS^T Q (0 * NaN = NaN): it is read as 0
    sighted = rows & ~blind_rows(offs_m, causal_offset, MASKED)[:, None]
    q = tl.load(Q_head + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_mask & sighted, other=0.0)
    do = tl.load(DO_head + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_mask, other=0.0)
    lse_log2 = load_lse_log2(LSE_head, offs_m, N_Q)
    delta = tl.load(DELTA_head + offs_m, mask=offs_m < N_Q, other=0.0)
    # Transposed tiles ([keys, queries]) so dK and dV come out of the dots without a transpose.
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:  # the head dim's second column block (key_block.py)
        row_mask2 = rows & head_columns(offs_d2, HEAD_DIM)[None, :]
        q2 = tl.load(Q_head + offs_m[:, None] * stride_qn + offs_d2[None, :], mask=row_mask2 & sighted, other=0.0)
        do2 = tl.load(DO_head + offs_m[:, None] * stride_don + offs_d2[None, :], mask=row_mask2, other=0.0)
        s_t += tl.dot(k2, tl.trans(q2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    p_t = tl.math.exp2(s_t * qk_scale_log2 - lse_log2[None, :])
    if MASKED:
        p_t = tl.where(offs_m[None, :] + causal_offset >= offs_n[:, None], p_t, 0.0)
    if FORM_DV:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if BLOCK_D2 > 0:
            dv2 += tl.dot(p_t.to(do2.dtype), do2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if FORM_DK:
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if BLOCK_D2 > 0:
            dp_t += tl.dot(v2, tl.trans(do2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if BLOCK_D2 > 0:
            dk2 += tl.dot(ds_t.to(q2.dtype), q2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if ATOMIC_DQ:  # dQ += dS K for these rows, added in whatever order the programs reach them (FORM_DK too)
        # keys past N_K load K = 0, so their P = exp2(0 - lse) overflows for LSE < -88 and inf * 0
        # would be NaN in dS K: they are masked here (dK and dV drop those rows at the store)
        ds = tl.trans(tl.where(offs_n[:, None] < N_K, ds_t, 0.0).to(k.dtype))
        dq_part = tl.dot(ds, k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if BLOCK_D2 > 0:
            dq_part2 = tl.dot(ds, k2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        if DQ_TMA:  # one bulk reduction a tile, summed in L2 by the copy engine; rows past N_Q are clipped
            dq_desc.atomic_add([bh, m0, 0], tl.reshape(dq_part, [1, BLOCK_M, BLOCK_D]))
            if BLOCK_D2 > 0:
                dq_desc2.atomic_add([bh, m0, BLOCK_D], tl.reshape(dq_part2, [1, BLOCK_M, BLOCK_D2]))
        else:
            # relaxed: nothing reads dQ before the kernel ends (the default, acq_rel, is an ordered round trip
            # per element, far slower: docs/measurements/flash.md)
            dq_rows = DQ_head + offs_m[:, None] * HEAD_DIM
            tl.atomic_add(dq_rows + offs_d[None, :], dq_part, mask=row_mask, sem="relaxed")
            if BLOCK_D2 > 0:
                tl.atomic_add(dq_rows + offs_d2[None, :], dq_part2, mask=row_mask2, sem="relaxed")
    return dk, dv, dk2, dv2


# Accumulator registers a thread may hold (registers_per_thread): dK and dV at 256 registers a thread
# spill (D 256 at 4 warps x 64 keys), at 160-192 they do not (D 160 as 128 + 32 columns at 4 warps x
# 64 keys is the fastest tile there; docs/measurements/flash.md).
ACCUMULATOR_REGISTERS = 192


def _dkdv_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (2 * kw["BLOCK_N"] * block_d + config.num_stages * 2 * kw["BLOCK_M"] * block_d) * element_size


def _dkdv_atomic_shared_bytes(config, constexprs):
    """The tma_atomic route's fp32 dQ tile, staged for the copy engine, and the transposed dS operand of
    dS K (a D 256 launch at 64 x 32 tiles asks for 238,592 bytes: 73 KiB past its K, V, Q and dO stages)."""
    if not constexprs.get("ATOMIC_DQ"):
        return 0
    kw = config.kwargs
    staging = kw["BLOCK_M"] * head_width(constexprs) * 4 if constexprs.get("DQ_TMA") else 0
    return staging + kw["BLOCK_M"] * kw["BLOCK_N"] * 4


def _accumulators_fit(elements, config, constexprs):
    itemsize = constexprs["ACC_DTYPE"].primitive_bitwidth // 8  # fp64 accumulators take two registers
    return registers_per_thread(elements, config.num_warps, itemsize) <= ACCUMULATOR_REGISTERS


def _dkdv_accumulators_fit(config, constexprs):
    """dK and dV (or the one of them a split pass forms), [BLOCK_N, head width] each, within the
    accumulator registers of a thread."""
    count = int(constexprs.get("FORM_DK", True)) + int(constexprs.get("FORM_DV", True))
    return _accumulators_fit(count * config.kwargs["BLOCK_N"] * head_width(constexprs), config, constexprs)


# Ordered fastest first over D 64-256 (bf16; docs/measurements/flash.md): the first that fits is the
# default when autotuning is off. The 128-key tiles lead at D <= 128 (and at D 192); at D 256 only
# 32- and 64-key tiles keep dK and dV in registers (4 warps x 32 keys, 8 warps x 64 keys).
_DKDV_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_N",
            (8, 3, 64, 128), (4, 3, 32, 128), (8, 2, 64, 128),
            (4, 2, 32, 64), (4, 2, 64, 32), (8, 2, 64, 64),
            # the D 256 dK pass's (split route)
            (4, 2, 16, 64)),
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16))


# DQ_ACC is zeroed before each config is timed and after tuning (the atomic route adds into it).
@autotune(_DKDV_CONFIGS, key=["SEQ_BUCKET", "BLOCK_D", "BLOCK_D2", "CAUSAL", "GROUP", "ATOMIC_DQ", "DQ_TMA",
                               "FORM_DK", "FORM_DV"],
                 prune_configs_by={"early_config_prune": pruner(_dkdv_shared_bytes, _dkdv_accumulators_fit,
                                                                _dkdv_atomic_shared_bytes)},
                 reset_to_zero=["DQ_ACC"])
@triton.jit
def flash_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
                          stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                          BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
                          FORM_DK: tl.constexpr, FORM_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_rows = K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn
    v_rows = V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn
    kv_mask = key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, True)
    k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0)
    if FORM_DK:  # dP = dO V^T; a dV pass does without V
        v = tl.load(v_rows + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        v = k
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC_DTYPE)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:  # the head dim's second column block (key_block.py)
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        kv_mask2 = key_block_mask(offs_n, offs_d2, N_K, HEAD_DIM, True)
        k2 = tl.load(k_rows + offs_d2[None, :], mask=kv_mask2, other=0.0)
        if FORM_DK:
            v2 = tl.load(v_rows + offs_d2[None, :], mask=kv_mask2, other=0.0)
        else:
            v2 = k2
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=ACC_DTYPE)
        dv2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=ACC_DTYPE)
    else:
        offs_d2, k2, v2, dk2, dv2 = offs_d, k, v, dk, dv
    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)

    # Query rows that see any of these keys start at i = n0 - causal_offset; query blocks from
    # full_lo on see every key of the block, the ones before it straddle the diagonal.
    if CAUSAL:
        lo = tl.maximum(n0 - causal_offset, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.minimum(tl.maximum(tl.cdiv(n0 + BLOCK_N - 1 - causal_offset, BLOCK_M) * BLOCK_M, lo), N_Q)
    else:
        lo = 0
        full_lo = 0
    if DQ_TMA:  # DQ_ACC as [B * Hq, N_Q, D] fp32 (contiguous; the launcher checks D * 4 is 16-byte aligned)
        dq_desc = tl.make_tensor_descriptor(DQ_ACC, [tl.num_programs(2) * H_Q, N_Q, HEAD_DIM],
                                            [N_Q * HEAD_DIM, HEAD_DIM, 1], [1, BLOCK_M, BLOCK_D])
        if BLOCK_D2 > 0:
            dq_desc2 = tl.make_tensor_descriptor(DQ_ACC, [tl.num_programs(2) * H_Q, N_Q, HEAD_DIM],
                                                 [N_Q * HEAD_DIM, HEAD_DIM, 1], [1, BLOCK_M, BLOCK_D2])
        else:
            dq_desc2 = dq_desc
    else:
        dq_desc, dq_desc2 = DQ_ACC, DQ_ACC
    for g in range(0, GROUP):
        h = hk * GROUP + g
        Q_head = Q + b * stride_qb + h * stride_qh
        DO_head = DO + b * stride_dob + h * stride_doh
        bh = b * H_Q + h  # the (batch, query head) row of the [B, Hq, ...] row statistics and dQ sum
        LSE_head = LSE + bh * N_Q
        DELTA_head = DELTA + bh * N_Q
        DQ_head = DQ_ACC + bh * N_Q * HEAD_DIM  # [B, Hq, Nq, D], contiguous
        for m0 in range(lo, full_lo, BLOCK_M):
            dk, dv, dk2, dv2 = _dkdv_query_block(dk, dv, dk2, dv2, k, v, k2, v2, Q_head, DO_head, LSE_head, DELTA_head,
                                                 DQ_head, dq_desc, dq_desc2, bh.to(tl.int32), stride_qn, stride_don,
                                                 m0, offs_n, offs_d, offs_d2, N_Q, N_K, HEAD_DIM, causal_offset,
                                                 qk_scale_log2, BLOCK_M, BLOCK_D, BLOCK_D2, True, ACC_DTYPE,
                                                 DOT_PRECISION, ATOMIC_DQ, DQ_TMA, FORM_DK, FORM_DV)
        for m0 in range(full_lo, N_Q, BLOCK_M):
            dk, dv, dk2, dv2 = _dkdv_query_block(dk, dv, dk2, dv2, k, v, k2, v2, Q_head, DO_head, LSE_head, DELTA_head,
                                                 DQ_head, dq_desc, dq_desc2, bh.to(tl.int32), stride_qn, stride_don,
                                                 m0, offs_n, offs_d, offs_d2, N_Q, N_K, HEAD_DIM, causal_offset,
                                                 qk_scale_log2, BLOCK_M, BLOCK_D, BLOCK_D2, False, ACC_DTYPE,
                                                 DOT_PRECISION, ATOMIC_DQ, DQ_TMA, FORM_DK, FORM_DV)

    # dS was formed from base-2 scores divided back by log2(e) implicitly: dK = scale * dS^T Q.
    dk_scale = qk_scale_log2 / tl.full([], LOG2E, ACC_DTYPE)
    dk_rows = DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn
    dv_rows = DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn
    if FORM_DK:
        tl.store(dk_rows + offs_d[None, :], (dk * dk_scale).to(DK.dtype.element_ty), mask=kv_mask)
        if BLOCK_D2 > 0:
            tl.store(dk_rows + offs_d2[None, :], (dk2 * dk_scale).to(DK.dtype.element_ty), mask=kv_mask2)
    if FORM_DV:
        tl.store(dv_rows + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)
        if BLOCK_D2 > 0:
            tl.store(dv_rows + offs_d2[None, :], dv2.to(DV.dtype.element_ty), mask=kv_mask2)


@triton.jit
def _dq_key_block(dq, dq2, q, q2, do, do2, lse_log2, delta, K_head, V_head, stride_kn, stride_vn, n0, offs_m, offs_d,
                  offs_d2, N_K, HEAD_DIM, causal_offset, qk_scale_log2, BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, MASKED)
    k = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:  # the head dim's second column block (key_block.py)
        kv_mask2 = key_block_mask(offs_n, offs_d2, N_K, HEAD_DIM, MASKED)
        k2 = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d2[None, :], mask=kv_mask2, other=0.0)
        v2 = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d2[None, :], mask=kv_mask2, other=0.0)
        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    p = tl.math.exp2(s * qk_scale_log2 - lse_log2[:, None])
    if MASKED:  # keys past N_K load K = 0, so s = 0 there and exp2(-lse) overflows for LSE < -88
        keep = offs_n[None, :] < N_K
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        dp += tl.dot(do2, tl.trans(v2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        dq2 += tl.dot(ds.to(k2.dtype), k2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dq, dq2


def _dq_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (2 * kw["BLOCK_M"] * block_d + config.num_stages * 2 * kw["BLOCK_N"] * block_d) * element_size


def _dq_accumulator_fits(config, constexprs):
    return _accumulators_fit(config.kwargs["BLOCK_M"] * head_width(constexprs), config, constexprs)


# Ordered as above: 8 warps on 128 x 64 tiles lead at D <= 128 and D 160, 128 x 32 at D 256, 4 warps
# on 64 x 64 at D 192 (docs/measurements/flash.md).
_DQ_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_N",
            (8, 3, 128, 64), (4, 3, 64, 32), (8, 3, 128, 32),
            (4, 3, 64, 64), (4, 3, 128, 32), (4, 2, 64, 32)),
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16))


@autotune(_DQ_CONFIGS, key=["SEQ_BUCKET", "BLOCK_D", "BLOCK_D2", "CAUSAL", "KEY_SPLIT"],
                 prune_configs_by={"early_config_prune": pruner(_dq_shared_bytes, _dq_accumulator_fits)})
@triton.jit
def flash_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                        stride_dqb, stride_dqh, stride_dqn,
                        N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                        SPLITS, KEYS_PER_SPLIT, stride_dqs,
                        BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, KEY_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    pid_m, b, h, hk = query_tile(GROUP, CAUSAL)
    if KEY_SPLIT:  # the grid's first axis holds (query block, key split) pairs; each split writes its share
        split = pid_m % SPLITS
        pid_m = pid_m // SPLITS
        DQ += split.to(tl.int64) * stride_dqs
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = offs_m[:, None] < N_Q
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn
    do_rows = DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don
    row_mask = rows & head_columns(offs_d, HEAD_DIM)[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(do_rows + offs_d[None, :], mask=row_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:  # the head dim's second column block (key_block.py)
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        row_mask2 = rows & head_columns(offs_d2, HEAD_DIM)[None, :]
        q2 = tl.load(q_rows + offs_d2[None, :], mask=row_mask2, other=0.0)
        do2 = tl.load(do_rows + offs_d2[None, :], mask=row_mask2, other=0.0)
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=ACC_DTYPE)
    else:
        offs_d2, q2, do2, dq2 = offs_d, q, do, dq
    lse_log2 = load_lse_log2(LSE + (b * H_Q + h) * N_Q, offs_m, N_Q)
    delta = tl.load(DELTA + (b * H_Q + h) * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh
    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)

    full_hi, hi = visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    lo = 0
    if KEY_SPLIT:  # this split's keys [lo, lo + KEYS_PER_SPLIT), a multiple of BLOCK_N: P uses the whole row's LSE
        lo = split * KEYS_PER_SPLIT
        hi = tl.minimum(hi, lo + KEYS_PER_SPLIT)
        full_hi = tl.maximum(tl.minimum(full_hi, lo + KEYS_PER_SPLIT), lo)
    for n0 in range(lo, full_hi, BLOCK_N):
        dq, dq2 = _dq_key_block(dq, dq2, q, q2, do, do2, lse_log2, delta, K_head, V_head, stride_kn, stride_vn, n0,
                                offs_m, offs_d, offs_d2, N_K, HEAD_DIM, causal_offset, qk_scale_log2, BLOCK_N, BLOCK_D2,
                                False, CAUSAL, ACC_DTYPE, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        dq, dq2 = _dq_key_block(dq, dq2, q, q2, do, do2, lse_log2, delta, K_head, V_head, stride_kn, stride_vn, n0,
                                offs_m, offs_d, offs_d2, N_K, HEAD_DIM, causal_offset, qk_scale_log2, BLOCK_N, BLOCK_D2,
                                True, CAUSAL, ACC_DTYPE, DOT_PRECISION)

    dq_scale = qk_scale_log2 / tl.full([], LOG2E, ACC_DTYPE)
    dq_rows = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn
    tl.store(dq_rows + offs_d[None, :], (dq * dq_scale).to(DQ.dtype.element_ty), mask=row_mask)
    if BLOCK_D2 > 0:
        tl.store(dq_rows + offs_d2[None, :], (dq2 * dq_scale).to(DQ.dtype.element_ty), mask=row_mask2)


DQ_ROUTES = ("recompute", "atomic", "tma_atomic", "split")
ATOMIC_DQ_ROUTES = ("atomic", "tma_atomic")
_DQ_ROUTE = RouteSwitch(DQ_ROUTES, "dQ route")


def dq_route(route):
    """How the backward forms dQ inside the block: "recompute" (the dQ pass above, unsplit, deterministic;
    the default is this or "split" by shape: _dq_splits), "atomic" (**not deterministic**: the dK/dV pass
    also forms dS K and adds it into an fp32 dQ with atomics, in whatever order the programs get there, so
    dQ may differ in its last bits from run to run; five matmuls instead of seven) or "tma_atomic" (the
    same sum, each [rows, D] tile added by one bulk reduction of the copy engine instead of an atomic a element:
    CUDA GPUs with tensor descriptors, compute capability 9.0+, head dims a multiple of 4, not fp64; **not
    deterministic** either; at D 256 no tile keeps dK, dV and the staged dQ tile without spilling, so it is
    slow there).
    Both atomic routes are slower than "recompute" at every head dim, hence the default
    (docs/measurements/flash.md): with "atomic" every key block adds a [rows, D] fp32 tile per query
    block (2 GB of atomic traffic at B4 H16 N4096 D64), which costs more than the two matmuls it
    saves; with "tma_atomic" the sum is not what binds, but dS K and its fp32 tile slow the fused
    pass's best tile below the dK/dV pass alone. (Deterministic fixed-point atomics are slower still,
    so there is no such route.) "split": the dQ pass with each program on one run of keys (its share of
    dQ in fp32, the shares summed: _dq_splits), deterministic, for backward passes with few query rows.
    ``with dq_route("atomic"):``."""
    return _DQ_ROUTE(route)


DKDV_ROUTES = ("tiles", "split", "hopper")
_DKDV_ROUTE = RouteSwitch(DKDV_ROUTES, "dK/dV route")
# Whether the Gluon dK/dV pass (flash_bwd_hopper.py) takes the shapes it applies to on sm_90.
HOPPER_DKDV_BY_DEFAULT = False
# Padded head widths (head_dim_blocks) from which the default forms dV and dK in two passes ("split"):
# at D 256 the dV pass (8 warps, 64 x 128 tiles) and the dK pass (4 warps, 16 x 64) together beat the
# one pass; at D 160 and D 192 they gain nothing, so those keep one pass (docs/measurements/flash.md).
SPLIT_DKDV_MIN_WIDTH = 256


def dkdv_route(route):
    """Which kernel forms dK and dV inside the block: "tiles" (the pointer kernel above, both in one
    pass), "split" (the same kernel as a dV pass and a dK pass, each holding one accumulator: S is
    computed twice, but a [keys, D] fp32 tile less a thread lets wide heads take bigger key tiles;
    not with an atomic dQ route) or "hopper" (the Gluon kernel, sm_90, fp16/bf16 at
    HOPPER_DKDV_HEAD_DIMS; raises where it does not apply); None: by device and shape (split from
    padded head widths of SPLIT_DKDV_MIN_WIDTH). All are deterministic. ``with dkdv_route("tiles"):``."""
    return _DKDV_ROUTE(route)


GROUP_ROUTES = ("shared", "per-head")
_GROUP_ROUTE = RouteSwitch(GROUP_ROUTES, "head-group route")
# Whether the default spreads a head group's dK/dV over a program per query head where one program per KV
# head would leave multiprocessors idle. Timed beside the shared route over the random set's 73 GQA backward
# shapes on an H200 (results/nvidia-h200/flash/random-bwd-*.json): 1.03-3.73x at the six where the shared grid
# filled under GROUP_RULE_FILL of the GPU and each program walked at least GROUP_RULE_MIN_ROWS query rows; 0.07-1.18x
# at the other 67, all but one at or below 1.01x (short rows: the K/V repeats and fp32 shares outweigh the parallelism).
GROUP_PER_HEAD_BY_DEFAULT = True
# The key tile the occupancy rule assumes (the autotuner's largest: BLOCK_N of _DKDV_CONFIGS).
GROUP_RULE_BLOCK_N = 128
GROUP_RULE_FILL = 0.7
GROUP_RULE_MIN_ROWS = 1024


def group_route(route):
    """How the dK/dV pass covers a group of query heads that share a KV head (GQA): "shared" (one program
    per key block and KV head walks every query head of its group, accumulating dK and dV in registers)
    or "per-head" (K and V repeated per query head, so that a program per key block and query head forms
    that head's share in fp32, and the shares are summed over the group: Hq/Hkv times the programs, for
    the small batches and few KV heads that leave the GPU's multiprocessors idle, at the cost of the
    copies and the fp32 shares in memory). Deterministic either way. None: by shape ("shared", unless
    GROUP_PER_HEAD_BY_DEFAULT, the shared grid fills under GROUP_RULE_FILL of the GPU and each program walks at
    least GROUP_RULE_MIN_ROWS query rows). ``with group_route("per-head"):``."""
    return _GROUP_ROUTE(route)


def _per_head(batch, heads_kv, group, n_q, n_k, device, hopper) -> bool:
    if _GROUP_ROUTE.forced is not None:
        if _GROUP_ROUTE.forced == "per-head" and hopper and group > 1:
            raise ValueError("head-group route 'per-head' forms fp32 shares with the pointer kernel; the Gluon "
                             "dK/dV pass (dkdv_route('hopper')) writes the inputs' dtype")
        return _GROUP_ROUTE.forced == "per-head" and group > 1
    return (GROUP_PER_HEAD_BY_DEFAULT and group > 1 and not hopper and n_q >= GROUP_RULE_MIN_ROWS
            and cdiv(n_k, GROUP_RULE_BLOCK_N) * heads_kv * batch < GROUP_RULE_FILL * multiprocessors(device))


def _hopper_dkdv(do, q, k, v, atomic) -> bool:
    if _DKDV_ROUTE.forced is None and not HOPPER_DKDV_BY_DEFAULT:
        return False  # decided without the alignment checks (host time on every backward)
    applies = (not atomic and q.shape[-1] in HOPPER_DKDV_HEAD_DIMS and hopper_applies(q, k, v)
               and hopper_applies(do, k, v))
    if _DKDV_ROUTE.forced == "hopper" and not applies:
        raise ValueError("dK/dV route 'hopper' needs an sm_90 GPU, fp16/bf16 inputs with a head dim in "
                         f"{HOPPER_DKDV_HEAD_DIMS}, 16-byte aligned pointers and strides (do too), Triton's "
                         "Gluon, and the recomputing dQ route")
    if _DKDV_ROUTE.forced is not None:
        return _DKDV_ROUTE.forced == "hopper"
    return HOPPER_DKDV_BY_DEFAULT and applies


def flash_bwd_launch(do, q, k, v, o, lse, sm_scale: float, causal_offset, dlse=None, dkdv_dtype=None):
    """Run the backward launches on checked inputs; returns (dq, dk, dv) of <do, o> + <dlse, lse>
    (``dlse`` None: the LSE is not differentiated). dQ by ``dq_route`` (default: the recomputing pass, its
    keys split by shape), a head group's dK/dV by ``group_route``. ``dkdv_dtype``: dK and dV in that dtype
    instead of k's."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    block_d, block_d2 = head_dim_blocks(head_dim)
    acc_dtype = accumulator_dtype(q.dtype)
    precision = dot_precision(q.dtype)
    causal = causal_offset is not None
    offset = int(causal_offset) if causal else 0
    scale_hi, scale_lo = split_scale(sm_scale)
    bucket = seq_bucket(max(n_q, n_k))

    atomic = _DQ_ROUTE.forced in ATOMIC_DQ_ROUTES
    if atomic and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(f"flash backward: dq_route({_DQ_ROUTE.forced!r}) is not deterministic, and "
                           "torch.use_deterministic_algorithms(True) is set")
    tma = _DQ_ROUTE.forced == "tma_atomic"
    if tma and not (q.is_cuda and not interpreting() and tma_capable(q.device) and head_dim % 4 == 0
                    and q.dtype != torch.float64):
        raise ValueError('flash backward: dq_route("tma_atomic") needs a CUDA GPU with tensor descriptors '
                         "(compute capability 9.0+), a head dim that is a multiple of 4 and fp16, bf16 or fp32 "
                         f"inputs (the copy engine adds no fp64), got D {head_dim} {q.dtype} on {q.device}")
    # every route question answered before any kernel runs
    # (the Gluon pass writes the inputs' dtype: not the fp32 shares of the per-head route)
    hopper = dkdv_dtype in (None, k.dtype) and _hopper_dkdv(do, q, k, v, atomic)
    passes = SPLIT_PASSES if _split_dkdv(block_d + block_d2, atomic) else (BOTH_PASS, )
    if _per_head(batch, heads_kv, group, n_q, n_k, q.device, hopper):
        # a program per query head (group 1 below) forms its fp32 share of dK and dV; the group sums them
        kx, vx = copy_heads_each(None, k, v, repeat=group)
        dq, dk, dv = flash_bwd_launch(do, q, kx, vx, o, lse, sm_scale, causal_offset, dlse,
                                      accumulator_torch_dtype(q.dtype))
        return (dq, *(sum_shares(t.unflatten(1, (heads_kv, group)), 2, dkdv_dtype or k.dtype) for t in (dk, dv)))
    width = padded_width(head_dim, q.device)
    if width != head_dim and not hopper:  # head_padding.py: a column block the kernels would mask
        grads = flash_bwd_launch(*pad_heads(width, do, q, k, v, o), lse, sm_scale, causal_offset, dlse, dkdv_dtype)
        return tuple(cut_heads(head_dim, *grads))
    delta = row_dot_launch(q.shape, q.device, q.dtype, first=(do, o), minus=dlse)
    dk = new_output(k.shape, dkdv_dtype or k.dtype, k.device)
    dv = new_output(v.shape, dkdv_dtype or v.dtype, v.device)
    # The atomic route's dQ sum (contiguous, in the accumulator dtype); otherwise an unread one-value
    # stand-in, left uninitialized (no fill kernel on the default path) and made once per device and
    # dtype (an allocation a call is host time): the autotuner zeroes DQ_ACC, which must not be an
    # output (that would hide an unwritten element from the poisoning checks).
    acc = accumulator_torch_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device) if atomic else _stand_in(q.device, acc)

    common = dict(BLOCK_D=block_d, BLOCK_D2=block_d2, CAUSAL=causal, ACC_DTYPE=acc_dtype, DOT_PRECISION=precision)
    if hopper:
        flash_bwd_dkdv_hopper_launch(q, k, v, do, lse, delta, dk, dv, sm_scale, causal_offset)
    else:
        with descriptor_scratch(q.device) if tma else contextlib.nullcontext():
            for forms in passes:
                _dkdv_tiles(q, k, v, do, lse, delta, dk, dv, dq_acc, group, offset, scale_hi, scale_lo, bucket,
                            atomic, tma, forms, common)
    if atomic:
        return (dq_acc * sm_scale).to(q.dtype), dk, dv
    visible = visible_key_count(n_q, n_k, causal_offset)
    splits, keys_per_split = _dq_splits(batch, heads_q, n_q, n_k, visible, q.device)
    if splits > 1:  # each split's share of dQ in the accumulator dtype, summed below and rounded once
        dq = new_output((splits, *q.shape), acc, q.device)
        split_stride, bucket = dq.stride(0), seq_bucket(max(n_q, keys_per_split))
    else:
        dq, split_stride = new_output(q.shape, q.dtype, q.device), 0
    rows = dq[0] if splits > 1 else dq
    planned(flash_bwd_dq_kernel)[lambda meta: (cdiv(n_q, meta["BLOCK_M"]) * splits, heads_q, batch)](
        q, k, v, do, lse, delta, dq,
        *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(do),
        *row_strides(rows),
        n_q, n_k, head_dim, heads_q, group, offset, scale_hi, scale_lo, bucket, splits, keys_per_split, split_stride,
        KEY_SPLIT=splits > 1, **common)
    if splits > 1:
        dq = sum_shares(dq, 0, q.dtype)
    return dq, dk, dv


# Keys a split of the dQ pass takes at the least (a multiple of every config's BLOCK_N), and the most splits; 128
# where the query rows fit one block of the smaller config (DQ_SPLIT_FEW_ROWS): an H200's kernel breakdown of the
# decode-shaped backward passes still below FLASH (results/nvidia-h200/flash/bwd-breakdown.txt) found the dQ pass
# 40-65% of their GPU time, a few programs walking 662-5549 keys each, which 512-key runs left unsplit (under
# DQ_SPLIT_MIN_SPLITS runs) or at 6-16 splits. More rows keep 512: untimed there.
DQ_SPLIT_MIN_KEYS, DQ_SPLIT_FEW_ROWS_MIN_KEYS, INTERPRETER_DQ_SPLIT_MIN_KEYS = 512, 128, 16
DQ_SPLIT_FEW_ROWS = 64
DQ_SPLIT_MAX = 32
# Whether the default splits the dQ pass's keys where its grid (query blocks x heads x batch) leaves most
# multiprocessors idle: yes, timed on an H200 over the random set's decode-shaped backward passes
# (results/nvidia-h200/flash/route-dq-split.md): 2-3x faster where a few programs walk thousands of keys,
# slower where the keys a row sees are few (top-left causal with few rows), the split runs short (under 4 runs)
# or the unsplit grid already fills half the GPU; the rule below keeps the split to the first kind.
DQ_SPLIT_BY_DEFAULT = True
DQ_SPLIT_MIN_SPLITS = 4


def dq_split_min_keys(n_q) -> int:
    """The keys a dQ split takes at the least on a GPU, for ``n_q`` query rows."""
    return DQ_SPLIT_FEW_ROWS_MIN_KEYS if n_q <= DQ_SPLIT_FEW_ROWS else DQ_SPLIT_MIN_KEYS


def _dq_splits(batch, heads_q, n_q, n_k, visible, device) -> tuple:
    """(key splits, keys a split) of the dQ pass. Its programs own query blocks, each walking every visible
    key: few query rows (a decode-shaped backward) give few programs, each walking thousands of keys. Split,
    each program takes one run of keys and writes its share of dQ in fp32, and the shares are summed: dQ is
    a sum over keys (P uses the row's whole LSE), so the split needs no renormalizing. ``visible``: the keys
    some row sees (a causal mask's last visible key + 1), the ones the splits cover. dq_route("split") splits
    wherever there are visible keys for two runs; the default, when DQ_SPLIT_BY_DEFAULT, only where the
    unsplit grid is at most half the GPU and there are keys for DQ_SPLIT_MIN_SPLITS runs, into enough splits
    to fill it twice."""
    min_keys = INTERPRETER_DQ_SPLIT_MIN_KEYS if interpreting() else dq_split_min_keys(n_q)
    most = min(DQ_SPLIT_MAX, visible // min_keys)
    if _DQ_ROUTE.forced == "split":
        splits = most
    elif _DQ_ROUTE.forced is None and DQ_SPLIT_BY_DEFAULT and most >= DQ_SPLIT_MIN_SPLITS:
        programs = cdiv(n_q, 64) * heads_q * batch  # 64: the smaller of the configs' query blocks
        sms = multiprocessors(device)
        splits = min(most, cdiv(2 * sms, programs)) if 2 * programs <= sms else 1
    else:
        splits = 1
    if splits <= 1:
        return 1, n_k
    keys_per_split = cdiv(cdiv(visible, splits), min_keys) * min_keys
    return cdiv(visible, keys_per_split), keys_per_split


@functools.lru_cache(maxsize=None)
def _stand_in(device, dtype):
    """A one-value tensor for a pointer argument the kernel does not read (kept: a replay passes it again)."""
    return kept(torch.empty(1, dtype=dtype, device=device))


def _split_dkdv(width, atomic) -> bool:
    if _DKDV_ROUTE.forced == "split" and atomic:
        raise ValueError(f"dK/dV route 'split' forms dK apart from dV, so it cannot add dS K into dQ "
                         f"(dq_route {_DQ_ROUTE.forced!r}); use the recomputing dQ route")
    if _DKDV_ROUTE.forced is not None:
        return _DKDV_ROUTE.forced == "split"
    return not atomic and width >= SPLIT_DKDV_MIN_WIDTH


def _dkdv_tiles(q, k, v, do, lse, delta, dk, dv, dq_acc, group, offset, scale_hi, scale_lo, bucket, atomic, tma,
                forms, common):
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    (flash_bwd_dkdv_kernel if tma else planned(flash_bwd_dkdv_kernel))[
        lambda meta: (cdiv(n_k, meta["BLOCK_N"]), heads_kv, batch)](
        q, k, v, do, lse, delta, dk, dv, dq_acc,
        *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(do),
        *row_strides(dk), *row_strides(dv),
        n_q, n_k, head_dim, heads_q, group, offset, scale_hi, scale_lo, bucket, ATOMIC_DQ=atomic, DQ_TMA=tma,
        **forms, **common)
