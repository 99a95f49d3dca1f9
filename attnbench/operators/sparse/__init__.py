"""The ``sparse`` operator: SparseScale and the seven sparse products of ``attnbench.sparse``, to second order.

    product:  z[n, i3] += s x[n, i1] ∘ y[n, i2]   (the CG tensor product of irreps 0..L: so3.tensor_product_coo)
    scale:    z[n, m]  += s x[n, index]          (y = S x, S a CSR matrix: the edge -> atom segment sum, or a
                                                  random CSR with the same number of terms)

Modes, each timed alone (what it needs beforehand is built in prepare, untimed):
  fwd         z
  bwd         (grad_x, grad_y): the gradients of <g, z> for a fixed random cotangent g (grad_x alone for scale)
  double_bwd  (ggrad_x, ggrad_y, ggrad_g): the gradients w.r.t. x, y and g of <h, grad> for a second fixed random
              cotangent h = (h_x, h_y), the derivative of a gradient that force training needs. For scale only
              ggrad_g = S h_x: grad_x = S^T g does not depend on x, so its x-derivative is identically zero.

Cost model. A product term does ``w`` multiply-adds of channel work (C for mul, inner, vecsca, scavec; C^2 for outer,
vecmat, mat_t_vec), so fwd = 2 T w N FLOPs (T terms), with one exception: where the matrix operand is shared (the FC
layer's weight: vecmat shared-y, mat_t_vec shared-x), the terms of one (output row, batched row) pair fold into one
C x C block of the weight (attnbench/kernels/sparse/fold.py), so T counts those pairs where they are fewer (CG L 6: 2401
against 11896 terms; without this the fold route ran at up to 198% of a roofline of the terms' work). bwd = 2 x fwd:
grad_x and grad_y are each one product over the same T terms with the same channel work (the Functions' rotated
infos). double_bwd = 4 x fwd: the backward of grad_x = Bx(y, g) gives two products (w.r.t. y and g), that of
grad_y = By(g, x) two more (w.r.t. g and x). Scale: fwd = 2 nnz W (W the row width), bwd one S^T product, double_bwd
one S product (1x each). Minimum bytes: every operand read once and every output written once per mode, with
X, Y, Z the sizes of x, y, z (a shared operand counted once):
  fwd:         X + Y + Z                   (read x, y; write z)
  bwd:         2X + 2Y + Z                 (read x, y, g; write grad_x, grad_y)
  double_bwd:  3X + 3Y + 2Z                (read x, y, g, h_x, h_y; write ggrad_x, ggrad_y, ggrad_g)
plus the structure read once per product launched (1, 2, 4 infos; 3 int64 indices + a float64 scale per term).
Scale: X + Z in every mode (fwd reads x writes z; bwd reads g writes grad_x; double_bwd reads h_x writes ggrad_g),
plus nnz x (int64 index + float64 scale) and the CSR row offsets.

The layer ("fc"): FullyConnectedTensorProduct (attnbench.sparse.tensor_product) on irreps 0..L x 0..L -> 0..L, C -> C
channels, with its weight w [P, C, C] (P paths) a third input: z = vecmat(vecsca(x, y), w) with w shared. Its modes
add grad_w (bwd) and ggrad_w (double_bwd, for a third cotangent h_w); its cost model counts its products: 2 N (k_c T C
+ k_m U C^2) FLOPs (T the coupling's CG terms, U its coupled rows, 2 l3 + 1 a path) with (k_c, k_m) = (1, 1) fwd,
(2, 2) bwd and (6, 4) double bwd (LAYER_PRODUCTS), and w read (its gradient written) as x is.

Case sets (labels like "vecsca L3 N100000 C32 fp32"; "shared-y": y has no batch dim, as the weight of vecmat in the
fully connected layer; "scale-rand": a random CSR):
  tiny    the CPU gate: every op at L 1-2, N 2-5, C 3-8, fp32 and fp64, shared operands, both scale structures, fc
  gpu     real sizes, fp32 and bf16
  anchor  the issue's target grid for the ops of the fully connected layer and the message-passing segment sum:
          vecsca, vecmat (shared y) and scale, L in {2, 3, 4, 6}, C in {32, 128}, N in {1e4, 1e5}, fp32 and bf16.
          N = 1e6 is left to the sweep: at L 6 C 128 fp32 one feature tensor is 25 GB.
  layer   the fully connected layer ("fc") on the anchor grid, less the cases whose tensors and u exceed 4 GiB: what
          cuEquivariance's FullyConnectedTensorProduct runs
  sweep   the full grid (every op, L {2,3,4,6}, C {32,128}, N {1e4,1e5,1e6}, fp32/bf16) less the cases whose operands
          and output together exceed SWEEP_BYTE_CAP (8 GiB: double_bwd holds about three times that, plus the graph).
The split implementation materializes [N, T, C...] terms (T = 11896 at L 6), so it runs out of memory on the
largest cases; the runner records those rows as skipped ("out of memory").
"""
import functools
import math
from dataclasses import dataclass

import torch

from ...bench.cases import DtypeNamed, seeded_inputs
from ...bench.registry import Operator, Variant, register
from ...sparse import functional, reference, triton_ops
from ...sparse.functional import CHANNEL_RANKS, PRODUCT_FUNCTIONS
from ...sparse.info import random_scale_infos, scale_infos
from ...sparse.tensor_product import FullyConnectedTensorProduct, cg_product_infos, layer_structure
from . import cuequivariance, peers, routes

PRODUCTS = tuple(PRODUCT_FUNCTIONS)  # mul, outer, inner, vecmat, vecsca, scavec, mat_t_vec
OPS = ("scale",) + PRODUCTS + ("fc",)  # fc: the fully connected layer, vecsca then vecmat with a shared weight w
# channel multiply-adds per term and batch item, per op
CHANNEL_WORK = {"mul": 1, "inner": 1, "vecsca": 1, "scavec": 1, "outer": 2, "vecmat": 2, "mat_t_vec": 2}  # powers of C
# products launched per mode (bwd: grad_x and grad_y; double_bwd: two per first-order gradient)
PRODUCTS_PER_MODE = {"fwd": 1, "bwd": 2, "double_bwd": 4}
OUTPUTS = {"fwd": ("z",), "bwd": ("grad_x", "grad_y"), "double_bwd": ("ggrad_x", "ggrad_y", "ggrad_g")}
SCALE_OUTPUTS = {"fwd": ("z",), "bwd": ("grad_x",), "double_bwd": ("ggrad_g",)}
# the layer's products launched per mode (counted: autograd over the Functions), coupling (vecsca's family over x, y
# and the coupled features u) and mixing (vecmat's over u, w, z): the double backward's chain through u adds two
# coupling products to the 2 + 2 of each product's own second order
LAYER_PRODUCTS = {"coupling": {"fwd": 1, "bwd": 2, "double_bwd": 6}, "mixing": {"fwd": 1, "bwd": 2, "double_bwd": 4}}
# the layer's weight is a third input: trained, so differentiated as x and y are
FC_OUTPUTS = {"fwd": ("z",), "bwd": ("grad_x", "grad_y", "grad_w"),
              "double_bwd": ("ggrad_x", "ggrad_y", "ggrad_w", "ggrad_g")}
NEIGHBORS = 16  # edges per atom of the segment-sum structure
SWEEP_BYTE_CAP = 8 * 2**30
LAYER_BYTE_CAP = 4 * 2**30  # the layer's operands, output and coupled features u


@dataclass(frozen=True)
class SparseCase(DtypeNamed):
    op: str  # "scale", a product (a key of functional.PRODUCT_FUNCTIONS) or "fc" (the fully connected layer)
    l_max: int  # irreps 0..L: sparse size (L+1)^2 for products, row width (L+1)^2 C for scale
    batch: int  # N: batch items of a product, edges of a scale
    channels: int  # C
    dtype: str = "float32"
    shared: str = ""  # "", "x" or "y": that operand has no batch dim (products only)
    structure: str = ""  # scale: "segment" (edge -> atom segment sum, default) or "random"; products: CG

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"sparse: op must be one of {OPS}, got {self.op!r}")
        if self.shared not in ("", "x", "y") or (self.shared and self.op in ("scale", "fc")):
            raise ValueError(f"sparse: shared must be '', 'x' or 'y' (products only), got {self.shared!r}")
        if self.structure not in (("", "segment", "random") if self.op == "scale" else ("",)):
            raise ValueError(f"sparse: structure {self.structure!r} does not apply to {self.op}")

    @property
    def is_scale(self):
        return self.op == "scale"

    @property
    def is_layer(self):
        """The fully connected layer: x [N, S, C], y [N, S] (spherical harmonics), a weight w [P, C, C] shared by the
        batch (P: the CG paths of irreps 0..L x 0..L -> 0..L), z [N, S, C]
        (attnbench.sparse.FullyConnectedTensorProduct)."""
        return self.op == "fc"

    @property
    def operands(self):
        """The inputs: x, y (not for scale), w (the layer's)."""
        return "x" if self.is_scale else "xyw" if self.is_layer else "xy"

    @property
    def sparse_size(self):
        return (self.l_max + 1) ** 2

    @property
    def width(self):
        """Scale: the row width, a feature of irreps 0..L with C channels flattened."""
        return self.sparse_size * self.channels

    @property
    def atoms(self):
        """Scale: output rows (atoms), NEIGHBORS edges each."""
        return max(2, self.batch // NEIGHBORS)

    def shape(self, operand):
        """Shape of x, y or z."""
        if self.is_scale:
            return (self.batch, self.width) if operand == "x" else (self.atoms, self.width)
        if self.is_layer:
            if operand == "w":
                return (len(layer_paths(self.l_max)), self.channels, self.channels)
            return (self.batch, self.sparse_size) + ((self.channels,) if operand in "xz" else ())
        rank = CHANNEL_RANKS[self.op]["xyz".index(operand)]
        lead = () if operand == self.shared else (self.batch,)
        return lead + (self.sparse_size,) + (self.channels,) * rank

    def numel(self, operand):
        if (self.is_scale and operand == "y") or (operand == "w" and not self.is_layer):
            return 0
        return math.prod(self.shape(operand))

    @property
    def tensor_bytes(self):
        """Operands and output once, and the layer's coupled features u: what the memory caps are applied to."""
        u = self.batch * _layer(self.l_max)["coupled"] * self.channels if self.is_layer else 0
        return (sum(self.numel(o) for o in "xywz") + u) * self.torch_dtype.itemsize

    @property
    def label(self):
        name = "scale-rand" if self.structure == "random" else self.op
        shared = f" shared-{self.shared}" if self.shared else ""
        return f"{name} L{self.l_max} N{self.batch} C{self.channels}{shared} {self.short_dtype}"


def num_terms(case):
    """T: product terms of the CG structure, or nonzeros of the scale's CSR (one per edge); the layer's: both its
    products' (the coupling's CG terms and the mixing's one term a coupled row)."""
    if case.is_layer:
        layer = _layer(case.l_max)
        return len(layer["coupling"]["i1"]) + len(layer["mixing"]["i1"])
    return case.batch if case.is_scale else _cg_terms(case.l_max)


@functools.lru_cache(maxsize=None)
def _layer(l_max):
    """The fully connected layer's structure on irreps 0..L (channels do not change it but for the path scale): its
    paths, U (the coupled rows: 2 l3 + 1 a path) and both products' terms (attnbench.sparse.tensor_product)."""
    paths, coupled, coupling, mixing = layer_structure(l_max, l_max, l_max, False, 1)
    return {"paths": paths, "coupled": coupled, "coupling": coupling, "mixing": mixing}


@functools.lru_cache(maxsize=None)
def _layer_pairs(l_max):
    """Distinct (coupled row, x row) pairs of the layer's coupling, as _cg_pairs for a product."""
    return _distinct_pairs(_layer(l_max)["coupling"], "i1")


def layer_paths(l_max):
    return _layer(l_max)["paths"]


def _layer_work(case, mode, coupling_per_column=None):
    """Multiply-adds a batch item of the layer in ``mode``: the coupling's products (a vecsca's: C a CG term, or
    ``coupling_per_column`` C) and the mixing's (a vecmat's with the weight shared: C^2 a coupled row, each the one
    (output row, coupled row) pair its terms fold into), each times its count in LAYER_PRODUCTS."""
    layer = _layer(case.l_max)
    coupling = (coupling_per_column or len(layer["coupling"]["i1"])) * case.channels
    mixing = layer["coupled"] * case.channels ** 2
    return LAYER_PRODUCTS["coupling"][mode] * coupling + LAYER_PRODUCTS["mixing"][mode] * mixing


def _layer_structure_bytes(case, mode):
    """The terms each of the mode's products reads (3 int64 indices and a float64 scale a term)."""
    layer = _layer(case.l_max)
    return (LAYER_PRODUCTS["coupling"][mode] * len(layer["coupling"]["i1"])
            + LAYER_PRODUCTS["mixing"][mode] * len(layer["mixing"]["i1"])) * (3 * 8 + 8)


@functools.lru_cache(maxsize=None)
def _cg_coo(l_max):
    from ...sparse import so3
    return so3.tensor_product_coo(l_max, l_max, l_max)


def _cg_terms(l_max):
    return len(_cg_coo(l_max)["i1"])


# the matrix operand whose sharing folds the terms, and the batched operand's row index, by op
_FOLDED = {"vecmat": ("y", "i1"), "mat_t_vec": ("x", "i2")}


def work_terms(case):
    """The T of the cost model (see the module): the terms, or for a shared matrix operand the (output row, batched
    row) pairs its terms fold into, where fewer."""
    shared, row = _FOLDED.get(case.op, (None, None))
    if case.is_layer:
        raise ValueError("work_terms: the layer's two products have their own counts (_layer_work)")
    if case.is_scale or shared is None or case.shared != shared:
        return num_terms(case)
    return min(num_terms(case), _cg_pairs(case.l_max, row))


@functools.lru_cache(maxsize=None)
def _cg_pairs(l_max, row):
    """Distinct (output row, ``row``: "i1" or "i2") pairs of the CG structure."""
    return _distinct_pairs(_cg_coo(l_max), row)


def _distinct_pairs(terms, row):
    """Distinct (output row, ``row``) pairs of a structure's terms ({"i1", "i2", "i3", ...})."""
    return len(set(zip(torch.as_tensor(terms["i3"]).tolist(), torch.as_tensor(terms[row]).tolist())))


def cg_block_macs(l_max):
    """Multiply-adds a (sample, channel) column of mul with every Clebsch-Gordan path's block dense, unpadded."""
    return sum((2 * a + 1) * (2 * b + 1) * (2 * c + 1) for a in range(l_max + 1) for b in range(l_max + 1)
               for c in range(abs(a - b), min(a + b, l_max) + 1))


def matrix_unit_flops(case):
    """The forward's FLOPs in the fewest multiply-adds of a dense form on the tensor cores, None for scale: mul's
    Clebsch-Gordan blocks dense and unpadded ((2 l1 + 1)(2 l2 + 1)(2 l3 + 1) a path a (sample, channel) column);
    vecsca and scavec as M[n] @ x[n] over the (output, vector row) pairs; inner as the Gram matrix x[n] @ y[n]^T;
    the others at their own FLOPs (a shared weight's already folded)."""
    if case.is_scale:
        return None
    if case.is_layer:  # the coupling as M[n] @ x[n] over its (coupled row, x row) pairs, the mixing as its own GEMM
        return 2.0 * _layer_work(case, "fwd", _layer_pairs(case.l_max)) * case.batch
    size = (case.l_max + 1) ** 2
    per_column = {"mul": cg_block_macs(case.l_max), "vecsca": _cg_pairs(case.l_max, "i1"),
                  "scavec": _cg_pairs(case.l_max, "i2"), "inner": size * size}.get(case.op)
    if per_column is None:
        return 2.0 * work_terms(case) * case.channels ** CHANNEL_WORK[case.op] * case.batch
    return 2.0 * per_column * case.channels * case.batch


def largest_batch(cases):
    """Each (op, L, C, dtype, sharing, structure) of ``cases`` once, at its largest N (the floors of a sweep)."""
    largest = {}
    for case in cases:
        key = (case.op, case.l_max, case.channels, case.dtype, case.shared, case.structure)
        if key not in largest or case.batch > largest[key].batch:
            largest[key] = case
    return list(largest.values())


# The CPU gate: every product and both scale structures, shared operands both ways, outer's rank-2 output.
TINY = [
    ("mul", 2, 3, 4, ""), ("outer", 1, 2, 3, ""), ("inner", 2, 4, 5, ""), ("vecmat", 1, 3, 4, ""),
    ("vecmat", 2, 2, 3, "y"), ("vecsca", 2, 5, 8, ""), ("scavec", 1, 3, 6, ""), ("mat_t_vec", 1, 2, 3, "x"),
]
TINY_SCALE = [(1, 5, 4, "segment"), (2, 5, 3, "random")]
TINY_LAYER = [(2, 3, 4)]  # (L, N, C) of the fully connected layer
# Real sizes for the GPU gate: every op at L 3 (611 terms), the FC-layer ops at L 4 as well.
GPU = [
    ("mul", 3, 2000, 32, ""), ("outer", 3, 500, 16, ""), ("inner", 3, 2000, 32, ""), ("vecmat", 3, 2000, 32, "y"),
    ("vecmat", 2, 500, 16, ""), ("vecsca", 3, 3000, 32, ""), ("vecsca", 4, 1000, 64, ""), ("scavec", 3, 2000, 32, ""),
    ("mat_t_vec", 3, 2000, 32, "x"),
]
GPU_SCALE = [(3, 50000, 32, "segment"), (3, 50000, 32, "random"), (6, 10000, 128, "segment")]
ANCHOR_L, ANCHOR_C, ANCHOR_N = (2, 3, 4, 6), (32, 128), (10_000, 100_000)
SWEEP_N = (10_000, 100_000, 1_000_000)
# products whose rank-2 operand is the FC layer's weight (shared) in the sweep and the anchor
SHARED_IN_SWEEP = {"vecmat": "y", "mat_t_vec": "x"}


def _listed(products, scales, dtypes):
    """Cases from (op, L, N, C, shared) product rows and (L, N, C, structure) scale rows, per dtype."""
    cases = []
    for dtype in dtypes:
        cases += [SparseCase(op, l, n, c, dtype, shared) for op, l, n, c, shared in products]
        cases += [SparseCase("scale", l, n, c, dtype, structure=s) for l, n, c, s in scales]
    return cases


def _tiny():
    return _listed(TINY, TINY_SCALE, ("float32", "float64")) + [
        SparseCase("fc", l, n, c, dtype) for dtype in ("float32", "float64") for l, n, c in TINY_LAYER]


def _gpu():
    return _listed(GPU, GPU_SCALE, ("float32", "bfloat16"))


def _anchor():
    return [SparseCase(op, l, n, c, dtype, "y" if op == "vecmat" else "")
            for dtype in ("float32", "bfloat16") for op in ("vecsca", "vecmat", "scale")
            for l in ANCHOR_L for c in ANCHOR_C for n in ANCHOR_N]


def _layer_set():
    """The fully connected layer (vecsca then vecmat with the weight shared, as one call) on the anchor grid: what
    its peers (cuEquivariance's FullyConnectedTensorProduct) run as one layer."""
    cases = [SparseCase("fc", l, n, c, dtype) for dtype in ("float32", "bfloat16")
             for l in ANCHOR_L for c in ANCHOR_C for n in ANCHOR_N]
    # u (N x U x C: 73 GB at L6 N1e5 C128 fp32) counts: the float64 oracle's double backward holds several
    return [c for c in cases if c.tensor_bytes <= LAYER_BYTE_CAP]


def _sweep():
    cases = []
    for dtype in ("float32", "bfloat16"):
        for op in PRODUCTS:
            cases += [SparseCase(op, l, n, c, dtype, SHARED_IN_SWEEP.get(op, ""))
                      for l in ANCHOR_L for c in ANCHOR_C for n in SWEEP_N]
        for structure in ("segment", "random"):
            cases += [SparseCase("scale", l, n, c, dtype, structure=structure)
                      for l in ANCHOR_L for c in ANCHOR_C for n in SWEEP_N]
    return [c for c in cases if c.tensor_bytes <= SWEEP_BYTE_CAP]  # memory cap: see the module docstring


def _odd():
    """compute-sanitizer's set (scripts/gpu_gate.sh): the kernels' GPU-only paths on odd sizes. A batch of 3001
    splits a batch sum (a shared operand's gradient) over several ranges with a ragged last one (a range is 256
    items at least on a GPU); odd channel counts (17, 33) cut every channel tile; mul at L 4 and 6 pads its
    bilinear route's held operand from 25 to 32 and 49 to 64 rows; vecsca, scavec and inner take the channel-wise
    kernels at L 2 and the fused dense ones at L 3 in 16 bits; SparseScale on odd M with row widths that fold into
    channel lines (48, 96, 2048) and one that does not (17), its random CSR's transpose (the backward) with empty
    rows."""
    cases = []
    for dtype in ("float32", "bfloat16"):
        cases += [SparseCase(op, 2, 3001, channels, dtype, shared) for op in PRODUCTS
                  for shared, channels in (("", 17), ("x", 33), ("y", 17))]
        cases += [SparseCase("mul", l, n, 17, dtype, shared) for l, n in ((4, 301), (6, 101)) for shared in ("", "x", "y")]
        cases += [SparseCase("scale", l, 3001, c, dtype, structure=structure) for structure in ("segment", "random")
                  for l, c in ((0, 17), (1, 12), (1, 24), (1, 512))]
    cases += [SparseCase(op, 3, 3001, 17, dtype, shared) for dtype in ("float16", "bfloat16", "float32")
              for op in ("vecsca", "scavec", "inner") for shared in ("", "y")]
    return cases


CASE_SETS = {"tiny": _tiny, "gpu": _gpu, "anchor": _anchor, "layer": _layer_set, "sweep": _sweep, "odd": _odd}


# ---- structures and inputs

def structure(case, device, seed=0):
    """The infos of a case on ``device``: (info_fwd, info_bwd1, info_bwd2) for a product, (info_fwd, info_bwd) for
    scale (the scales stay float64; the ops cast them to the operands' dtype)."""
    if case.is_layer:  # (coupling infos, mixing infos), each a product's (fwd, bwd1, bwd2); the path scale is C's
        return FullyConnectedTensorProduct(case.l_max, case.l_max, case.l_max, case.channels, case.channels).infos(
            device)
    if not case.is_scale:
        return cg_product_infos(case.l_max, case.l_max, case.l_max, device=device)
    if case.structure == "random":
        gen = torch.Generator().manual_seed(seed + 1)
        return random_scale_infos(case.batch, case.atoms, case.batch, gen, device=device)
    edges = torch.arange(case.batch)
    dst = edges * case.atoms // case.batch  # sorted, NEIGHBORS (or so) edges per atom, none empty
    return scale_infos(edges.to(device), dst.to(device), None, case.batch, case.atoms)


def _cotangent_shapes(case):
    return {"g": case.shape("z"), **{f"h_{o}": case.shape(o) for o in case.operands}}


def _forward(case, infos, implementation):
    """f(x, y[, w]) -> z through the Functions (``implementation`` entered around each call) or None for the einsum."""
    if case.is_layer:
        coupling, mixing = infos
        if implementation is None:
            return lambda x, y, w: reference.sparse_product_reference(
                "vecmat", reference.sparse_product_reference("vecsca", x, y, coupling[0]), w, mixing[0])

        def layer(x, y, w):  # FullyConnectedTensorProduct.forward with the weight an input
            with implementation():
                return functional.sparse_product("vecmat", functional.sparse_product("vecsca", x, y, coupling), w,
                                                 mixing)
        return layer
    if implementation is None:  # the dense reference
        if case.is_scale:
            return lambda x, y: reference.sparse_scale_reference(x, infos[0])
        return lambda x, y: reference.sparse_product_reference(case.op, x, y, infos[0])

    def run(x, y):
        with implementation():
            if case.is_scale:
                return functional.sparse_scale(x, *infos)
            return functional.sparse_product(case.op, x, y, infos)

    return run


def evaluate(case, inputs, forward, mode, dtype=None):
    """A mode's outputs through torch autograd over ``forward``; returns () -> dict, with everything the timed call
    does not need (the forward, the first backward for double_bwd) done here. ``dtype`` casts the inputs first."""
    operands = [inputs[o] for o in case.operands]
    g = inputs["g"]
    hs = [inputs[f"h_{o}"] for o in case.operands]
    if dtype is not None:
        operands, g, hs = [t.to(dtype) for t in operands], g.to(dtype), [h.to(dtype) for h in hs]
    names = _outputs(case)[mode]
    no_y = [None] if case.is_scale else []  # scale's forward takes (x, None)
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return {"z": forward(*operands, *no_y)}
        return fwd
    leaves = [t.detach().requires_grad_() for t in operands]
    z = forward(*leaves, *no_y)
    if mode == "bwd":
        def bwd():
            return dict(zip(names, torch.autograd.grad(z, leaves, g, retain_graph=True)))
        return bwd
    g = g.detach().requires_grad_()
    grads = torch.autograd.grad(z, leaves, g, create_graph=True)
    wrt = [g] if case.is_scale else leaves + [g]  # scale: grad_x = S^T g is linear in g alone

    def double_bwd():
        out = torch.autograd.grad(grads, wrt, hs, retain_graph=True, allow_unused=True)
        return dict(zip(names, (torch.zeros_like(w) if o is None else o for o, w in zip(out, wrt))))
    return double_bwd


def _outputs(case):
    return SCALE_OUTPUTS if case.is_scale else FC_OUTPUTS if case.is_layer else OUTPUTS


def _autograd_prepare(case, inputs, mode, forward):
    fn = evaluate(case, inputs, forward, mode)
    fn.graph_capturable = mode == "fwd"  # autograd's backward cannot be captured (timing.not_graph_capturable)
    return fn


def _functions_variant(name, implementation, kind=None, description="", unavailable_reason=None):
    """A variant that runs the autograd Functions of attnbench.sparse.functional (their backward is the rotated-
    infos structure, to any order), with ``implementation()`` (a context manager factory) entered around every call
    of the ops: the switch to the split implementation for "split" (on CUDA tensors the default is Triton), to the
    Triton kernels for "triton"."""
    def prepare(case, inputs, mode):
        with implementation():  # the untimed forward (and first backward) here
            fn = _autograd_prepare(case, inputs, mode, _forward(case, inputs["infos"], implementation))

        def run():  # the backward that autograd runs in the timed call is the Functions' too
            with implementation():
                return fn()

        run.graph_capturable = fn.graph_capturable
        return run

    extra = {} if unavailable_reason is None else {"unavailable_reason": unavailable_reason}
    return Variant(name, kind or name, prepare, SparseOperator.modes, description, **extra)


class SparseOperator(Operator, cases=CASE_SETS):
    name = "sparse"
    description = ("SparseScale, the seven sparse tensor products (CG structures) and the fully connected layer, fwd, "
                   "bwd and double backward")
    modes = ("fwd", "bwd", "double_bwd")
    baselines = ("split", "reference")
    gate_baselines = ("split",)
    ratio_subject = "triton"
    ratio_peers = ("split", "reference", "torch_csr", "e3nn", "cuequivariance")

    def register_variants(self):
        self.add_variant(Variant(
            "reference", "reference",
            lambda case, inputs, mode: _autograd_prepare(case, inputs, mode, _forward(case, inputs["infos"], None)),
            self.modes, "dense einsum over the structure's coefficient tensor (a scale matrix past 2**28 entries: "
                        "torch's sparse matmul), torch autograd (the oracle, run in the case dtype)"))
        self.add_variant(_functions_variant(  # forced: by default the Functions run Triton on CUDA tensors
            "split", lambda: functional.use_implementation("split"),
            description="the autograd Functions, split-PyTorch (index_select, dense op, index_add); backward by "
                        "rotated infos"))
        self.add_variant(_functions_variant(
            "triton", lambda: functional.use_implementation("triton"),
            unavailable_reason=triton_ops.unavailable_reason,
            description="the autograd Functions on the Triton kernels: CSR segments (attnbench/kernels/sparse/segment.py), the "
                        "dense route of vecsca/scavec/inner (dense.py), batch sums of outer products on "
                        "matrix units (outer_sum.py); no atomics; backward by rotated infos, so every order "
                        "runs on them"))
        for route in routes.sparse_routes(self.variants["triton"]):
            self.add_route(route)
        self.add_variant(Variant("torch_csr", "peer", peers.torch_csr_prepare, self.modes,
                                 "scale only: torch.sparse_csr_tensor @ x, torch autograd"))
        self.add_variant(Variant("e3nn", "peer", peers.e3nn_prepare, self.modes,
                                 "vecsca only: e3nn.o3.TensorProduct ('uvu', every CG path of irreps 0..L, no "
                                 "normalization), torch autograd", peers.e3nn_unavailable))
        self.add_variant(Variant("cuequivariance", "peer", cuequivariance.prepare, self.modes,
                                 cuequivariance.description(), cuequivariance.unavailable_reason))

    def tunables(self):
        from ...bench.tune import tunable_table

        return tunable_table("attnbench.kernels.sparse", [
            ("product", "the CSR segment kernel of the products", "segment.sparse_product_kernel", "fwd",
             "triton@segment"),
            ("scale", "SparseScale's segment kernel", "segment.sparse_scale_kernel", "fwd"),
            ("scale_rows", "SparseScale's rows kernel", "segment.sparse_scale_rows_kernel", "fwd"),
            ("outer_sum", "batch sums of outer products on the matrix units (a shared weight's gradient)",
             "outer_sum.outer_sum_kernel", "bwd", "triton@unfolded"),
            ("gather_rows", "the dense route's per-sample sums on the gather kernel", "dense.gather_rows_kernel", "fwd",
             "triton@gather-kernel"),
            ("small_matmul", "the dense route's per-sample products (two launches)", "small_matmul.small_matmul_kernel",
             "fwd", "triton@two-launch"),
            ("gram_stack", "fp32 Gram matrices of a few rows, samples stacked (vecsca's backward)",
             "dense.gram_stack_kernel", "bwd"),
            ("split_matmul", "the fold route's 16-bit products, both halves in one program",
             "split_matmul.split_matmul_kernel", "fwd", "triton@split-matmul"),
            ("bilinear", "mul's bilinear route", "bilinear.bilinear_kernel", "fwd"),
            ("scaled_rows", "the fused dense route of vecsca and scavec", "fused_dense.scaled_rows_kernel", "fwd",
             "triton@matrix-units"),
            ("gram_rows", "the fused dense route of inner", "fused_dense.gram_rows_kernel", "fwd",
             "triton@matrix-units"),
            ("channelwise_rows", "the channel-wise route of vecsca and scavec", "channelwise.channelwise_rows_kernel",
             "fwd", "triton@channelwise"),
            ("channelwise_gram", "the channel-wise route of inner (vecsca's backward: gy)",
             "channelwise.channelwise_gram_kernel", "bwd", "triton@channelwise"),
        ])

    def make_inputs(self, case, device, seed=0):
        shapes = {**{o: case.shape(o) for o in case.operands}, **_cotangent_shapes(case)}
        # y is None for scale (no draw); the keys in the order x, y[, w], g, h_x[, h_y, h_w], infos
        return {"x": None, "y": None, **seeded_inputs(seed, shapes, device, case.torch_dtype),
                "infos": structure(case, device, seed)}

    def flops(self, case, mode):
        self.check_mode(mode)
        if case.is_scale:
            return 2.0 * num_terms(case) * case.width
        if case.is_layer:
            return 2.0 * _layer_work(case, mode) * case.batch
        forward = 2.0 * work_terms(case) * case.channels ** CHANNEL_WORK[case.op] * case.batch
        return forward * PRODUCTS_PER_MODE[mode]

    def bytes(self, case, mode):
        self.check_mode(mode)
        item = case.torch_dtype.itemsize
        x, y, z = (case.numel(o) * item for o in "xyz")
        if case.is_scale:
            return x + z + num_terms(case) * (8 + 8) + (case.atoms + 1) * 8
        if case.is_layer:  # the weight a third operand: read, and its gradient written, as x's
            x += case.numel("w") * item
        tensors = {"fwd": x + y + z, "bwd": 2 * x + 2 * y + z, "double_bwd": 3 * x + 3 * y + 2 * z}[mode]
        if case.is_layer:
            return tensors + _layer_structure_bytes(case, mode)
        return tensors + PRODUCTS_PER_MODE[mode] * num_terms(case) * (3 * 8 + 8)

    def compute_floor_s(self, case, mode, rates):
        """The least time the arithmetic allows (``attnbench report --floors``), the faster of two formulations,
        each at a peak rate and generous to the kernel: the terms as written (the cost model's FLOPs) on the FMA
        units (``rates.fma_tflops``; 16-bit inputs accumulate in fp32 there too), and the fewest multiply-adds of
        a dense form on the tensor cores (``matrix_unit_flops``; fp32 at half the bf16 rate: TF32's one pass,
        though fp32's accuracy needs three). A derivative's products count as the forward's (2 for bwd, 4 for
        double bwd), as in the cost model."""
        fma_s = self.flops(case, mode) / (rates.fma_tflops * 1e12)
        if case.is_layer:  # its products' own counts a mode
            dense = 2.0 * _layer_work(case, mode, _layer_pairs(case.l_max)) * case.batch
        else:
            dense = matrix_unit_flops(case)
            if dense is None:
                return fma_s
            dense *= PRODUCTS_PER_MODE[mode]
        rate = rates.matmul_tflops if case.torch_dtype.itemsize == 2 else rates.matmul_tflops / 2
        return min(fma_s, dense / (rate * 1e12))

    def design_bytes(self, case, mode):
        """What the derivatives' design moves (None for scale, whose design is the minimum): the issue asks for the
        backward as sibling products (each gradient one Function's .apply with the infos rotated), so each product
        reads its two operands and writes its output: backward 2 (X + Y + Z) where the minimum is 2X + 2Y + Z (g is
        read twice); double backward four products plus autograd's sum of the two contributions to d/dg (read both,
        write one), 4 (X + Y) + 7Z against 3X + 3Y + 2Z; the structure once per product."""
        if case.is_scale:
            return None
        item = case.torch_dtype.itemsize
        if case.is_layer:  # sibling products, each reading two of its family's tensors and writing the third
            u = case.batch * _layer(case.l_max)["coupled"] * case.channels * item
            x, y, w, z = (case.numel(o) * item for o in "xywz")
            moved = (LAYER_PRODUCTS["coupling"][mode] * (x + y + u) + LAYER_PRODUCTS["mixing"][mode] * (u + w + z))
            return moved + _layer_structure_bytes(case, mode)
        x, y, z = (case.numel(o) * item for o in "xyz")
        structure = self.bytes(case, "fwd") - (x + y + z)  # one product's read of the terms
        moved = {"fwd": x + y + z, "bwd": 2 * (x + y + z), "double_bwd": 4 * (x + y) + 7 * z}[mode]
        return moved + PRODUCTS_PER_MODE[mode] * structure

    def outputs(self, mode):
        self.check_mode(mode)
        return OUTPUTS[mode]

    def case_outputs(self, case, mode):
        self.check_mode(mode)
        return _outputs(case)[mode]

    def oracle(self, case, inputs, dtype=torch.float64):
        forward = _forward(case, inputs["infos"], None)
        out = {}
        for mode in self.modes:
            out.update({k: v.detach() for k, v in evaluate(case, inputs, forward, mode, dtype)().items()})
        return out


SPARSE = register(SparseOperator())
