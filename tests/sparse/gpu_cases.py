"""The sparse GPU gate's cases, float64 oracles and error bounds, shared by tests/sparse/test_gpu_*.py (products,
routes, shared_and_odd, launch_configs, tensor_product: skipped without CUDA; scripts/gpu_gate.sh runs them).
Their fixtures (gpu_triton_only, default_launch_configs) are in tests/sparse/conftest.py.

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

ATTNBENCH_GPU_SPARSE_DRYRUN=1 is a dry run of those files' logic on a machine without a GPU: the tests run on the
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
from attnbench.kernels.sparse.segment import product_out_shape
from attnbench.sparse import (CHANNEL_RANKS, product_infos, product_terms, random_product_infos, random_scale_infos,
                              scale_infos, scale_terms, sparse_product, sparse_product_reference, sparse_scale,
                              triton_ops)
from attnbench.sparse.tensor_product import cg_product_infos

from .helpers import SHARING

DRYRUN = os.environ.get("ATTNBENCH_GPU_SPARSE_DRYRUN", "") == "1"
DEVICE = "cpu" if DRYRUN else "cuda"
# every GPU file's pytestmark: gpu (interpreter in the dry run), and one launch config per kernel key
GPU_MARKS = [pytest.mark.interpreter if DRYRUN else pytest.mark.gpu, pytest.mark.usefixtures("default_launch_configs")]

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
        """Every output, on the kernels (under ``gpu_triton_only``), in ``dtype``."""
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
# the case tables more than one file runs

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
