"""Unit tests of the verification core: error metric, mismatch report, the two-bar judge,
bitwise determinism, the gradcheck guard and NaN-poisoning of outputs."""
import math

import pytest
import torch

from attnbench.bench import verify
from attnbench.kernels import new_output, poisoned_outputs
from attnbench.kernels import outputs as kernel_outputs
from attnbench.operators.flash import FlashCase
from attnbench.bench.verify import BOUNDS, FLOORS, CheckResult, OutputCheck, judge, mismatch_report, relative_error


def _ref():
    return torch.tensor([[1.0, -2.0, 3.0], [0.5, 4.0, -1.5]], dtype=torch.float64)


def _scaled_error(ref, rel):
    """A tensor whose relative error against ref is exactly ``rel`` (up to rounding)."""
    direction = torch.ones_like(ref)
    return ref + direction * (rel * ref.norm() / direction.norm())


# ---------------------------------------------------------------- relative_error

def test_relative_error_exact_match_is_zero():
    ref = _ref()
    assert relative_error(ref.clone(), ref) == 0.0


def test_relative_error_value():
    ref = _ref()
    out = ref.clone()
    out[0, 0] += 0.1
    assert relative_error(out, ref) == pytest.approx(0.1 / ref.norm().item(), rel=1e-12)


def test_relative_error_low_precision_output_is_compared_in_float64():
    ref = _ref()
    assert relative_error(ref.to(torch.float32), ref) == 0.0  # values exactly representable


@pytest.mark.parametrize("value,index", [(math.nan, (1, 2)), (math.inf, (0, 1))], ids=["nan", "inf"])
def test_relative_error_non_finite_in_output_where_reference_is_finite_is_inf(value, index):
    ref = _ref()
    out = ref.clone()
    out[index] = value
    assert relative_error(out, ref) == math.inf


def test_relative_error_ignores_matching_neg_inf():
    """An LSE row that sees no key is -inf in both: it must not turn the error into NaN or inf."""
    ref = torch.tensor([1.0, -math.inf, 2.0, -math.inf], dtype=torch.float64)
    out = torch.tensor([1.0, -math.inf, 2.0 + 1e-3, -math.inf], dtype=torch.float64)
    err = relative_error(out, ref)
    assert math.isfinite(err)
    assert err == pytest.approx(1e-3 / math.sqrt(5.0), rel=1e-9)
    assert relative_error(ref.clone(), ref) == 0.0


def test_relative_error_mismatched_neg_inf_pattern_is_inf():
    ref = torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float64)
    finite_where_ref_is_inf = torch.tensor([1.0, -30.0, 2.0], dtype=torch.float64)
    inf_where_ref_is_finite = torch.tensor([-math.inf, -math.inf, 2.0], dtype=torch.float64)
    assert relative_error(finite_where_ref_is_inf, ref) == math.inf
    assert relative_error(inf_where_ref_is_finite, ref) == math.inf


def test_relative_error_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        relative_error(torch.zeros(2, 3), torch.zeros(3, 2))


# ---------------------------------------------------------------- mismatch_report

def test_mismatch_report_counts_and_locates():
    ref = torch.zeros(4, 5, dtype=torch.float64)
    out = ref.clone()
    out[0, 3] = 1.0
    out[2, 1] = math.nan
    out[3, 4] = -2.5
    rep = mismatch_report(out, ref, rtol=1e-6, atol=1e-6)
    assert rep.count == 3
    assert rep.total == 20
    assert rep.first_indices == [(0, 3), (2, 1), (3, 4)]
    assert rep.nan == 1
    assert rep.inf == 0
    assert rep.max_abs == 2.5
    text = str(rep)
    assert "3/20" in text
    assert "NaN: 1" in text
    assert "(0, 3)" in text


def test_mismatch_report_first_limits_indices():
    ref = torch.zeros(10, dtype=torch.float64)
    out = torch.ones(10, dtype=torch.float64)
    rep = mismatch_report(out, ref, rtol=0.0, first=2)
    assert rep.count == 10
    assert rep.first_indices == [(0,), (1,)]


def test_mismatch_report_all_match():
    ref = torch.tensor([1.0, -math.inf, 3.0], dtype=torch.float64)
    rep = mismatch_report(ref.clone(), ref, rtol=1e-9)
    assert rep.count == 0
    assert rep.inf == 0
    assert "all 3 elements match" in str(rep)


def test_mismatch_report_counts_unmatched_inf():
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = torch.tensor([math.inf, 2.0], dtype=torch.float64)
    rep = mismatch_report(out, ref, rtol=1e-9)
    assert (rep.count, rep.inf, rep.nan) == (1, 1, 0)


# ---------------------------------------------------------------- judge

def test_judge_passes_small_error():
    ref = _ref()
    out = _scaled_error(ref, 1e-4)
    lowp = _scaled_error(ref, 1e-3)
    check = judge("o", out, ref, lowp, torch.float16)
    assert isinstance(check, OutputCheck)
    assert check.passed
    assert check.error == pytest.approx(1e-4, rel=1e-6)
    assert check.reference_error == pytest.approx(1e-3, rel=1e-6)
    assert check.detail == ""


def test_judge_fails_beyond_twice_the_reference_error():
    """fp16: 1e-3 is under BOUNDS (3e-3) and above the floor (2e-4) but > 2 x 4e-4."""
    ref = _ref()
    out = _scaled_error(ref, 1e-3)
    lowp = _scaled_error(ref, 4e-4)
    check = judge("o", out, ref, lowp, torch.float16)
    assert 1e-3 < BOUNDS[torch.float16] and 1e-3 > FLOORS[torch.float16]
    assert not check.passed
    assert check.bound == pytest.approx(8e-4, rel=1e-6)
    assert "mismatch" in check.detail


def test_judge_floor_lets_rounding_pass_when_reference_is_exact():
    """fp64 reference against the fp64 oracle has error 0; a few ulps must still pass (FLOORS)."""
    ref = _ref()
    out = _scaled_error(ref, 1e-14)
    check = judge("o", out, ref, ref.clone(), torch.float64)
    assert check.reference_error == 0.0
    assert check.passed
    worse = judge("o", _scaled_error(ref, 5e-13), ref, ref.clone(), torch.float64)
    assert not worse.passed  # above the floor 1e-13, and 2 x 0 = 0


def test_judge_fails_above_bounds_even_if_reference_is_worse():
    ref = _ref()
    out = _scaled_error(ref, 5e-3)  # fp16 bound is 3e-3
    lowp = _scaled_error(ref, 1e-1)
    check = judge("o", out, ref, lowp, torch.float16)
    assert not check.passed
    assert check.bound == BOUNDS[torch.float16]


def test_judge_without_low_precision_reference_uses_the_bound():
    ref = _ref()
    assert judge("o", _scaled_error(ref, 1e-6), ref, None, torch.float32).passed
    assert not judge("o", _scaled_error(ref, 1e-4), ref, None, torch.float32).passed


def test_judge_nan_never_passes():
    ref = _ref()
    out = ref.clone()
    out[0, 0] = math.nan
    lowp = ref.clone()
    lowp[0, 0] = math.nan  # even a NaN reference does not excuse a NaN output
    for lp in (ref.clone(), lowp, None):
        check = judge("o", out, ref, lp, torch.bfloat16)
        assert not check.passed
        assert check.error == math.inf
        assert "NaN: 1" in check.detail


# ---------------------------------------------------------------- check_outputs / CheckResult

CASE = FlashCase(1, 1, 1, 3, 3, 16, None, "float32")


def _flash_oracle():
    gen = torch.Generator().manual_seed(0)
    return {"o": torch.randn(1, 1, 3, 16, generator=gen, dtype=torch.float64),
            "lse": torch.randn(1, 1, 3, generator=gen, dtype=torch.float64)}


def test_check_outputs_pass(flash):
    oracle = _flash_oracle()
    outputs = {k: v.to(torch.float32) for k, v in oracle.items()}
    result = verify.check_outputs(flash, "triton", CASE, "fwd", outputs, oracle, outputs)
    assert isinstance(result, CheckResult)
    assert [o.name for o in result.outputs] == ["o", "lse"]
    assert result.passed
    assert not result.skipped
    assert result.max_error < FLOORS[torch.float32]
    d = result.as_dict()
    assert d["passed"] is True and d["case"] == CASE.label and len(d["outputs"]) == 2


def test_check_outputs_one_bad_output_fails(flash):
    oracle = _flash_oracle()
    outputs = {k: v.to(torch.float32) for k, v in oracle.items()}
    outputs["lse"] = outputs["lse"] * 1.01
    result = verify.check_outputs(flash, "triton", CASE, "fwd", outputs, oracle, None)
    assert not result.passed
    assert [o.passed for o in result.outputs] == [True, False]
    assert result.max_error == pytest.approx(0.01, rel=1e-4)


def test_check_outputs_subset_and_none(flash):
    """A peer may produce only o; our variants must produce every output (a missing lse fails);
    a variant producing none of the mode's outputs is skipped, never passed."""
    oracle = _flash_oracle()
    only_o = verify.check_outputs(flash, "sdpa_math", CASE, "fwd", {"o": oracle["o"].float()}, oracle, None)
    assert [o.name for o in only_o.outputs] == ["o"] and only_o.passed
    ours = verify.check_outputs(flash, "triton", CASE, "fwd", {"o": oracle["o"].float()}, oracle, None)
    assert not ours.passed and [o.detail for o in ours.outputs if not o.passed] == ["output missing"]
    none = verify.check_outputs(flash, "sdpa_math", CASE, "fwd", {"dq": oracle["o"]}, oracle, None)
    assert none.skipped
    assert not none.passed
    assert math.isnan(none.max_error)


def test_one_bad_tile_fails_the_local_bar():
    """Zeroing rows of a large output barely moves the global norm but scores 1.0 on those rows."""
    ref = torch.randn(4, 16, 512, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = ref.clone()
    out[0, 0, :2] = 0  # 2 of 32768 rows: global error sqrt(2 / 32768) = 0.008, under the bf16 bound
    assert verify.relative_error(out, ref) < verify.BOUNDS[torch.bfloat16]
    check = verify.judge("o", out.to(torch.bfloat16), ref, None)
    # a zeroed row scores its norm over max(its norm, the RMS row norm): ~1 for a typical row
    assert not check.passed and check.worst_row_error > 0.5


def test_lse_is_judged_at_its_own_precision():
    """An fp32 LSE off by 0.01 (a 1% wrong softmax normaliser) fails even in a bf16 case."""
    ref = torch.randn(1, 2, 1024, dtype=torch.float64) + 8
    lowp_eager = ref.to(torch.bfloat16)
    check = verify.judge("lse", (ref + 0.01).to(torch.float32), ref, lowp_eager)
    assert not check.passed


def test_check_result_skipped_is_not_passed():
    assert not CheckResult("op", "v", "c", "fwd").passed  # no outputs: nothing was verified
    assert not CheckResult("op", "v", "c", "fwd", skipped="needs CUDA").passed
    r = CheckResult("op", "v", "c", "fwd",
                    outputs=[OutputCheck("o", 1e-3, 0.0, 1.0, True), OutputCheck("lse", 2e-3, 0.0, 1.0, True)])
    assert r.max_error == 2e-3


# ---------------------------------------------------------------- bitwise_equal_runs

def test_bitwise_equal_runs_deterministic():
    x = torch.randn(8, 8)
    assert verify.bitwise_equal_runs(lambda: {"a": x @ x, "b": x.t()}, runs=3)
    assert verify.bitwise_equal_runs(lambda: (x + 1, x * 2))


def test_bitwise_equal_runs_nan_is_bitwise_equal():
    """Bitwise comparison: a NaN output repeated exactly counts as reproducible."""
    assert verify.bitwise_equal_runs(lambda: {"a": torch.full((3,), math.nan)})


def test_bitwise_equal_runs_detects_change():
    calls = []

    def drifting():
        calls.append(None)
        return {"o": torch.ones(4) + len(calls) * 1e-7}

    assert not verify.bitwise_equal_runs(drifting)
    assert len(calls) == 2


def test_bitwise_equal_runs_detects_change_on_a_later_run():
    calls = []

    def third_differs():
        calls.append(None)
        return (torch.zeros(2) if len(calls) < 3 else torch.tensor([0.0, -0.0]),)

    assert verify.bitwise_equal_runs(third_differs, runs=2)
    calls.clear()
    assert not verify.bitwise_equal_runs(third_differs, runs=3)  # -0.0 differs from 0.0 bitwise


# ---------------------------------------------------------------- gradcheck

def test_gradcheck_rejects_float32():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="float64"):
        verify.gradcheck(lambda t: t * 2, (x,))


def test_gradcheck_rejects_any_low_precision_input():
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float16)
    with pytest.raises(TypeError, match="input 1"):
        verify.gradcheck(lambda s, t: s * t.double(), (a, b))


def test_gradcheck_float64_passes():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert verify.gradcheck(lambda a, b: torch.tanh(a @ b), (x, w)) is True


def test_gradcheck_catches_a_wrong_gradient():
    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * x

        @staticmethod
        def backward(ctx, g):
            return g  # should be 2 x g

    from torch.autograd.gradcheck import GradcheckError

    x = torch.tensor([1.5, -0.7, 2.3], dtype=torch.float64, requires_grad=True)
    with pytest.raises(GradcheckError):
        verify.gradcheck(WrongGrad.apply, (x,))


# ---------------------------------------------------------------- poisoned_outputs

def test_poisoned_outputs_fills_new_outputs_with_nan_and_restores():
    assert not kernel_outputs._poisoning()
    with poisoned_outputs():
        t = new_output((3, 4), torch.float32, "cpu")
        assert t.shape == (3, 4) and t.dtype == torch.float32
        assert torch.isnan(t).all()
        assert torch.isnan(new_output((5,), torch.float16, "cpu")).all()
        with poisoned_outputs(False):
            assert not kernel_outputs._poisoning()
        assert kernel_outputs._poisoning()  # the inner block restores the outer state
    assert not kernel_outputs._poisoning()


def test_poisoning_reaches_autograds_threads():
    """Autograd runs the backward of CUDA tensors on a device thread of its own: a thread-local switch
    left the backward kernels' outputs unpoisoned there."""
    import threading

    seen = []
    with poisoned_outputs():
        worker = threading.Thread(target=lambda: seen.append(kernel_outputs._poisoning()))
        worker.start()
        worker.join()
    assert seen == [True]


def test_poisoned_outputs_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with poisoned_outputs():
            raise RuntimeError("kernel failed")
    assert not kernel_outputs._poisoning()


def test_run_poisoned_reaches_the_triton_launcher(flash, monkeypatch):
    """The check path allocates triton outputs under poisoning: a kernel that writes nothing gives NaN."""
    seen = []
    real = kernel_outputs.new_output

    def spy(shape, dtype, device):
        seen.append(kernel_outputs._poisoning())
        return real(shape, dtype, device)

    import attnbench.kernels.attention.flash_decode as decode_module
    import attnbench.kernels.attention.flash_fwd as fwd_module
    import attnbench.kernels.merge_states as merge_module

    for module in (fwd_module, decode_module, merge_module):  # both forward routes, and the split merge
        monkeypatch.setattr(module, "new_output", spy)
    for case in (FlashCase(1, 1, 1, 5, 7, 16, None, "float32"), FlashCase(1, 2, 1, 3, 70, 16, None, "float32"),
                 FlashCase(1, 1, 1, 70, 7, 16, None, "float32")):  # decode: one split, several; the tiles
        seen.clear()
        x = flash.make_inputs(case, "cpu")
        out = verify.run_poisoned(flash, "triton", case, x, "fwd")
        assert seen and all(seen), case
        assert torch.isfinite(out["o"]).all()
        assert not kernel_outputs._poisoning()


def test_eager_reference_is_reported_not_bounded(flash):
    """The eager reference in a low dtype is the 2x rule's yardstick: over the dtype bound it still
    passes (its error is shown), while the same numbers from a shipped variant fail."""
    oracle = _flash_oracle()
    bad = {k: v * 1.05 for k, v in oracle.items()}
    as_reference = verify.check_outputs(flash, "reference", CASE, "fwd", bad, oracle, bad)
    as_triton = verify.check_outputs(flash, "triton", CASE, "fwd", bad, oracle, bad)
    assert as_reference.passed and not as_triton.passed
    assert as_reference.max_error == pytest.approx(0.05, rel=1e-6)


def test_worst_row_bar_follows_the_eager_reference_row_by_row():
    """A row whose true value is 0 (a one-key causal row of a Hessian) and that carries bf16-sized
    noise: it fails the fixed 8 x bound bar alone, and passes when plain PyTorch in the same dtype
    has a worse worst row (FlashAttention's 2x rule, applied locally); a better reference fails it."""
    g = torch.Generator().manual_seed(0)
    oracle = torch.randn(1, 1, 1024, 32, generator=g, dtype=torch.float64)  # global error stays small
    oracle[0, 0, 0] = 0.0
    out = oracle.clone()
    out[0, 0, 0] = 0.12 * oracle[0, 0, 1:].norm(dim=-1).mean() / 32 ** 0.5  # ~12% of a typical row
    worse = oracle.clone()
    worse[0, 0, 0] = 2 * out[0, 0, 0]
    better = oracle.clone()
    assert not judge("hq", out.bfloat16(), oracle, better.bfloat16()).passed
    check = judge("hq", out.bfloat16(), oracle, worse.bfloat16())
    assert check.passed, check
    assert not judge("hq", out.bfloat16(), oracle, None).passed


def test_an_allocation_error_without_the_caching_allocator_counts_as_out_of_memory():
    """Under compute-sanitizer the gate turns torch's caching allocator off, and cudaMalloc's failure arrives as an
    AcceleratorError, not an OutOfMemoryError: the case is skipped as out of memory all the same; any other
    AcceleratorError still stops the run."""
    from types import SimpleNamespace

    from attnbench.bench import runner

    def op_raising(error):
        def make_inputs(case, device, seed):
            raise error
        return SimpleNamespace(make_inputs=make_inputs)

    oom = op_raising(torch.AcceleratorError("CUDA error: out of memory"))
    assert runner._case_inputs(oom, None, "cpu", 0, lambda x: x) == (None, None, "inputs")
    other = op_raising(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        runner._case_inputs(other, None, "cpu", 0, lambda x: x)


def test_an_output_coarser_than_the_case_fails():
    """Found by review: outputs were judged by their own dtype's bound, so a variant that returned bf16 on an fp32
    case (computing in bf16, or leaking autocast) passed at 1.7e-3 against fp32's 1e-5. A coarser output fails,
    named; a finer one (fp32 on a bf16 case) is judged as before."""
    import attnbench

    op = attnbench.get("flash")
    for dtype in ("float32", "float64"):
        case = FlashCase(1, 2, 2, 37, 29, 24, None, dtype)
        x = op.make_inputs(case, "cpu", 0)
        oracle, lowp = op.oracle(case, x), op.oracle(case, x, dtype=case.torch_dtype)
        coarse = {name: t.to(torch.bfloat16) for name, t in oracle.items()}
        result = verify.check_outputs(op, "split", case, "fwd", coarse, oracle, lowp)
        assert not result.passed and all("coarser than the case's" in o.detail for o in result.outputs)
    case = FlashCase(1, 2, 2, 37, 29, 24, None, "bfloat16")
    x = op.make_inputs(case, "cpu", 0)
    oracle, lowp = op.oracle(case, x), op.oracle(case, x, dtype=case.torch_dtype)
    assert verify.check_outputs(op, "split", case, "fwd", {k: t.float() for k, t in oracle.items()}, oracle,
                                lowp).passed
