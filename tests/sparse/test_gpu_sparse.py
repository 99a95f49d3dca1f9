"""GPU gate for the sparse operator (skipped without CUDA; scripts/gpu_gate.sh runs it).

SparseScale and the seven SparseProducts on the Triton CSR segment kernels (the default for CUDA tensors; the
split implementation is made to fail, so every forward of every derivative must run on the kernels), at real
sizes, in fp32 and bf16, against a float64 oracle on the same GPU (the dense einsum reference, or for SparseScale
an index_add, differentiated by torch autograd): forward, first backward (every input gradient) and double
backward (the gradient w.r.t. the inputs and the cotangent of <h, first gradients>). Also: shared inputs and the
batch-summed outputs (out_accumulated), odd sizes and output rows without terms, bitwise determinism, float64
gradcheck/gradgradcheck through the kernels, e3nn's tensor product (when e3nn is installed), the toy potential
end to end and its equivariance, and bad inputs rejected before any kernel runs.

Tolerances are error bounds, not measurements. The kernels accumulate in fp32 for fp32 and bf16 inputs and round
once to the output dtype, so for an output that is a sum of monomials (products of inputs and a scale)

    |out - exact| <= (rho u_out + gamma_m(u32)) * A,    gamma_m(u) = m u / (1 - m u)   (Higham, ASNA, ch. 3)

elementwise, where A is the same computation on absolute values (|x|, |y|, |scale|, ...: the sum of |monomials|,
computed by the float64 oracle), m bounds the roundings along any monomial's path in fp32 (the segment's terms k,
the contracted channels R, the scale's cast and two multiplies), u_out is the output dtype's unit roundoff and rho
the roundings to it (one per product; two for d/dg, which autograd sums from two products). The float64 oracle
adds gamma_m(u64) twice (its own error and A's). The inputs are bf16-representable, so the fp32 and bf16 runs of
a case share one oracle. For fp32 the bound is 3e-6 to 1.4e-5 of A here: a correct fp32 computation of these
cases (the split path on a CPU) reaches at most 16% of it, and a 1e-3 error in one element fails.

A sum over the batch (shared inputs, out_accumulated) chains N k roundings, for which this worst-case bound is too
loose to see a dropped batch block; those paths run on small integers instead (|partial sums| < 2**24, checked),
where fp32 arithmetic is exact: fp32 must equal float64 bitwise.

ATTNBENCH_GPU_SPARSE_DRYRUN=1 is a dry run of this file's logic on a machine without a GPU: the tests run on the
CPU through the Triton interpreter (marked ``interpreter`` instead of ``gpu``) at tiny sizes. It changes only the
device and the sizes.
"""
import dataclasses
import functools
import math
import os

import pytest
import torch

import attnbench
from attnbench.bench import verify
from attnbench.bench.verify import gamma
from attnbench.kernels import outputs as kernel_outputs
from attnbench.kernels.sparse import bilinear as sparse_bilinear
from attnbench.kernels.sparse import fused_dense as sparse_fused_dense
from attnbench.kernels.sparse import segment as sparse_segment
from attnbench.kernels.sparse.outer_sum import outer_sum_kernel
from attnbench.kernels.sparse.segment import product_out_shape
from attnbench.operators.sparse import SparseCase, peers
from attnbench.sparse import (CHANNEL_RANKS, functional, product_infos, product_terms, random_product_infos,
                              random_scale_infos, scale_infos, scale_terms, so3, sparse_product,
                              sparse_product_reference, sparse_scale, sparse_vecsca, triton_ops, use_implementation)
from attnbench.sparse.tensor_product import ToyPotential, all_pairs, cg_product_infos

DRYRUN = os.environ.get("ATTNBENCH_GPU_SPARSE_DRYRUN", "") == "1"
DEVICE = "cpu" if DRYRUN else "cuda"
pytestmark = pytest.mark.interpreter if DRYRUN else pytest.mark.gpu

OP = attnbench.get("sparse")
OPS = tuple(CHANNEL_RANKS)
PRODUCT_OUTPUTS = ("z", "grad_x", "grad_y", "ggrad_x", "ggrad_y", "ggrad_g")
SCALE_OUTPUTS = ("z", "grad_x", "ggrad_x", "ggrad_g")
# roundings to the output dtype per output: one product each, except d/dg of a product: autograd adds the
# products of both first-order gradients (each rounded) and rounds the sum
PRODUCT_ROUNDINGS = (1, 1, 1, 1, 1, 2)
U32, U64 = 2.0 ** -24, 2.0 ** -53
EXACT_LIMIT = 2 ** 24  # integers below this, and every sum of them below it, are exact in fp32
ORACLE_BYTES = 2 * 2 ** 30  # float64 einsum intermediates per oracle chunk


@pytest.fixture(autouse=True, scope="module")
def default_launch_configs():
    """One launch config per kernel key, as scripts/gpu_gate.sh runs the correctness gate (ATTNBENCH_AUTOTUNE=0):
    a tuning sweep per shape would dominate this file's runtime, and every config must be correct anyway."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNBENCH_AUTOTUNE", "0")
        yield


@pytest.fixture
def triton_only(monkeypatch):
    """The default implementation for CUDA tensors (the dry run forces Triton: CPU tensors default to split),
    with the split implementation made to fail, so every forward, those of every derivative included, runs on the
    kernels; and every kernel output NaN-poisoned, so an element a kernel forgets fails. Poisoning is patched at
    module level: ``poisoned_outputs()`` is thread-local, and autograd runs CUDA backward nodes on its own
    device thread."""
    def refuse(*args, **kwargs):
        raise AssertionError("the split implementation ran: sparse forwards on CUDA tensors must run on Triton")

    monkeypatch.setattr(functional, "sparse_product_split", refuse)
    monkeypatch.setattr(functional, "sparse_scale_split", refuse)
    monkeypatch.setattr(kernel_outputs, "_poisoning", lambda: True)
    with use_implementation("triton" if DRYRUN else None):
        yield


# ---------------------------------------------------------------------------------------------------------------------
# error bounds


def unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


def error_factor(dtype, m, roundings, exact=False):
    """f with |out - oracle| <= f * A elementwise (see the module docstring); ``exact``: integer data, every fp32
    partial sum exact, so only the rounding to a narrower output dtype remains."""
    to_output = 0.0 if dtype == torch.float32 and exact else roundings * unit_roundoff(dtype)
    if exact:
        return to_output
    return to_output + gamma(m, U32) + 2 * gamma(m, U64)


def matrix_unit_chain(case, dtype, m):
    """m of the bound where mul's bilinear route (attnbench/kernels/sparse/bilinear.py) runs on the tensor cores: their fp32
    accumulation may truncate instead of rounding (up to 2u an add: each rounding counted twice); fp32's tf32x3
    products leave up to 5 x 2^-22 = 20 u32 of each product (the two low parts cut to TF32, the dropped lo x lo), and
    16-bit inputs' coefficients in two halves up to 2^-16 = 256 u32 of each. The route's chain is otherwise no
    longer than the segment kernel's: a term's path has the nonzero j of its (o, i) in the dot and the nonzero i of o
    in the row loop, at most k + 1 together (tf32x3's two low-part dots, chained into the same accumulator, add two
    roundings of products 2^-10 the size)."""
    if not getattr(case, "bilinear", lambda dtype: False)(dtype):
        return m
    return 2 * m + 2 + (20 if dtype == torch.float32 else 256)


def longest_segment(infos):
    return max(int(info.seg_out.diff().max()) if info.seg_out.numel() > 1 else 0 for info in infos)


def assert_within(name, out, ref, bound):
    """|out - ref| <= bound elementwise; NaN fails (the outputs are NaN-poisoned)."""
    assert out is not None, f"{name}: no output"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)}, oracle {tuple(ref.shape)}"
    error = (out.double() - ref).abs()
    bad = ~(error <= bound)
    if bad.any():
        first = [tuple(i) for i in bad.nonzero()[:4].tolist()]
        excess = (error - bound)[bad]
        pytest.fail(f"{name}: {int(bad.sum())}/{bad.numel()} elements outside the bound (NaN: "
                    f"{int(torch.isnan(out).sum())}), max |error| {float(error[bad].max()):.3g}, worst excess "
                    f"{float(excess.max()):.3g}; first at {first}; normwise error "
                    f"{verify.relative_error(out, ref):.2e}")


# ---------------------------------------------------------------------------------------------------------------------
# derivatives and oracles


def derivatives(fn, inputs, g, hs):
    """[z, d<g, z>/d inputs..., d<hs, those gradients>/d (inputs..., g)], detached; None for a second derivative
    that does not depend on the variable."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    g = g.detach().requires_grad_()
    z = fn(*leaves)
    grads = torch.autograd.grad(z, leaves, g, create_graph=True)
    second = torch.autograd.grad(grads, leaves + [g], hs, allow_unused=True)
    return [z.detach(), *(t.detach() for t in grads), *(None if t is None else t.detach() for t in second)]


def random_tensor(shape, generator, integer):
    """Never zero. Floats: N(0, 1) rounded to bf16 (exact in fp32 too, so one oracle serves both dtypes); integers:
    {-2, -1, 1, 2}."""
    if integer:
        magnitude = torch.randint(1, 3, shape, generator=generator, device=DEVICE)
        sign = torch.randint(0, 2, shape, generator=generator, device=DEVICE) * 2 - 1
        return (magnitude * sign).float()
    return torch.randn(shape, generator=generator, device=DEVICE).bfloat16().float()


def to_sign_scales(scale):
    return torch.where(scale < 0, -1.0, 1.0).to(torch.float64)


@functools.lru_cache(maxsize=None)
def product_structure(spec, integer):
    """("cg", l1, l2, l3): the CG tensor product of irreps 0..l1 and 0..l2 into 0..l3 (so3); ("random", size1,
    size2, size3, terms): random CSR with empty output segments in all three groupings and repeated terms, scales
    in [-1, 1), or +-1 with ``integer``."""
    kind, *sizes = spec
    if kind == "cg":
        return cg_product_infos(*sizes, device=DEVICE)
    size1, size2, size3, terms = sizes
    infos = random_product_infos(size1, size2, size3, terms, torch.Generator().manual_seed(sum(sizes)),
                                 device=DEVICE)
    if integer:
        i1, i2, i3, scale = product_terms(infos[0])
        infos = product_infos(i1, i2, i3, to_sign_scales(scale), size1, size2, size3)
    return infos


@functools.lru_cache(maxsize=None)
def scale_structure(kind, in_size, out_size, terms, integer):
    """"segment": the edge -> atom segment sum (in_size edges, each row out_size / in_size of them, none empty);
    "random": random CSR with empty rows and repeated terms."""
    if kind == "segment":
        edges = torch.arange(in_size, device=DEVICE)
        return scale_infos(edges, edges * out_size // in_size, None, in_size, out_size)
    infos = random_scale_infos(in_size, out_size, terms, torch.Generator().manual_seed(in_size + terms),
                               device=DEVICE)
    if integer:
        index, rows, scale = scale_terms(infos[0])
        infos = scale_infos(index, rows, to_sign_scales(scale), in_size, out_size)
    return infos


def cg(*l_max):
    return ("cg", *(l_max * 3 if len(l_max) == 1 else l_max))


def rand(size1, size2, size3, terms):
    return ("random", size1, size2, size3, terms)


SHARING = {"batched": (False, False), "shared_x": (True, False), "shared_y": (False, True),
           "shared_both": (True, True)}


@dataclasses.dataclass(frozen=True)
class ProductCase:
    op: str
    structure: tuple
    batch: int
    cx: tuple  # channel dims of x and of y
    cy: tuple
    sharing: str = "batched"
    out_accumulated: bool = False
    integer: bool = False  # exact-arithmetic data (random structures only: CG scales are irrational)

    @property
    def label(self):
        flags = ("" if self.sharing == "batched" else f" {self.sharing}") + (" acc" if self.out_accumulated else "")
        ints = " int" if self.integer else ""
        channels = ",".join("x".join(map(str, c)) or "-" for c in (self.cx, self.cy))
        return f"{self.op} {'-'.join(map(str, self.structure))} N{self.batch} C{channels}{flags}{ints}"

    def dry(self):
        """The dry run's case: same op, sharing and kind of structure, tiny sizes (the interpreter runs one program
        at a time); channel counts of 1 stay 1."""
        if self.structure[0] == "cg":
            l1, l2, l3 = (min(l, 1 if self.op in ("outer", "vecmat", "mat_t_vec") else 2) for l in self.structure[1:])
            unreachable = self.structure[3] > self.structure[1] + self.structure[2]  # rows without terms: keep some
            structure = cg(l1, l2, l1 + l2 + 1 if unreachable else l3)
        else:
            structure = rand(5, 4, 6, 16)
        return dataclasses.replace(self, structure=structure, batch=min(self.batch, 3),
                                   cx=tuple(min(c, 3) for c in self.cx), cy=tuple(min(c, 3) for c in self.cy))

    def infos(self):
        return product_structure(self.structure, self.integer)

    def shapes(self):
        info = self.infos()[0]
        shared_x, shared_y = SHARING[self.sharing]
        x = (() if shared_x else (self.batch,)) + (info.size1,) + self.cx
        y = (() if shared_y else (self.batch,)) + (info.size2,) + self.cy
        return x, y, product_out_shape(self.op, x, y, info.out_size, self.out_accumulated)

    def make_inputs(self, seed=0):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        x, y, z = self.shapes()
        return {name: random_tensor(shape, generator, self.integer)
                for name, shape in (("x", x), ("y", y), ("g", z), ("hx", x), ("hy", y))}

    def run(self, inputs, dtype):
        """Every output, on the kernels (under ``triton_only``), in ``dtype``."""
        x, y, g, hx, hy = (inputs[k].to(dtype) for k in ("x", "y", "g", "hx", "hy"))
        infos = self.infos()
        return derivatives(lambda a, b: sparse_product(self.op, a, b, infos, self.out_accumulated), (x, y), g,
                           (hx, hy))

    def oracle(self, inputs, absolute=False):
        """Every output in float64 by autograd through the dense einsum reference; ``absolute``: on |inputs| and
        |scale|, the A of the error bounds. In chunks of batch rows (the einsum's intermediates are [rows, K, J,
        C...]): a batched output concatenates the chunks', a shared one sums them."""
        info = self.infos()[0]
        if absolute:
            info = dataclasses.replace(info, scale=info.scale.abs())
        x, y, g, hx, hy = (inputs[k].double().abs() if absolute else inputs[k].double()
                           for k in ("x", "y", "g", "hx", "hy"))
        rank_x, rank_y, rank_z = CHANNEL_RANKS[self.op]
        bx, by, bg = x.dim() == rank_x + 2, y.dim() == rank_y + 2, g.dim() == rank_z + 2
        rows = x.shape[0] if bx else (y.shape[0] if by else 1)
        channels = max(math.prod(self.cx), math.prod(self.cy), math.prod(g.shape[g.dim() - rank_z:]))
        per_row = 8 * 6 * (info.out_size * (info.size1 + info.size2) + info.size1 * info.size2) * channels
        chunk = max(1, ORACLE_BYTES // per_row)
        parts = []
        for start in range(0, rows, chunk):
            def cut(t, batched):
                return t[start:start + chunk] if batched else t

            parts.append(derivatives(
                lambda a, b: sparse_product_reference(self.op, a, b, info, self.out_accumulated),
                (cut(x, bx), cut(y, by)), cut(g, bg), (cut(hx, bx), cut(hy, by))))
        templates = (bg, bx, by, bx, by, bg)
        return [torch.cat(ps) if batched else sum(ps) for ps, batched in zip(zip(*parts), templates)]

    def chain_length(self):
        """m of the bound, for paths without a batch sum: a segment's terms, the contracted channels (every op but
        mul has a contraction among its derivatives), the scale's cast and two multiplies."""
        contracted = 1 if self.op == "mul" else max(self.cx + self.cy)
        return longest_segment(self.infos()) + contracted + 3

    def batch_summed(self):
        return self.sharing != "batched" or self.out_accumulated

    def bilinear(self, dtype):
        """Whether mul's forward, or the mul of one of its derivatives, in ``dtype`` takes the bilinear route
        (attnbench/kernels/sparse/bilinear.py: tensor cores); each info as if both operands were batched."""
        if self.op != "mul":
            return False

        def meta(size):
            return torch.empty((2, size, 1), device="meta", dtype=dtype)

        return any(triton_ops._bilinear_table("mul", meta(info.size1), meta(info.size2), info, False) is not None
                   for info in self.infos())


@dataclasses.dataclass(frozen=True)
class ScaleCase:
    structure: str  # "segment" or "random"
    in_size: int
    out_size: int
    terms: int
    lead: tuple  # leading dims of x: [*lead, in_size, C]
    channels: int
    integer: bool = False

    @property
    def label(self):
        lead = "x".join(map(str, self.lead)) + "x" if self.lead else ""
        return (f"scale-{self.structure} {lead}{self.in_size}->{self.out_size} T{self.terms} C{self.channels}"
                f"{' int' if self.integer else ''}")

    def dry(self):
        return dataclasses.replace(self, in_size=7, out_size=5, terms=7 if self.structure == "segment" else 12,
                                   lead=tuple(min(d, 2) for d in self.lead), channels=min(self.channels, 3))

    def infos(self):
        return scale_structure(self.structure, self.in_size, self.out_size, self.terms, self.integer)

    def make_inputs(self, seed=0):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        x = (*self.lead, self.in_size, self.channels)
        z = (*self.lead, self.out_size, self.channels)
        return {name: random_tensor(shape, generator, self.integer) for name, shape in (("x", x), ("g", z), ("hx", x))}

    def run(self, inputs, dtype):
        x, g, hx = (inputs[k].to(dtype) for k in ("x", "g", "hx"))
        infos = self.infos()
        return derivatives(lambda a: sparse_scale(a, *infos), (x,), g, (hx,))

    def oracle(self, inputs, absolute=False):
        """y = S x as an index_add over the terms in float64 (S dense would be out_size x in_size), differentiated
        by torch autograd: independent of the kernels and of SparseScale's backward."""
        index, rows, scale = scale_terms(self.infos()[0])
        if absolute:
            scale = scale.abs()
        x, g, hx = (inputs[k].double().abs() if absolute else inputs[k].double() for k in ("x", "g", "hx"))

        def apply(a):
            terms = a.index_select(a.dim() - 2, index) * scale[:, None]
            return a.new_zeros(*a.shape[:-2], self.out_size, a.shape[-1]).index_add(a.dim() - 2, rows, terms)

        return derivatives(apply, (x,), g, (hx,))

    def chain_length(self):
        return longest_segment(self.infos()) + 2  # the row's terms, the scale's cast and its multiply


_ORACLES = {}


def oracles(case):
    """(inputs, float64 oracle, A) of a case; the latest case only: at real sizes they take GBs."""
    if case not in _ORACLES:
        _ORACLES.clear()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        inputs = case.make_inputs()
        _ORACLES[case] = (inputs, case.oracle(inputs), case.oracle(inputs, absolute=True))
    return _ORACLES[case]


def check_against_oracle(case, dtype, names, roundings):
    """Run a case on the kernels in ``dtype`` and hold every output to its bound; returns the outputs."""
    inputs, oracle, absolute = oracles(case)
    outs = case.run(inputs, dtype)
    m = matrix_unit_chain(case, dtype, case.chain_length())
    exact = case.integer
    if not exact:
        assert not getattr(case, "batch_summed", lambda: False)(), "batch sums are checked on integer data"
    for name, out, ref, a, rho in zip(names, outs, oracle, absolute, roundings):
        if ref is None:  # does not depend on the variable: neither may the kernels' result
            assert out is None or not out.any(), name
            continue
        if exact:
            assert float(a.max()) < EXACT_LIMIT, f"{name}: partial sums up to {float(a.max()):.3g}, not exact in fp32"
        assert_within(f"{case.label} {str(dtype)[6:]} {name}", out, ref, error_factor(dtype, m, rho, exact) * a)
    return outs


def sized(cases):
    """The cases, or in the dry run their tiny versions (once each: several shrink to one)."""
    return list(dict.fromkeys(case.dry() for case in cases)) if DRYRUN else list(cases)


# ---------------------------------------------------------------------------------------------------------------------
# every op at real sizes, fp32 and bf16, to second order

# Every op, CG structures of L 2-4 and random CSR structures, C 32 and 128; batches of 1e4-1e5 where the output is
# [N, M, C], 2000 where it is [N, M, C, C] (outer) or an input is (vecmat, mat_t_vec): z alone is then 18-50M values.
PRODUCT_CASES = sized([
    ProductCase("mul", cg(3), 20_000, (128,), (128,)),
    ProductCase("outer", cg(2), 2_000, (32,), (32,)),
    ProductCase("inner", rand(24, 32, 40, 1500), 10_000, (128,), (128,)),
    ProductCase("vecmat", cg(4), 2_000, (32,), (32, 32)),
    ProductCase("vecsca", cg(2), 100_000, (32,), ()),
    ProductCase("vecsca", cg(4), 10_000, (128,), ()),
    ProductCase("scavec", rand(24, 32, 40, 1500), 10_000, (), (128,)),
    ProductCase("mat_t_vec", rand(24, 32, 40, 1500), 2_000, (32, 32), (32,)),
])
SCALE_CASES = sized([
    ScaleCase("segment", 100_000, 6_250, 100_000, (), 128),  # 1e5 edges onto 6250 atoms, 16 each
    ScaleCase("random", 20_000, 5_000, 60_000, (3,), 32),
])
DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("case,dtype", [(c, d) for c in PRODUCT_CASES for d in DTYPES],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_product_matches_float64_to_second_order(case, dtype, triton_only):
    """fp32: f = u32 + gamma_m(u32), m = k + R + 3, e.g. 1.4e-5 of A at k ~ 110 terms, R = 128; bf16: u_bf16 =
    3.9e-3 dominates."""
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)


@pytest.mark.parametrize("case,dtype", [(c, d) for c in SCALE_CASES for d in DTYPES],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_scale_matches_float64_to_second_order(case, dtype, triton_only):
    """y = S x, grad_x = S^T g, and d<h, grad_x>/dg = S h (grad_x does not depend on x: no second x-derivative)."""
    check_against_oracle(case, dtype, SCALE_OUTPUTS, (1, 1, 1, 1))



@pytest.mark.parametrize("split", [False, True], ids=["cublas", "split_matmul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,l_max", [("vecmat", 4), ("mat_t_vec", 3)])
def test_fold_route_matches_float64(op, l_max, dtype, split, triton_only, monkeypatch):
    """The fold route of the shared-weight products (attnbench/kernels/sparse/fold.py: the weight folded into the
    coefficients, one GEMM over the batch) at a real size: z, the batched vectors' gradient (the other op of the
    pair against the weight transposed: folded too) and the weight's (outer summed over the batch: one GEMM over the
    batch, the fold transposed) against float64. Normwise a-priori bound, A = the same of |x|, |y|, |scale|, |gz|:
    a per-sample output sums m = P C + P products (the GEMM over (i, a), the fold over i2), the weight's gradient
    N + P^2, so (u_out + gamma_m) A with u_out the output's rounding (bf16: 2^-8; fp32: none beyond gamma) and
    2^-16 for the hi + lo split in 16 bits. ``split``: the 16-bit products on attnbench/kernels/sparse/split_matmul.py (both halves
    in one program) instead of cuBLAS."""
    import dataclasses

    from attnbench.kernels.sparse import fold as sparse_fold
    from attnbench.sparse import cg_product_infos, sparse_product, sparse_product_reference, use_implementation
    from attnbench.sparse.triton_ops import FOLD_ROUTE

    assert FOLD_ROUTE["enabled"]
    monkeypatch.setitem(sparse_fold.SPLIT_MATMUL, "enabled", split)
    calls = []
    launcher = sparse_fold.split_matmul
    monkeypatch.setattr(sparse_fold, "split_matmul", lambda *a: calls.append(1) or launcher(*a))
    infos = cg_product_infos(l_max, l_max, l_max, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    batch, channels = 2000, 32
    size = (l_max + 1) ** 2
    vectors = torch.randn(batch, size, channels, device=DEVICE, generator=generator).to(dtype)
    weight = (torch.randn(size, channels, channels, device=DEVICE, generator=generator) / channels ** 0.5).to(dtype)
    x, y = (vectors, weight) if op == "vecmat" else (weight, vectors)
    x64, y64 = x.double().requires_grad_(), y.double().requires_grad_()
    batched = 0 if op == "vecmat" else 1  # which operand has the batch
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    with use_implementation("triton"):
        z = sparse_product(op, xr, yr, infos)
        gz = torch.randn(z.shape, device=DEVICE, generator=generator).to(dtype)
        grads = torch.autograd.grad(z, (xr, yr), gz)
    z64 = sparse_product_reference(op, x64, y64, infos[0])
    grads64 = torch.autograd.grad(z64, (x64, y64), gz.double())
    absolute = dataclasses.replace(infos[0], scale=infos[0].scale.abs())
    xa, ya = x64.detach().abs().requires_grad_(), y64.detach().abs().requires_grad_()
    za = sparse_product_reference(op, xa, ya, absolute)
    grads_a = torch.autograd.grad(za, (xa, ya), gz.double().abs())
    u = 2.0 ** -24
    half = 2.0 ** -8 + 2.0 ** -16 if dtype == torch.bfloat16 else 0.0
    for index, (got, exact, scale) in enumerate(zip((z, *grads), (z64, *grads64), (za, *grads_a))):
        # products summed: size * channels + size a per-sample output, batch + size^2 the weight's gradient
        m = batch + size * size if index == 1 + (1 - batched) else size * channels + size
        rel = m * u / (1 - m * u) + half
        err = (got.double() - exact.detach()).abs().max().item()
        assert err <= rel * scale.max().item(), (index, err, rel * scale.max().item())
    # z and the vectors' gradient take split_matmul in 16 bits when it is on (not in the dry run: bf16 runs upcast)
    assert len(calls) == (2 if split and dtype != torch.float32 and not DRYRUN else 0), calls

# mul on its bilinear route (attnbench/kernels/sparse/bilinear.py) where it pads differently: CG L 2 (9 rows a 16 tile; bf16
# only: fp32 keeps the segment kernel there), L 4 (25: 32), L 6 (49: 64), and a random structure of 24 x 70 -> 80
# (held x of 24 rows, 80 output rows: two row tiles).
BILINEAR_CASES = sized([
    ProductCase("mul", cg(2), 100_000, (32,), (32,)),
    ProductCase("mul", cg(4), 10_000, (32,), (32,)),
    ProductCase("mul", cg(6), 2_000, (32,), (32,)),
    ProductCase("mul", rand(24, 70, 80, 9000), 10_000, (32,), (32,)),
])


@pytest.mark.parametrize("case,dtype", [(c, d) for c in BILINEAR_CASES for d in DTYPES + (torch.float16,)],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_bilinear_route_matches_float64_to_second_order(case, dtype, triton_only, spy_kernel):
    """Every derivative of mul is a mul: forward, backward and double backward all take the route (a spy counts
    its launches), each held to the float64 bound (fp32: with the tensor cores' terms, matrix_unit_chain)."""
    routed = case.bilinear(dtype)
    # fp32 CG L 2 (15 terms a row) stays on the segment kernel (triton_ops.FP32_MIN_TERMS_PER_ROW), and fp16 where its
    # scaled halves would miss more than 2^-16 of a coefficient (coefficients spanning more than 2^22: no fp16 split);
    # the dry run's tiny random structure is too thin for the route
    expected = not (dtype == torch.float32 and case.structure == cg(2))
    if dtype == torch.float16:
        expected = expected and all(torch.float16 in info.dense_rows["gram"].splits for info in case.infos())
    assert routed == expected or DRYRUN, case.label
    launches = spy_kernel(sparse_bilinear, "bilinear_kernel")
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    assert launches.launches >= 5 if routed else not launches.launches  # z, gx, gy, and the double backward's


# vecsca, scavec and inner with both steps of the dense route in one program (attnbench/kernels/sparse/fused_dense.py): CG L 2
# and 3 (9 and 16 rows: one padded tile), batches not a multiple of a program's samples, channels not a multiple of
# the channel tile (37, 33) or below it (5). inner at L 2 (a 9 x 9 Gram grid) and fp32 keep the two launches.
FUSED_CASES = sized([
    ProductCase("vecsca", cg(3), 30_001, (37,), ()),
    ProductCase("scavec", cg(3), 30_001, (), (128,)),
    ProductCase("inner", cg(3), 30_001, (33,), (33,)),
    ProductCase("vecsca", cg(2), 10_007, (5,), ()),
    ProductCase("scavec", cg(2), 10_007, (), (32,)),
])


@pytest.mark.parametrize("case,dtype", [(c, d) for c in FUSED_CASES for d in DTYPES + (torch.float16,)],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_fused_dense_route_matches_float64_to_second_order(case, dtype, triton_only, spy_kernel):
    """vecsca's derivatives are a scavec and an inner (and theirs the same family): in 16 bits every mode takes the
    fused kernels (spies count their launches: at least the forward's, one a backward, two a double backward, where
    L 2's inner products keep two launches), M entering as hi + lo; fp32 keeps the two launches. Each output is held
    to the float64 bound."""
    scaled = spy_kernel(sparse_fused_dense, "scaled_rows_kernel")
    gram = spy_kernel(sparse_fused_dense, "gram_rows_kernel")
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    fused = scaled.launches + gram.launches
    if dtype == torch.float32:
        assert fused == 0 or DRYRUN  # (the dry run's interpreter upcasts bf16, and its fp32 does not fuse either)
    else:
        assert fused >= 4 or DRYRUN


@pytest.mark.parametrize("op", ["vecsca", "scavec", "inner"])
def test_fused_dense_route_in_float64_and_against_two_launches(op, triton_only, spy_kernel):
    """fp64 through the fused kernels (3-D fp64 dots) within 1e-12 of the reference on a batch-innermost x (strides,
    not a compact copy's); fp32, on the two launches, and the fused kernels forced on for it, within fp32's bound."""
    infos = cg_product_infos(3, 3, 3, device=DEVICE)
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    generator = torch.Generator(device=DEVICE).manual_seed(7)
    n, c = (5, 3) if DRYRUN else (3001, 19)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.float64)

    x = randn(16, *(c,) * rank_x, n).movedim(-1, 0)  # [N, 16, C...] with the batch innermost in memory
    y = randn(n, 16, *(c,) * rank_y)
    launches = spy_kernel(sparse_fused_dense, "gram_rows_kernel" if op == "inner" else "scaled_rows_kernel")
    z = sparse_product(op, x, y, infos)
    expected = sparse_product_reference(op, x, y, infos[0])
    torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)
    z32 = sparse_product(op, x.float(), y.float(), infos)
    assert launches.launches == 1  # fp32: two launches
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sparse_fused_dense, "FUSED_DTYPES", sparse_fused_dense.FUSED_DTYPES + (torch.float32,))
        forced = sparse_product(op, x.float(), y.float(), infos)
    assert launches.launches == 2
    # fp32 sums along a path of at most (a table row, 16 terms; the contraction, 16 rows or C channels) + 3
    # roundings, the output's one: gamma_m(u32) of the absolute values' result
    info = infos[0]
    magnitude = sparse_product_reference(op, x.abs(), y.abs(), dataclasses.replace(info, scale=info.scale.abs()))
    bound = (gamma(16 + max(16, c) + 3, U32) + U32) * magnitude
    for name, got in (("two launches", z32), ("fused", forced)):
        assert ((got.double() - expected).abs() <= bound).all(), name


def test_bilinear_route_row_offsets_past_int32(triton_only):
    """Operands seen as [N, M, C] but stored [M, N, C] (row stride N C = 1.5e8 at N 1.2e6, C 128: row 15's offset
    passes 2**31): the route's row offsets are int64, so the result equals the same call on compact copies,
    bitwise (the same arithmetic in the same order), held and looped operand alike. The dry run: tiny, no overflow."""
    batch, channels = (3, 3) if DRYRUN else (1_200_000, 128)
    infos = cg_product_infos(2 if DRYRUN else 3, 2 if DRYRUN else 3, 2 if DRYRUN else 3, device=DEVICE)
    size = infos[0].size1
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    x = torch.randn(size, batch, channels, device=DEVICE, generator=generator).to(torch.bfloat16).transpose(0, 1)
    y = torch.randn(size, batch, channels, device=DEVICE, generator=generator).to(torch.bfloat16).transpose(0, 1)
    assert triton_ops._bilinear_table("mul", x, y, infos[0], False) is not None
    for strided in ((x, y.contiguous()), (x.contiguous(), y)):
        z = sparse_product("mul", *strided, infos)
        assert torch.equal(z, sparse_product("mul", x.contiguous(), y.contiguous(), infos))
        del z


# ---------------------------------------------------------------------------------------------------------------------
# shared inputs and batch-summed outputs (exact integer arithmetic)

SMALL_RANDOM = rand(24, 20, 28, 400)  # ~20 terms a segment, up to ~35
# ~32 terms an output row and a dense matrix form: mul takes the bilinear route in fp32 too (triton_ops._bilinear_table)
DENSER_RANDOM = rand(24, 20, 28, 900)
# Every sharing and out_accumulated, spread over the ops (the FC layer's shared weight: vecmat's y, mat_t_vec's x).
# N = 2048 keeps the partial sums of the contracting ops below 2**24 (N k R |x y| <= 2048 * 35 * 32 * 4).
SHARED_CASES = sized([
    ProductCase("mul", SMALL_RANDOM, 2048, (32,), (32,), "shared_y", integer=True),
    ProductCase("mul", SMALL_RANDOM, 2048, (32,), (32,), out_accumulated=True, integer=True),
    ProductCase("mul", DENSER_RANDOM, 2048, (32,), (32,), "shared_y", integer=True),  # on the bilinear route
    ProductCase("outer", SMALL_RANDOM, 512, (16,), (8,), "shared_x", True, integer=True),
    # both batched: the FC layer's weight gradient, on matrix units (attnbench/kernels/sparse/outer_sum.py)
    ProductCase("outer", SMALL_RANDOM, 2048, (128,), (64,), out_accumulated=True, integer=True),
    ProductCase("inner", SMALL_RANDOM, 1, (32,), (32,), "shared_both", integer=True),
    ProductCase("vecmat", SMALL_RANDOM, 2048, (32,), (32, 16), "shared_y", integer=True),
    ProductCase("vecsca", SMALL_RANDOM, 2048, (32,), (), out_accumulated=True, integer=True),
    ProductCase("scavec", SMALL_RANDOM, 2048, (), (32,), "shared_x", integer=True),
    ProductCase("mat_t_vec", SMALL_RANDOM, 2048, (16, 32), (16,), "shared_x", integer=True),
])


@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in SHARED_CASES]
                         + [(c, torch.bfloat16) for c in SHARED_CASES if c.op == "vecmat"
                            or (c.op == "outer" and c.sharing == "batched")],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_shared_inputs_and_batch_sums(case, dtype, triton_only):
    """fp32: equal to float64 bitwise (every partial sum is an integer below 2**24, checked); bf16: the one
    rounding of an exact fp32 value to bf16 (two for d/dg), u_bf16 A each. A shared input's gradient and an
    out_accumulated output are the kernel's in-program batch loop, which a dropped or doubled block fails."""
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)


# ---------------------------------------------------------------------------------------------------------------------
# odd sizes and output rows without terms

ODD_CASES = sized([
    ProductCase("mul", SMALL_RANDOM, 1009, (48,), (48,), integer=True),  # N prime: a masked batch block
    ProductCase("mul", DENSER_RANDOM, 1009, (48,), (48,), integer=True),  # the same on the bilinear route
    ProductCase("outer", SMALL_RANDOM, 37, (1,), (80,), integer=True),  # C1 = 1: z's c = a C2 + b with one a
    ProductCase("outer", SMALL_RANDOM, 1009, (37,), (5,), out_accumulated=True, integer=True),  # masked tiles
    ProductCase("inner", SMALL_RANDOM, 1009, (37,), (37,), integer=True),  # R = 37: a masked contraction chunk
    ProductCase("vecmat", SMALL_RANDOM, 1, (37,), (37, 1), integer=True),  # N = 1, Cout = 1
    ProductCase("vecsca", cg(1, 1, 3), 1009, (80,), ()),  # CG: the l = 3 rows 9..15 have no terms
    ProductCase("scavec", SMALL_RANDOM, 1009, (), (1,), integer=True),  # C = 1
    ProductCase("mat_t_vec", SMALL_RANDOM, 101, (48, 3), (48,), integer=True),
])
ODD_SCALE_CASES = sized([
    ScaleCase("random", 1009, 333, 3000, (), 1, integer=True),
    ScaleCase("random", 1009, 333, 3000, (3,), 80, integer=True),
])


@pytest.mark.parametrize("case", ODD_CASES, ids=lambda c: c.label)
def test_odd_sizes_and_rows_without_terms(case, triton_only):
    """Sizes that are no block's multiple, and output rows that no segment writes (the random structures leave
    about a third of every grouping's rows empty, the last always): fp32 exact on integers (the CG case: the
    float bound), NaN-poisoned, and the empty rows exactly zero."""
    info = case.infos()[0]
    empty = sorted(set(range(info.out_size)) - set(info.index_out.tolist()))
    assert empty, "the structure should leave an output row without terms"
    z = check_against_oracle(case, torch.float32, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)[0]
    rows = z.index_select(0 if case.out_accumulated else 1, torch.tensor(empty, device=z.device))  # [(N,) M, C...]
    assert not rows.any(), "an output row without terms must be zero"


@pytest.mark.parametrize("case", ODD_CASES, ids=lambda c: c.label)
def test_odd_sizes_walking_every_row(case, triton_only, all_rows_launches):
    """The odd cases with ALL_ROWS allowed for every op at every batch (attnbench/kernels/sparse/segment.py: a program walks
    every output row of its batch block; by default mul's from 1e4 items): to second order against the oracle,
    NaN-poisoned. Every launch of the segment kernel that may walk the rows does (the others: batch sums, the
    shared-matrix tl.dot route); the forwards the dense, fold and outer-by-dot routes take do not launch it."""
    check_against_oracle(case, torch.float32, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    assert all(k["ALL_ROWS"] == (not k["ACCUMULATE"] and not k["DOT"]) for k in all_rows_launches)
    if case.op == "mul":
        assert any(k["ALL_ROWS"] for k in all_rows_launches)


@pytest.mark.parametrize("case", [c for c in PRODUCT_CASES if c.op in ("mul", "outer")], ids=lambda c: c.label)
def test_walking_every_row_is_bitwise_one_row_a_program(case, triton_only, all_rows_launches, monkeypatch):
    """Forward, backward and double backward with ALL_ROWS on and off (every op, every batch): each output's terms
    are summed in the same CSR order either way, so the results are bitwise equal."""
    inputs = case.make_inputs(seed=2)
    runs = []
    for enabled in (True, False):
        monkeypatch.setitem(sparse_segment.ALL_ROWS, "enabled", enabled)
        del all_rows_launches[:]
        runs.append([t for t in case.run(inputs, torch.float32) if t is not None])
        assert any(k["ALL_ROWS"] for k in all_rows_launches) == enabled
    assert len(runs[0]) == len(runs[1]) > 0
    for on, off in zip(*runs):
        assert torch.equal(on, off)


@pytest.mark.parametrize("case", ODD_SCALE_CASES, ids=lambda c: c.label)
def test_scale_odd_sizes_and_rows_without_terms(case, triton_only):
    assert (case.infos()[0].seg_out.diff() == 0).any(), "some output row should have no terms"
    check_against_oracle(case, torch.float32, SCALE_OUTPUTS, (1, 1, 1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# SparseScale on [M, C] (a batch of one), every launch config of both scale kernels

SCALE_CONFIG_CASES = sized([
    ScaleCase("segment", 16_001, 1_001, 16_001, (), 96, integer=True),  # forward: 3 lines; backward: row tiles
    ScaleCase("random", 3_001, 2_999, 3_001, (), 800, integer=True),  # ~1 term a row both ways: row tiles (25 lines)
    ScaleCase("segment", 16_001, 1_001, 16_001, (), 128, integer=True),  # 2 lines of 64 both ways
])


@pytest.mark.parametrize("kernel,config", [(name, i) for name in ("sparse_scale_kernel", "sparse_scale_rows_kernel")
                                           for i in range(len(getattr(sparse_segment, name).configs))],
                         ids=lambda v: str(v))
def test_scale_every_launch_config(kernel, config, monkeypatch, triton_only):
    """Each config of the batched scale kernel (channels folded into lines) and of the row-tile kernel (short rows)
    forced in turn on odd M and odd line counts: fp32 exact on integers, to second order, NaN-poisoned."""
    tuned = getattr(sparse_segment, kernel)
    monkeypatch.setattr(tuned, "configs", [tuned.configs[config]])
    monkeypatch.setattr(tuned, "cache", {})
    for case in SCALE_CONFIG_CASES:
        check_against_oracle(case, torch.float32, SCALE_OUTPUTS, (1, 1, 1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# every launch config of the batch sum on matrix units

OUTER_SUM_CASES = sized([
    ProductCase("outer", SMALL_RANDOM, 1009, (37,), (80,), out_accumulated=True, integer=True),
    ProductCase("outer", SMALL_RANDOM, 2048, (128,), (128,), out_accumulated=True, integer=True),
    ProductCase("outer", SMALL_RANDOM, 700, (32,), (32,), out_accumulated=True, integer=True),
])


@pytest.mark.parametrize("config", range(len(outer_sum_kernel.configs)))
def test_outer_sum_every_launch_config(config, monkeypatch, triton_only):
    """The correctness gate runs one config per key, but the autotuner may pick any of them on a user's shapes: each
    is forced in turn (the route asserted) on masked and full tiles, the batch sum on integers, so fp32 equals
    float64 bitwise and bf16 and fp16 are its one rounding."""
    calls = []
    launcher = triton_ops.outer_sum_launch
    monkeypatch.setattr(triton_ops, "outer_sum_launch", lambda *a: calls.append(1) or launcher(*a))
    monkeypatch.setitem(triton_ops.FOLD_ROUTE, "enabled", False)  # the kernel, not the fold route's GEMMs
    monkeypatch.setattr(outer_sum_kernel, "configs", [outer_sum_kernel.configs[config]])
    monkeypatch.setattr(outer_sum_kernel, "cache", {})
    for case in OUTER_SUM_CASES:
        inputs, infos = case.make_inputs(), case.infos()
        x, y = inputs["x"].double(), inputs["y"].double()
        abs_info = dataclasses.replace(infos[0], scale=infos[0].scale.abs())

        def batch_sum(a, b, info):  # float64, 8 batch rows an einsum ([8, T, C1, C2] intermediates)
            return sum(sparse_product_reference("outer", a[i:i + 8], b[i:i + 8], info, True)
                       for i in range(0, case.batch, 8))

        exact = batch_sum(x, y, infos[0])
        # every partial sum is bounded by the sum of |terms|: below 2**24, fp32 sums of these integers are exact
        assert float(batch_sum(x.abs(), y.abs(), abs_info).max()) < EXACT_LIMIT
        for dtype in DTYPES + (torch.float16,):
            calls.clear()
            z = sparse_product("outer", x.to(dtype), y.to(dtype), infos, True)
            assert calls, "the matrix-unit route did not run"
            assert_within(f"{case.label} {str(dtype)[6:]} config {config}", z, exact,
                          unit_roundoff(dtype) * exact.abs() if dtype != torch.float32 else 0.0 * exact)


# ---------------------------------------------------------------------------------------------------------------------
# determinism

# one real-size case per op (every path of the kernel's OP switch), the batch-summing cases on float data too
DETERMINISM_CASES = ([next(c for c in PRODUCT_CASES if c.op == op) for op in OPS]
                     + [dataclasses.replace(c, integer=False) for c in SHARED_CASES if c.batch_summed()])


@pytest.mark.parametrize("case", DETERMINISM_CASES + SCALE_CASES[:1], ids=lambda c: c.label)
def test_bitwise_deterministic(case, triton_only):
    """No atomics: the kernels sum in CSR order (and a batch sum inside one program), so three runs of forward,
    backward and double backward are bitwise equal. On float data: integer sums would be equal in any order."""
    inputs = case.make_inputs(seed=1)

    def run():
        return [t for t in case.run(inputs, torch.float32) if t is not None]

    assert verify.bitwise_equal_runs(run, runs=3)


# ---------------------------------------------------------------------------------------------------------------------
# float64 gradcheck and gradgradcheck through the kernels on the GPU


# full checks cost a launch per input element and per cotangent element: small, and smaller in the dry run
GRADCHECK_SIZES = (3, 3, 3, 6) if DRYRUN else (4, 3, 5, 10)  # size1, size2, out_size, terms
GRADCHECK_CHANNELS = {"vecmat": ((2,), (2, 1)), "outer": ((1,), (2,))} if DRYRUN else \
    {"vecmat": ((3,), (3, 2)), "outer": ((2,), (3,))}


@pytest.mark.parametrize("op,sharing,out_accumulated", [("vecmat", "shared_y", False), ("outer", "batched", True)])
def test_float64_gradcheck_and_gradgradcheck(op, sharing, out_accumulated, triton_only):
    """Full (not fast-mode) checks of the fp64 kernels (fp64 accumulators, fp64 scales) on a random structure with
    empty segments and a repeated term."""
    size1, size2, out_size, terms = GRADCHECK_SIZES
    infos = random_product_infos(size1, size2, out_size, terms, torch.Generator().manual_seed(3), device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(4)
    shared_x, shared_y = SHARING[sharing]
    cx, cy = GRADCHECK_CHANNELS[op]
    x = torch.randn((() if shared_x else (2,)) + (size1,) + cx, generator=generator, device=DEVICE,
                    dtype=torch.float64)
    y = torch.randn((() if shared_y else (2,)) + (size2,) + cy, generator=generator, device=DEVICE,
                    dtype=torch.float64)
    args = (x.requires_grad_(), y.requires_grad_())

    def fn(a, b):
        return sparse_product(op, a, b, infos, out_accumulated)

    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def test_scale_float64_gradcheck_and_gradgradcheck(triton_only):
    in_size, out_size, terms, channels = (4, 3, 6, 2) if DRYRUN else (5, 7, 12, 3)
    infos = random_scale_infos(in_size, out_size, terms, torch.Generator().manual_seed(1), device=DEVICE)
    x = torch.randn(2, in_size, channels, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: sparse_scale(a, *infos), (x,))
    assert torch.autograd.gradgradcheck(lambda a: sparse_scale(a, *infos), (x,))


# ---------------------------------------------------------------------------------------------------------------------
# e3nn

E3NN_L, E3NN_C, E3NN_N = (1, 2, 3) if DRYRUN else (3, 16, 4096)


def test_vecsca_matches_e3nn_tensor_product(triton_only):
    """Our vecsca over cg_product_infos against e3nn's TensorProduct as the operator's e3nn peer builds it ('uvu',
    every path of irreps 0..L, no normalization; peers._e3nn_tensor_product) on the peer's layout, fp32, forward,
    gradients and double backward. e3nn's wigner_3j(l1, l2, l3) is (-1)^l3 so3.clebsch_gordan(l1, l2, l3)
    exactly (checked first: a different convention, not a kernel error, fails there); the peer multiplies its
    output by those signs, so its output is ours. Bound: ours as above plus e3nn's, whose 3j are rounded to fp32 once
    (+u32) and whose sums may run in any order (m doubled, to be safe)."""
    pytest.importorskip("e3nn")
    from e3nn import o3

    for l1, l2, l3 in so3.tensor_product_paths(E3NN_L, E3NN_L, E3NN_L):
        theirs = o3.wigner_3j(l1, l2, l3, dtype=torch.float64)
        assert torch.allclose(theirs, (-1) ** l3 * so3.clebsch_gordan(l1, l2, l3), rtol=0, atol=1e-12), \
            f"e3nn's wigner_3j{(l1, l2, l3)} is not (-1)^l3 so3.clebsch_gordan: the conventions changed"
    assert not torch.backends.cuda.matmul.allow_tf32, "e3nn's fp32 einsums would round to TF32"
    case = ProductCase("vecsca", cg(E3NN_L), E3NN_N, (E3NN_C,), ())
    inputs, _, absolute = oracles(case)
    infos = case.infos()
    tp, out_signs = peers._e3nn_tensor_product(E3NN_L, E3NN_C, torch.device(DEVICE), torch.float32)
    x, y, g, hx, hy = (inputs[k] for k in ("x", "y", "g", "hx", "hy"))
    ours = derivatives(lambda a, b: sparse_vecsca(a, b, infos), (x, y), g, (hx, hy))
    theirs = derivatives(lambda a, b: peers._from_e3nn(tp(peers._to_e3nn(a, E3NN_L), b) * out_signs, E3NN_L,
                                                       E3NN_C), (x, y), g, (hx, hy))
    m = case.chain_length()
    for name, a, b, bound, rho in zip(PRODUCT_OUTPUTS, ours, theirs, absolute, PRODUCT_ROUNDINGS):
        factor = error_factor(torch.float32, m, rho) + error_factor(torch.float32, 2 * m, rho + 1)
        assert_within(f"e3nn {name}", a, b.double(), factor * bound)


def test_e3nn_peer_passes_the_operators_check():
    """The peer as the runner verifies it (it once fed our basis to e3nn unchanged: odd-l3 rows came out negated,
    wigner_3j = (-1)^l3 CG; its paths now carry that sign)."""
    pytest.importorskip("e3nn")
    case = SparseCase("vecsca", E3NN_L, E3NN_N, E3NN_C, "float32")
    x = OP.make_inputs(case, DEVICE)
    oracle, lowp = OP.oracle(case, x), OP.oracle(case, x, dtype=torch.float32)
    for mode in OP.modes:
        result = verify.check_variant(OP, "e3nn", case, mode, x, oracle, lowp)
        assert result.passed, (mode, result.skipped, [(o.name, o.error) for o in result.outputs if not o.passed])


# ---------------------------------------------------------------------------------------------------------------------
# the toy potential end to end

ATOM_GRID = (2, 2, 1) if DRYRUN else (4, 4, 3)  # 48 atoms, 2256 edges (all pairs)
POTENTIAL = dict(channels=2, l_hidden=1, l_sh=1, num_radial=3) if DRYRUN else dict(channels=8, l_hidden=3, l_sh=3)
# measured at this size on the CPU (split path, float64): energy 1.4e-15, forces 1.2e-15, sum of forces 2.6e-16 of
# the largest force; 1e-12 leaves a factor of several hundred for other summation orders, and a wrong sign, phase
# or basis order in any op gives O(1)
EQUIVARIANCE_TOL = 1e-12


def toy_system(seed=0):
    """Atoms on a jittered grid (spacing 1.3, so no two come close and the forces stay well conditioned), two
    species, every ordered pair an edge (those beyond the cutoff of 4 weigh zero, smoothly)."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in ATOM_GRID), indexing="ij"), -1)
    positions = grid.reshape(-1, 3) * 1.3 + 0.2 * torch.randn(math.prod(ATOM_GRID), 3, generator=generator,
                                                              dtype=torch.float64)
    target = torch.randn(positions.shape, generator=generator, dtype=torch.float64)
    species = torch.arange(positions.shape[0]) % 2
    src, dst = all_pairs(positions.shape[0])
    return positions.to(DEVICE), species.to(DEVICE), src.to(DEVICE), dst.to(DEVICE), target.to(DEVICE)


def potential_step(model, implementation, positions, species, src, dst, target):
    """(energy, forces, d force_loss / d parameters...) on ``implementation``."""
    with use_implementation(implementation):
        energy, forces = model.energy_and_forces(positions, species, src, dst, create_graph=False)
        loss = model.force_loss(positions, species, src, dst, target)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return [energy.detach(), forces.detach(), *grads]


def test_toy_potential_on_the_kernels():
    """Energy, forces and the force loss's weight gradient (a derivative of a gradient) on the Triton kernels.
    float64: equal to the split path within verify.BOUNDS[float64] (1e-12, normwise: float64 arithmetic, the two
    differing only in summation order). float32, both against the float64 split path on the fp32 model's own
    parameters and positions: at most 2x the split path's fp32 error, or verify.FLOORS[float32] (the project's
    rule for a kernel against the eager computation in the same dtype: DESIGN.md, verification). Measured at this
    size on the CPU with the split path and a permuted edge list (every segment sum in another order): float64
    differs by <= 3.3e-15; float32 errors are 1.5e-8 (energy) to 4.5e-7, so the floor (2e-6) is the bar that
    binds, as verify.py says of fp32; a wrong derivative term is O(1)."""
    system = toy_system()
    model32 = ToyPotential(dtype=torch.float32, seed=1, **POTENTIAL).to(DEVICE)
    model64 = ToyPotential(dtype=torch.float64, seed=1, **POTENTIAL).to(DEVICE)
    model64.load_state_dict(model32.state_dict())  # the fp32 parameters, exactly
    positions, species, src, dst, target = system
    system32 = (positions.float(), species, src, dst, target.float())
    system64 = (positions.float().double(), species, src, dst, target.float().double())
    names = ["energy", "forces"] + [f"d loss / d {name}" for name, _ in model64.named_parameters()]
    oracle = potential_step(model64, "split", *system64)
    for name, got, want in zip(names, potential_step(model64, "triton", *system64), oracle):
        error = verify.relative_error(got, want)
        assert error <= verify.BOUNDS[torch.float64], (name, error)
    triton32 = potential_step(model32, "triton", *system32)
    split32 = potential_step(model32, "split", *system32)
    for name, ours, split, want in zip(names, triton32, split32, oracle):
        assert ours.dtype == torch.float32, name
        error, split_error = verify.relative_error(ours, want), verify.relative_error(split, want)
        assert error <= max(2 * split_error, verify.FLOORS[torch.float32]), (name, error, split_error)


def test_toy_potential_equivariance_in_float64():
    """On the kernels: E(R x + t) = E(x), F(R x + t) = F(x) R^T, and the forces sum to zero."""
    positions, species, src, dst, _ = toy_system(seed=2)
    model = ToyPotential(dtype=torch.float64, seed=3, **POTENTIAL).to(DEVICE)
    with use_implementation("triton"):
        energy, forces = model.energy_and_forces(positions, species, src, dst, create_graph=False)
        scale = forces.abs().max()
        assert forces.sum(0).abs().max() / scale < EQUIVARIANCE_TOL
        generator = torch.Generator().manual_seed(5)
        for _ in range(2):
            rotation = so3.random_rotation(generator).to(DEVICE)
            shift = torch.randn(3, generator=generator, dtype=torch.float64).to(DEVICE)
            energy_r, forces_r = model.energy_and_forces(positions @ rotation.T + shift, species, src, dst,
                                                         create_graph=False)
            assert abs(energy_r - energy) / abs(energy) < EQUIVARIANCE_TOL
            assert (forces_r - forces @ rotation.T).abs().max() / scale < EQUIVARIANCE_TOL


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs


OTHER_DEVICE = "meta" if DRYRUN else "cpu"  # a device the infos are not on (the dry run's infos are on the CPU)


def test_bad_inputs_fail_before_any_kernel(monkeypatch):
    """A ValueError/TypeError naming what is wrong, with the launchers made to fail: infos on another device than
    the tensors (both ways on a GPU), a wrong sparse size, mismatched channels or dtypes."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel launched")

    monkeypatch.setattr(triton_ops, "sparse_product_launch", launched)
    monkeypatch.setattr(triton_ops, "sparse_scale_launch", launched)
    infos = random_product_infos(5, 4, 6, 20, torch.Generator().manual_seed(0), device=DEVICE)
    x = torch.randn(3, 5, 8, device=DEVICE)
    y = torch.randn(3, 4, 8, device=DEVICE)
    cases = [
        (ValueError, "device", (x.to(OTHER_DEVICE), y.to(OTHER_DEVICE), infos)),
        (ValueError, "size1", (x[:, :4], y, infos)),
        (ValueError, "channel dims", (x, y[..., :7], infos)),
        (TypeError, "dtype", (x, y.bfloat16(), infos)),
    ]
    if not DRYRUN:  # infos built on the CPU for CUDA tensors
        cpu_infos = random_product_infos(5, 4, 6, 20, torch.Generator().manual_seed(0))
        cases.append((ValueError, "device", (x, y, cpu_infos)))
    scaling = random_scale_infos(5, 7, 12, torch.Generator().manual_seed(1), device=DEVICE)
    with use_implementation("triton"):
        with pytest.raises(AssertionError, match="launched"):
            sparse_product("mul", x, y, infos)  # the guard is armed: valid arguments reach the launch
        for error, match, (a, b, structure) in cases:
            with pytest.raises(error, match=match):
                sparse_product("mul", a, b, structure)
        with pytest.raises(ValueError, match="in_size"):
            sparse_scale(torch.randn(2, 4, 3, device=DEVICE), *scaling)
        with pytest.raises(ValueError, match="device"):
            sparse_scale(torch.randn(2, 5, 3, device=OTHER_DEVICE), *scaling)
