"""Third-party attention measured on jvp_attention's routes: SDPA's four backends, compiled
FlexAttention (from flash's peers) and jvp-flash-attention (PyPI) when installed.

Only SDPA's MATH backend differentiates to second order; the fused backends and FlexAttention
raise on forward-mode AD and double backward (tests/attention/test_gpu_jvp_attention.py holds the strict
xfail witnesses), and each peer's failure is reported with its own first error line.
"""
import functools
import importlib.util

from ...bench.registry import Unsupported
from ..flash.peers import flex_forward, flex_unavailable, sdpa_forward, sdpa_unavailable  # noqa: F401 (re-exported)

JVP_FLASH_BLOCK = 128  # its kernels' largest query/key tile


def jvp_flash_unavailable(device):
    if importlib.util.find_spec("jvp_flash_attention") is None:
        return "jvp-flash-attention is not installed (pip install jvp-flash-attention)"
    if device.type != "cuda":
        return "jvp-flash-attention's kernels need a CUDA device"
    return None


def jvp_flash_declines(case):
    """Cases jvp-flash-attention returns wrong values for without an error (lengths off its block,
    Nq != Nk: docs/measurements/jvp_attention.md), or cannot express: declined in check and bench
    with the reason; the capability matrix still runs them to show the wrong values."""
    if case.seqlen_q != case.seqlen_k:
        return "jvp-flash-attention assumes Nq = Nk (it returns wrong values otherwise)"
    if case.seqlen_q % JVP_FLASH_BLOCK:
        return f"jvp-flash-attention returns wrong values for lengths that are not multiples of {JVP_FLASH_BLOCK}"
    if case.heads_q != case.heads_kv:
        return "jvp-flash-attention has no GQA/MQA"
    if case.causal not in (None, "top_left"):
        return "jvp-flash-attention has no bottom-right causal mask"
    return None


def jvp_flash_declines_mode(mode):
    """jvp-flash-attention cannot differentiate its tangent output or its backward: its gradient
    of a tangent output comes back as zeros without an error (relative error 1), and its
    double backward raises. Declined in check and bench; the capability matrix shows both."""
    if mode != "fwd_jvp":
        return "jvp-flash-attention differentiates only to first order in forward mode (vjp of its tangent is zero)"
    return None


def jvp_flash_forward(case, checked=True):
    """f(q, k, v) -> o through JVPAttn.fwd_dual, its documented entry point under torch.func.jvp."""
    if checked and (reason := jvp_flash_declines(case)):
        raise Unsupported(reason)
    module = importlib.import_module("jvp_flash_attention.jvp_attention")
    return functools.partial(_jvp_flash, module.JVPAttn, case.causal is not None, case.softmax_scale)


def _jvp_flash(jvp_attn, causal, scale, q, k, v):
    return jvp_attn.fwd_dual(q, k, v, causal=causal, sm_scale=scale)
