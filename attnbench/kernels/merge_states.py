"""merge_states in Triton: combine attention states (O, LSE) computed over disjoint key sets.

The device functions ``merge_init`` / ``merge_step`` / ``merge_finish`` are the online merge any
kernel can run in registers (the shared-context kernel's split-K epilogue does); the two kernels
below run it over tensors: two states (``merge_two_kernel``) or a stack of S states along a
leading split dimension (``merge_stack_kernel`` state by state, ``merge_stack_chunks_kernel`` several states a load
for many of them: flash-decoding's reduction).

Rows are addressed through up to three leading dimensions with their own strides, so strided
views (a [B, N, H, D] tensor seen as [B, H, N, D], a batch-folded output seen per sample) merge
without a copy. The head dimension must be contiguous. Merging runs in fp32 (fp64 for fp64) in
natural-log units (so merging a state with an empty one returns it bit for bit): a state with
LSE = -inf adds nothing, whatever its O holds; a row whose states are all
-inf gets O = 0 and LSE = -inf. LSEs are read, compared and subtracted in float64
(precision.STATE_LSE_DTYPE says why); the exponentials and O run in the accumulator dtype.
"""
import torch
import triton
import triton.language as tl

from .launch import planned
from .offsets import INT32_MAX
from .outputs import new_output
from .tiling import aligned, stride_align
from .tuning import cdiv, multiprocessors, next_pow2


@triton.jit
def merge_init(BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """(running max of LSE in float64, running sum of exp(lse - max), running weighted sum of O)."""
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float64)
    s = tl.zeros([BLOCK_R], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC_DTYPE)
    return m, s, acc


@triton.jit
def merge_step(m, s, acc, lse, o):
    """Fold one state in: ``lse`` its LSE ([BLOCK_R], natural log; float32 is widened), ``o`` its O
    ([BLOCK_R, BLOCK_D])."""
    lse = lse.to(tl.float64)
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no (-inf) - (-inf)
    alpha = tl.exp((m - m_safe).to(s.dtype))  # distances in float64, exponentials in the accumulator dtype
    beta = tl.exp((lse - m_safe).to(s.dtype))
    s = s * alpha + beta
    # beta == 0 (a state that saw no key) must add nothing even when its O is NaN
    acc = acc * alpha[:, None] + tl.where(beta[:, None] > 0, beta[:, None] * o, 0.0)
    return m_new, s, acc


@triton.jit
def merge_finish(m, s, acc):
    """(O, LSE in natural-log units, float64) of the merged state. A NaN state (a non-finite input) makes
    its row's sum NaN, and the row comes out NaN: never disguised as one that saw no key."""
    return merge_finish_where(m, s, acc, s < 0.0)  # s >= 0 or NaN: no row is known to see a key


@triton.jit
def merge_finish_where(m, s, acc, sees_keys):
    """``merge_finish`` for rows some of which are known to see keys (``sees_keys``): such a row
    whose states are all empty had every score -inf, a non-finite input, and comes out NaN."""
    empty = s == 0.0
    s_safe = tl.where(empty, 1.0, s)
    o = tl.where(empty[:, None], 0.0, acc / s_safe[:, None])
    lse = tl.where(empty, float("-inf"), m + tl.log(s_safe).to(tl.float64))
    poisoned = empty & sees_keys
    return tl.where(poisoned[:, None], float("nan"), o), tl.where(poisoned, float("nan"), lse)


@triton.jit
def _row_offsets(rows, DIM_Y, DIM_Z, stride_x, stride_y, stride_z):
    """Offsets of flat row indices over a [X, Y, Z] leading shape with the given strides (int64)."""
    rows = rows.to(tl.int64)
    x = rows // (DIM_Y * DIM_Z)
    yz = rows - x * (DIM_Y * DIM_Z)
    y = yz // DIM_Z
    z = yz - y * DIM_Z
    return x * stride_x + y * stride_y + z * stride_z


@triton.jit
def _row_tile(N_ROWS, HEAD_DIM, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows and head-dim columns, with their masks."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    return rows, offs_d, rows < N_ROWS, offs_d < HEAD_DIM


@triton.jit
def _store_state(O, L, o, lse, rows, offs_d, row_mask, d_mask, DIM_Y, DIM_Z, s_o_x, s_o_y, s_o_z, s_l_x, s_l_y, s_l_z):
    o_rows = _row_offsets(rows, DIM_Y, DIM_Z, s_o_x, s_o_y, s_o_z)
    tl.store(O + o_rows[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    tl.store(L + _row_offsets(rows, DIM_Y, DIM_Z, s_l_x, s_l_y, s_l_z), lse.to(L.dtype.element_ty), mask=row_mask)


@triton.jit
def _load_state(O, L, o_rows, l_rows, offs_d, row_mask, d_mask, ACC_DTYPE: tl.constexpr):
    lse = tl.load(L + l_rows, mask=row_mask, other=float("-inf")).to(tl.float64)
    o = tl.load(O + o_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    return lse, o.to(ACC_DTYPE)


@triton.jit
def merge_two_kernel(OA, LA, OB, LB, O, L, N_ROWS, DIM_Y, DIM_Z, HEAD_DIM,
                     s_oa_x, s_oa_y, s_oa_z, s_la_x, s_la_y, s_la_z,
                     s_ob_x, s_ob_y, s_ob_z, s_lb_x, s_lb_y, s_lb_z,
                     s_o_x, s_o_y, s_o_z, s_l_x, s_l_y, s_l_z,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    # the O strides and the head dim are multiples of ALIGN (tiling.aligned: vector loads at D 40 or 72)
    s_oa_x, s_oa_y, s_oa_z = aligned(s_oa_x, ALIGN), aligned(s_oa_y, ALIGN), aligned(s_oa_z, ALIGN)
    s_ob_x, s_ob_y, s_ob_z = aligned(s_ob_x, ALIGN), aligned(s_ob_y, ALIGN), aligned(s_ob_z, ALIGN)
    s_o_x, s_o_y, s_o_z = aligned(s_o_x, ALIGN), aligned(s_o_y, ALIGN), aligned(s_o_z, ALIGN)
    rows, offs_d, row_mask, d_mask = _row_tile(N_ROWS, aligned(HEAD_DIM, ALIGN), BLOCK_R, BLOCK_D)
    m, s, acc = merge_init(BLOCK_R, BLOCK_D, ACC_DTYPE)
    lse, o = _load_state(OA, LA, _row_offsets(rows, DIM_Y, DIM_Z, s_oa_x, s_oa_y, s_oa_z),
                          _row_offsets(rows, DIM_Y, DIM_Z, s_la_x, s_la_y, s_la_z), offs_d, row_mask, d_mask, ACC_DTYPE)
    m, s, acc = merge_step(m, s, acc, lse, o)
    lse, o = _load_state(OB, LB, _row_offsets(rows, DIM_Y, DIM_Z, s_ob_x, s_ob_y, s_ob_z),
                          _row_offsets(rows, DIM_Y, DIM_Z, s_lb_x, s_lb_y, s_lb_z), offs_d, row_mask, d_mask, ACC_DTYPE)
    m, s, acc = merge_step(m, s, acc, lse, o)
    o, lse = merge_finish(m, s, acc)
    _store_state(O, L, o, lse, rows, offs_d, row_mask, d_mask, DIM_Y, DIM_Z, s_o_x, s_o_y, s_o_z, s_l_x, s_l_y, s_l_z)


@triton.jit
def merge_stack_kernel(OS, LS, O, L, NUM_STATES, N_ROWS, DIM_Y, DIM_Z, HEAD_DIM, SEE_FROM,
                       s_os_s, s_os_x, s_os_y, s_os_z, s_ls_s, s_ls_x, s_ls_y, s_ls_z,
                       s_o_x, s_o_y, s_o_z, s_l_x, s_l_y, s_l_z,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    # the O strides and the head dim are multiples of ALIGN (tiling.aligned: vector loads at D 40 or 72)
    s_os_s, s_os_x = aligned(s_os_s, ALIGN), aligned(s_os_x, ALIGN)
    s_os_y, s_os_z = aligned(s_os_y, ALIGN), aligned(s_os_z, ALIGN)
    s_o_x, s_o_y, s_o_z = aligned(s_o_x, ALIGN), aligned(s_o_y, ALIGN), aligned(s_o_z, ALIGN)
    rows, offs_d, row_mask, d_mask = _row_tile(N_ROWS, aligned(HEAD_DIM, ALIGN), BLOCK_R, BLOCK_D)
    o_rows = _row_offsets(rows, DIM_Y, DIM_Z, s_os_x, s_os_y, s_os_z)
    l_rows = _row_offsets(rows, DIM_Y, DIM_Z, s_ls_x, s_ls_y, s_ls_z)
    m, s, acc = merge_init(BLOCK_R, BLOCK_D, ACC_DTYPE)
    # the states' pointers step one stride at a time: k * stride in int32 wrapped past 2**31 elements
    os_k, ls_k = OS, LS
    for k in range(0, NUM_STATES):  # fixed order: the result does not depend on scheduling
        lse, o = _load_state(os_k, ls_k, o_rows, l_rows, offs_d, row_mask, d_mask, ACC_DTYPE)
        m, s, acc = merge_step(m, s, acc, lse, o)
        os_k += s_os_s
        ls_k += s_ls_s
    o, lse = merge_finish_where(m, s, acc, rows % DIM_Z >= SEE_FROM)
    _store_state(O, L, o, lse, rows, offs_d, row_mask, d_mask, DIM_Y, DIM_Z, s_o_x, s_o_y, s_o_z, s_l_x, s_l_y, s_l_z)


@triton.jit
def _lse_chunk(LS, k, NUM_STATES, s_ls_s, l_rows, row_mask):
    """The LSEs of states ``k`` (a chunk) at the rows, float64 ([CHUNK, rows]; -inf past the stack and the rows), and
    that mask: both passes of merge_stack_chunks_kernel read them the same way."""
    mask = (k < NUM_STATES)[:, None] & row_mask[None, :]
    lse = tl.load(LS + k.to(tl.int64)[:, None] * s_ls_s + l_rows[None, :], mask=mask, other=float("-inf"))
    return lse.to(tl.float64), mask


@triton.jit
def merge_stack_chunks_kernel(OS, LS, O, L, NUM_STATES, N_ROWS, DIM_Y, DIM_Z, HEAD_DIM, SEE_FROM,
                              s_os_s, s_os_x, s_os_y, s_os_z, s_ls_s, s_ls_x, s_ls_y, s_ls_z,
                              s_o_x, s_o_y, s_o_z, s_l_x, s_l_y, s_l_z,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                              ACC_DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """merge_stack_kernel for many states (CHUNKS_FROM_STATES and more): a program merges BLOCK_R rows x BLOCK_D
    columns (axis 1 of the grid walks the head dim) over every state, CHUNK states a load. State by state, a decode of
    25 splits spent 27 us merging 6 MB from DRAM; this kernel, 19 (docs/measurements/flash.md). Two passes: the rows'
    largest LSE over all states, then each state's weight exp(lse - max) and weighted O, summed chunk by chunk in
    state order (a chunk's states by a tree of fixed shape): the same bits on every run. A state of LSE -inf adds
    nothing, whatever its O holds."""
    # the O strides and the head dim are multiples of ALIGN (tiling.aligned: vector loads at D 40 or 72)
    s_os_s, s_os_x = aligned(s_os_s, ALIGN), aligned(s_os_x, ALIGN)
    s_os_y, s_os_z = aligned(s_os_y, ALIGN), aligned(s_os_z, ALIGN)
    s_o_x, s_o_y, s_o_z = aligned(s_o_x, ALIGN), aligned(s_o_y, ALIGN), aligned(s_o_z, ALIGN)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask, d_mask = rows < N_ROWS, offs_d < aligned(HEAD_DIM, ALIGN)
    o_rows = _row_offsets(rows, DIM_Y, DIM_Z, s_os_x, s_os_y, s_os_z)
    l_rows = _row_offsets(rows, DIM_Y, DIM_Z, s_ls_x, s_ls_y, s_ls_z)
    states = tl.arange(0, CHUNK)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float64)
    for k0 in range(0, NUM_STATES, CHUNK):
        lse, _ = _lse_chunk(LS, k0 + states, NUM_STATES, s_ls_s, l_rows, row_mask)
        m = tl.maximum(m, tl.max(lse, 0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf: no (-inf) - (-inf)
    s = tl.zeros([BLOCK_R], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC_DTYPE)
    for k0 in range(0, NUM_STATES, CHUNK):  # fixed order: the result does not depend on scheduling
        k = k0 + states
        lse, state_mask = _lse_chunk(LS, k, NUM_STATES, s_ls_s, l_rows, row_mask)
        w = tl.exp((lse - m_safe[None, :]).to(ACC_DTYPE))  # distances in float64, exponentials in the accumulator's
        o = tl.load(OS + (k.to(tl.int64) * s_os_s)[:, None, None] + o_rows[None, :, None] + offs_d[None, None, :],
                    mask=state_mask[:, :, None] & d_mask[None, None, :], other=0.0).to(ACC_DTYPE)
        s += tl.sum(w, 0)
        # w == 0 (a state that saw no key) must add nothing even when its O is NaN
        acc += tl.sum(tl.where(w[:, :, None] > 0, w[:, :, None] * o, 0.0), 0)
    o, lse = merge_finish_where(m, s, acc, rows % DIM_Z >= SEE_FROM)
    o_out = _row_offsets(rows, DIM_Y, DIM_Z, s_o_x, s_o_y, s_o_z)
    tl.store(O + o_out[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    if tl.program_id(1) == 0:  # one column block stores the rows' LSE
        tl.store(L + _row_offsets(rows, DIM_Y, DIM_Z, s_l_x, s_l_y, s_l_z), lse.to(L.dtype.element_ty), mask=row_mask)


def _acc_dtype(o_dtypes, lse_dtypes, state_lse):
    """float64 arithmetic when any O or LSE is float64 (the public contract, as attnbench.merge's PyTorch twin), except
    that ``state_lse`` (our own merged states, whose LSEs are float64 for precision: precision.STATE_LSE_DTYPE) looks
    at O alone: a bf16 or fp32 state is no float64 mode."""
    return tl.float64 if torch.float64 in (*o_dtypes, *(() if state_lse else lse_dtypes)) else tl.float32


def _lead3(t, lead_dims):
    """View ``t`` ([..., D] or [...] for LSE, ``lead_dims`` leading dims) as exactly three leading
    dims; returns (tensor, (stride_x, stride_y, stride_z)). Copies only when the head dimension is
    not contiguous or more than three leading dims do not fold into a view."""
    if t.dim() > lead_dims and t.stride(-1) != 1:
        t = t.contiguous()
    while lead_dims < 3:
        t = t.unsqueeze(0)
        lead_dims += 1
    if lead_dims > 3:
        t = t.reshape(-1, *t.shape[lead_dims - 2:])  # merges the outer dims; copies if it must
    return t, (t.stride(0), t.stride(1), t.stride(2))


def _block_sizes(head_dim, device, n_rows, fewest=1):
    """(rows a program, padded head dim). Rows a program shrink (to ``fewest``) until the grid has
    two programs an SM: a stack of many states over few rows (flash-decoding at B8 Hkv8 Nq1: 256
    rows, 10 splits) would run its whole reduction on 4 programs, a visible share of the call
    (docs/measurements/flash.md)."""
    block_d = max(16, next_pow2(head_dim))
    if device.type == "cpu":
        return 16, block_d
    most = max(1, min(128, 8192 // block_d))
    return max(fewest, min(most, next_pow2(cdiv(n_rows, 2 * multiprocessors(device))))), block_d


# The stack merge's tile: states x rows x columns loaded at once. 1024 elements: 8 a thread of 4 warps, with their
# int64 addresses; 4096 took 254 registers a thread and merged 5 states in 21 us where one state a step took 10
# (ncu, H200, B19 H8/4 N10x6964 D96: docs/measurements/flash.md). Columns a program: at most 64, so that a few rows
# still make many programs, of which PROGRAMS_PER_SM an SM.
STACK_TILE = 1024
STACK_COLUMNS = 64
PROGRAMS_PER_SM = 4
MIN_CHUNK = 8  # states a load at least, where the stack has them (B21's 25 states merged 8 a load in 18.8 us)
# small under the interpreter, so that the tests' few states and narrow heads still span several chunks and column
# blocks, and partial ones
INTERPRETER_CHUNK = 4
INTERPRETER_COLUMNS = 16
# States from which a stack merges in chunks. Each kernel alone on an H200, its states read from DRAM (decode
# study): 16 states 18.0 -> 9.1 us, 25 states 26.7 -> 18.8, 12 states 16.0 -> 12.7, but 5 states 10.2 -> 12.3 and
# 6 to 10 states within 10% either way: the chunks' extra pass over the LSEs costs a memory round trip of its own.
CHUNKS_FROM_STATES = 12
INTERPRETER_CHUNKS_FROM_STATES = 4  # both kernels under the interpreter tests' 1-9 states


def chunks_from_states(device) -> int:
    """The fewest states merge_stack_launch merges in chunks (merge_stack_chunks_kernel) on ``device``."""
    return INTERPRETER_CHUNKS_FROM_STATES if device.type == "cpu" else CHUNKS_FROM_STATES


def _stack_blocks(head_dim, device, n_rows, num_states, acc_dtype):
    """(rows a program, columns a program, states a load) of merge_stack_chunks_kernel: the most rows (a power of two)
    that still give PROGRAMS_PER_SM programs an SM over rows and column blocks, but few enough that a load holds
    MIN_CHUNK states (many rows would leave one state a load, and the extra pass over the LSEs for nothing); then as
    many states a load as the tile holds beside them (float64 takes half as many)."""
    if device.type == "cpu":
        return 16, INTERPRETER_COLUMNS, INTERPRETER_CHUNK
    block_d = min(STACK_COLUMNS, max(16, next_pow2(head_dim)))
    tile = STACK_TILE // (2 if acc_dtype == tl.float64 else 1)
    slices = n_rows * cdiv(head_dim, block_d)
    most = slices // (PROGRAMS_PER_SM * multiprocessors(device))  # rows a program at PROGRAMS_PER_SM
    fewest_states = min(MIN_CHUNK, next_pow2(num_states))
    block_r = max(1, min(tile // (block_d * fewest_states), 1 << max(0, most.bit_length() - 1)))
    return block_r, block_d, max(1, min(next_pow2(num_states), tile // (block_r * block_d)))


def merge_two_launch(o_a, lse_a, o_b, lse_b, out_dtype, out_lse_dtype=None, state_lse=False):
    """Merge two checked states of one shape. Returns (O in out_dtype, LSE in ``out_lse_dtype``, by default
    lse_a's), contiguous. ``state_lse``: see _acc_dtype."""
    lead = lse_a.dim()
    shape = tuple(o_a.shape)
    head_dim = shape[-1]
    o = new_output(shape, out_dtype, o_a.device)
    lse = new_output(tuple(lse_a.shape), out_lse_dtype or lse_a.dtype, o_a.device)
    n_rows = lse.numel()
    if n_rows == 0:
        return o, lse
    (oa, soa), (la, sla), (ob, sob), (lb, slb) = (_lead3(t, lead) for t in (o_a, lse_a, o_b, lse_b))
    (ov, so), (lv, sl) = _lead3(o, lead), _lead3(lse, lead)
    # triton 3.6 fails to compile merge_two_kernel in fp64 at 8 rows a program
    # (TritonGPURemoveLayoutConversions; 1-64 rows checked for sm_90): it keeps 16 and more
    block_r, block_d = _block_sizes(head_dim, o.device, n_rows, fewest=16)
    with _on_device(o):
        planned(merge_two_kernel)[(cdiv(n_rows, block_r),)](
            oa, la, ob, lb, ov, lv, n_rows, ov.shape[1], ov.shape[2], head_dim,
            *soa, *sla, *sob, *slb, *so, *sl,
            BLOCK_R=block_r, BLOCK_D=block_d,
            ACC_DTYPE=_acc_dtype((o_a.dtype, o_b.dtype), (lse_a.dtype, lse_b.dtype), state_lse),
            ALIGN=stride_align(head_dim, *soa, *sob, *so))
    return o, lse


def merge_stack_launch(o_stack, lse_stack, out_dtype, see_from=None, out_lse_dtype=None, state_lse=False):
    """Merge the states stacked along dim 0: O [S, ..., D], LSE [S, ...] -> (O, LSE in ``out_lse_dtype``, by
    default the stack's), contiguous.
    ``see_from``: rows whose last index is at least this are known to see a key (flash-decoding's
    splits of a row's keys): there an all-empty merge is NaN, not (0, -inf). ``state_lse``: see _acc_dtype."""
    num_states = lse_stack.shape[0]
    head_dim = o_stack.shape[-1]
    o = new_output(tuple(o_stack.shape[1:]), out_dtype, o_stack.device)
    lse = new_output(tuple(lse_stack.shape[1:]), out_lse_dtype or lse_stack.dtype, o_stack.device)
    n_rows = lse.numel()
    if n_rows == 0:
        return o, lse
    if num_states == 0:  # no state at all: rows that saw no key
        return o.zero_(), lse.fill_(float("-inf"))
    lead = lse.dim()
    if o_stack.stride(-1) != 1:
        o_stack = o_stack.contiguous()
    if lead > 3:  # fold the outer row dimensions (a view where strides allow, else a copy)
        o_stack = o_stack.reshape(num_states, -1, *o_stack.shape[lead - 1:])
        lse_stack = lse_stack.reshape(num_states, -1, *lse_stack.shape[lead - 1:])
        lead = 3
    # each state alone, as three row dimensions; the split stride walks from one to the next
    (_, so), (_, sl) = _lead3(o_stack[0], lead), _lead3(lse_stack[0], lead)
    (ov, s_o), (lv, s_l) = _lead3(o, lse.dim()), _lead3(lse, lse.dim())
    acc_dtype = _acc_dtype((o_stack.dtype,), (lse_stack.dtype,), state_lse)
    args = (o_stack, lse_stack, ov, lv, num_states, n_rows, ov.shape[1], ov.shape[2], head_dim,
            INT32_MAX if see_from is None else see_from, o_stack.stride(0), *so, lse_stack.stride(0), *sl, *s_o, *s_l)
    align = stride_align(head_dim, o_stack.stride(0), *so, *s_o)
    with _on_device(o):
        if num_states >= chunks_from_states(o.device):
            block_r, block_d, chunk = _stack_blocks(head_dim, o.device, n_rows, num_states, acc_dtype)
            # at least one column block: it stores the LSEs (head dim 0 has rows too)
            planned(merge_stack_chunks_kernel)[(cdiv(n_rows, block_r), max(1, cdiv(head_dim, block_d)))](
                *args, BLOCK_R=block_r, BLOCK_D=block_d, CHUNK=chunk, ACC_DTYPE=acc_dtype, ALIGN=align)
        else:
            block_r, block_d = _block_sizes(head_dim, o.device, n_rows)
            planned(merge_stack_kernel)[(cdiv(n_rows, block_r),)](
                *args, BLOCK_R=block_r, BLOCK_D=block_d, ACC_DTYPE=acc_dtype, ALIGN=align)
    return o, lse


def _on_device(t):
    import contextlib

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
