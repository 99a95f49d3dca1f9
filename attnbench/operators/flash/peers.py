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
