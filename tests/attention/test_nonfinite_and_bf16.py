"""No silent wrong answers from the attention kernels (issue 5, item 1), on the CPU interpreter:

- a NaN or an infinity in q, k or v reaches the outputs it touches as NaN (or, for an infinite V,
  as the same non-finite values the float64 eager reference gives), never as a finite number and
  never as the pair O = 0, LSE = -inf that means "this row sees no key" (a NaN in V may also
  reach rows that mask its key: 0 x NaN in the P V product, exactly as in eager math);
- rows the mask leaves without keys still give exactly that pair, whatever their q holds;
- bfloat16 runs correctly in the interpreter (a labelled float32 upcast: Triton's interpreter
  computes tl.dot on bf16 bit patterns wrongly) for every kernel.
tests/attention/test_gpu_jvp_attention.py repeats the propagation checks on the compiled GPU kernels.
"""
import pytest
import torch

from attnbench.bench import verify
from attnbench.attention import attention_bwd_jvp, attention_jvp, flash_bwd, flash_fwd
from attnbench.operators.flash import split
from attnbench.operators.flash.reference import attention as reference_attention
from tests.helpers import tied_scores

pytestmark = pytest.mark.interpreter

B, HQ, HK, NQ, NK, D = 1, 2, 1, 20, 13, 16
OFFSET = NK - NQ  # bottom-right: rows 0..6 see no key


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, NQ, D, generator=g)
    k, v = torch.randn(B, HK, NK, D, generator=g), torch.randn(B, HK, NK, D, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def forward_variants():
    return {
        "triton": lambda q, k, v: flash_fwd(q, k, v, causal="bottom_right"),
        "split": lambda q, k, v: split.flash_fwd(q, k, v, D ** -0.5, OFFSET),
        "triton_jvp": lambda q, k, v: attention_jvp(q, k, v, torch.ones_like(q), None, None, causal="bottom_right")[:2],
    }


def reference(q, k, v):
    return reference_attention(q.double(), k.double(), v.double(), D ** -0.5, OFFSET)


def poisoned(name, index, value):
    x = inputs()
    dict(zip("qkv", x))[name][index] = value
    return x


BLIND = -OFFSET  # the first rows: blind by the mask
VISIBLE_ROW, KEY = 10, 2  # row 10 sees keys 0..3


@pytest.mark.parametrize("variant", list(forward_variants()))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_query_row_gives_nan_row(variant, value):
    x = poisoned("q", (0, 0, VISIBLE_ROW, 3), value)
    o, lse = forward_variants()[variant](*x)
    assert torch.isnan(o[0, 0, VISIBLE_ROW]).all() and torch.isnan(lse[0, 0, VISIBLE_ROW])
    others = torch.ones(NQ, dtype=torch.bool)
    others[VISIBLE_ROW] = False
    assert torch.isfinite(o[0, 0, others]).all() and torch.isfinite(o[0, 1]).all()
    assert torch.equal(torch.isneginf(lse[0, 0, others]), torch.arange(NQ)[others] < BLIND)


@pytest.mark.parametrize("variant", list(forward_variants()))
def test_all_scores_minus_inf_is_nan_not_blind(variant):
    """A query of -inf against keys whose first coordinate is positive: every score is -inf. Not a
    blind row (it has visible keys): NaN, where a blind row would read O = 0, LSE = -inf."""
    q, k, v = inputs()
    k[..., 0] = k[..., 0].abs() + 0.5
    q[0, 0, VISIBLE_ROW] = 0.0
    q[0, 0, VISIBLE_ROW, 0] = -float("inf")
    o, lse = forward_variants()[variant](q, k, v)
    assert torch.isnan(o[0, 0, VISIBLE_ROW]).all() and torch.isnan(lse[0, 0, VISIBLE_ROW])


@pytest.mark.parametrize("variant", list(forward_variants()))
@pytest.mark.parametrize("name", ["k", "v"])
def test_nan_key_or_value_reaches_every_row_that_sees_it(variant, name):
    x = poisoned(name, (0, 0, KEY, 5), float("nan"))
    o, lse = forward_variants()[variant](*x)
    sees = torch.arange(NQ) + OFFSET >= KEY
    if name == "k":  # every score of the key is NaN: the whole row, and only the rows that see it
        assert torch.isnan(o[0, :, sees]).all() and torch.isnan(lse[0, :, sees]).all()
        assert torch.isfinite(o[0, :, ~sees]).all()
    else:  # O = P V: only the poisoned coordinate, and the LSE does not depend on V
        assert torch.isnan(o[0, :, sees, 5]).all() and torch.isfinite(o[0, :, :, :5]).all()
        assert torch.isfinite(lse[0, :, sees]).all()
        # a row that masks the key may still read NaN there (0 x NaN in the P V product, as in
        # eager math) but a finite value must be the right one: the key's exact zero weight
        clean = inputs()
        clean[2][0, 0, KEY, 5] = 0.0
        want = reference(*clean)[0].float()
        col = o[0, :, ~sees, 5]
        assert torch.equal(col[~torch.isnan(col)], want[0, :, ~sees, 5][~torch.isnan(col)].to(col.dtype)) or \
            verify.relative_error(col[~torch.isnan(col)], want[0, :, ~sees, 5][~torch.isnan(col)]) < 1e-5


@pytest.mark.parametrize("variant", list(forward_variants()))
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf")], ids=["inf", "-inf"])
def test_infinite_key_or_value_matches_the_reference_pattern(variant, name, value):
    """An infinite K or V gives non-finite outputs exactly where float64 eager math does (a key whose
    score is -inf for some row is a zero weight there, as in the reference), and never a blind row."""
    x = poisoned(name, (0, 0, KEY, 5), value)
    o, lse = forward_variants()[variant](*x)
    want_o, want_lse = reference(*x)
    assert torch.equal(torch.isfinite(o), torch.isfinite(want_o))
    assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))  # eager gives +inf where ours is NaN
    finite = torch.isfinite(want_o)
    assert verify.relative_error(o[finite], want_o[finite]) < 1e-5
    sees = torch.arange(NQ) + OFFSET >= KEY
    assert not torch.isneginf(lse[0, :, sees]).any()


def test_blind_rows_ignore_their_queries():
    x = poisoned("q", (0, 1, 2, 0), float("nan"))  # row 2 is blind
    for variant, f in forward_variants().items():
        o, lse = f(*x)
        assert torch.all(o[0, 1, 2] == 0) and torch.isneginf(lse[0, 1, 2]), variant


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_blind_rows_ignore_their_queries_in_every_derivative(value):
    """A blind row's dS is 0, but its query once reached dK through dS^T Q (0 x NaN) and, in the
    backward's tangent, dK_t, dV_t and dQ_t through the score tangent: NaN gradients and HVPs from a
    row whose every derivative is zero by definition (found by review). The query and its tangent
    at blind rows must change nothing: the same bits as with them zeroed."""
    q, k, v = inputs(torch.float64)
    g = torch.Generator().manual_seed(5)
    do, tq = torch.randn(q.shape, generator=g, dtype=q.dtype), torch.randn(q.shape, generator=g, dtype=q.dtype)
    tk, tv = torch.randn(k.shape, generator=g, dtype=k.dtype), torch.randn(v.shape, generator=g, dtype=v.dtype)
    bad_q, bad_tq = q.clone(), tq.clone()
    bad_q[0, 1, 0, 3] = bad_q[0, 0, BLIND - 1, 0] = value  # blind rows: the first and the last of them
    bad_tq[0, 0, 2, 5] = value
    clean_q, clean_tq = q.clone(), tq.clone()
    clean_q[:, :, :BLIND] = 0.0
    clean_tq[:, :, :BLIND] = 0.0
    o, lse = flash_fwd(clean_q, k, v, causal="bottom_right")
    for name, (qq, tt) in {"poisoned": (bad_q, bad_tq), "clean": (clean_q, clean_tq)}.items():
        grads = flash_bwd(do, qq, k, v, o, lse, causal="bottom_right")
        hvp = attention_bwd_jvp(do, qq, k, v, o, lse, tt, tk, tv, causal="bottom_right")
        if name == "poisoned":
            got = grads + hvp
        else:
            want = grads + hvp
    for name, a, b in zip(["dq", "dk", "dv", "dq_t", "dk_t", "dv_t"], got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_backward_and_its_tangent_propagate_nan():
    q, k, v = poisoned("q", (0, 0, VISIBLE_ROW, 3), float("nan"))
    do = torch.randn_like(q)
    o, lse = flash_fwd(q, k, v, causal="bottom_right")
    dq, dk, dv = flash_bwd(do, q, k, v, o, lse, causal="bottom_right")
    assert torch.isnan(dq[0, 0, VISIBLE_ROW]).all()
    assert torch.isnan(dk[0, 0, : VISIBLE_ROW + OFFSET + 1]).any(dim=-1).all()
    assert torch.isfinite(dq[0, 1]).all()
    hq, hk, hv = attention_bwd_jvp(do, q, k, v, o, lse, torch.ones_like(q), None, None, causal="bottom_right")
    assert torch.isnan(hq[0, 0, VISIBLE_ROW]).all() and torch.isnan(hv).any()


# ----------------------------------------------------------------------------- bf16 in the interpreter

@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_bf16_runs_correctly_in_the_interpreter(causal):
    """Every kernel on bfloat16 CPU tensors: within bf16 rounding of the float64 oracle (the raw
    interpreter gave rel. error ~1.8e9 here). Measured: ~2-3e-3; bound 1e-2 (verify.BOUNDS)."""
    q, k, v = inputs(torch.bfloat16)
    do, tq = (torch.randn_like(q) for _ in range(2))
    off = None if causal is None else OFFSET
    (want_o, want_lse) = reference(q, k, v) if causal else reference_attention(q.double(), k.double(), v.double(), D ** -0.5, None)
    o, lse = flash_fwd(q, k, v, causal=causal)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert verify.relative_error(o, want_o) < verify.BOUNDS[torch.bfloat16]
    assert verify.relative_error(lse, want_lse) < 1e-5
    dq, dk, dv = flash_bwd(do, q, k, v, o, lse, causal=causal)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want_grads = torch.autograd.grad(reference_attention(*leaves, D ** -0.5, off)[0], leaves, do.double())
    for got, want in zip((dq, dk, dv), want_grads):
        assert got.dtype == torch.bfloat16 and verify.relative_error(got, want) < verify.BOUNDS[torch.bfloat16]
    _, _, o_t, _ = attention_jvp(q, k, v, tq, None, None, causal=causal)
    want_t = torch.func.jvp(lambda a: reference_attention(a, k.double(), v.double(), D ** -0.5, off)[0], (q.double(),),
                            (tq.double(),))[1]
    assert verify.relative_error(o_t, want_t) < verify.BOUNDS[torch.bfloat16]


def tiles_variant(q, k, v):  # the pointer tiles (Nq <= 64 takes the split-KV forward by default)
    from attnbench.kernels.attention.flash_fwd import forward_route

    with forward_route("tiles"):
        return flash_fwd(q, k, v, causal="bottom_right")


@pytest.mark.parametrize("variant", [*forward_variants(), "tiles"])
@pytest.mark.parametrize("dtype,magnitude", [(torch.float64, 1e17), (torch.float32, 3e15)], ids=["fp64", "fp32"])
def test_scores_far_below_minus_1e30_are_attended_not_dropped(variant, dtype, magnitude):
    """Finite inputs whose scores all lie below -1e30: the running max started at -1e30, so every p was 0 and the
    row came back NaN, as if its scores were -inf (found by review). It starts at the most negative float32 now
    (kernels/precision.ROW_MAX_START) and the answer matches float64, the blind rows still (0, -inf)."""
    q, k, v = inputs(dtype)
    q, k = -q.abs() * magnitude, k.abs() * magnitude  # every score about -magnitude**2 * D**-0.5
    forward = tiles_variant if variant == "tiles" else forward_variants()[variant]
    o, lse = forward(q, k, v)
    ro, rlse = reference(q, k, v)
    seen = torch.arange(NQ) >= BLIND
    assert rlse[..., seen].max() < -1e31
    assert (o.double() - ro).abs().max() < 1e-5
    assert ((lse[..., seen].double() / rlse[..., seen]) - 1).abs().max() < 1e-6  # relative: |LSE| ~ 1e31
    assert torch.isneginf(lse[..., ~seen]).all() and (o[..., ~seen, :] == 0).all()


@pytest.mark.parametrize("route", ["tiles", "decode"])
def test_keys_tied_far_from_zero_weigh_alike(route):
    """Many keys tie for each row's largest score at |LSE| ~ 1e11 (tests.helpers.tied_scores, fp32). The split-KV
    forward merged its partial states through float32 LSEs, whose ulps there (16384) swallow log(ties): 0.29 off in
    O (found by the float64 oracle once it stopped making the same mistake). Partial LSEs are float64 now
    (kernels/precision.STATE_LSE_DTYPE); the fp32 LSE output cannot hold log(ties) at that size, so it is compared
    relative to |LSE|."""
    from attnbench.kernels.attention.flash_fwd import forward_route

    g = torch.Generator().manual_seed(2)
    q, k = tied_scores((1, 2, 8, 64), (1, 2, 80, 64), exponent=20, generator=g)
    v = torch.randn(1, 2, 80, 64, generator=g)
    ro, rlse = reference_attention(q.double(), k.double(), v.double(), 0.125, None)
    with forward_route(route):
        o, lse = flash_fwd(q, k, v, scale=0.125)
    assert verify.relative_error(o, ro) < verify.BOUNDS[torch.float32]
    assert ((lse.double() / rlse) - 1).abs().max() < 1e-6


def test_the_oracle_averages_tied_keys_at_any_distance_from_zero():
    """The float64 oracle took P = exp(s - LSE); at |LSE| ~ 1e30 LSE's rounding swallows log(ties), and every tied key
    weighed 1, not 1/ties: O came back the sum of the tied values (found by the GPU test of scores below -1e30). It
    subtracts the row max now (attnbench/softmax.py)."""
    g = torch.Generator().manual_seed(0)
    q, k = tied_scores((1, 1, 4, 16), (1, 1, 12, 16), exponent=52, generator=g)
    v = torch.randn(1, 1, 12, 16, generator=g)
    o, lse = reference_attention(q.double(), k.double(), v.double(), 0.25, None)
    top = k[0, 0, :, 0] == k[0, 0, :, 0].min()  # the least negative score: the smallest key
    assert 1 < top.sum() < 12
    assert torch.allclose(o[0, 0], v.double()[0, 0, top].mean(0).expand(4, -1), rtol=1e-15, atol=0)


@pytest.mark.parametrize("sign", [1, -1], ids=["+inf", "-inf"])
@pytest.mark.parametrize("route", ["tiles", "decode"])
def test_an_infinite_query_entry_makes_its_row_nan_in_the_oracle_as_in_the_kernels(sign, route):
    """Scores of +inf and -inf in one row: the oracle's logsumexp read LSE +inf where every kernel gives NaN, so the
    two disagreed on a non-finite input (left alone in an earlier review). The max-subtracted oracle
    (attnbench/softmax.py) gives NaN as well; the other rows stay finite and equal."""
    from attnbench.kernels.attention.flash_fwd import forward_route

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for n in (3, 5, 5))
    q[0, 0, 1, 0] = sign * float("inf")
    ro, rlse = reference_attention(q.double(), k.double(), v.double(), 0.25, None)
    with forward_route(route):
        o, lse = flash_fwd(q, k, v, scale=0.25)
    for got in (ro, rlse, o, lse):
        assert torch.isnan(got[0, 0, 1]).all()
    keep = torch.tensor([0, 2])
    assert torch.isfinite(rlse[..., keep]).all()
    assert verify.relative_error(o[..., keep, :], ro[..., keep, :]) < verify.BOUNDS[torch.float32]
