"""Tile bookkeeping shared by the kernels that own a block of query rows (forward and dQ pass),
and the launchers' stride helper."""
import triton
import triton.language as tl


@triton.jit
def query_tile(GROUP, CAUSAL: tl.constexpr):
    """(query block index, batch, query head, KV head) of a program on the grid
    (query blocks, heads, batch); int64 where they scale strides. Batch and heads get grid axes of
    their own (each up to 65535) so that a decode-sized batch times heads cannot overflow one axis.
    Under a causal mask the longest rows (most key blocks) are launched first, for a better tail."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    return pid_m, b, h.to(tl.int64), hk


@triton.jit
def visible_keys(m0, N_K, causal_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full_hi, hi) for query rows [m0, m0 + BLOCK_M): keys [0, full_hi) are visible to every row
    and inside N_K (no masking needed), keys [full_hi, hi) need the causal and length masks, and
    no row sees a key at or past hi. Row i sees key j <= i + causal_offset."""
    if CAUSAL:
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + causal_offset, 0), N_K)
        full_hi = tl.minimum(tl.maximum(m0 + 1 + causal_offset, 0), N_K) // BLOCK_N * BLOCK_N
    else:
        hi = N_K
        full_hi = N_K // BLOCK_N * BLOCK_N
    return full_hi, hi


@triton.jit
def aligned(x, ALIGN: tl.constexpr):
    """``x``, known to the compiler as a multiple of ALIGN (the launcher's ``stride_align``). Triton learns
    only that an argument divisible by 16 is; a head dim of 40 or 72 leaves strides that are multiples of 8,
    and without the hint every load of such a row is a 2-byte load and nothing is pipelined (a split-KV
    decode at D 40 read 19% of copy bandwidth: docs/measurements/flash.md). tl.multiple_of does not mark a
    kernel argument; this division and product do, at two scalar instructions."""
    return x // ALIGN * ALIGN


@triton.jit
def aligned_rows(stride_b, stride_h, stride_n, ALIGN: tl.constexpr):
    """A [B, H, N, D] tensor's batch, head and row strides, each through ``aligned``."""
    return aligned(stride_b, ALIGN), aligned(stride_h, ALIGN), aligned(stride_n, ALIGN)


def stride_align(*values) -> int:
    """The largest power of two up to 16 that divides every one of ``values`` (strides and sizes in elements):
    the ALIGN a kernel may claim for them through ``aligned``."""
    align = 16
    for value in values:
        while value % align:
            align //= 2
    return align


def row_strides(t):
    """(batch, head, row) strides of a [B, H, N, D] tensor whose last dimension is contiguous (one stride()
    call, not three: launches pass several of these on every call)."""
    return t.stride()[:3]


def visible_key_count(seqlen_q: int, seqlen_k: int, offset) -> int:
    """The keys the last query row sees (row i sees j <= i + offset; all of them for None): what a launcher may
    split, and beyond which no row reads. A top-left causal decode of 12 rows over 15778 keys reads 12 of them."""
    return seqlen_k if offset is None else min(seqlen_k, max(0, seqlen_q + int(offset)))


def visible_pairs(seqlen_q: int, seqlen_k: int, offset) -> int:
    """(query, key) pairs a causal offset leaves visible in one head (all of them for None), in closed form:
    row i sees min(seqlen_k, max(0, i + offset + 1)) keys. Plain ints, no tensors: route rules ask per call."""
    if offset is None:
        return seqlen_q * seqlen_k
    full = min(max(seqlen_k - offset - 1, 0), seqlen_q)  # rows from here on see every key
    first = min(max(-offset, 0), full)  # rows before this see none
    partial = full - first
    return partial * (offset + 1) + (first + full - 1) * partial // 2 + (seqlen_q - full) * seqlen_k
