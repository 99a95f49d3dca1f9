"""Verification core: is a variant's output the same function as the float64 oracle?

Metric: ||out - oracle|| / ||oracle|| over the finite entries of every output and gradient, with
non-finite entries (an LSE of -inf for a row that sees no key) required to match exactly. Each
output is judged at the precision it is stored in (an fp32 LSE of a bf16 case is held to fp32).
Three bars, all must hold:

1. a per-dtype bound (``BOUNDS``);
2. FlashAttention's rule: at most 2x the error of the eager reference evaluated in the same low
   dtype, or the dtype's ``FLOORS`` entry when the reference happens to be nearly exact;
3. locally: the worst row's error (a row: the last dimension of a [B, H, N, D] tensor, one
   element of a per-row statistic such as the LSE), relative to the tensor's RMS row norm, within
   ``LOCAL_FACTOR`` x the dtype bound, so that one wrong tile cannot hide in a large tensor's norm.

NaN never passes. Outputs are NaN-poisoned before the kernels write them, so an element a kernel
forgot to write shows up as NaN rather than as a plausible zero.
"""
import math
from dataclasses import asdict, dataclass, field

import torch

from ..kernels import poisoned_outputs
from .registry import Unsupported

# Relative-error ceilings, each a few times the worst error measured for its dtype and far below what a
# wrong mask or a dropped key block gives (>= 1e-2, usually O(1)); the fp64 bound only says "fp64
# arithmetic". The measured worst cases are in docs/methodology.md.
BOUNDS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# Floor of the 2x rule: when the reference in that dtype is itself nearly exact (fp64 against the
# fp64 oracle is exactly 0; fp32 is ~1e-7), a few units of rounding must still pass. For fp32 the
# floor (~17 ulp) is the bar that binds; for bf16 from N ~ 1024 the bound does (eager bf16 attention is
# 6.3e-3 off at N = 1024 on a CPU, 2x that is past 1e-2); for fp16 the 2x rule does (7.7e-4 there):
# docs/methodology.md.
FLOORS = {torch.float64: 1e-13, torch.float32: 2e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}
# Worst-row error allowed, as a multiple of the bound. Measured on the tiny set (3 seeds, triton and
# split, every output): worst rows reach 7x the global error, since the first rows of a causal mask
# average few keys, i.e. fp16 2.0e-3 and fp32 2.0e-6, under a tenth of 8 x bound; a zeroed tile
# scores 1.0.
LOCAL_FACTOR = 8


def gamma(m: int, u: float) -> float:
    """gamma_m(u) = m u / (1 - m u): the relative error bound of m roundings of unit roundoff u (Higham, Accuracy
    and Stability of Numerical Algorithms, ch. 3), behind the a priori bounds of the kernel tests."""
    assert m * u < 0.5, f"{m} roundings of {u:.1e}: the bound says nothing"
    return m * u / (1 - m * u)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 4 else t.reshape(-1, 1)


def worst_row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows (finite reference) of ||out_row - ref_row|| / max(||ref_row||, RMS row norm):
    a row's own relative error, except that rows much smaller than typical are measured against
    the typical row instead of their own near-zero norm."""
    out = _rows(out.detach().to(torch.float64))
    ref = _rows(ref.detach().to(torch.float64))
    finite = torch.isfinite(ref).all(dim=1)
    if torch.isnan(out).any():
        return math.inf
    diff = (out[finite] - ref[finite]).norm(dim=1)
    if not diff.numel():
        return 0.0
    norms = ref[finite].norm(dim=1)
    rms = norms.square().mean().sqrt()
    if rms == 0:
        return diff.max().item()
    return (diff / torch.maximum(norms, rms)).max().item()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over finite ref entries; inf if out has NaN or a
    non-finite pattern different from ref's."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: output {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if torch.isnan(out).any():
        return math.inf
    finite = torch.isfinite(ref)
    if not torch.equal(out[~finite], ref[~finite]) or not torch.isfinite(out[finite]).all():
        return math.inf
    diff = (out[finite] - ref[finite]).norm().item()
    scale = ref[finite].norm().item()
    return diff / scale if scale > 0 else diff


@dataclass
class MismatchReport:
    """Where two tensors disagree beyond |out - ref| <= atol + rtol |ref| (liger-kernel style)."""

    count: int
    total: int
    first_indices: list
    nan: int
    inf: int
    max_abs: float

    def __str__(self):
        if not self.count:
            return f"all {self.total} elements match"
        return (f"{self.count}/{self.total} elements mismatch (NaN: {self.nan}, inf: {self.inf}, "
                f"max |diff| {self.max_abs:.3g}); first at {self.first_indices}")


def mismatch_report(out, ref, rtol: float, atol: float = 0.0, first: int = 5) -> MismatchReport:
    out = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    same_nonfinite = (out == ref) & ~torch.isfinite(ref)
    diff = (out - ref).abs()
    bad = ~(diff <= atol + rtol * ref.abs()) & ~same_nonfinite
    idx = bad.nonzero()[:first].tolist()
    finite_diff = diff[torch.isfinite(diff)]
    return MismatchReport(int(bad.sum()), out.numel(), [tuple(i) for i in idx], int(torch.isnan(out).sum()),
                          int((torch.isinf(out) & ~same_nonfinite).sum()),
                          float(finite_diff.max()) if finite_diff.numel() else math.nan)


@dataclass
class OutputCheck:
    name: str
    error: float
    reference_error: float  # the eager reference in the same low dtype, against the oracle
    bound: float
    passed: bool
    detail: str = ""
    worst_row_error: float = math.nan


@dataclass
class CheckResult:
    op: str
    variant: str
    case: str
    mode: str
    outputs: list = field(default_factory=list)
    skipped: str = ""  # the reason, when the variant cannot run this case

    @property
    def passed(self) -> bool:
        return not self.skipped and bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def max_error(self) -> float:
        return max((o.error for o in self.outputs), default=math.nan)

    def as_dict(self):
        d = asdict(self)
        d["passed"] = self.passed
        return d


def judge(name, out, oracle, reference_lowp, dtype=None, bounded=True) -> OutputCheck:
    """Apply the bars to one output, at the precision ``out`` is stored in (``dtype`` overrides).
    ``bounded=False`` (the eager reference itself, the 2x rule's yardstick) reports its error
    without holding it to the bounds: eager bf16 attention can be above them at long sequences
    (docs/methodology.md), which is the point of comparing against it."""
    dtype = dtype or out.dtype
    err = relative_error(out, oracle)
    local = worst_row_error(out, oracle)
    ref_err = relative_error(reference_lowp, oracle) if reference_lowp is not None else math.nan
    bound = BOUNDS[dtype] if bounded else math.inf
    relative_bar = max(2 * ref_err, FLOORS[dtype]) if math.isfinite(ref_err) else bound
    # the worst row: within LOCAL_FACTOR x the bound, or within 2x the eager reference's own worst
    # row in this dtype (FlashAttention's rule, row by row). Second derivatives in bf16 need the
    # latter: a causal row that sees one key has a Hessian row of exactly 0, and the rounding of
    # P * S_t to bf16 for its matmul leaves noise there of a few percent of a typical row, where the
    # eager bf16 reference, measured against the same oracle, does worse (docs/methodology.md).
    ref_local = worst_row_error(reference_lowp, oracle) if reference_lowp is not None else math.nan
    local_bar = max(LOCAL_FACTOR * BOUNDS[dtype], 2 * ref_local if math.isfinite(ref_local) else 0.0)
    local_ok = local <= local_bar or not bounded
    passed = err <= bound and err <= relative_bar and local_ok
    detail = ""
    if not passed:
        detail = str(mismatch_report(out, oracle, rtol=max(min(bound, relative_bar), 1e-12)))
        if not local_ok:
            detail = f"worst row {local:.2e} > {local_bar:.2e} (max of {LOCAL_FACTOR} x bound and 2 x eager's worst row); " + detail
    return OutputCheck(name, err, ref_err, min(bound, relative_bar), passed, detail, local)


def check_outputs(op, variant, case, mode, outputs, oracle, reference_lowp) -> CheckResult:
    """Judge every output of the mode. Our variants must produce all of them; a peer may produce a
    subset (SDPA returns no LSE) but not none."""
    result = CheckResult(op.name, variant, case.label, mode)
    kind = op.variant(variant).kind
    for name in op.case_outputs(case, mode):
        if name in outputs:
            lowp = reference_lowp.get(name) if reference_lowp else None
            if _coarser(outputs[name], case.torch_dtype):  # its own dtype's looser bound would have judged it
                result.outputs.append(OutputCheck(name, math.inf, math.nan, BOUNDS[case.torch_dtype], False,
                                                  f"returned in {outputs[name].dtype}, coarser than the case's "
                                                  f"{case.torch_dtype}"))
                continue
            try:
                result.outputs.append(judge(name, outputs[name], oracle[name], lowp, bounded=kind != "reference"))
            except ValueError as exc:  # a shape that is not the oracle's: a wrong answer, named, not a crash
                result.outputs.append(OutputCheck(name, math.inf, math.nan, BOUNDS[case.torch_dtype], False, str(exc)))
        elif kind != "peer":
            result.outputs.append(OutputCheck(name, math.inf, math.nan, BOUNDS[case.torch_dtype], False,
                                              "output missing"))
    if not result.outputs:
        result.skipped = "produced none of the outputs of this mode"
    return result


def _coarser(out, dtype) -> bool:
    """Whether ``out`` is a floating tensor of less precision than ``dtype``: a variant that computes in bf16 (or
    leaks autocast) on an fp32 case had passed, judged by the bf16 bound its own dtype gave (found by review)."""
    return (isinstance(out, torch.Tensor) and out.is_floating_point() and dtype.is_floating_point
            and torch.finfo(out.dtype).eps > torch.finfo(dtype).eps)


def run_poisoned(op, variant_name, case, inputs, mode):
    """Prepare and run a variant once with NaN-poisoned outputs; raises Unsupported if it cannot."""
    with poisoned_outputs():
        return op.variant(variant_name).prepare(case, inputs, mode)()


def check_variant(op, variant_name, case, mode, inputs, oracle, reference_lowp) -> CheckResult:
    """Run one variant on one case and judge every output it produces against the oracle."""
    try:
        outputs = run_poisoned(op, variant_name, case, inputs, mode)
    except Unsupported as exc:
        return CheckResult(op.name, variant_name, case.label, mode, skipped=str(exc))
    except Exception as exc:
        if isinstance(exc, DEVICE_ERRORS):  # out of memory (the caller skips the case) or a broken CUDA context
            raise
        # a variant that raises is a failed check that names the error, and the run goes on to the others
        return CheckResult(op.name, variant_name, case.label, mode, outputs=[OutputCheck(
            "(call)", math.inf, math.nan, BOUNDS[case.torch_dtype], False, raised(exc))])
    return check_outputs(op, variant_name, case, mode, outputs, oracle, reference_lowp)


# What check_variant and bench let through rather than record: the device's own errors (out of memory, which the
# runners catch as runner.OUT_OF_MEMORY and skip; any other leaves the CUDA context unusable)
DEVICE_ERRORS = (torch.OutOfMemoryError, torch.AcceleratorError)


def raised(exc) -> str:
    """One line naming an exception a variant raised."""
    text = " ".join(str(exc).split())
    return f"raised {type(exc).__name__}: {text[:300]}"


def bitwise_equal_runs(fn, runs: int = 2) -> bool:
    """True when ``runs`` calls of fn return bitwise-identical tensors (dicts or tuples of them)."""
    def as_bytes(out):
        vals = [out] if isinstance(out, torch.Tensor) else (out.values() if isinstance(out, dict) else out)
        return [t.detach().reshape(-1).view(torch.uint8).clone() for t in vals]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    first = as_bytes(fn())
    return all(same(first, as_bytes(fn())) for _ in range(runs - 1))


def gradcheck(fn, inputs, *, fast_mode=True, **kwargs) -> bool:
    """torch.autograd.gradcheck in float64 (fails loudly on lower precision: finite differences
    need it). Random-projection fast mode keeps interpreter cases in seconds."""
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            raise TypeError(f"gradcheck input {i} has dtype {t.dtype}; finite differences need float64")
    return torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode, **kwargs)
