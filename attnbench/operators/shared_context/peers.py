"""Third-party ways to compute shared-context attention, measured beside ours.

- ``per_batch_*``: today's layout. The context is copied into every sample's KV cache
  ([B, Hkv, Nctx + Nbuf, D], built untimed in prepare) and SDPA runs per batch, pinned to one
  backend (FLASH, cuDNN; MATH as the CPU-runnable yardstick).
- ``expand0_flash``: the context *expanded* to the batch with stride 0 (a view, no copy: every
  sample re-reads the same context from L2) through SDPA FLASH with its logsumexp, the buffer
  through SDPA FLASH per sample, and an exact merge of the two states.
- ``fold_flash`` / ``fold_cudnn``: Hydragen-style batch folding. Per KV head the queries of all
  samples (and the query heads of a GQA group) become the rows of ONE attention over the
  context, so the context is read once per tile of rows, like our kernels do; then the buffer per
  sample and the merge.

The merge of the last two is ``attnbench.merge.merge_states_triton`` on a GPU (one launch: the
fastest merge we have, so the peers are not charged for an eager one) and the torch merge on
a CPU. A backend that cannot run a case raises Unsupported with its reason.
"""
import warnings

import torch
import torch.nn.functional as F

from ...merge import merge_states, merge_states_triton
from ...bench.registry import Unsupported
from ...shared_context import reference
from ..peers import SDPBackend, causal_lower_right, sdpa_kernel, sdpa_unavailable  # noqa: F401 (re-exported)

PER_BATCH = {"per_batch_math": "MATH", "per_batch_flash": "FLASH_ATTENTION", "per_batch_cudnn": "CUDNN_ATTENTION"}
# the backend a folded / expanded peer computes each (O, LSE) part with
WITH_LSE = {"expand0_flash": "flash", "fold_flash": "flash", "fold_cudnn": "cudnn"}
MEMORY_HEADROOM = 0.8  # a per-batch cache may take this share of the free GPU memory


def lse_unavailable(device):
    if device.type != "cuda":
        return "SDPA's logsumexp-returning kernels (flash, cuDNN) need a CUDA device"
    return None


def _all_full(case):
    return case.lengths == "full"


def per_batch_cache_bytes(case) -> int:
    """Bytes of the materialized per-batch K and V caches."""
    return 2 * case.batch * case.heads_kv * (case.n_ctx + case.n_buf) * case.head_dim * case.torch_dtype.itemsize


def _check_fits(case, device):
    if device.type != "cuda":
        return
    need = per_batch_cache_bytes(case)
    free, _ = torch.cuda.mem_get_info(device)
    if need > MEMORY_HEADROOM * free:
        raise Unsupported(f"the per-batch cache needs {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB free")


def per_batch_forward(backend_name, case, x):
    """SDPA on the materialized per-batch cache. Returns a callable -> (o, None)."""
    q = x["q"]
    device = q.device
    n_keys = case.n_ctx + case.n_buf
    if backend_name != "MATH" and not _all_full(case):
        raise Unsupported("per-sample buffer lengths need a mask, which this SDPA backend does not take")
    _check_fits(case, device)
    try:
        k, v = reference.per_batch_cache(x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], case.batch)
    except torch.OutOfMemoryError:
        raise Unsupported("out of memory building the per-batch cache") from None
    kwargs = dict(scale=case.softmax_scale, enable_gqa=case.heads_q != case.heads_kv)
    if not _all_full(case):  # MATH only: the explicit visibility mask
        kwargs["attn_mask"] = reference.visibility(case.batch, case.seqlen_q, case.n_ctx, case.n_buf, x["buf_lens"],
                                                   case.causal, device).unsqueeze(1)
        if not kwargs["attn_mask"].any(dim=-1).all():
            raise Unsupported("rows that see no key: SDPA's output is undefined there")
    elif case.causal and case.seqlen_q > 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            kwargs["attn_mask"] = causal_lower_right(case.seqlen_q, n_keys)
    backend = getattr(SDPBackend, backend_name)

    def forward():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs), None

    return forward


def attend_with_lse(backend, q, k, v, scale, causal=False):
    """(O, LSE) of attention over same-headed [N, H, L, D] tensors through a logsumexp-returning
    SDPA kernel; ``causal`` is bottom-right aligned (FlashAttention's convention)."""
    if backend == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    if backend == "cudnn":
        if causal:
            raise Unsupported("cuDNN's is_causal is top-left aligned; the buffer needs bottom-right")
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
        return out[0], out[1].reshape(q.shape[:3])
    if backend == "cpu":  # torch's CPU flash kernel: lets the CPU gate check the folding and merging
        mask = None
        if causal:
            rows = torch.arange(q.shape[2], device=q.device)[:, None]
            cols = torch.arange(k.shape[2], device=q.device)[None, :]
            visible = cols <= rows + (k.shape[2] - q.shape[2])
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                         scale=scale)
        return out[0], out[1]
    raise ValueError(f"unknown backend {backend!r}")


def _grouped_rows(q, heads_kv):
    """[B, H, Lq, D] -> [B, Hkv, G * Lq, D]: a view when G == 1 or Lq == 1, else a copy."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    return q.unflatten(1, (heads_kv, heads_q // heads_kv)).reshape(batch, heads_kv, -1, head_dim)


def _buffer_part(backend, case, q_rows, x):
    if case.causal and case.seqlen_q > 1 and case.heads_q != case.heads_kv:
        raise Unsupported("causal buffer with GQA and Lq > 1: the folded rows need a mask SDPA cannot express")
    causal = case.causal and case.seqlen_q > 1  # with Lq == 1 the causal limit is the length itself
    return attend_with_lse(backend, q_rows, x["k_buf"], x["v_buf"], case.softmax_scale, causal)


def _merge(device):
    return merge_states_triton if device.type == "cuda" else merge_states


def split_peer_forward(name, case, x, backend=None):
    """Context part (expanded with stride 0, or batch-folded), buffer part, merge. -> callable -> (o, lse)."""
    if not _all_full(case):
        raise Unsupported("per-sample buffer lengths need a mask, which SDPA FLASH does not take")
    q = x["q"]
    backend = backend or WITH_LSE[name]
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv = case.heads_kv
    scale = case.softmax_scale
    k_ctx, v_ctx = x["k_ctx"], x["v_ctx"]
    merge = _merge(q.device)
    folded = name.startswith("fold")

    def context_part():
        if folded:
            # [1, Hkv, B * G * Lq, D]: a view of q when G == 1 and q has the model's [B, Lq, H, D] layout
            q_fold = q.unflatten(1, (heads_kv, heads_q // heads_kv)).permute(1, 0, 2, 3, 4).reshape(
                1, heads_kv, -1, head_dim)
            o, lse = attend_with_lse(backend, q_fold, k_ctx.unsqueeze(0), v_ctx.unsqueeze(0), scale)
            # back to [B, Hkv, G * Lq] rows, as strided views
            o = o.view(heads_kv, batch, -1, head_dim).transpose(0, 1)
            lse = lse.view(heads_kv, batch, -1).transpose(0, 1)
            return o, lse
        q_rows = _grouped_rows(q, heads_kv)
        expand = (batch, *k_ctx.shape)
        return attend_with_lse(backend, q_rows, k_ctx.unsqueeze(0).expand(expand), v_ctx.unsqueeze(0).expand(expand),
                               scale)

    def forward():
        o_c, lse_c = context_part()
        if case.n_buf:
            o_b, lse_b = _buffer_part(backend, case, _grouped_rows(q, heads_kv), x)
            o, lse = merge(o_c, lse_c, o_b, lse_b, q.dtype)
        else:
            o, lse = o_c, lse_c
        return o.reshape(batch, heads_q, seqlen_q, head_dim), lse.reshape(batch, heads_q, seqlen_q)

    return forward


# ---- FlashInfer: cascade attention, an LLM server's route for a shared prefix and per-request suffixes


def flashinfer_cascade_declines(case):
    from ..external import half_only, padded_head_dim

    if reason := half_only(case.dtype, "FlashInfer"):
        return reason
    if padded_head_dim(case.head_dim) is None:
        return f"FlashInfer's FA2 kernels take head dims up to 256, not {case.head_dim}"
    if not case.n_ctx:
        return "no shared context: the cascade has no shared level"
    if case.causal and case.seqlen_q > 1 and case.n_buf:
        lens = case.buffer_lengths()
        shortest = case.n_buf if lens is None else int(lens.min())
        if shortest < case.seqlen_q:
            return (f"a buffer of {shortest} entries under {case.seqlen_q} causal queries leaves rows that see no "
                    "buffer key: FlashInfer's causal append needs kv_len >= qo_len")
    return None


def flashinfer_cascade_levels(case, device):
    """The two levels' paged-cache descriptions (dicts of plan arguments), FlashInfer's HND pages
    ([pages, Hkv, page_size, D]) laid over our tensors as they are:

    - shared: k_ctx [Hkv, Nctx, D] is ONE page of page_size Nctx, and all B * Lq query rows are ONE request
      over it (qo_indptr [0, B * Lq]): the batch folded into the rows, read once (Hydragen's fold);
    - unique: k_buf [B, Hkv, Nbuf, D] is B pages of page_size Nbuf, sample b's page holding its buf_lens[b]
      valid entries (last_page_len); a sample with an empty buffer has no page (kv_len 0); its Lq rows
      are request b (qo_indptr b * Lq), causal bottom-right when the case is: our alignment, the Lq
      queries being the last Lq valid entries."""
    from ..external import page_per_sequence

    batch, seqlen_q = case.batch, case.seqlen_q
    lens = case.buffer_lengths()
    lens = torch.full((batch,), case.n_buf, dtype=torch.int32) if lens is None else lens
    # the shared level: one sequence of n_ctx entries whose query rows are all B * Lq rows
    shared = dict(page_per_sequence(torch.tensor([case.n_ctx]), batch * seqlen_q, case.n_ctx, device), causal=False)
    unique = dict(page_per_sequence(lens, seqlen_q, case.n_buf, device), causal=case.causal)
    return shared, unique


def flashinfer_cascade_forward(case, x):
    """Cascade attention as FlashInfer's MultiLevelCascadeAttentionWrapper runs it, two levels: a
    BatchPrefillWithPagedKVCacheWrapper per level (shared context, then each sample's buffer), each
    returning its (O, base-2 LSE), and ``merge_state_in_place`` of the shared state into the unique one.
    The wrapper's run() returns O alone; its steps are taken here one by one so that the merged LSE comes
    back too (converted to the natural log). Planned once here, as a server plans once a step for every
    layer. Head dims FlashInfer lacks (below 256) are zero-padded to the next one it takes: the
    context and buffers once here (untimed, as the per-batch peers build their cache), q at every call
    (timed); the scale stays 1/sqrt(D) and the padded output columns, zero, are dropped.
    -> callable -> (o, lse)."""
    if reason := flashinfer_cascade_declines(case):
        raise Unsupported(reason)
    from ..external import flashinfer, flashinfer_workspace, from_token_major, padded_head_dim, token_major

    fi = flashinfer()
    q = x["q"]
    device = q.device
    batch, heads_q, seqlen_q, head_dim = q.shape
    width = padded_head_dim(head_dim)

    def pad(t):
        return t if width == head_dim else F.pad(t, (0, width - head_dim))

    k_ctx, v_ctx = (pad(t).unsqueeze(0) for t in (x["k_ctx"], x["v_ctx"]))  # [1, Hkv, Nctx, D]: one page
    k_buf, v_buf = pad(x["k_buf"]), pad(x["v_buf"])  # [B, Hkv, Nbuf, D]: a page per sample
    workspace = flashinfer_workspace(device)  # shared by the levels, which run one after the other
    wrappers = []
    for level in flashinfer_cascade_levels(case, device)[:2 if case.n_buf else 1]:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend="fa2")
        wrapper.plan(level["qo_indptr"], level["kv_indptr"], level["kv_indices"], level["last_page_len"], heads_q,
                     case.heads_kv, width, level["page_size"], causal=level["causal"], sm_scale=case.softmax_scale,
                     q_data_type=q.dtype, kv_data_type=q.dtype)
        wrappers.append(wrapper)

    def forward():
        q_tokens = pad(token_major(q))  # a view of the model's [B, Lq, H, D] memory
        o, lse = wrappers[0].run(q_tokens, (k_ctx, v_ctx), return_lse=True)
        if case.n_buf:
            o_buf, lse_buf = wrappers[1].run(q_tokens, (k_buf, v_buf), return_lse=True)
            fi.merge_state_in_place(o_buf, lse_buf, o, lse)  # base 2 on both sides
            o, lse = o_buf, lse_buf
        return from_token_major(o[..., :head_dim], lse, batch, seqlen_q)

    return forward
