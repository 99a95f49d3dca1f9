"""A NaN input poisons exactly the rows that read it, in every shared_context implementation.

Each implementation computes a state (O, LSE) per key set (the context, each split of it, the buffer) and merges
them; a state with LSE = -inf is "saw no key" and the merge drops it whatever its O holds. A part that read a NaN
once finished as (NaN, -inf): its NaN sum read as "no key", so the merge dropped the part and the row came back
finite, the answer without the NaN key (fused and composed kernels and the split PyTorch path alike; found by a
review against the float64 oracle). The oracle here is reference.attention on the same inputs: it is NaN exactly
in the rows whose visible scores or query hold a NaN (the NaNs are put in K or in Q, not in V, where the
oracle's p @ V would also spread a NaN from a masked slot: 0 * NaN)."""
import pytest
import torch

from attnbench.bench import verify
from attnbench.shared_context import reference, shared_context_attention, shared_context_attention_composed
from attnbench.shared_context.split import shared_context_fwd
from tests.helpers import tied_scores

pytestmark = pytest.mark.interpreter

B, HQ, HKV, LQ, D, N_CTX, N_BUF = 3, 2, 1, 2, 16, 5, 4
LENS = [4, 2, 3]


def fused(q, kc, vc, kb, vb, lens, causal, scale, splits):
    return shared_context_attention(q, kc, vc, kb, vb, lens, causal=causal, scale=scale, num_splits=splits)


def composed(q, kc, vc, kb, vb, lens, causal, scale, splits):
    return shared_context_attention_composed(q, kc, vc, kb, vb, lens, causal=causal, scale=scale, num_splits=splits)


def split_torch(q, kc, vc, kb, vb, lens, causal, scale, splits):
    return shared_context_fwd(q, kc, vc, kb, vb, lens, causal, scale)


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, LQ, D, generator=g, dtype=dtype)
    kc, vc = (torch.randn(HKV, N_CTX, D, generator=g, dtype=dtype) for _ in range(2))
    kb, vb = (torch.randn(B, HKV, N_BUF, D, generator=g, dtype=dtype) for _ in range(2))
    return q, kc, vc, kb, vb, torch.tensor(LENS, dtype=torch.int32)


def poison(where, q, kc, vc, kb, vb):
    """NaN in one place; the (batch, query head, query row) entries whose answer must be NaN."""
    q, kc, kb = q.clone(), kc.clone(), kb.clone()
    rows = torch.zeros(B, HQ, LQ, dtype=torch.bool)
    if where == "visible buffer key":  # slot 0 of sample 1 (length 2): every row of that sample sees it
        kb[1, 0, 0, 3] = float("nan")
        rows[1] = True
    elif where == "context key":  # every row of every sample sees the shared context
        kc[0, 2, 5] = float("nan")
        rows[:] = True
    elif where == "query row":
        q[2, 1, 1, 7] = float("nan")
        rows[2, 1, 1] = True
    elif where == "buffer slot past its length":  # sample 1's slot 3: unused, may hold anything
        kb[1, 0, 3] = float("nan")
    else:
        raise AssertionError(where)
    return (q, kc, vc, kb, vb), rows


@pytest.mark.parametrize("where", ["visible buffer key", "context key", "query row", "buffer slot past its length"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl,splits", [(fused, 1), (fused, 2), (composed, 1), (composed, 2), (split_torch, None)],
                         ids=["fused", "fused-2-splits", "composed", "composed-2-splits", "split"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_nan_input_poisons_exactly_the_rows_that_read_it(impl, splits, causal, where, dtype):
    q, kc, vc, kb, vb, lens = inputs(dtype)
    (q, kc, vc, kb, vb), rows = poison(where, q, kc, vc, kb, vb)
    scale = D ** -0.5
    o, lse = impl(q, kc, vc, kb, vb, lens, causal, scale, splits)
    kb_used = kb.clone()
    kb_used[1, :, LENS[1]:] = 0.0  # the oracle's p @ V and scores would read the unused slot
    ref_o, ref_lse = reference.attention(*(t.double() for t in (q, kc, vc, kb_used, vb)), lens, causal, scale)
    assert torch.equal(torch.isnan(ref_lse), rows), "the oracle itself"  # the test's own premise
    assert torch.equal(torch.isnan(lse), rows), (where, torch.isnan(lse), lse)
    assert torch.equal(torch.isnan(o).all(-1), rows) and not torch.isnan(o[~rows]).any(), where
    # fp64 rounding of the same sums; fp32 accumulates in fp32 (measured error about 1e-6 at this size)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(o[~rows].double(), ref_o[~rows], rtol=tol, atol=tol)
    torch.testing.assert_close(lse[~rows].double(), ref_lse[~rows], rtol=tol, atol=tol)


@pytest.mark.parametrize("implementation", [reference.attention, shared_context_fwd], ids=["reference", "split"])
def test_an_unused_slots_nan_stays_out_of_the_gradient(implementation):
    """The differentiable implementations masked an unused slot's score after Q K^T, so their backward formed
    dQ = dS K with dS = 0 against the NaN key there: the output was right and dQ NaN (found by review). The
    unused slots are zeroed in K as in V now; the gradient equals that of a finite slot, which no row reads."""
    q, kc, vc, kb, vb, lens = inputs(torch.float64)
    bad = kb.clone()
    bad[2, 0, 3] = float("nan")  # sample 2 has length 3: slot 3 is unused
    grads = []
    for k_buf in (kb, bad):
        x = q.clone().requires_grad_()
        o, lse = implementation(x, kc, vc, k_buf, vb, lens, True, 0.25)
        grads.append(torch.autograd.grad(o.sum() + lse.sum(), x)[0])
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl,splits", [(fused, 1), (fused, 2), (composed, 1), (composed, 2), (split_torch, None)],
                         ids=["fused", "fused-2-splits", "composed", "composed-2-splits", "split"])
@pytest.mark.parametrize("dtype,magnitude", [(torch.float64, 1e17), (torch.float32, 3e15)], ids=["fp64", "fp32"])
def test_scores_far_below_minus_1e30_are_attended_not_dropped(impl, splits, causal, dtype, magnitude):
    """Finite inputs whose scores all lie below -1e30: each part's running max started at -1e30, so its p were
    all 0 and the part finished as 'saw no key', which the merge drops: the composed path answered 4.05 off in
    O (found by review). The start is the most negative float32 now (kernels/precision.ROW_MAX_START)."""
    q, kc, vc, kb, vb, lens = inputs(dtype)
    q, kc, kb = -q.abs() * magnitude, kc.abs() * magnitude, kb.abs() * magnitude
    scale = D ** -0.5
    o, lse = impl(q, kc, vc, kb, vb, lens, causal, scale, splits)
    ref_o, ref_lse = reference.attention(*(t.double() for t in (q, kc, vc, kb, vb)), lens, causal, scale)
    assert ref_lse.max() < -1e30  # below the old start (in log2 units, 1.44x this)
    assert (o.double() - ref_o).abs().max() < 1e-5
    assert (lse.double() / ref_lse - 1).abs().max() < 1e-6  # relative: |LSE| ~ 1e31


@pytest.mark.parametrize("impl,splits", [(fused, 1), (fused, 3), (composed, 1), (composed, 3), (split_torch, None)],
                         ids=["fused", "fused-3-splits", "composed", "composed-3-splits", "split"])
def test_keys_tied_far_from_zero_weigh_alike_across_the_merge(impl, splits):
    """Keys of the context and of the buffers tie for a row's largest score at |LSE| ~ 1e11 (tests.helpers.tied_scores,
    fp32): each half's state carried its LSE in float32, whose ulps there (16384) swallow log(ties), so the merge
    weighed the halves by their largest score alone: 0.53 off in O (found by the float64 oracle at such scores). The
    states keep their LSE in float64 now (kernels/precision.STATE_LSE_DTYPE) and O is held to the fp32 bar; the fp32
    LSE output itself cannot hold log(ties) at that size, so it is compared relative to |LSE|."""
    g = torch.Generator().manual_seed(2)
    q, kc, kb = tied_scores((2, 2, 3, 64), (1, 40, 64), (2, 1, 30, 64), exponent=20, generator=g)
    vc, vb = torch.randn(1, 40, 64, generator=g), torch.randn(2, 1, 30, 64, generator=g)
    lens = torch.tensor([30, 17], dtype=torch.int32)
    o, lse = impl(q, kc, vc, kb, vb, lens, False, 0.125, splits)
    ref_o, ref_lse = reference.attention(*(t.double() for t in (q, kc, vc, kb, vb)), lens, False, 0.125)
    assert verify.relative_error(o, ref_o) < verify.BOUNDS[torch.float32]
    assert (lse.double() / ref_lse - 1).abs().max() < 1e-6
