"""Bad input gets a clear error naming the argument, before any kernel launches."""
import pytest
import torch

import attnbench.attention.ops as api
from attnbench.attention import flash_attention, flash_bwd, flash_fwd


@pytest.fixture(autouse=True)
def no_kernel_may_run(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched before the inputs were checked")

    monkeypatch.setattr(api, "_launch", boom)  # every kernel launch goes through it


def qkv(b=1, hq=2, hk=2, nq=8, nk=8, d=16, dtype=torch.float32):
    return (torch.randn(b, hq, nq, d).to(dtype), torch.randn(b, hk, nk, d).to(dtype),
            torch.randn(b, hk, nk, d).to(dtype))


@pytest.mark.parametrize("make,exc,words", [
    (lambda: (torch.randn(2, 8, 16), *qkv()[1:]), ValueError, "q must have 4 dimensions"),
    (lambda: (*qkv()[:2], [1.0]), TypeError, "v must be a torch.Tensor"),
    (lambda: (qkv()[0].to_sparse(), *qkv()[1:]), TypeError, "q must be a dense (strided) tensor, got layout"),
    # a strided nested tensor (the default layout of torch.nested) raised PyTorch's "NestedTensorImpl doesn't support
    # sizes" from the checks' own shape read (found by a probe of the API)
    (lambda: (qkv()[0], torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 3, 16)]), qkv()[2]),
     TypeError, "k must be a dense tensor, got a nested one"),
    (lambda: qkv(dtype=torch.int32), TypeError, "q has dtype torch.int32"),
    (lambda: (qkv()[0].half(), *qkv()[1:]), TypeError, "must share a dtype"),
    (lambda: (qkv()[0], qkv()[1], qkv(nk=9)[2]), ValueError, "k and v must have the same shape"),
    (lambda: (qkv()[0], *qkv(b=2)[1:]), ValueError, "k batch (2) must equal q batch (1)"),
    (lambda: (qkv()[0], *qkv(d=32)[1:]), ValueError, "k head_dim (32) must equal q head_dim (16)"),
    (lambda: qkv(hq=3, hk=2), ValueError, "q heads (3) must be a multiple of k/v heads (2)"),
    (lambda: qkv(d=8), ValueError, "head_dim 8 is unsupported"),
    (lambda: qkv(d=320), ValueError, "head_dim 320 is unsupported"),
    (lambda: qkv(nq=0), ValueError, "empty input"),
    (lambda: qkv(nk=0), ValueError, "empty input"),
    (lambda: qkv(b=0), ValueError, "empty input"),
    (lambda: qkv(hq=0, hk=0), ValueError, "empty input"),  # was read as a bad head-group ratio
    (lambda: qkv(hq=2, hk=0), ValueError, "empty input"),
])
def test_bad_qkv_is_rejected_by_name(make, exc, words):
    for fn in (flash_fwd, flash_attention):
        with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
            fn(*make())


def test_ambiguous_causal_is_rejected():
    with pytest.raises(ValueError, match="causal=True is ambiguous"):
        flash_fwd(*qkv(nq=8, nk=12), causal=True)
    with pytest.raises(ValueError, match="causal must be"):
        flash_fwd(*qkv(), causal="diagonal")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "0.1", True, 1e39, 1e-50])
def test_bad_scale_is_rejected(scale):
    """1e39 overflows and 1e-50 underflows the fp32 the kernels receive: NaN outputs, not an error."""
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        flash_fwd(*qkv(), scale=scale)


def test_numpy_scale_is_accepted():
    import numpy as np

    from attnbench.attention.spec import check_qkv

    assert check_qkv(*qkv(), scale=np.float32(0.25))[0] == 0.25


def test_huge_row_strides_are_copied_not_overflowed():
    """A [B, N, H, D] view of a long sequence has row offsets past int32: the API hands the kernels
    a contiguous copy instead (meta tensors: the shape and strides without 4 GB of storage)."""
    view = torch.empty(0, device="meta", dtype=torch.float16).as_strided((1, 1, 17, 16), (0, 0, 2**27, 1))
    fixed = api._unit_stride(view)
    assert fixed.stride() == (272, 272, 16, 1)
    small = torch.empty(1, 2, 8, 16)
    assert api._unit_stride(small) is small
    with pytest.raises(ValueError, match="exceeds 2\\*\\*31 - 1 elements per head"):
        api._unit_stride(torch.empty(0, device="meta").as_strided((1, 1, 2**27, 32), (0, 0, 32, 1)))


def test_fp64_beyond_head_dim_128_is_declined_on_cuda():
    assert api.unsupported_on_cuda(torch.float64, 256) is not None
    assert api.unsupported_on_cuda(torch.float64, 128) is None
    assert api.unsupported_on_cuda(torch.bfloat16, 256) is None


def test_backward_inputs_are_checked_against_q():
    q, k, v = qkv()
    o, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"do must have shape \(1, 2, 8, 16\)"):
        flash_bwd(do[:, :1], q, k, v, o, lse)
    with pytest.raises(TypeError, match="o must have dtype torch.float32"):
        flash_bwd(do, q, k, v, o.double(), lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 8\)"):
        flash_bwd(do, q, k, v, o, lse[..., :4])
    with pytest.raises(TypeError, match="lse must have dtype torch.float32"):
        flash_bwd(do, q, k, v, o, lse.half())


def test_cpu_tensors_without_interpreter_are_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        flash_fwd(*qkv())


def test_a_sparse_input_is_refused_after_a_dense_call_of_its_shapes(monkeypatch):
    """The call-signature memo held shapes, dtypes and devices but not the layout: a sparse q after a dense call of
    the same shapes skipped the checks and failed inside the launch, naming a memory format (found by review)."""
    monkeypatch.undo()  # the dense call runs its kernel
    q, k, v = qkv()
    flash_attention(q, k, v)
    with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor"):
        flash_attention(q.to_sparse(), k, v)


def test_meta_tensors_are_refused_by_device():
    """Meta tensors (shape-only) reached torch.autocast's query, which knows no 'meta' device and raised its own
    error (found by review): the device check names them."""
    q = torch.randn(1, 2, 8, 16, device="meta")
    with pytest.raises(ValueError, match="need CUDA tensors .* got meta"):
        flash_attention(q, q, q)
