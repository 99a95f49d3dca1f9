"""Third-party flash implementations measured beside ours: SDPA's four backends and FlexAttention.

Each SDPA backend is pinned (operators/peers.py) so that a backend that cannot run a case fails
loudly (reported as unsupported) instead of silently falling back to another one.
"""
import functools
import warnings

import torch
import torch.nn.functional as F

from ...bench.registry import Unsupported
from ..peers import SDPBackend, causal_lower_right, sdpa_kernel, sdpa_unavailable  # noqa: F401 (re-exported)

SDPA_BACKENDS = {
    "sdpa_math": "MATH",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
}


def sdpa_forward(backend_name, case, offset):
    if offset is not None and offset < 0:
        # with causal_lower_right and Nq > Nk, cuDNN returns non-zero values for the rows that see no
        # key (torch 2.11; docs/measurements/flash.md) and torch documents NaN there for the other
        # backends: no SDPA backend has a defined answer to compare.
        raise Unsupported("rows that see no key (bottom-right causal, Nq > Nk): SDPA's output is undefined there")
    backend = getattr(SDPBackend, backend_name)
    gqa = case.heads_q != case.heads_kv
    kwargs = dict(scale=case.softmax_scale, enable_gqa=gqa)
    if offset == 0 or (offset is not None and case.seqlen_q == case.seqlen_k):
        kwargs["is_causal"] = True  # top-left, which is also bottom-right when Nq == Nk
    elif offset is not None:
        with warnings.catch_warnings():  # its NaN-rows warning: probe() reports NaN as unsupported
            warnings.simplefilter("ignore", UserWarning)
            kwargs["attn_mask"] = causal_lower_right(case.seqlen_q, case.seqlen_k)

    def forward(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return forward


def flex_unavailable(device):
    if device.type != "cuda":
        return "compiled FlexAttention needs a CUDA device"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as exc:  # pragma: no cover
        return f"flex_attention not importable: {exc}"
    return None


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_forward(case, offset, device):
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = None
    if offset is not None:
        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(visible, None, None, case.seqlen_q, case.seqlen_k, device=device)
    flex = _compiled_flex()
    gqa = case.heads_q != case.heads_kv

    def forward(q, k, v):
        return flex(q, k, v, block_mask=block_mask, scale=case.softmax_scale, enable_gqa=gqa)

    return forward


# ---- FlashAttention-4 (flash_attn.cute): forward and backward, its own autograd Function


def fa4_declines(case):
    """Why FA-4 does not take a case (None when it does)."""
    from ..external import attention_peer_declines, fa4_head_dim

    return attention_peer_declines(case, "FlashAttention-4", fa4_head_dim)


def fa4_forward(case, offset, deterministic=False):
    """f(q, k, v) -> (o, lse) through ``flash_attn_func``, differentiable; ``deterministic``: its backward's
    deterministic mode (dQ, and dK/dV under GQA, added in a fixed order behind semaphores), the peer of our backward,
    which adds no atomics. FA-4 takes [B, N, H, D] tensors
    whose last dim is contiguous: ours are [B, H, N, D], passed as transposed views (no copy) and its
    output returned as one. Its LSE is natural-log [B, H, Nq], ours as it is; rows that see no key
    (bottom-right, Nq > Nk) get O = 0, LSE = -inf from it, as from the oracle, and its backward's
    preprocess reads that -inf as 0, so that their P, hence their gradients, are 0 (flash_bwd_preprocess.py)."""
    if reason := fa4_declines(case):
        raise Unsupported(reason)
    from ..external import fa4

    flash_attn_func = fa4()
    causal = offset is not None  # bottom-right; top-left only where it is the same (Nq == Nk)

    def forward(q, k, v):
        out, lse = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   softmax_scale=case.softmax_scale, causal=causal, return_lse=True,
                                   deterministic=deterministic)
        return out.transpose(1, 2), lse

    return forward


# ---- FlashInfer: the decode kernels an LLM server runs for Nq new tokens per request

FLASHINFER_MAX_NQ = 64  # a decode peer: the rows our split-KV route takes (flash_decode.DECODE_MAX_NQ)
TENSOR_CORE_GROUP = 4  # GQA groups above this decode on tensor cores (vLLM's rule for FlashInfer's decode)


def flashinfer_decode_declines(case):
    from ..external import attention_peer_declines, flashinfer_head_dim

    if case.seqlen_q > FLASHINFER_MAX_NQ:
        return f"the FlashInfer peer is a decode peer: Nq <= {FLASHINFER_MAX_NQ}, not {case.seqlen_q}"
    if reason := attention_peer_declines(case, "FlashInfer", flashinfer_head_dim):
        return reason
    if case.causal is not None and case.seqlen_q > case.seqlen_k:
        return "rows that see no key (bottom-right causal, Nq > Nk): FlashInfer's causal append needs Nq <= Nk"
    return None


def flashinfer_decode_forward(case, offset, device):
    """f(q, k, v) -> (o, lse), forward only. Nq = 1: BatchDecodeWithPagedKVCacheWrapper (CUDA cores, tensor
    cores for GQA groups above 4); Nq > 1: BatchPrefillWithPagedKVCacheWrapper, causal bottom-right when
    the case is causal (speculative decoding's verify step). Planned once here, as a server plans once per
    step for all layers; the timed call is run() plus the layout views and the LSE's change of base."""
    if reason := flashinfer_decode_declines(case):
        raise Unsupported(reason)
    from ..external import flashinfer, flashinfer_workspace, from_token_major, page_per_sequence, token_major

    fi = flashinfer()
    device = torch.device(device)
    # one page per sequence: [B, Hkv, Nk, D] read in place as B pages of page_size Nk, each page full
    plan = page_per_sequence(torch.full((case.batch,), case.seqlen_k), case.seqlen_q, case.seqlen_k, device)
    batch, heads_q, heads_kv, seqlen_q = case.batch, case.heads_q, case.heads_kv, case.seqlen_q
    dtype = case.torch_dtype
    common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=case.softmax_scale)
    workspace = flashinfer_workspace(device)
    if seqlen_q == 1:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=heads_q // heads_kv
                                                        > TENSOR_CORE_GROUP, backend="fa2")
        wrapper.plan(plan["kv_indptr"], plan["kv_indices"], plan["last_page_len"], heads_q, heads_kv, case.head_dim,
                     plan["page_size"], **common)
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend="fa2")
        wrapper.plan(plan["qo_indptr"], plan["kv_indptr"], plan["kv_indices"], plan["last_page_len"], heads_q,
                     heads_kv, case.head_dim, plan["page_size"], causal=offset is not None, **common)

    def forward(q, k, v):
        out, lse = wrapper.run(token_major(q), (k, v), return_lse=True)  # k, v: B pages [Hkv, Nk, D]
        return from_token_major(out, lse, batch, seqlen_q)

    return forward
