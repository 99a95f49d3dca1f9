"""The merges and the shared_context API: functions without derivatives refuse them, and arguments of the
wrong kind are named. Each failed before its fix."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

from attnbench.merge import merge_many, merge_many_triton, merge_states, merge_states_triton
from attnbench.shared_context import shared_context_attention

pytestmark = pytest.mark.interpreter


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_triton_merges_refuse_derivatives():
    """merge_states_triton and merge_many_triton have no derivatives: a gradient came back None and
    a tangent vanished (no error); torch.func failed inside the interpreter."""
    oa, ob = randn(1, 2, 8, 16), randn(1, 2, 8, 16, seed=1)
    la, lb = randn(1, 2, 8, seed=2), randn(1, 2, 8, seed=3)
    with pytest.raises(RuntimeError, match="no backward"):
        merge_states_triton(oa.requires_grad_(), la, ob, lb)
    oa = oa.detach()
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        merge_states_triton(fwAD.make_dual(oa, torch.ones_like(oa)), la, ob, lb)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda a: merge_many_triton(torch.stack([a, ob]), torch.stack([la, lb]))[0].sum())(oa)
    # the plain PyTorch merges differentiate
    assert torch.func.grad(lambda a: merge_states(a, la, ob, lb)[0].sum())(oa).abs().sum() > 0


@pytest.mark.parametrize("bad", ["x", 5, torch.tensor(0.25)], ids=["str", "int", "tensor"])
def test_out_dtype_must_be_a_dtype(bad):
    o, lse = randn(2, 1, 4, 16), randn(2, 1, 4)
    for call in (lambda: merge_many(o, lse, out_dtype=bad), lambda: merge_states(o[0], lse[0], o[1], lse[1], out_dtype=bad),
                 lambda: merge_many_triton(o, lse, out_dtype=bad)):
        with pytest.raises(TypeError, match="out_dtype must be a torch.dtype"):
            call()


@pytest.mark.parametrize("config,words", [
    ("x", "must be a dict"), ({"BLOCK_MM": 16}, "unknown key 'BLOCK_MM'"), ({"BLOCK_M": 0}, "positive int"),
    # these two failed inside the launch (a Triton arange error; a missing positional argument): found by review
    ({"BLOCK_M": 24, "BLOCK_N": 16, "BLOCK_NB": 16}, "BLOCK_M'] must be a power of two >= 16"),
    ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_NB": 4}, "BLOCK_NB'] must be a power of two >= 8"),
    ({"BLOCK_M": 16}, "lacks BLOCK_N, BLOCK_NB"),
    ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_NB": 16, "num_warps": 3}, "num_warps'] must be a power of two"),
])
def test_a_forced_launch_config_is_checked(config, words):
    q, kc = randn(1, 2, 1, 16).float(), randn(2, 8, 16).float()
    with torch.no_grad(), pytest.raises((TypeError, ValueError), match=words):
        shared_context_attention(q, kc, kc, config=config)



def test_autocast_computes_in_the_regions_dtype_as_sdpa_does():
    """Inside torch.autocast the fused kernel takes float32 inputs in the region's dtype, as SDPA does
    (it had computed and returned float32 there); float64 stays float64."""
    q, kc, vc = randn(2, 2, 3, 16).float(), randn(2, 5, 16, seed=1).float(), randn(2, 5, 16, seed=2).float()
    kb, vb = randn(2, 2, 4, 16, seed=3).float(), randn(2, 2, 4, 16, seed=4).float()
    lens = torch.tensor([4, 1], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, lse = shared_context_attention(q, kc, vc, kb, vb, lens)
        o64, _ = shared_context_attention(*(t.double() for t in (q, kc, vc, kb, vb)), lens)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and o64.dtype == torch.float64
    assert torch.equal(o, shared_context_attention(*(t.bfloat16() for t in (q, kc, vc, kb, vb)), lens)[0])


def test_negative_bit_views_are_read_with_their_sign():
    """A torch._neg_view keeps its sign in a flag; the kernels read the storage (found by review on flash's
    eager path; shared_context's launches skip the dispatcher the same way)."""
    q, kc, vc = randn(2, 2, 3, 16), randn(2, 5, 16, seed=1), randn(2, 5, 16, seed=2)
    kb, vb = randn(2, 2, 4, 16, seed=3), randn(2, 2, 4, 16, seed=4)
    lens = torch.tensor([4, 1], dtype=torch.int32)
    neg = torch._neg_view
    got = shared_context_attention(neg(q), neg(kc), vc, kb, neg(vb), lens)
    want = shared_context_attention(-q, -kc, vc, kb, -vb, lens)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_unchecked_int64_lengths_clamp_rather_than_wrap():
    """check_lengths=False leaves the lengths to the kernels, which clamp them to [0, n_buf]; they cast an int64
    length to int32 first, so 2**32 + 1 read as 1, a silently shorter buffer (found by review)."""
    from attnbench.shared_context import buffer_attention, shared_context_attention_composed

    q, kc, vc = randn(2, 2, 3, 16), randn(2, 5, 16, seed=1), randn(2, 5, 16, seed=2)
    kb, vb = randn(2, 2, 4, 16, seed=3), randn(2, 2, 4, 16, seed=4)
    huge = torch.tensor([2**32 + 1, -(2**32) + 2], dtype=torch.int64)
    clamped = torch.tensor([4, 0], dtype=torch.int64)
    for f in (shared_context_attention, shared_context_attention_composed):
        got, want = f(q, kc, vc, kb, vb, huge, check_lengths=False), f(q, kc, vc, kb, vb, clamped)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    got, want = buffer_attention(q, kb, vb, huge, check_lengths=False), buffer_attention(q, kb, vb, clamped)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_meta_tensors_are_refused_by_device():
    """All-meta inputs failed inside autocast's device query or on reading the lengths' values (found by review):
    the device check comes first and names them."""
    meta = dict(device="meta")
    q, kc, kb = torch.randn(2, 2, 3, 16, **meta), torch.randn(2, 5, 16, **meta), torch.randn(2, 2, 4, 16, **meta)
    with pytest.raises(ValueError, match="need CUDA tensors .* got meta"):
        shared_context_attention(q, kc, kc, kb, kb, torch.tensor([1, 2], **meta))
