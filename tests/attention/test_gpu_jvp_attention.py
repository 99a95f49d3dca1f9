"""GPU gate for jvp_attention (skipped without CUDA; scripts/gpu_gate.sh runs it).

bf16 and fp16 at real sizes against the float64 oracle for every mode (the JVP's bf16 error is
reported: tangents are fragile in bf16); the boundary witnesses (SDPA's fused backends and
FlexAttention pass forward and first-order backward but fail forward-mode AD and grad-of-grad:
strict xfail, so the day PyTorch gains support the suite says so); NaN/inf propagation in the
compiled kernels; torch.compile and torch.func on the GPU; bitwise determinism; and perf gates
at issue 6's anchor cases (the numbers behind them are in results/gpu/).
"""
import pytest
import torch
import torch.func as tf

import attnbench
from attnbench.bench import verify
from attnbench.attention import attention_bwd_jvp, attention_jvp, flash_attention, flash_bwd, flash_fwd
from attnbench.kernels.attention.flash_bwd import dkdv_route
from attnbench.operators.flash import FlashCase
from attnbench.bench.runner import bench

from tests.helpers import far_scores

from .helpers import sdpa

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def jvp_op():
    return attnbench.get("jvp_attention")


@pytest.mark.parametrize("case", attnbench.get("jvp_attention").cases("gpu"), ids=lambda c: c.label)
def test_our_variants_match_the_oracle_at_real_sizes(jvp_op, case):
    x = jvp_op.make_inputs(case, "cuda", 0)
    oracle, lowp = jvp_op.oracle(case, x), jvp_op.oracle(case, x, dtype=case.torch_dtype)
    for mode in jvp_op.modes:
        for variant in ("triton", "triton_fused"):
            result = verify.check_variant(jvp_op, variant, case, mode, x, oracle, lowp)
            assert result.passed, (variant, mode, result.skipped, [o for o in result.outputs if not o.passed])
            if mode == "fwd_jvp":
                errors = {o.name: f"{o.error:.1e}" for o in result.outputs}
                print(f"{case.label} {variant} fwd_jvp errors vs float64: {errors}")


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 256, 256, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


FUSED = {"FLASH": lambda: sdpa("FLASH_ATTENTION"), "EFFICIENT": lambda: sdpa("EFFICIENT_ATTENTION"),
         "CUDNN": lambda: sdpa("CUDNN_ATTENTION"), "FLEX": _flex}


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 4, 256, 64, generator=g).to("cuda", dtype) for _ in range(3))


def _reference(q, k, v):
    return sdpa("MATH")(q, k, v)


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_backends_pass_forward_and_first_order_backward(name):
    f, x = FUSED[name](), _inputs()
    assert verify.relative_error(f(*x), _reference(*x)) < verify.BOUNDS[torch.bfloat16]
    # plain autograd: FlexAttention's higher-order op does not run under torch.func.grad at all
    leaves = [t.clone().requires_grad_() for t in x]
    grads = torch.autograd.grad(f(*leaves).float().sum(), leaves)
    want = torch.autograd.grad(_reference(*leaves).float().sum(), leaves)
    # two bf16 implementations against each other: each within the bf16 bound (1e-2) of the
    # truth, so up to 2e-2 apart (measured: under 1e-2)
    assert max(verify.relative_error(g, w) for g, w in zip(grads, want)) < 2e-2


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.xfail(strict=True, reason="fused SDPA backends and FlexAttention have no forward-mode AD (torch 2.11)")
def test_fused_backends_forward_mode(name):
    f, x = FUSED[name](), _inputs()
    tf.jvp(f, x, tuple(torch.randn_like(t) for t in x))


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.xfail(strict=True, reason="fused SDPA backends and FlexAttention have no double backward (torch 2.11)")
def test_fused_backends_grad_of_grad(name):
    f, x = FUSED[name](), _inputs()
    tf.grad(lambda q: tf.grad(lambda q: f(q, *x[1:]).float().sum())(q).float().sum())(x[0])


def test_ours_does_what_the_fused_backends_cannot():
    x = _inputs()
    f = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    t = tuple(torch.randn_like(a) for a in x)
    assert verify.relative_error(tf.jvp(f, x, t)[1], tf.jvp(_reference, x, t)[1]) < verify.BOUNDS[torch.bfloat16]
    gg = tf.grad(lambda q: tf.grad(lambda q: f(q, *x[1:]).float().sum())(q).float().sum())(x[0])
    want = tf.grad(lambda q: tf.grad(lambda q: _reference(q, *x[1:]).float().sum())(q).float().sum())(x[0])
    assert verify.relative_error(gg, want) < 3e-2  # a second derivative summed in bf16: 2-3x the first's error


def test_nan_and_inf_propagate_in_the_compiled_kernels():
    """The interpreter tests of tests/attention/test_nonfinite_and_bf16.py, on the GPU's compiled kernels."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 300, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, 2, 100, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    blind = 200  # bottom-right with Nq > Nk: rows 0..199 see no key
    q[0, 0, 250, 3] = float("nan")
    q[0, 0, 260, 0] = float("inf")
    q[0, 1, 10, 0] = float("nan")  # a blind row: stays (0, -inf)
    k2 = k.clone()
    k2[..., 0] = k2[..., 0].abs() + 0.5
    q2 = q.clone()
    q2[0, 1, 270] = 0.0
    q2[0, 1, 270, 0] = -float("inf")  # every score -inf on a row with visible keys: NaN, not blind
    for o, lse in (flash_fwd(q, k, v, causal="bottom_right"), attention_jvp(q, k, v, torch.ones_like(q), causal="bottom_right")[:2]):
        assert torch.isnan(o[0, 0, 250]).all() and torch.isnan(lse[0, 0, 250])
        assert torch.isnan(o[0, 0, 260]).all() and torch.isnan(lse[0, 0, 260])
        assert torch.all(o[0, 1, 10] == 0) and torch.isneginf(lse[0, 1, 10])
        assert torch.isneginf(lse[0, :, :blind]).all() and torch.isfinite(lse[0, 1, blind:]).all()
    o, lse = flash_fwd(q2, k2, v, causal="bottom_right")
    assert torch.isnan(o[0, 1, 270]).all() and torch.isnan(lse[0, 1, 270])
    k3 = k.clone()
    k3[0, 1, 40, 7] = float("nan")
    o, lse = flash_fwd(q, k3, v, causal="bottom_right")
    assert torch.isnan(lse[0, 1, blind + 40:]).all() and torch.isfinite(lse[0, 1, blind:blind + 40]).all()


@pytest.mark.parametrize("route", [None, "tiles"], ids=["default", "dkdv-tiles"])
def test_blind_rows_ignore_their_queries_in_every_derivative_on_the_gpu(route):
    """tests/attention/test_nonfinite_and_bf16.py's blind-row derivative test on the compiled kernels: a NaN or inf
    query (and query tangent) at rows that see no key changes no bit of dQ, dK, dV or their tangents. Not the
    forced Gluon dK/dV route (dkdv_route("hopper"), off by default): it feeds Q from shared memory, as the copy
    engine wrote it, straight into dS^T Q, so a blind row's NaN query still reaches dK there."""
    g = torch.Generator().manual_seed(1)
    q, do, tq = (torch.randn(1, 2, 300, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    k, v, tk, tv = (torch.randn(1, 2, 100, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    blind = 200  # bottom-right with Nq > Nk: rows 0..199 see no key
    clean_q, clean_tq = q.clone(), tq.clone()
    clean_q[:, :, :blind] = 0.0
    clean_tq[:, :, :blind] = 0.0
    bad_q, bad_tq = clean_q.clone(), clean_tq.clone()
    bad_q[0, 0, 5, 3], bad_q[0, 1, blind - 1, 0], bad_tq[0, 0, 150, 9] = float("nan"), float("inf"), float("nan")
    o, lse = flash_fwd(clean_q, k, v, causal="bottom_right")
    results = []
    for qq, tt in ((bad_q, bad_tq), (clean_q, clean_tq)):
        with dkdv_route(route):
            grads = flash_bwd(do, qq, k, v, o, lse, causal="bottom_right")
        results.append(grads + attention_bwd_jvp(do, qq, k, v, o, lse, tt, tk, tv, causal="bottom_right"))
    for name, got, want in zip(["dq", "dk", "dv", "dq_t", "dk_t", "dv_t"], *results):
        assert torch.isfinite(got).all() and torch.equal(got, want), name


@pytest.mark.parametrize("route,n_q,d", [(None, 300, 64), (None, 300, 72), ("tiles", 300, 64), (None, 9, 64),
                                         ("decode", 300, 128)],
                         ids=["default-d64", "default-d72", "tiles", "split-kv", "split-kv-forced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scores_far_below_minus_1e30_are_attended_on_the_gpu(route, n_q, d, dtype):
    """The compiled twin of the interpreter test: finite scores all below -1e30 gave NaN rows while the running max
    started at -1e30 (kernels/precision.ROW_MAX_START); scores that are powers of two (tests.helpers.far_scores:
    random ones that large meet the fused multiply-add's residual); the default bf16 routes at D 64 and 72 on sm_90 are the
    Gluon forward. The forward, the fused JVP kernel, and the forward's output, which is no view (in-place edits)."""
    from attnbench.kernels.attention.flash_fwd import forward_route
    from attnbench.operators.flash.reference import attention as reference

    g = torch.Generator().manual_seed(2)
    q, k = (t.to("cuda", dtype) for t in far_scores((2, 4, n_q, d), (2, 2, 200, d), generator=g))
    v, tq = (torch.randn(*shape, generator=g).to("cuda", dtype) for shape in ((2, 2, 200, d), (2, 4, n_q, d)))
    o_ref, lse_ref = reference(q.double(), k.double(), v.double(), d ** -0.5, 200 - n_q)
    seen = torch.isfinite(lse_ref)  # with Nq 300 > Nk 200 bottom-right, rows 0..99 see no key
    assert lse_ref[seen].max() < -1e30
    with forward_route(route):
        o, lse = flash_fwd(q, k, v, causal="bottom_right")
        o2, lse2, o_t, _ = attention_jvp(q, k, v, tq, causal="bottom_right")
    for got, got_lse in ((o, lse), (o2, lse2)):
        assert verify.relative_error(got, o_ref) < verify.BOUNDS[dtype]
        assert ((got_lse[seen].double() / lse_ref[seen]) - 1).abs().max() < 1e-3
        assert torch.isneginf(got_lse[~seen]).all()
    assert torch.isfinite(o_t).all() and not o._is_view()


def test_torch_compile_and_func_on_the_gpu():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

    def model(q, k, v):
        return lin(flash_attention(lin(q), k, v, causal=True)).float().square().mean()

    x = [t.clone().requires_grad_() for t in _inputs()]
    eager = model(*x)
    eager_grads = torch.autograd.grad(eager, x)
    compiled = torch.compile(model, fullgraph=True)(*x)
    compiled_grads = torch.autograd.grad(compiled, x)
    assert abs(compiled.item() - eager.item()) <= 1e-2 * abs(eager.item())
    assert max(verify.relative_error(a, b) for a, b in zip(compiled_grads, eager_grads)) < 1e-2
    xd = [t.detach() for t in x]
    u = tuple(torch.randn_like(t) for t in xd)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    jvp = torch.compile(lambda *a: tf.jvp(f, a[:3], a[3:])[1], fullgraph=True)(*xd, *u)
    assert verify.relative_error(jvp, tf.jvp(f, tuple(xd), u)[1]) < 1e-2
    hv = tf.vmap(f)(*(torch.stack([t, t]) for t in xd))
    assert verify.relative_error(hv[0], f(*xd)) == 0.0


@pytest.mark.parametrize("case", [FlashCase(2, 8, 2, 1000, 777, 128, "bottom_right", "bfloat16"),
                                  FlashCase(1, 8, 8, 2048, 2048, 64, "top_left", "float16")], ids=lambda c: c.label)
def test_backward_tangent_is_bitwise_deterministic(jvp_op, case):
    x = jvp_op.make_inputs(case, "cuda", 0)
    q, k, v, do, tq, tk, tv = (x[n] for n in ("q", "k", "v", "do", "tq", "tk", "tv"))
    o, lse = flash_fwd(q, k, v, causal=case.causal)
    assert verify.bitwise_equal_runs(lambda: attention_bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, causal=case.causal), runs=3)


def _ratio(rows, mode, ours, peer):
    times = {r.variant: r.timing.median_ms for r in rows if r.mode == mode and r.timing}
    assert ours in times and peer in times, (mode, {r.variant: r.skipped for r in rows if r.mode == mode})
    return times[peer] / times[ours]


@pytest.mark.perf
def test_fwd_jvp_perf_gate(jvp_op, tuned_kernels):
    """Issue 6: fwd+JVP >= 3x jvp-flash-attention and >= 20x SDPA MATH under torch.func.jvp at
    B4 H16 N2048 D64 (measured on an H200: the fused kernel 4.1x and 34x)."""
    case = jvp_op.cases("anchor")[0]
    variants = ["triton_fused", "sdpa_math"] + (["jvp_flash"] if "jvp_flash" in jvp_op.available_variants("cuda") else [])
    rows = bench(jvp_op, [case], "cuda", variants=variants, modes=["fwd_jvp"], progress=False)
    assert _ratio(rows, "fwd_jvp", "triton_fused", "sdpa_math") >= 20
    if "jvp_flash" in variants:
        assert _ratio(rows, "fwd_jvp", "triton_fused", "jvp_flash") >= 3


@pytest.mark.perf
def test_hvp_perf_gate(jvp_op, tuned_kernels):
    """Issue 6: a Hessian-vector product >= 10x SDPA MATH's at B2 H8 N2048 D64, with peak GPU
    memory <= 10% of MATH's. At this size eager PyTorch is host-bound (autograd's and Triton's
    Python costs more than the ~0.65 ms of kernels: see results/), so our kernels are timed as
    CUDA-graph replays; MATH, at 7-8 ms of GPU work, on CUDA events (its host time is noise)."""
    case = jvp_op.cases("anchor")[3]
    modes = ["hvp_fwd_rev", "hvp_rev_rev"]
    ours = bench(jvp_op, [case], "cuda", variants=["triton_fused"], modes=modes, cuda_graph=True, progress=False)
    math_rows = bench(jvp_op, [case], "cuda", variants=["sdpa_math"], modes=modes, progress=False)
    for mode in modes:
        mine = next(r for r in ours if r.mode == mode)
        theirs = next(r for r in math_rows if r.mode == mode)
        assert mine.timing and theirs.timing, (mine.skipped, theirs.skipped)
        assert theirs.timing.median_ms / mine.timing.median_ms >= 10, (mode, mine.timing, theirs.timing)
        assert mine.peak_mem_bytes <= 0.1 * theirs.peak_mem_bytes, (mode, mine.peak_mem_bytes, theirs.peak_mem_bytes)
