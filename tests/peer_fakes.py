"""CPU stand-ins for FlashInfer and FlashAttention-4, put under their module names so that the peers'
adapters run on this machine: each computes, in plain torch, what the library's documentation says the
call computes, in the library's own layouts and LSE base, and asserts the argument layouts it is given.
A layout or base the adapter gets wrong then shows as a mismatch against the float64 oracle.

- FlashInfer (0.7): paged K/V in HND pages [pages, Hkv, page_size, D], requests described by qo_indptr,
  kv_indptr, kv_indices and last_page_len (kv_len = (pages - 1) * page_size + last_page_len, 0 without
  pages), q and out token-major [tokens, H, D], causal aligned bottom-right, LSE in base 2 [tokens, H].
- FA-4 (flash_attn.cute.flash_attn_func): q [B, Nq, H, D], k, v [B, Nk, Hkv, D], causal bottom-right,
  returns (out [B, Nq, H, D], natural-log LSE [B, H, Nq]), differentiable.
"""
import importlib.machinery
import math
import sys
import types

import torch

from attnbench.operators.flash import reference


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


def _attend(q, k, v, scale, causal):
    """q [Lq, H, D], k, v [Lk, Hkv, D] -> (out [Lq, H, D] float32, natural LSE [Lq, H]); GQA, causal
    bottom-right, a row that sees no key gives (0, -inf)."""
    offset = k.shape[0] - q.shape[0] if causal else None
    o, lse = reference.attention(q.float().permute(1, 0, 2)[None], k.float().permute(1, 0, 2)[None],
                                 v.float().permute(1, 0, 2)[None], scale, offset)
    return o[0].permute(1, 0, 2), lse[0].t()


class PagedWrapper:
    """BatchPrefillWithPagedKVCacheWrapper and BatchDecodeWithPagedKVCacheWrapper (decode: qo_indptr is
    arange(B + 1) and there is no causal mask)."""

    instances = []  # every wrapper made, for the tests' assertions

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 backend="auto", decode=False):
        assert float_workspace_buffer.dtype == torch.uint8
        assert kv_layout in ("NHD", "HND")
        self.kv_layout, self.use_tensor_cores, self.backend, self.decode = kv_layout, use_tensor_cores, backend, decode
        self.plan_args = None
        self.runs = []
        PagedWrapper.instances.append(self)

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              causal=False, sm_scale=None, q_data_type="float16", kv_data_type=None, **unused):
        assert not unused, unused
        for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32 and t.dim() == 1
        assert len(kv_indptr) == len(qo_indptr) == len(last_page_len) + 1
        assert num_qo_heads % num_kv_heads == 0
        assert bool(((last_page_len >= 1) & (last_page_len <= page_size) | (kv_indptr[1:] == kv_indptr[:-1])).all())
        self.plan_args = dict(qo_indptr=qo_indptr.cpu(), kv_indptr=kv_indptr.cpu(), kv_indices=kv_indices.cpu(),
                              last_page_len=last_page_len.cpu(), num_qo_heads=num_qo_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=causal,
                              sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale,
                              q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type)

    def plan(self, *args, **kwargs):
        if self.decode:  # plan(indptr, indices, last_page_len, Hq, Hkv, D, page_size, ...)
            indptr = args[0]
            qo_indptr = torch.arange(len(indptr), dtype=torch.int32, device=indptr.device)
            return self._plan(qo_indptr, *args, **kwargs)
        return self._plan(*args, **kwargs)

    def run(self, q, paged_kv_cache, return_lse=False):
        p = self.plan_args
        k_cache, v_cache = paged_kv_cache
        assert q.dim() == 3 and q.shape[1:] == (p["num_qo_heads"], p["head_dim"]) and q.dtype == p["q_data_type"]
        assert q.shape[0] == int(p["qo_indptr"][-1])
        pages_dim = (1, 2) if self.kv_layout == "HND" else (2, 1)  # (heads, tokens) axes of a page
        for cache in (k_cache, v_cache):
            assert cache.dim() == 4 and cache.dtype == p["kv_data_type"] and cache.shape[3] == p["head_dim"]
            assert cache.shape[pages_dim[0]] == p["num_kv_heads"] and cache.shape[pages_dim[1]] == p["page_size"]
        self.runs.append(dict(q=q, k_cache=k_cache, v_cache=v_cache))
        outs, lses = [], []
        for r in range(len(p["qo_indptr"]) - 1):
            pages = p["kv_indices"][p["kv_indptr"][r]:p["kv_indptr"][r + 1]].long()
            kv_len = max(len(pages) - 1, 0) * p["page_size"] + (int(p["last_page_len"][r]) if len(pages) else 0)

            def tokens(cache):  # the request's pages, one after the other, as [kv_len, Hkv, D]
                chunk = cache[pages.to(cache.device)]
                chunk = chunk.permute(0, 2, 1, 3) if self.kv_layout == "HND" else chunk
                return chunk.reshape(-1, *chunk.shape[2:])[:kv_len]

            rows = q[p["qo_indptr"][r]:p["qo_indptr"][r + 1]]
            o, lse = _attend(rows, tokens(k_cache), tokens(v_cache), p["sm_scale"], p["causal"] and not self.decode)
            outs.append(o)
            lses.append(lse / math.log(2.0))  # FlashInfer's LSE is base 2
        out = torch.cat(outs).to(q.dtype)
        return (out, torch.cat(lses)) if return_lse else out


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    """FlashInfer's merge of two states with base-2 LSEs, written into (v, s)."""
    assert mask is None and s.dtype == s_other.dtype == torch.float32
    merged = torch.logaddexp2(s, s_other)
    safe = torch.where(torch.isneginf(merged), torch.zeros_like(merged), merged)
    w, w_other = torch.exp2(s - safe)[..., None], torch.exp2(s_other - safe)[..., None]
    v.copy_((w * v.float() + w_other * v_other.float()).to(v.dtype))
    s.copy_(merged)


def flashinfer_module():
    PagedWrapper.instances.clear()
    return _module(
        "flashinfer",
        BatchPrefillWithPagedKVCacheWrapper=PagedWrapper,
        BatchDecodeWithPagedKVCacheWrapper=lambda *a, **kw: PagedWrapper(*a, decode=True, **kw),
        merge_state_in_place=merge_state_in_place,
        PagedWrapper=PagedWrapper,
    )


class FA4Calls(list):
    """The arguments FA-4's stand-in was called with."""


def fa4_modules():
    """(flash_attn, flash_attn.cute) stand-ins; ``flash_attn.cute.calls`` records every call."""
    calls = FA4Calls()

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, deterministic=False, **unused):
        assert not unused, unused
        batch, seqlen_q, heads_q, head_dim = q.shape
        assert k.shape[0] == batch and k.shape == v.shape and k.shape[3] == head_dim and heads_q % k.shape[2] == 0
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.dtype == k.dtype == v.dtype
        calls.append(dict(q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse,
                          deterministic=deterministic))
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        offset = k.shape[1] - seqlen_q if causal else None
        o, lse = reference.attention(*(t.float().transpose(1, 2) for t in (q, k, v)), scale, offset)
        out = o.transpose(1, 2).to(q.dtype)
        return (out, lse) if return_lse else out

    cute = _module("flash_attn.cute", flash_attn_func=flash_attn_func, calls=calls)
    package = _module("flash_attn", cute=cute)
    package.__path__ = []
    return package, cute


def install(monkeypatch, flashinfer=False, fa4=False, cutlass=True):
    """Put the stand-ins in sys.modules for the test; returns them."""
    installed = {}
    if flashinfer:
        installed["flashinfer"] = flashinfer_module()
        monkeypatch.setitem(sys.modules, "flashinfer", installed["flashinfer"])
    if fa4:
        package, cute = fa4_modules()
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        installed["fa4"] = cute
        if cutlass:
            monkeypatch.setitem(sys.modules, "cutlass", _module("cutlass"))
    return installed
