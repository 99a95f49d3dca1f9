"""Plain helpers of the attention tests, shared by their interpreter and GPU files."""
import pytest
import torch

from attnbench.attention import flash_fwd
from attnbench.bench import verify
from attnbench.kernels.attention.flash_fwd import forward_route


def sdpa(backend, causal=True):
    """torch's scaled_dot_product_attention on one SDPBackend (by name), causal by default."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def f(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def check_tma_route_refuses_40_byte_rows(device, seqlen):
    """A row stride of 40 bytes (D 20 in fp16) cannot be a tensor descriptor's: a forced "tma" forward route says
    so before any kernel runs, and the default route takes the pointer tiles (right to the fp16 bound against
    float64). Returns the q, k, v it ran on."""
    q, k, v = (torch.randn(1, 2, seqlen, 20, device=device, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="16 bytes"):
        with forward_route("tma"):
            flash_fwd(q, k, v)
    o, _ = flash_fwd(q, k, v)
    ref = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / 20 ** 0.5, -1) @ v.double()
    assert verify.relative_error(o, ref) < verify.BOUNDS[torch.float16]
    return q, k, v
