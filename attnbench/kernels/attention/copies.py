"""The copies and sums the attention launchers make around their kernels, as planned Triton launches.

Three launcher steps are tensor ops of PyTorch's: the zero-padded copies of a head dim the pointer kernels would
mask and the cut of their outputs (head_padding.py), the sum of the dQ pass's fp32 shares over its key splits and
of the per-head route's dK/dV shares over a head group (flash_bwd.py), and that route's K and V repeated per query
head. Each costs the dispatcher's host time on every call, and each stops a host replay (replay.py refuses a body
that runs a tensor op other than an allocation or a view), so those calls pay the launchers' Python every time: on
an H200 the flash backward at D 40 and D 72 and the decode-shaped backward whose dQ keys are split spent 0.3-0.9 ms
of host time a call beyond their GPU time, where replayed ones spent about 0.1 ms
(results/nvidia-h200/flash/random-bwd-partial.md; docs/measurements/flash.md). Allocated with ``new_output`` and
launched through ``launch.planned``, the same steps replay:

    copy_heads(src, width, repeat)   [B, H, N, D] (any strides, 0 too) -> contiguous [B, H * repeat, N, width]: head h
                                     holds src's head h // repeat, its first min(D, width) columns, zeros after
    copy_heads_each(width, *srcs)    copy_heads of each; by the "grouped" route, those of one layout in one launch
    sum_shares(src, dim, dtype)      a contiguous tensor summed over ``dim`` in the accumulator dtype, in index
                                     order (deterministic), rounded once to ``dtype``

Both are the one place the choice is made: ``copy_route("triton")`` forces the kernels, ``copy_route("torch")``
PyTorch's ops (the same ops the launchers made before); by default the kernels, since they were timed side by side
on a GPU (TRITON_COPIES_BY_DEFAULT; the forced route ``triton@copies`` of flash).
"""
import math

import torch.nn.functional as F
import triton
import triton.language as tl

from ..launch import planned
from ..outputs import new_output
from ..precision import accumulator_dtype
from ..tiling import aligned, stride_align
from ..tuning import cdiv, multiprocessors, next_pow2
from .routes import RouteSwitch

COPY_ROUTES = ("torch", "triton", "grouped")
_COPY_ROUTE = RouteSwitch(COPY_ROUTES, "launcher copy route")
# Whether the launchers' copies and sums run as the kernels below where no route is forced. Timed beside PyTorch's
# ops over the random set on an H200 (results/nvidia-h200/flash/random-{fwd,bwd}-*.json): the backward took
# 0.59-1.06x the time, median 0.94x (GPU) and 0.79x (eager; 0.30-1.16x); the forward the same GPU time (0.93-1.06x).
TRITON_COPIES_BY_DEFAULT = True
# Whether the default copies the pads and cuts of tensors of one layout in one launch ("grouped"): a padded backward
# makes at most 4 launches for its 5 pads and 3 cuts instead of 8 (3 where q and k have one shape). Timed beside the
# one-launch-a-tensor kernels (triton@copies) at the random set's 26 padded head dims on an H200
# (results/nvidia-h200/flash/grouped-copies.json): the backward 0.71-1.01x the GPU time, median 0.82x, and 0.72-0.94x
# in the 25-90 us calls where 11 launches' GPU floor was much of the time; the forward the same (0.97-1.05x).
GROUPED_COPIES_BY_DEFAULT = True
GROUP_MAX = 3  # sources a grouped launch takes (the kernel's pointer arguments)
# Elements a program moves: enough per program to stream at copy bandwidth, few enough to keep the grid wide.
BLOCK_ELEMENTS = 4096
SUM_MIN_BLOCK = 256  # the smallest block a GPU's sum spreads its elements to


def copy_route(route):
    """How the launchers copy and sum around their kernels: "torch" (PyTorch's ops: F.pad, contiguous, sum, to,
    repeat_interleave), "triton" (the planned kernels here, which host replays repeat: a launch a tensor) or
    "grouped" (the same kernels, tensors of one layout sharing a launch: copy_heads_each); None: by default
    (TRITON_COPIES_BY_DEFAULT, GROUPED_COPIES_BY_DEFAULT). The same values either way, bit for bit for the copies; the
    sums in a fixed order.
    ``with copy_route("triton"):``."""
    return _COPY_ROUTE(route)


def by_kernel() -> bool:
    """Whether the launchers' copies and sums take the kernels here now."""
    forced = _COPY_ROUTE.forced
    return TRITON_COPIES_BY_DEFAULT if forced is None else forced in ("triton", "grouped")


def grouped() -> bool:
    """Whether pads and cuts of tensors of one layout share a launch now (copy_heads_each)."""
    forced = _COPY_ROUTE.forced
    return TRITON_COPIES_BY_DEFAULT and GROUPED_COPIES_BY_DEFAULT if forced is None else forced == "grouped"


def _block_elements(device) -> int:
    return 64 if device.type == "cpu" else BLOCK_ELEMENTS  # the interpreter: small tiles, several programs


@triton.jit
def copy_heads_kernel(SRC, DST, SRC1, DST1, SRC2, DST2, HEADS, N, D, WIDTH, REPEAT, ROW_BLOCKS, s_b, s_h, s_n, s_d,
                      COUNT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ALIGN: tl.constexpr):
    """One program: BLOCK_N rows of one (batch, destination head) of one of COUNT (1-3) sources of one layout, the
    second grid axis. The first axis is (batch x destination heads x row blocks): a long sequence's row blocks on an
    axis of their own would pass CUDA's 65535 there."""
    # the source's batch, head and row strides, D and WIDTH are multiples of ALIGN (tiling.aligned): a pad of D 40
    # rows to 48 compiled to 2-byte loads without it (tests/attention/test_vector_loads.py)
    s_b, s_h, s_n = aligned(s_b, ALIGN), aligned(s_h, ALIGN), aligned(s_n, ALIGN)
    D, WIDTH = aligned(D, ALIGN), aligned(WIDTH, ALIGN)
    which = tl.program_id(1)
    if COUNT > 1:  # the pointers chosen by scalar branches keep their 16-byte vectors (test_vector_loads.py)
        if which == 1:
            SRC, DST = SRC1, DST1
    if COUNT > 2:
        if which == 2:
            SRC, DST = SRC2, DST2
    pid = tl.program_id(0).to(tl.int64)
    bh, blk = pid // ROW_BLOCKS, pid % ROW_BLOCKS
    b, h = bh // (HEADS * REPEAT), (bh % (HEADS * REPEAT)) // REPEAT
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W).to(tl.int64)  # int64: a column stride may be large (a transposed view)
    rows = offs_n < N
    copied = offs_w < tl.minimum(D, WIDTH)  # a cut reads only the columns it keeps
    x = tl.load(SRC + b * s_b + h * s_h + offs_n[:, None] * s_n + offs_w[None, :] * s_d,
                mask=rows[:, None] & copied[None, :], other=0.0)
    tl.store(DST + (bh * N + offs_n[:, None]) * WIDTH + offs_w[None, :], x,
             mask=rows[:, None] & (offs_w < WIDTH)[None, :])


def copy_heads(src, width=None, repeat=1):
    """``src`` [B, H, N, D] as a new contiguous [B, H * repeat, N, width] (width None: D): head h is src's head
    h // repeat, columns past D are zeros, columns past width are dropped: F.pad, a contiguous slice and
    repeat_interleave(repeat, dim=1), as one planned launch where ``by_kernel()``."""
    batch, heads, n, head_dim = src.shape
    width = head_dim if width is None else width
    if not by_kernel():  # PyTorch's ops: repeat_interleave, then F.pad or a contiguous slice
        out = src.repeat_interleave(repeat, dim=1) if repeat > 1 else src
        if width > head_dim:
            return F.pad(out, (0, width - head_dim))
        return out if width == head_dim and repeat > 1 else out[..., :width].contiguous()
    return _launch_copies([src], width, repeat)[0]


def copy_heads_each(width, *sources, repeat=1):
    """``copy_heads(t, width, repeat)`` of each source. Where ``grouped()``, the sources of one layout (shape, strides,
    dtype, device, pointer alignment) share a launch, up to GROUP_MAX of them: the backward's pads of do, q and o are
    one launch, of k and v another."""
    if not grouped():
        return [copy_heads(t, width, repeat) for t in sources]
    out, layouts = [None] * len(sources), {}
    for i, t in enumerate(sources):
        # the pointer's remainder too: one source off 16 bytes would cost its partners their 16-byte loads
        layouts.setdefault((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16), []).append(i)
    for members in layouts.values():
        for start in range(0, len(members), GROUP_MAX):
            part = members[start:start + GROUP_MAX]
            for i, copied in zip(part, _launch_copies([sources[i] for i in part], width, repeat)):
                out[i] = copied
    return out


def _launch_copies(sources, width, repeat):
    """copy_heads of 1 to GROUP_MAX sources of one layout as one planned launch."""
    src = sources[0]
    batch, heads, n, head_dim = src.shape
    width = head_dim if width is None else width
    outputs = [new_output((batch, heads * repeat, n, width), src.dtype, src.device) for _ in sources]
    if outputs[0].numel() == 0:
        return outputs
    block_w = next_pow2(width)  # the destination's columns: a pad's zeros and a cut's kept columns
    block_n = max(1, min(next_pow2(n), _block_elements(src.device) // block_w))
    row_blocks = cdiv(n, block_n)
    strides = src.stride()
    pairs = [a for pair in zip(sources, outputs) for a in pair]
    pairs += pairs[:2] * (GROUP_MAX - len(sources))  # unread placeholders: the first pair again
    planned(copy_heads_kernel)[(batch * heads * repeat * row_blocks, len(sources))](
        *pairs, heads, n, head_dim, width, repeat, row_blocks, *strides, COUNT=len(sources), BLOCK_N=block_n,
        BLOCK_W=block_w, ALIGN=stride_align(head_dim, width, *strides[:3]))
    return outputs


@triton.jit
def sum_shares_kernel(SRC, DST, SHARES, INNER, BLOCKS, BLOCK: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """DST[o, i] = sum over s of SRC[o, s, i], s in order; the grid's one axis holds (o, block of i) pairs. The
    shares are read four at a time before they are added (still in order): one share a step left a program waiting
    on each load in turn, 10.8 us for 32 shares of a 2688-element dQ on an H200 (kernel_breakdown)."""
    pid = tl.program_id(0).to(tl.int64)
    o, blk = pid // BLOCKS, pid % BLOCKS
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INNER
    share = SRC + o * SHARES * INNER + offs
    acc = tl.zeros([BLOCK], dtype=ACC_DTYPE)
    for _ in range(0, SHARES // 4):
        # one INNER a step, never a multiple of it: INNER is an int32 argument, and 4 * INNER would wrap at 2**29
        # (found by review: a segfault under the interpreter at INNER 2**29, five shares)
        second = share + INNER
        third = second + INNER
        fourth = third + INNER
        a = tl.load(share, mask=mask, other=0.0)
        b = tl.load(second, mask=mask, other=0.0)
        c = tl.load(third, mask=mask, other=0.0)
        d = tl.load(fourth, mask=mask, other=0.0)
        acc += a.to(ACC_DTYPE)
        acc += b.to(ACC_DTYPE)
        acc += c.to(ACC_DTYPE)
        acc += d.to(ACC_DTYPE)
        share = fourth + INNER
    for _ in range(0, SHARES % 4):
        acc += tl.load(share, mask=mask, other=0.0).to(ACC_DTYPE)
        share += INNER
    tl.store(DST + o * INNER + offs, acc.to(DST.dtype.element_ty), mask=mask)


def sum_shares(src, dim, dtype):
    """``src`` (contiguous) summed over ``dim`` in its accumulator dtype (fp32, fp64 for fp64), the shares added
    in index order, the sum rounded once to ``dtype``: ``src.sum(dim).to(dtype)``, as one planned launch where
    ``by_kernel()``."""
    if not by_kernel():
        return src.sum(dim).to(dtype)
    if not src.is_contiguous():
        raise ValueError("sum_shares: the shares must be contiguous (the launchers write them so)")
    shape = src.shape
    outer, shares, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    dst = new_output(shape[:dim] + shape[dim + 1:], dtype, src.device)
    if dst.numel() == 0:
        return dst
    # programs enough for two an SM where the sum is small (a few query rows' dQ shares in one block left one program
    # adding every share), else the copies' block
    spread = next_pow2(cdiv(outer * inner, 2 * multiprocessors(src.device)))
    block = min(_block_elements(src.device), next_pow2(inner), max(SUM_MIN_BLOCK, spread))
    blocks = cdiv(inner, block)
    planned(sum_shares_kernel)[(outer * blocks,)](src, dst, shares, inner, blocks, BLOCK=block,
                                                ACC_DTYPE=accumulator_dtype(src.dtype))
    return dst
