"""The shared_context kernels, their launch configurations and their autotuners.

- ``shared_context_fused_kernel`` (the shipped path): buffer, context and merge in one launch. Each
  sample's buffer state (O, LSE) goes to a scratch buffer in L2 and, after a CTA barrier, seeds the
  online softmax of the context phase for the same rows. With NUM_SPLITS > 1 each program writes its
  partial state to a workspace and takes a per-tile ticket; the program that arrives last merges
  the tile's partials in split order (so the result does not depend on scheduling) and resets the
  ticket for the next launch.
- ``context_attention_kernel`` and ``buffer_attention_kernel``: the two halves alone, each writing
  (O, LSE) (the context kernel one partial per split, reduced by ``merge_stack_kernel``); the
  composed path merges them with ``merge_two_kernel``.
"""
import triton
import triton.language as tl

from ..merge_states import merge_finish, merge_init, merge_step
from ..precision import LOG2E, ROW_MAX_START, softmax_scale_log2
from ..tuning import (ACCUMULATOR_REGISTERS, autotune, cfg, configs, config_list, pruner, registers_per_thread,
                      seq_bucket)
from .buffer_phase import _buffer_phase
from .context_phase import _context_phase
from .packed_rows import _load_q_tile, _normalized, _packed_rows, _rows, _store_state

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
# warps for 128 rows; 128-key context blocks) are each the fastest at some D 32 shapes where none
# of the first three is (docs/measurements/shared_context.md). Under the interpreter: 16-row
# tiles, 16-key context blocks, 8-key buffer steps and 4-row buffer tiles (BLOCK_R, set by the
# launcher), so that tiny cases span several of each. The pruner drops what does not fit.
_FUSED_TABLES = {
    "small_d": configs("BLOCK_M BLOCK_N BLOCK_NB", (8, 3, 128, 64, 128), (8, 2, 256, 64, 256), (4, 3, 64, 64, 128),
                       (4, 3, 128, 64, 128), (4, 3, 64, 128, 128)),
    "large_d": configs("BLOCK_M BLOCK_N BLOCK_NB", (8, 3, 128, 64, 64), (4, 3, 64, 64, 64), (4, 2, 32, 32, 16)),
}
_INTERPRETER_CONFIG = cfg(1, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_NB=8)
_FUSED_CONFIGS = {d: config_list(table, _INTERPRETER_CONFIG) for d, table in _FUSED_TABLES.items()}
# The context kernel has no buffer phase: the fused kernel's tiles with BLOCK_NB unused (16).
_CONTEXT_CONFIGS = {d: config_list([cfg(c.num_warps, c.num_stages, **dict(c.kwargs, BLOCK_NB=16)) for c in table],
                                   _INTERPRETER_CONFIG) for d, table in _FUSED_TABLES.items()}
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


def _tune_key(rows, n_ctx, n_buf, common, config):
    """What the kernels' autotune key (_KEY) buckets, less NUM_SPLITS; plus a forced config."""
    return (seq_bucket(rows), seq_bucket(n_ctx), seq_bucket(n_buf), common["BLOCK_D"], common["BLOCK_R"],
            common["CAUSAL"], common["FULL_LENS"], None if config is None else tuple(sorted(config.items())))


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
        # (O, LSE) is (acc = O l, l, m) with m = LSE in base 2 rounded to the accumulator dtype and l = 2^(what the
        # rounding left), so that the seed keeps the float64 LSE's precision (precision.STATE_LSE_DTYPE). The buffer's
        # own m is a float32, so what the rounding leaves is about log2 of its key count.
        mine = valid & (b % NUM_SPLITS == split)
        lse_b = tl.load(WB_L + _rows(b, h, i, stride_wbl_b, stride_wbl_h, stride_wbl_n), mask=mine,
                        other=float("-inf"), cache_modifier=".cg").to(tl.float64) * LOG2E
        o_b = tl.load(WB_O + _rows(b, h, i, stride_wbo_b, stride_wbo_h, stride_wbo_n)[:, None] + offs_d[None, :],
                      mask=mine[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
        seen = lse_b != float("-inf")  # a NaN state (a NaN input) is seeded as it is and poisons the row
        m_i = tl.where(seen, lse_b.to(ACC_DTYPE), ROW_MAX_START)
        # past 2^52 a float64 LSE no longer resolves units (the round trip through natural log is noise there,
        # and exp2 of it could overflow): the seed is then m alone, l = 1
        left = tl.where(tl.abs(lse_b) < 4503599627370496.0, lse_b - m_i.to(tl.float64), 0.0)
        l_i = tl.where(seen, tl.math.exp2(left.to(ACC_DTYPE)), 0.0)
        acc = tl.where(seen[:, None], o_b.to(ACC_DTYPE) * l_i[:, None], 0.0)  # O = acc / l
    else:
        m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=ACC_DTYPE)
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
                m, s, merged = merge_step(m, s, merged, part_lse, part_o.to(ACC_DTYPE))
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
    m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=ACC_DTYPE)
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
