"""FlashAttention-2 forward: O = softmax(scale * Q K^T + mask) V and the row logsumexp L.

Layout [B, H, N, D] with the last dimension contiguous. One program owns BLOCK_M query rows of
one (batch, query head) and streams the key/value blocks of its KV head (GQA: query head h reads
KV head h // group), keeping the running max m, sum l and unnormalized accumulator in registers.

Key blocks are visited in two phases: blocks every row of the tile may see in full (no mask
arithmetic at all), then the blocks that touch the causal diagonal or the end of the keys.
A row that sees no key at all (bottom-right causal with Nq > Nk) gets O = 0 and L = -inf; a
non-finite input gives NaN, never that pair (softmax_rows.finish_rows). The key-block step is
key_block.attend_key_block. Few query rows (decode) go to flash_decode.py instead.

On sm_90 the forward in fp16/bf16 at the head dims that kernel is measured at (64-256 but 24) is
flash_fwd_hopper.py's Gluon kernel (asynchronous wgmma, the softmax beside the P V product, a loader
warp), faster than these tiles there (docs/measurements/flash.md).
On Hopper (and the interpreter, when forced) the same tiles may also read K and V through tensor
descriptors (``flash_fwd_tma_kernel``: TMA copies, optionally a warp-specialized key loop); the
pointer kernel is the fallback wherever descriptors do not apply (older GPUs, strides that are not
multiples of 16 bytes, fp32/fp64 on a GPU). ``forward_route`` forces a route.
"""
import contextlib

import triton
import triton.language as tl

from .flash_decode import decode_applies, flash_decode_launch
from .flash_fwd_hopper import (HOPPER_DEFAULT_HEAD_DIMS, HOPPER_HEAD_DIMS, HOPPER_NARROW_HEAD_DIMS,
                               HOPPER_NARROW_MAX_PAIRS, flash_fwd_hopper_launch, hopper_applies)
from .head_padding import cut_heads, pad_heads, padded_width
from .key_block import attend_key_block, attend_key_block_tma, head_columns
from ..launch import descriptor_scratch, descriptors_apply, planned
from ..outputs import new_output
from ..precision import ROW_MAX_START, accumulator_dtype, dot_precision, lse_dtype, softmax_scale_log2, split_scale
from .routes import RouteSwitch
from .softmax_rows import finish_rows
from ..tiling import query_tile, row_strides, visible_keys, visible_pairs
from ..tuning import autotune, cdiv, cfg, configs, config_list, head_dim_blocks, pruner, seq_bucket


def _fwd_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (kw["BLOCK_M"] * block_d + config.num_stages * 2 * kw["BLOCK_N"] * block_d) * element_size


_FWD_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_N",
            (4, 3, 128, 64), (8, 3, 128, 128), (8, 3, 128, 64),
            (4, 4, 64, 64), (4, 2, 64, 32)),
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16))


@triton.jit
def load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qn, offs_m, N_Q, HEAD_DIM, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """A tile's query rows in one or two column blocks and their zeroed accumulators:
    (q, q2, acc, acc2, offs_d, offs_d2); without a second block its names alias the first's."""
    rows = offs_m[:, None] < N_Q
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn
    q = tl.load(q_rows + offs_d[None, :], mask=rows & head_columns(offs_d, HEAD_DIM)[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:  # the head dim's second column block (key_block.py)
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + offs_d2[None, :], mask=rows & head_columns(offs_d2, HEAD_DIM)[None, :], other=0.0)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=ACC_DTYPE)
    else:
        offs_d2, q2, acc2 = offs_d, q, acc
    return q, q2, acc, acc2, offs_d, offs_d2


@triton.jit
def store_query_tile(O, LSE, b, h, stride_ob, stride_oh, stride_on, H_Q, offs_m, offs_d, offs_d2, N_Q, HEAD_DIM,
                     acc, acc2, l_i, m_i, causal_offset, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr,
                     ACC_DTYPE: tl.constexpr):
    """Normalize a tile's rows (softmax_rows.finish_rows) and store O and the LSE."""
    rows = offs_m[:, None] < N_Q
    o, lse, inv_l = finish_rows(acc, l_i, m_i, offs_m, causal_offset, CAUSAL, ACC_DTYPE)
    o_rows = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on
    tl.store(o_rows + offs_d[None, :], o.to(O.dtype.element_ty), mask=rows & head_columns(offs_d, HEAD_DIM)[None, :])
    if BLOCK_D2 > 0:
        o2 = acc2 * inv_l[:, None]
        o2_mask = rows & head_columns(offs_d2, HEAD_DIM)[None, :]
        tl.store(o_rows + offs_d2[None, :], o2.to(O.dtype.element_ty), mask=o2_mask)
    tl.store(LSE + (b * H_Q + h) * N_Q + offs_m, lse.to(LSE.dtype.element_ty), mask=offs_m < N_Q)


@autotune(_FWD_CONFIGS, key=["SEQ_BUCKET", "BLOCK_D", "BLOCK_D2", "CAUSAL"],
                 prune_configs_by={"early_config_prune": pruner(_fwd_shared_bytes)})
@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                     N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                     BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, b, h, hk = query_tile(GROUP, CAUSAL)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q, q2, acc, acc2, offs_d, offs_d2 = load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qn, offs_m, N_Q, HEAD_DIM,
                                                        BLOCK_M, BLOCK_D, BLOCK_D2, ACC_DTYPE)
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh

    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)

    full_hi, hi = visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(0, full_hi, BLOCK_N):
        acc, acc2, l_i, m_i = attend_key_block(acc, acc2, l_i, m_i, q, q2, K_head, V_head, stride_kn, stride_vn, n0,
                                               offs_m, offs_d, offs_d2, N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                                               BLOCK_N, BLOCK_D2, False, CAUSAL, ACC_DTYPE, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        acc, acc2, l_i, m_i = attend_key_block(acc, acc2, l_i, m_i, q, q2, K_head, V_head, stride_kn, stride_vn, n0,
                                               offs_m, offs_d, offs_d2, N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                                               BLOCK_N, BLOCK_D2, True, CAUSAL, ACC_DTYPE, DOT_PRECISION)
    store_query_tile(O, LSE, b, h, stride_ob, stride_oh, stride_on, H_Q, offs_m, offs_d, offs_d2, N_Q, HEAD_DIM,
                     acc, acc2, l_i, m_i, causal_offset, BLOCK_D2, CAUSAL, ACC_DTYPE)


# The descriptor kernel's configs: the pointer kernel's, with the key loop not warp-specialized
# (WARP_SPECIALIZE: Triton's automatic producer/consumer split; it is no faster, and its 4-warp
# configs do not compile with triton 3.6: docs/measurements/flash.md).
_FWD_TMA_CONFIGS = [triton.Config({**c.kwargs, "WARP_SPECIALIZE": False}, num_warps=c.num_warps,
                                  num_stages=c.num_stages) for c in _FWD_CONFIGS]


@autotune(_FWD_TMA_CONFIGS, key=["SEQ_BUCKET", "BLOCK_D", "BLOCK_D2", "CAUSAL"],
          prune_configs_by={"early_config_prune": pruner(_fwd_shared_bytes)})
@triton.jit
def flash_fwd_tma_kernel(Q, K, V, O, LSE,
                         stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                         N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                         BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr,
                         ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """``flash_fwd_kernel`` reading K and V through tensor descriptors of the program's KV head
    [N_K, D] (key_block.attend_key_block_tma); same grid, same results."""
    pid_m, b, h, hk = query_tile(GROUP, CAUSAL)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q, q2, acc, acc2, offs_d, offs_d2 = load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qn, offs_m, N_Q, HEAD_DIM,
                                                        BLOCK_M, BLOCK_D, BLOCK_D2, ACC_DTYPE)
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh
    k_desc = tl.make_tensor_descriptor(K_head, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V_head, [N_K, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])
    if BLOCK_D2 > 0:
        k_desc2 = tl.make_tensor_descriptor(K_head, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D2])
        v_desc2 = tl.make_tensor_descriptor(V_head, [N_K, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D2])
    else:
        k_desc2, v_desc2 = k_desc, v_desc

    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)

    full_hi, hi = visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in tl.range(0, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, acc2, l_i, m_i = attend_key_block_tma(acc, acc2, l_i, m_i, q, q2, k_desc, v_desc, k_desc2, v_desc2, n0,
                                                   offs_m, N_K, causal_offset, qk_scale_log2, BLOCK_N, BLOCK_D,
                                                   BLOCK_D2, False, CAUSAL, ACC_DTYPE, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        acc, acc2, l_i, m_i = attend_key_block_tma(acc, acc2, l_i, m_i, q, q2, k_desc, v_desc, k_desc2, v_desc2, n0,
                                                   offs_m, N_K, causal_offset, qk_scale_log2, BLOCK_N, BLOCK_D,
                                                   BLOCK_D2, True, CAUSAL, ACC_DTYPE, DOT_PRECISION)
    store_query_tile(O, LSE, b, h, stride_ob, stride_oh, stride_on, H_Q, offs_m, offs_d, offs_d2, N_Q, HEAD_DIM,
                     acc, acc2, l_i, m_i, causal_offset, BLOCK_D2, CAUSAL, ACC_DTYPE)


ROUTES = ("tiles", "tma", "hopper", "decode")
_ROUTE = RouteSwitch(ROUTES, "forward route")
# Whether the query tiles read K and V through tensor descriptors where they apply: no, side by
# side with the pointer tiles they are no faster (docs/measurements/flash.md).
TMA_BY_DEFAULT = False
# Whether the Gluon wgmma kernel (flash_fwd_hopper.py) takes the shapes it applies to on sm_90: it
# does, being faster than the pointer tiles at the D 64 / D 128 anchors
# (docs/measurements/flash.md).
HOPPER_BY_DEFAULT = True


def forward_route(route):
    """Send every forward in the block to one route (None: by shape and device): "tiles" (FA2's
    query tiles through pointers), "tma" (the same tiles through tensor descriptors; raises where
    they do not apply), "hopper" (the Gluon kernel with asynchronous wgmma, sm_90 only; raises where
    it does not apply) or "decode" (split-KV), e.g. to test or time a route at any shape:
    ``with forward_route("tiles"):``."""
    return _ROUTE(route)


def _hopper_by_default(q, k, causal_offset) -> bool:
    head_dim = q.shape[-1]
    if head_dim in HOPPER_NARROW_HEAD_DIMS:  # by size (flash_fwd_hopper.py: HOPPER_DEFAULT_HEAD_DIMS)
        batch, heads, n_q, _ = q.shape
        return batch * heads * visible_pairs(n_q, k.shape[2], causal_offset) < HOPPER_NARROW_MAX_PAIRS
    return head_dim in HOPPER_DEFAULT_HEAD_DIMS


def _route(q, k, v, causal_offset):
    if _ROUTE.forced is not None:
        return _ROUTE.forced
    if decode_applies(q.shape[2]):
        return "decode"
    if HOPPER_BY_DEFAULT and _hopper_by_default(q, k, causal_offset) and hopper_applies(q, k, v):
        return "hopper"
    return "tma" if TMA_BY_DEFAULT and descriptors_apply((k, v), gpu_dtypes=True) else "tiles"


def flash_fwd_launch(q, k, v, sm_scale: float, causal_offset):
    """The forward on checked inputs. ``causal_offset`` None means no mask, otherwise query row i
    sees keys j <= i + causal_offset. Returns (o, lse) with lse of shape [B, Hq, Nq]. Few query
    rows (Nq <= flash_decode.DECODE_MAX_NQ) take the split-KV route, the rest FA2's query tiles
    (below), through tensor descriptors where they apply and pay; ``forward_route`` overrides."""
    route = _route(q, k, v, causal_offset)
    if route == "decode":
        return flash_decode_launch(q, k, v, sm_scale, causal_offset)
    if route == "tma" and not descriptors_apply((k, v)):
        raise ValueError("forward route 'tma' needs K and V whose base pointers and batch, head and row strides are "
                         "multiples of 16 bytes, on a GPU of compute capability >= 9.0 (or the interpreter)")
    # the default route asked hopper_applies already (_route); a forced one has not
    if route == "hopper" and _ROUTE.forced == "hopper" and not hopper_applies(q, k, v):
        raise ValueError("forward route 'hopper' needs an sm_90 GPU, fp16/bf16 inputs with a head dim in "
                         f"{HOPPER_HEAD_DIMS}, 16-byte aligned pointers and strides, and Triton's Gluon")
    batch, heads_q, n_q, head_dim = q.shape
    width = padded_width(head_dim, q.device)
    if width != head_dim and route in ("tiles", "tma"):  # head_padding.py: a column block the kernels would mask
        with forward_route(route):
            o, lse = flash_fwd_launch(*pad_heads(width, q, k, v), sm_scale, causal_offset)
        return cut_heads(head_dim, o)[0], lse
    heads_kv, n_k = k.shape[1], k.shape[2]
    o = new_output(q.shape, q.dtype, q.device)
    lse = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)
    if route == "hopper":
        flash_fwd_hopper_launch(q, k, v, o, lse, sm_scale, causal_offset)
        return o, lse
    block_d, block_d2 = head_dim_blocks(head_dim)

    def grid(meta):
        return (cdiv(n_q, meta["BLOCK_M"]), heads_q, batch)

    # the descriptor kernel makes its descriptors on the device (scratch set up by the JIT launch): not planned
    kernel = flash_fwd_tma_kernel if route == "tma" else planned(flash_fwd_kernel)
    with descriptor_scratch(q.device) if route == "tma" else contextlib.nullcontext():
        kernel[grid](
            q, k, v, o, lse,
            *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(o),
            n_q, n_k, head_dim, heads_q, heads_q // heads_kv,
            0 if causal_offset is None else int(causal_offset), *split_scale(sm_scale), seq_bucket(max(n_q, n_k)),
            BLOCK_D=block_d, BLOCK_D2=block_d2, CAUSAL=causal_offset is not None,
            ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        )
    return o, lse
