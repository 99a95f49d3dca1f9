"""Structure descriptions of the sparse operators: ``SparseProductInfo`` and ``SparseScaleInfo``.

A sparse product is a list of terms t = (i1[t], i2[t], i3[t], s[t]) meaning

    z[n, i3[t]] += s[t] * x[n, i1[t]] ∘ y[n, i2[t]]

(∘ a dense op on the channel dims). ``SparseProductInfo`` stores the terms grouped by output (CSR):
segment j holds positions k in [seg_out[j], seg_out[j+1]), each naming the term t = gather_index[k]
(or t = k without gather_index), and writes output row index_out[j]. The backward of a product is
again a product over the same terms with the roles rotated (``product_infos``):

    info_fwd:  (index1, index2, out) = (i1, i2, i3)   z  from (x, y)
    info_bwd1: (index1, index2, out) = (i2, i3, i1)   gx from (y, gz)
    info_bwd2: (index1, index2, out) = (i3, i1, i2)   gy from (gz, x)

so the backward of (info_bwd1, info_bwd2, info_fwd) is again one of the three: double backward needs no new
structure. ``SparseScaleInfo`` describes y[n, m] = sum_t scale[t] x[n, index[t]] over t in row m, i.e. a
sparse matrix S in CSR form; its backward uses S^T (``scale_infos``).

Infos are validated when they are built (one pass over the indices, with a device sync), so a bad info fails
with a ValueError naming the field before any kernel runs; calls then check only shapes.
"""
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..kernels.sparse.bilinear import coefficient_splits
from ..kernels.sparse.channelwise import unrolled_gram, unrolled_pairs

__all__ = [
    "SparseProductInfo", "SparseScaleInfo", "product_infos", "scale_infos", "product_terms", "scale_terms",
    "random_product_infos", "random_scale_infos", "verify_structure",
]


def _check_size(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _check_index(name, index, length=None, bound=None, bound_name=None, device=None):
    """``index`` is a 1-D int64 tensor of ``length`` entries in [0, bound), on ``device``."""
    if not isinstance(index, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(index).__name__}")
    if index.dtype != torch.int64:
        raise ValueError(f"{name} must have dtype torch.int64, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(index.shape)}")
    if length is not None and index.numel() != length:
        raise ValueError(f"{name} has {index.numel()} entries, expected {length}")
    if device is not None and index.device != device:
        raise ValueError(f"{name} is on device {index.device}, the other fields on device {device}")
    if bound is not None and index.numel():
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= bound:
            raise ValueError(f"{name} has values in [{low}, {high}], outside [0, {bound}) ({bound_name} = {bound})")


def _check_scale(scale, length, device):
    if scale is None:
        return
    if not isinstance(scale, Tensor):
        raise ValueError(f"scale must be a torch.Tensor or None, got {type(scale).__name__}")
    if not scale.is_floating_point():
        raise ValueError(f"scale must be a floating tensor, got {scale.dtype}")
    if scale.dim() != 1 or scale.numel() != length:
        raise ValueError(f"scale must have shape ({length},) (one per term), got {tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"scale is on device {scale.device}, the other fields on device {device}")
    if scale.numel() and not bool(torch.isfinite(scale).all()):  # once per info, as the index range checks
        bad = scale[~torch.isfinite(scale)][0].item()
        raise ValueError(f"scale must be finite: a term's coefficient is {bad} (every output it reaches would be "
                         "NaN or inf)")
    if scale.requires_grad:
        raise ValueError("scale requires grad, but the sparse ops hold an info's scales constant (no gradient "
                         "reaches them): pass scale.detach(), or make the learnable weights an operand (as the "
                         "fully connected layer's y)")


def _check_seg_out(seg_out, num_segments, num_positions, device):
    """seg_out: int64, num_segments + 1 entries, non-decreasing from 0 to num_positions."""
    _check_index("seg_out", seg_out, length=num_segments + 1, device=device)
    if int(seg_out[0]) != 0:
        raise ValueError(f"seg_out must start at 0, got {int(seg_out[0])}")
    if int(seg_out[-1]) != num_positions:
        raise ValueError(f"seg_out must end at the number of terms it groups ({num_positions}), got {int(seg_out[-1])}")
    if num_segments and bool((seg_out[1:] < seg_out[:-1]).any()):
        raise ValueError("seg_out must be non-decreasing (segment j is seg_out[j]:seg_out[j+1])")


def _segment_ids(seg_out, values, num_positions):
    """values[j] repeated over segment j's positions: the row each position writes."""
    return torch.repeat_interleave(values, seg_out[1:] - seg_out[:-1], output_size=num_positions)


class _TermVersions:
    """An info's term tensors (``TERM_FIELDS``) are read once to build its derived fields (term_out, row_bounds,
    dense_rows) and its sibling infos, so an in-place change to one (info.scale.mul_(2), or the caller's scale,
    which the backward infos share) would leave the forward and the backward computing different functions. Each
    tensor's version counter (bumped by every in-place op on it or a view of it) is kept at build time."""

    TERM_FIELDS = ()

    def _record_versions(self):
        # inference tensors (made under torch.inference_mode) have no version counter: untracked, as None fields
        # are (building an info under inference_mode had raised "do not track version counter"; found by review)
        versions = tuple(None if (t := getattr(self, f)) is None or t.is_inference() else t._version
                         for f in self.TERM_FIELDS)
        object.__setattr__(self, "versions", versions)

    def changed_in_place(self) -> Optional[str]:
        """The first term field modified in place since the info was built, or None."""
        for name, version in zip(self.TERM_FIELDS, self.versions):
            if version is not None and getattr(self, name)._version != version:
                return name
        return None


@dataclass(frozen=True, eq=False)
class SparseProductInfo(_TermVersions):
    """z[n, index_out[j]] = sum_{k in seg_out[j]:seg_out[j+1]} s[t] x[n, index1[t]] ∘ y[n, index2[t]],
    t = gather_index[k] (t = k without gather_index); s = scale (1 when None).

    ``size1`` and ``size2`` (not in the seed) are the sparse sizes of x and y, so that index ranges are checked
    here and input shapes at each call. ``term_out`` is derived: the output row of each position k; so is
    ``row_bounds`` [2, out_size], the (start, end) positions of every output row's segment ((0, 0) for a row of
    no segment), which the Triton kernel reads (one program per output row) and would otherwise rebuild, three
    small launches, on every call.
    """

    scale: Optional[Tensor]
    index1: Tensor
    index2: Tensor
    seg_out: Tensor
    gather_index: Optional[Tensor]
    index_out: Tensor
    out_size: int
    size1: int
    size2: int
    # (id, role) that product_infos gives the three infos it builds together (roles 0, 1, 2: fwd, bwd1, bwd2; None:
    # built by hand or copied), so that the ops refuse a backward info of another structure, or of another role,
    # with the same sizes: either would give wrong gradients. Not an init field: dataclasses.replace, which may
    # change the terms, gives an untagged copy, whose terms the ops then compare with its siblings'
    structure: Optional[tuple] = field(default=None, init=False, repr=False)
    term_out: Tensor = field(init=False, repr=False)
    row_bounds: Tensor = field(init=False, repr=False)
    dense_rows: dict = field(init=False, repr=False)
    versions: tuple = field(init=False, repr=False)  # see _TermVersions
    TERM_FIELDS = ("scale", "index1", "index2", "seg_out", "gather_index", "index_out")

    def __post_init__(self):
        for name in ("out_size", "size1", "size2"):
            _check_size(name, getattr(self, name))
        _check_index("index1", self.index1, bound=self.size1, bound_name="size1")
        device = self.index1.device
        num_terms = self.index1.numel()
        _check_index("index2", self.index2, length=num_terms, bound=self.size2, bound_name="size2", device=device)
        _check_scale(self.scale, num_terms, device)
        num_positions = num_terms
        if self.gather_index is not None:
            _check_index("gather_index", self.gather_index, bound=num_terms, bound_name="number of terms",
                         device=device)
            num_positions = self.gather_index.numel()
        _check_index("index_out", self.index_out, bound=self.out_size, bound_name="out_size", device=device)
        if torch.unique(self.index_out).numel() != self.index_out.numel():
            raise ValueError("index_out must not repeat a row (each output row is written by one segment)")
        _check_seg_out(self.seg_out, self.index_out.numel(), num_positions, device)
        object.__setattr__(self, "term_out", _segment_ids(self.seg_out, self.index_out, num_positions))
        bounds = torch.zeros(2, self.out_size, dtype=torch.int64, device=device)
        bounds[0, self.index_out] = self.seg_out[:-1]
        bounds[1, self.index_out] = self.seg_out[1:]
        object.__setattr__(self, "row_bounds", bounds)
        object.__setattr__(self, "dense_rows", _dense_rows(self))
        self._record_versions()

    @property
    def device(self):
        return self.index1.device

    @property
    def num_terms(self):
        return self.index1.numel()


@dataclass(frozen=True, eq=False)
class GatherRows:
    """out[n, r] = sum_{k in bounds[0, r]:bounds[1, r]} scale[k] in[n, index[k]]: a sparse matrix in CSR form
    with every row present (bounds [2, rows], (k, k) for an empty row), applied to one value per (n, index)
    (``kernels.sparse_dense.gather_rows_launch``). ``max_len`` is the longest row (the kernel's loop bound);
    ``dense_entries`` the entries of the per-sample dense matrix of the route that reads the table (its terms per
    entry decide whether the route pays: ``triton_ops.MIN_DENSITY``). ``matrix``, where the table is dense enough
    (``GATHER_MATRIX_PER_TERM``), is the same sparse matrix stored dense and transposed, [gathered size, rows] in
    float64 (repeated terms summed once, exactly rounded), so that out = in @ matrix is one GEMM, and
    ``matrix32`` the same rounded to fp32 (for fp32 and 16-bit inputs: no cast a call); else both None. ``splits``,
    for the gram table with a matrix form, maps bf16 and fp16 to mul's bilinear-route coefficients (matrix32
    = scale (hi + lo): ``kernels.sparse.bilinear.coefficient_splits``, which leaves out a dtype whose split would
    lose precision), made once here rather than on every call."""

    bounds: Tensor
    index: Tensor
    scale: Tensor
    rows: int
    max_len: int
    dense_entries: int
    matrix: Optional[Tensor] = None
    matrix32: Optional[Tensor] = None
    splits: dict = field(default_factory=dict, repr=False)
    unrolled: Optional[object] = field(default=None, repr=False)


# The dense route builds a per-sample matrix of rows x (one sparse size) entries; only where that grid is at most
# this many times the term count (CG structures: 2401 entries against 11896 terms at L 6) or this small.
DENSE_GRID_PER_TERM = 4
DENSE_GRID_SMALL = 256
# A table is also stored as a dense [gathered size, rows] matrix where that has at most this many entries a term
# (Clebsch-Gordan pairs tables at L 6: 9.9; their gram table: the same) or at most DENSE_GRID_SMALL entries.
GATHER_MATRIX_PER_TERM = 16


def _gather_rows(key, index, scale, rows, dense_entries, gathered_size, split=False, unroll=None):
    """GatherRows of the terms (key, index, scale) grouped by key in [0, rows), stably (the caller's order within
    a row: a fixed summation order); ``gathered_size`` bounds ``index`` (the matrix form's rows); ``split``: the
    matrix form's splits too; ``unroll(matrix, device)``: the channel-wise kernels' structure from the float64 matrix
    form on the CPU (``kernels.sparse.channelwise``; None where it is too large)."""
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=rows)
    ends = counts.cumsum(0)
    bounds = torch.stack([ends - counts, ends])
    max_len = int(counts.max()) if rows else 0
    matrix = matrix32 = unrolled = None
    if gathered_size * rows <= max(GATHER_MATRIX_PER_TERM * key.numel(), DENSE_GRID_SMALL):
        # summed in float64 on the CPU: a fixed order for repeated (row, index) terms
        matrix = torch.zeros(gathered_size, rows, dtype=torch.float64)
        matrix.index_put_((index.cpu(), key.cpu()), scale.cpu().double(), accumulate=True)
        unrolled = unroll(matrix, scale.device) if unroll is not None else None
        matrix, matrix32 = matrix.to(scale.device), matrix.float().to(scale.device)
    splits = coefficient_splits(matrix32) if split and matrix32 is not None else {}
    return GatherRows(bounds, index[order].contiguous(), scale[order].contiguous(), rows, max_len, dense_entries,
                      matrix, matrix32, splits, unrolled)


def _dense_rows(info):
    """The terms regrouped for the dense route of vecsca, scavec and inner (``kernels.sparse_dense``), one
    GatherRows each, or {} where the dense grid would be too large:

        "pairs1": rows (out, index1) gathering index2: vecsca's per-sample M[n, out, i1] = sum s y[n, i2]
        "pairs2": rows (out, index2) gathering index1: scavec's M[n, out, i2] = sum s x[n, i1]
        "gram":   rows out gathering index1 * size2 + index2: inner's z[n, out] = sum s (x y^T)[n, i1, i2]
    """
    i1, i2, out, scale = product_terms(info)
    positions = out.numel()
    budget = max(DENSE_GRID_PER_TERM * positions, DENSE_GRID_SMALL)
    # (name, row key, gathered index, rows, entries of the dense matrix (M's rows for the pairs, G's for gram),
    # gathered size, the channel-wise kernels' unrolling of the matrix form)
    size12 = info.size1 * info.size2
    layouts = [("pairs1", out * info.size1 + i1, i2, info.out_size * info.size1, info.out_size * info.size1,
                info.size2, lambda m, device: unrolled_pairs(m, info.out_size, info.size1, device)),
               ("pairs2", out * info.size2 + i2, i1, info.out_size * info.size2, info.out_size * info.size2,
                info.size1, lambda m, device: unrolled_pairs(m, info.out_size, info.size2, device)),
               ("gram", out, i1 * info.size2 + i2, info.out_size, size12, size12,
                lambda m, device: unrolled_gram(m, info.out_size, info.size2, device))]
    return {name: _gather_rows(key, index, scale, rows, entries, gathered, split=name == "gram", unroll=unroll)
            for name, key, index, rows, entries, gathered, unroll in layouts if entries <= budget}


@dataclass(frozen=True, eq=False)
class SparseScaleInfo(_TermVersions):
    """y[n, m] = sum_{t in seg_out[m]:seg_out[m+1]} scale[t] x[n, index[t]]: y = S x with S [out_size, in_size]
    in CSR form (scale 1 when None). ``in_size`` (not in the seed) is x's sparse size; ``term_out`` is derived:
    the row m of each term."""

    scale: Optional[Tensor]
    index: Tensor
    seg_out: Tensor
    out_size: int
    in_size: int
    structure: Optional[tuple] = field(default=None, init=False, repr=False)  # as SparseProductInfo's (roles 0, 1)
    term_out: Tensor = field(init=False, repr=False)
    versions: tuple = field(init=False, repr=False)
    TERM_FIELDS = ("scale", "index", "seg_out")

    def __post_init__(self):
        for name in ("out_size", "in_size"):
            _check_size(name, getattr(self, name))
        _check_index("index", self.index, bound=self.in_size, bound_name="in_size")
        device = self.index.device
        _check_scale(self.scale, self.index.numel(), device)
        _check_seg_out(self.seg_out, self.out_size, self.index.numel(), device)
        rows = torch.arange(self.out_size, device=device)
        object.__setattr__(self, "term_out", _segment_ids(self.seg_out, rows, self.index.numel()))
        self._record_versions()

    @property
    def device(self):
        return self.index.device




def _grouped_product_info(key, a, b, scale, size_key, size_a, size_b, gather):
    """The terms z[key] += s a ∘ b grouped by key; with ``gather`` the term tensors stay in their order and
    gather_index holds the grouping, else they are permuted into it."""
    order = torch.argsort(key, stable=True)  # stable: ties keep the caller's order, so the result is canonical
    counts = torch.bincount(key, minlength=size_key)
    index_out = counts.nonzero().squeeze(1)
    seg_out = torch.cat([counts.new_zeros(1), counts[index_out].cumsum(0)])
    if gather:
        return SparseProductInfo(scale, a, b, seg_out, order, index_out, size_key, size_a, size_b)
    return SparseProductInfo(scale[order], a[order], b[order], seg_out, None, index_out, size_key, size_a, size_b)


def product_infos(i1, i2, i3, scale, size1, size2, size3, *, gather_backward=True):
    """(info_fwd, info_bwd1, info_bwd2) of the terms z[i3] += scale * x[i1] ∘ y[i2] (see the module docstring).

    x, y and z have sparse sizes size1, size2 and size3. The forward info holds the terms sorted by i3; the
    backward infos group them by i1 (gx from (y, gz)) and by i2 (gy from (gz, x)), through gather_index into
    the caller's term order when ``gather_backward`` (one copy of the term tensors, as a kernel would read
    them), else as sorted copies. ``scale`` None means 1.
    """
    for name, size in (("size1", size1), ("size2", size2), ("size3", size3)):
        _check_size(name, size)
    _check_index("i1", i1, bound=size1, bound_name="size1")
    _check_index("i2", i2, length=i1.numel(), bound=size2, bound_name="size2", device=i1.device)
    _check_index("i3", i3, length=i1.numel(), bound=size3, bound_name="size3", device=i1.device)
    if scale is None:
        scale = torch.ones(i1.numel(), dtype=torch.float64, device=i1.device)
    _check_scale(scale, i1.numel(), i1.device)
    # the infos own their terms: the backward infos would otherwise hold the caller's tensors, which a caller
    # reusing its buffers would change under them
    i1, i2, i3, scale = (t.clone() for t in (i1, i2, i3, scale))
    info_fwd = _grouped_product_info(i3, i1, i2, scale, size3, size1, size2, gather=False)
    info_bwd1 = _grouped_product_info(i1, i2, i3, scale, size1, size2, size3, gather=gather_backward)
    info_bwd2 = _grouped_product_info(i2, i3, i1, scale, size2, size3, size1, gather=gather_backward)
    return _one_structure(info_fwd, info_bwd1, info_bwd2)


def _one_structure(*infos):
    """The infos, marked as built together, each with its role (a random id: it survives copy.copy and pickling,
    which keep the terms, as an object's identity would not; dataclasses.replace drops it)."""
    structure = uuid.uuid4().int
    for role, info in enumerate(infos):
        object.__setattr__(info, "structure", (structure, role))
    return infos


def scale_infos(index, rows, scale, in_size, out_size):
    """(info_fwd, info_bwd) of y[rows[t]] += scale[t] x[index[t]]: S [out_size, in_size] and S^T."""
    _check_size("in_size", in_size)
    _check_size("out_size", out_size)
    _check_index("index", index, bound=in_size, bound_name="in_size")
    _check_index("rows", rows, length=index.numel(), bound=out_size, bound_name="out_size", device=index.device)
    if scale is None:
        scale = torch.ones(index.numel(), dtype=torch.float64, device=index.device)
    _check_scale(scale, index.numel(), index.device)

    def grouped(key, other, size_key, size_other):
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=size_key)
        seg_out = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return SparseScaleInfo(scale[order], other[order], seg_out, size_key, size_other)

    return _one_structure(grouped(rows, index, out_size, in_size), grouped(index, rows, in_size, out_size))


def product_terms(info: SparseProductInfo):
    """The COO terms (index1, index2, out, scale) of an info, one per position k (in seg_out order)."""
    t = info.gather_index if info.gather_index is not None else torch.arange(info.num_terms, device=info.device)
    scale = info.scale if info.scale is not None else torch.ones(info.num_terms, dtype=torch.float64,
                                                                 device=info.device)
    return info.index1[t], info.index2[t], info.term_out, scale[t]


def scale_terms(info: SparseScaleInfo):
    """The COO terms (index, row, scale) of a SparseScaleInfo."""
    scale = info.scale if info.scale is not None else torch.ones(info.index.numel(), dtype=torch.float64,
                                                                 device=info.device)
    return info.index, info.term_out, scale


def _canonical_terms(info, step):
    """The info's terms as sorted columns in the forward info's order: a product's (i1, i2, i3, scale), a scale's
    (index, row, scale). ``step`` is the info's place after the forward one in the builder's cycle: bwd1 holds
    (i2, i3, i1), bwd2 (i3, i1, i2); a scale's bwd (row, index)."""
    if isinstance(info, SparseProductInfo):
        *columns, scale = product_terms(info)
    else:
        *columns, scale = scale_terms(info)
    columns = columns[len(columns) - step:] + columns[:len(columns) - step]
    columns.append(scale.double())
    order = torch.arange(scale.numel(), device=scale.device)
    for column in reversed(columns):  # lexicographic: stable sorts from the last key to the first
        order = order[torch.argsort(column[order], stable=True)]
    return [column[order] for column in columns]


def verify_structure(*infos):
    """Check that infos built by hand (or copied with ``dataclasses.replace``) hold one structure's terms in the
    builders' roles, (info_fwd, info_bwd1, info_bwd2) or (info_fwd, info_bwd), and tag them as the builders do;
    returns them. Raises ValueError naming the first info whose terms differ: its gradients would be wrong.

    The ops call this on untagged infos (one pass over the terms, with a device sync); call it yourself before
    ``torch.compile``, which cannot compare terms inside a graph."""
    kind = type(infos[0])
    if len(infos) != (3 if kind is SparseProductInfo else 2) or not all(type(i) is kind for i in infos):
        raise TypeError("verify_structure takes (info_fwd, info_bwd1, info_bwd2) or (info_fwd, info_bwd)")
    names = ("info_fwd", "info_bwd1", "info_bwd2") if kind is SparseProductInfo else ("info_fwd", "info_bwd")
    check_same_terms(dict(zip(names, infos)))
    return _one_structure(*infos)


def check_same_terms(infos: dict):
    """``infos``: name -> info in the builders' cycle, starting at any role. Raises ValueError naming the first
    whose terms are not the first one's in its role."""
    first, *others = infos.items()
    want = _canonical_terms(first[1], 0)
    for step, (name, info) in enumerate(others, start=1):
        got = _canonical_terms(info, step)
        if not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(want, got)):
            raise ValueError(f"{name} does not hold {first[0]}'s terms in its role (the builders make them "
                             "together: product_infos, scale_infos): its gradients would be wrong")


def _random_terms(sizes, num_terms, generator, empty_segments, repeated):
    """Random index columns, one per size. With ``empty_segments`` each column avoids about a third of its
    range (and always its last row when size > 1), so every grouping has empty segments; with ``repeated``
    a quarter of the terms copy an earlier term's indices, so pairs and whole terms repeat."""
    columns = []
    for size in sizes:
        if size == 0:
            raise ValueError("random structures need every size > 0")
        allowed = torch.arange(size)
        if empty_segments and size > 1:
            keep = torch.rand(size, generator=generator) > 1 / 3
            keep[-1] = False
            if not keep.any():
                keep[0] = True
            allowed = allowed[keep]
        columns.append(allowed[torch.randint(allowed.numel(), (num_terms,), generator=generator)])
    if repeated and num_terms >= 4:
        copies = num_terms // 4
        source = torch.randint(num_terms - copies, (copies,), generator=generator)
        for column in columns:
            column[num_terms - copies:] = column[source]
        # the last copy keeps only the pair (i1, i2) of its source and moves to another output
        columns[-1][-1] = torch.randint(sizes[-1], (1,), generator=generator)
    perm = torch.randperm(num_terms, generator=generator)  # the copies anywhere, not only at the end
    return [column[perm] for column in columns]


def random_product_infos(size1, size2, size3, num_terms, generator, *, empty_segments=True, repeated=True,
                         gather_backward=True, dtype=torch.float64, device="cpu"):
    """product_infos of ``num_terms`` random terms with scales in [-1, 1) (tests and sweeps)."""
    i1, i2, i3 = _random_terms((size1, size2, size3), num_terms, generator, empty_segments, repeated)
    scale = torch.rand(num_terms, generator=generator, dtype=torch.float64) * 2 - 1
    to = dict(device=device)
    return product_infos(i1.to(**to), i2.to(**to), i3.to(**to), scale.to(dtype=dtype, **to), size1, size2, size3,
                         gather_backward=gather_backward)


def random_scale_infos(in_size, out_size, num_terms, generator, *, empty_segments=True, repeated=True,
                       dtype=torch.float64, device="cpu"):
    """scale_infos of ``num_terms`` random terms with scales in [-1, 1) (tests and sweeps)."""
    index, rows = _random_terms((in_size, out_size), num_terms, generator, empty_segments, repeated)
    scale = torch.rand(num_terms, generator=generator, dtype=torch.float64) * 2 - 1
    return scale_infos(index.to(device), rows.to(device), scale.to(dtype=dtype, device=device), in_size, out_size)
