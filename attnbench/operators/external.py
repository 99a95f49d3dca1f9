"""Attention libraries from outside torch that the peers come from: FlashInfer (PyPI ``flashinfer-python``)
and FlashAttention-4 (PyPI ``flash-attn-4``, the CuTe-DSL package ``flash_attn.cute``).

Each is optional. ``*_unavailable(device)`` says why a library's peers cannot run on a device (not
installed, not importable, no compiler, not the GPU it is registered for), the way the SDPA peers'
``sdpa_unavailable`` does; the peers' builders raise ``Unsupported`` with the reason for a case they
do not take. The libraries are imported only when a peer is built (``flashinfer()``, ``fa4()``), so the
CPU tests can put a stand-in under the same module name.

LSE conventions (each library's own, converted to ours: natural log, float32):

- FlashInfer's attention kernels and its ``merge_state`` work in base 2: the LSE they return and take is
  ``log2(sum_j 2 ** (log2(e) * scale * q.k_j))`` = natural LSE / ln 2 (``state.cuh``: ``m + log2(d)``;
  ``prefill.py``'s run(): "lse_base: 'log2' (default, FlashInfer's convention)"). Its states are merged in
  base 2 and the result is multiplied by ln 2 once (``lse_from_log2``).
- FA-4 returns the natural-log LSE, [B, H, Nq] (``softmax.py`` finalize: ``(max * scale_log2 + log2(sum))
  * ln 2``), and O = 0, LSE = -inf for a row that sees no key: our convention, taken as it is.
"""
import importlib
import importlib.util
import math
import os
import shutil

import torch

LN2 = math.log(2.0)
HALF = ("float16", "bfloat16")  # the dtypes both libraries' attention kernels take (besides fp8)


def lse_from_log2(lse):
    """A base-2 LSE (FlashInfer's) as the natural-log LSE."""
    return lse * LN2


def _spec(name):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that fails to import, or a module without a spec
        return None


def half_only(dtype, library):
    if dtype not in HALF:
        return f"{library}'s attention kernels take fp16/bf16, not {dtype}"
    return None


def bottom_right_only(case, library):
    """Both libraries align a causal mask bottom-right: a top-left mask is the same only where Nq == Nk."""
    if case.causal == "top_left" and case.seqlen_q != case.seqlen_k:
        return f"{library}'s causal mask is bottom-right aligned; top-left differs when Nq != Nk"
    return None


def attention_peer_declines(case, library, head_dim_rule):
    """Why an external attention library does not take a flash case (None when it does): a 16-bit dtype, the
    head dims ``head_dim_rule`` allows (a reason or None), and a causal mask that its bottom-right one matches."""
    return (half_only(case.dtype, library) or head_dim_rule(case.head_dim)
            or bottom_right_only(case, library))


# ---- FlashInfer

FLASHINFER_HEAD_DIMS = (64, 128, 256)


def nvcc_path():
    """The nvcc FlashInfer's JIT would run, found as it finds it (flashinfer/jit/cpp_ext.py): FLASHINFER_NVCC,
    then $CUDA_HOME or $CUDA_PATH, then PATH, then /usr/local/cuda; None when there is none."""
    if os.environ.get("FLASHINFER_NVCC"):
        return os.environ["FLASHINFER_NVCC"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.path.exists(c)), None)


def flashinfer_unavailable(device):
    if _spec("flashinfer") is None:
        return "FlashInfer is not installed (pip install flashinfer-python)"
    if device.type != "cuda":
        return "FlashInfer's kernels need a CUDA device"
    if nvcc_path() is None:
        return "FlashInfer JIT-compiles its kernels with nvcc, and there is none (CUDA_HOME, PATH, /usr/local/cuda)"
    return None


def flashinfer():
    return importlib.import_module("flashinfer")


def flashinfer_head_dim(head_dim):
    """FlashInfer's FA2 kernels are instantiated for head dims 64, 128 and 256 and do not validate others
    (an illegal memory access, or wrong values for dims off 16: flashinfer issue 4299)."""
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"FlashInfer's FA2 kernels take head dims {', '.join(map(str, FLASHINFER_HEAD_DIMS))}, not {head_dim}"
    return None


def padded_head_dim(head_dim):
    """The smallest head dim FlashInfer takes that holds ``head_dim`` (zero columns added), None above 256."""
    return next((d for d in FLASHINFER_HEAD_DIMS if d >= head_dim), None)


WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial states)


def flashinfer_workspace(device):
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def page_per_sequence(lens, seqlen_q, page_size, device):
    """The plan arguments of a paged cache that is one page per sequence, laid over a [B, Hkv, page_size, D]
    tensor as it is (FlashInfer's HND pages): sequence b's page holds lens[b] valid entries, a sequence with none
    has no page (kv_len 0), and its seqlen_q query rows are request b (qo_indptr b * seqlen_q)."""
    int32 = dict(dtype=torch.int32, device=device)
    has_page = (lens > 0).to(torch.int32)
    return dict(qo_indptr=torch.arange(len(lens) + 1, **int32) * seqlen_q,
                kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), has_page.cumsum(0).to(torch.int32)]).to(
                    device),
                kv_indices=torch.nonzero(has_page).flatten().to(**int32), last_page_len=lens.to(**int32),
                page_size=page_size)


def token_major(q):
    """[B, H, Nq, D] as FlashInfer's query layout, [B * Nq, H, D] (a copy unless Nq == 1)."""
    batch, heads, seqlen_q, head_dim = q.shape
    return q.transpose(1, 2).reshape(batch * seqlen_q, heads, head_dim)


def from_token_major(o, lse, batch, seqlen_q):
    """FlashInfer's [B * Nq, H, D] output and base-2 [B * Nq, H] LSE as ours: [B, H, Nq, D] and natural-log
    [B, H, Nq]."""
    return (o.unflatten(0, (batch, seqlen_q)).transpose(1, 2),
            lse_from_log2(lse).unflatten(0, (batch, seqlen_q)).transpose(1, 2))


# ---- FlashAttention-4

FA4_ALIGNMENT = 8  # 16 bytes of fp16/bf16: FA-4 asserts head_dim % (16 // itemsize) == 0
FA4_MAX_HEAD_DIM = 256  # its sm_90 range: 8 <= head_dim <= 256 (interface.py, _validate_head_dims)


def fa4_unavailable(device):
    if _spec("flash_attn.cute") is None:
        return "FlashAttention-4 is not installed (pip install flash-attn-4)"
    if _spec("cutlass") is None:
        return ("FlashAttention-4 needs the CuTe DSL (pip install nvidia-cutlass-dsl; installed with --target, "
                "its nvidia_cutlass_dsl/dsl_packages folder must be on PYTHONPATH, which its .pth does in a site dir)")
    if device.type != "cuda":
        return "FlashAttention-4's kernels need a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if torch.version.hip is not None or capability[0] != 9:
        return (f"FlashAttention-4 is registered for its Hopper (sm_90) path; this GPU is "
                f"sm_{capability[0]}{capability[1]}")
    return None


def fa4():
    """FA-4's entry point, ``flash_attn.cute.flash_attn_func``."""
    return importlib.import_module("flash_attn.cute").flash_attn_func


def fa4_head_dim(head_dim):
    if head_dim % FA4_ALIGNMENT or not FA4_ALIGNMENT <= head_dim <= FA4_MAX_HEAD_DIM:
        return (f"FlashAttention-4 on sm_90 takes head dims {FA4_ALIGNMENT}-{FA4_MAX_HEAD_DIM} in steps of "
                f"{FA4_ALIGNMENT}, not {head_dim}")
    return None
