"""The sparse operator's core on CPU: infos, split Functions against the dense einsum reference in float64,
first and second derivatives, torch.func, torch.compile, bad infos and determinism.

Structures are random with empty output segments (in the forward and both backward groupings) and repeated
terms; inputs are batched [N, M, C...] or shared [M, C...].
"""
import dataclasses
import pytest
import torch

from attnbench.sparse import (CHANNEL_RANKS, SparseProductInfo, SparseScaleInfo, dense_scale_matrix, functional,
                              product_infos, product_terms, random_product_infos, random_scale_infos, scale_infos,
                              scale_terms, sparse_mul, sparse_outer, sparse_product, sparse_product_reference,
                              sparse_scale, sparse_scale_reference, sparse_vecmat)

from .helpers import CHANNELS, SHARING, check_compiled_pipeline, check_product_gradients_match_reference

OPS = list(CHANNEL_RANKS)
SIZE1, SIZE2, SIZE3, TERMS, BATCH = 5, 4, 6, 20, 2


def _random_infos(gather_backward):
    return random_product_infos(SIZE1, SIZE2, SIZE3, TERMS, torch.Generator().manual_seed(0),
                                gather_backward=gather_backward)


@pytest.fixture(scope="module")
def infos():
    """Backward infos through gather_index (the builder's default)."""
    return _random_infos(gather_backward=True)


@pytest.fixture(scope="module", params=["gather_backward", "sorted_backward"])
def infos_by_layout(request):
    """Both layouts of the backward infos, for the tests that use them (derivatives, rotations)."""
    return _random_infos(gather_backward=request.param == "gather_backward")


@pytest.fixture(scope="module")
def scale_info_pair():
    return random_scale_infos(5, 7, 12, torch.Generator().manual_seed(1))


def make_inputs(op, shared_x, shared_y, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    cx, cy = CHANNELS[op]

    def tensor(shared, size, channels):
        shape = ((() if shared else (BATCH,)) + (size,) + channels)
        return torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_(requires_grad)

    return tensor(shared_x, SIZE1, cx), tensor(shared_y, SIZE2, cy)


def sorted_terms(columns):
    """The multiset of terms as a sorted list of tuples, comparable across groupings."""
    return sorted(zip(*(column.tolist() for column in columns)))


# ---- structures


def test_random_structure_has_empty_segments_and_repeated_terms(infos_by_layout):
    infos = infos_by_layout
    info_fwd, info_bwd1, info_bwd2 = infos
    for info in infos:
        assert info.index_out.numel() < info.out_size, "every grouping should leave an output row empty"
        assert int(info.seg_out[-1]) == TERMS
    i1, i2, i3, _ = product_terms(info_fwd)
    pairs = list(zip(i1.tolist(), i2.tolist()))
    triples = list(zip(i1.tolist(), i2.tolist(), i3.tolist()))
    assert len(set(triples)) < len(triples), "some whole term should repeat"
    assert any(pairs.count(p) > 1 and len({t[2] for t in triples if t[:2] == p}) > 1 for p in pairs), \
        "some (i1, i2) pair should feed two outputs"


def test_backward_infos_are_the_rotated_terms(infos_by_layout):
    """bwd1 holds the terms as (i2, i3, i1, s), bwd2 as (i3, i1, i2, s): the same multiset."""
    infos = infos_by_layout
    info_fwd, info_bwd1, info_bwd2 = infos
    i1, i2, i3, s = product_terms(info_fwd)
    b1 = product_terms(info_bwd1)
    b2 = product_terms(info_bwd2)
    assert sorted_terms((b1[0], b1[1], b1[2], b1[3])) == sorted_terms((i2, i3, i1, s))
    assert sorted_terms((b2[0], b2[1], b2[2], b2[3])) == sorted_terms((i3, i1, i2, s))
    assert (info_bwd1.size1, info_bwd1.size2, info_bwd1.out_size) == (SIZE2, SIZE3, SIZE1)
    assert (info_bwd2.size1, info_bwd2.size2, info_bwd2.out_size) == (SIZE3, SIZE1, SIZE2)
    for info in infos:  # grouped by output: the positions of a segment all write its row
        assert torch.equal(info.term_out, info.index_out.repeat_interleave(info.seg_out.diff()))


def test_scale_infos_are_transposes(scale_info_pair):
    info_fwd, info_bwd = scale_info_pair
    torch.testing.assert_close(dense_scale_matrix(info_bwd), dense_scale_matrix(info_fwd).T, rtol=0, atol=0)
    index, rows, _ = scale_terms(info_fwd)
    assert (info_fwd.seg_out.diff() == 0).any(), "some output row should be empty"
    assert len(set(zip(index.tolist(), rows.tolist()))) < index.numel(), "some term should repeat"


# ---- values against the dense reference


@pytest.mark.parametrize("out_accumulated", [False, True])
@pytest.mark.parametrize("sharing", list(SHARING))
@pytest.mark.parametrize("op", OPS)
def test_product_matches_reference(infos, op, sharing, out_accumulated):
    x, y = make_inputs(op, *SHARING[sharing])
    z = sparse_product(op, x, y, infos, out_accumulated)
    expected = sparse_product_reference(op, x, y, infos[0], out_accumulated)
    assert z.shape == expected.shape
    torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rotation", [1, 2])
@pytest.mark.parametrize("op", ["mul", "vecmat"])
def test_rotated_infos_as_forward_match_reference(infos_by_layout, op, rotation):
    """A backward info used as the forward one, as the backward does (with gather_index in one fixture)."""
    infos = infos_by_layout
    rotated = infos[rotation:] + infos[:rotation]
    generator = torch.Generator().manual_seed(4)
    cx, cy = CHANNELS[op]
    x = torch.randn(BATCH, rotated[0].size1, *cx, dtype=torch.float64, generator=generator)
    y = torch.randn(rotated[0].size2, *cy, dtype=torch.float64, generator=generator)
    torch.testing.assert_close(sparse_product(op, x, y, rotated), sparse_product_reference(op, x, y, rotated[0]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 3), (2, 5, 3), (2, 3, 5, 1)])
def test_scale_matches_reference(scale_info_pair, shape):
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(sparse_scale(x, *scale_info_pair), sparse_scale_reference(x, scale_info_pair[0]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_sums_half_precision_in_float32(dtype):
    """1000 ones into one row: summed in bf16 the total sticks at 256 (256 + 1 rounds back to 256), summed in
    fp16 at 1000 only by luck of the spacing; both must give 1000 (exact in either dtype), as the kernels do."""
    n = 1000
    info, _ = scale_infos(torch.arange(n), torch.zeros(n, dtype=torch.int64), None, n, 1)
    assert functional.sparse_scale_split(torch.ones(2, n, 3, dtype=dtype), info).eq(n).all()
    product_info = SparseProductInfo(None, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                                     torch.tensor([0, n]), None, torch.tensor([0]), 1, 1, 1)
    z = functional.sparse_product_split("mul", torch.ones(2, 1, 3, dtype=dtype), torch.ones(2, 1, 3, dtype=dtype),
                                        product_info)
    assert z.dtype == dtype and z.eq(n).all()


def test_empty_structure_gives_zeros():
    empty = torch.zeros(0, dtype=torch.int64)
    infos = product_infos(empty, empty, empty, None, SIZE1, SIZE2, SIZE3)
    x, y = make_inputs("outer", False, True, requires_grad=True)
    z = sparse_outer(x, y, infos)
    assert z.shape == (BATCH, SIZE3, 3, 2) and not z.any()
    gx, gy = torch.autograd.grad(z.sum(), (x, y))
    assert gx.shape == x.shape and gy.shape == y.shape and not gx.any() and not gy.any()


# ---- derivatives (float64, through the Functions)


GRAD_CASES = [("batched", False), ("shared_x", True), ("shared_y", False), ("shared_both", False)]


@pytest.mark.parametrize("sharing,out_accumulated", GRAD_CASES)
@pytest.mark.parametrize("op", OPS)
def test_product_gradcheck_and_gradgradcheck(infos_by_layout, op, sharing, out_accumulated):
    infos = infos_by_layout
    x, y = make_inputs(op, *SHARING[sharing], requires_grad=True)

    def fn(a, b):
        return sparse_product(op, a, b, infos, out_accumulated)

    assert torch.autograd.gradcheck(fn, (x, y))
    assert torch.autograd.gradgradcheck(fn, (x, y))


def test_product_gradients_match_reference(infos):
    """The gradient of every op against autograd through the einsum reference, with a shared input (the split
    implementation; tests/sparse/test_segment.py: the same on Triton)."""
    check_product_gradients_match_reference(infos, make_inputs, OPS)


def test_scale_gradcheck_and_gradgradcheck(scale_info_pair):
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: sparse_scale(a, *scale_info_pair), (x,))
    assert torch.autograd.gradgradcheck(lambda a: sparse_scale(a, *scale_info_pair), (x,))


# ---- torch.func and torch.compile


def test_func_grad_and_vmap(infos):
    x, y = make_inputs("vecmat", False, True)
    scaling = random_scale_infos(SIZE3, 4, 10, torch.Generator().manual_seed(6))  # z [N, SIZE3, 2] -> [N, 4, 2]

    def loss(a, b):
        return sparse_scale(sparse_vecmat(a, b, infos), *scaling).square().sum()

    def loss_reference(a, b):
        return sparse_scale_reference(sparse_product_reference("vecmat", a, b, infos[0]), scaling[0]).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(x, y)
    expected = torch.func.grad(loss_reference, argnums=(0, 1))(x, y)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    # vmap over an extra leading dim of x, and per-sample gradients (vmap of grad)
    xs = torch.randn(3, *x.shape, dtype=torch.float64)
    zs = torch.func.vmap(lambda a: sparse_vecmat(a, y, infos))(xs)
    torch.testing.assert_close(zs, torch.stack([sparse_product_reference("vecmat", a, y, infos[0]) for a in xs]))
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(xs, y)
    torch.testing.assert_close(per_sample, torch.stack([torch.func.grad(loss_reference)(a, y) for a in xs]))
    # the backward's own derivative under functorch: the Jacobian of the gradient (reverse over reverse)
    hessian = torch.func.jacrev(torch.func.grad(loss))(x, y)
    torch.testing.assert_close(hessian, torch.func.jacrev(torch.func.grad(loss_reference))(x, y))


def test_torch_compile_fullgraph_forward_and_backward(infos):
    """Two ops in one graph, the second on the rotated infos (bwd1 as the forward: the gather_index path); the
    split implementation (tests/sparse/test_segment.py: the same graph on Triton)."""
    x, y = make_inputs("outer", False, True, requires_grad=True)
    w = torch.randn(BATCH, SIZE2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    check_compiled_pipeline(infos, x, y, w)


# ---- bad infos and bad arguments: a ValueError naming the field, before anything is computed


def _product_fields():
    i = torch.tensor([0, 1, 1, 2])
    return dict(scale=torch.ones(4, dtype=torch.float64), index1=i.clone(), index2=i.clone(),
                seg_out=torch.tensor([0, 1, 3, 4]), gather_index=None, index_out=torch.tensor([0, 2, 3]),
                out_size=4, size1=3, size2=3)


BAD_PRODUCT_FIELDS = {
    "index1 dtype": ("index1", dict(index1=torch.tensor([0, 1, 1, 2], dtype=torch.int32))),
    "index1 2-D": ("index1", dict(index1=torch.zeros(2, 2, dtype=torch.int64))),
    "index1 range": ("index1", dict(index1=torch.tensor([0, 1, 1, 3]))),
    "index1 negative": ("index1", dict(index1=torch.tensor([0, -1, 1, 2]))),
    "index2 length": ("index2", dict(index2=torch.tensor([0, 1, 2]))),
    "index2 range": ("index2", dict(index2=torch.tensor([0, 1, 5, 2]))),
    "scale length": ("scale", dict(scale=torch.ones(3))),
    "scale dtype": ("scale", dict(scale=torch.ones(4, dtype=torch.int64))),
    "seg_out start": ("seg_out", dict(seg_out=torch.tensor([1, 1, 3, 4]))),
    "seg_out end": ("seg_out", dict(seg_out=torch.tensor([0, 1, 3, 3]))),
    "seg_out order": ("seg_out", dict(seg_out=torch.tensor([0, 3, 1, 4]))),
    "seg_out length": ("seg_out", dict(seg_out=torch.tensor([0, 4]))),
    "index_out repeated": ("index_out", dict(index_out=torch.tensor([0, 2, 2]))),
    "index_out range": ("index_out", dict(index_out=torch.tensor([0, 2, 4]))),
    "gather_index range": ("gather_index", dict(gather_index=torch.tensor([0, 1, 2, 4]))),
    "gather_index dtype": ("gather_index", dict(gather_index=torch.tensor([0., 1., 2., 3.]))),
    "out_size negative": ("out_size", dict(out_size=-1)),
    "out_size type": ("out_size", dict(out_size=4.0)),
    "size1 type": ("size1", dict(size1=torch.tensor(3))),
}


@pytest.mark.parametrize("case", list(BAD_PRODUCT_FIELDS))
def test_bad_product_info_names_the_field(case):
    field, change = BAD_PRODUCT_FIELDS[case]
    SparseProductInfo(**_product_fields())  # the unchanged fields are valid
    with pytest.raises(ValueError, match=field):
        SparseProductInfo(**{**_product_fields(), **change})


BAD_SCALE_FIELDS = {
    "index range": ("index", dict(index=torch.tensor([0, 3, 1]))),
    "index dtype": ("index", dict(index=torch.tensor([0, 1, 1], dtype=torch.int32))),
    "scale length": ("scale", dict(scale=torch.ones(2))),
    "seg_out length": ("seg_out", dict(seg_out=torch.tensor([0, 3]))),
    "seg_out order": ("seg_out", dict(seg_out=torch.tensor([0, 2, 1, 3]))),
    "in_size": ("in_size", dict(in_size=-2)),
}


@pytest.mark.parametrize("case", list(BAD_SCALE_FIELDS))
def test_bad_scale_info_names_the_field(case):
    field, change = BAD_SCALE_FIELDS[case]
    fields = dict(scale=torch.ones(3), index=torch.tensor([0, 2, 1]), seg_out=torch.tensor([0, 1, 1, 3]),
                  out_size=3, in_size=3)
    SparseScaleInfo(**fields)
    with pytest.raises(ValueError, match=field):
        SparseScaleInfo(**{**fields, **change})


def test_builders_name_the_bad_argument():
    i = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="i2"):
        product_infos(i, torch.tensor([0, 1]), i, None, 3, 3, 3)
    with pytest.raises(ValueError, match="i3"):
        product_infos(i, i, torch.tensor([0, 1, 3]), None, 3, 3, 3)
    with pytest.raises(ValueError, match="size1"):
        product_infos(i, i, i, None, 2, 3, 3)
    with pytest.raises(ValueError, match="rows"):
        scale_infos(i, torch.tensor([0, 1, 5]), None, 3, 3)


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if a split implementation runs: a bad argument must be rejected before."""
    def refuse(*args, **kwargs):
        raise AssertionError("computed before the arguments were checked")
    monkeypatch.setattr(functional, "sparse_product_split", refuse)
    monkeypatch.setattr(functional, "sparse_scale_split", refuse)


def test_bad_arguments_raise_before_computing(infos, scale_info_pair, no_compute):
    x, y = make_inputs("mul", False, False)
    with pytest.raises(AssertionError, match="computed"):  # the guard works: valid arguments reach the compute
        sparse_product("mul", x, y, infos)
    other = random_product_infos(SIZE1, SIZE2, SIZE3 + 1, TERMS, torch.Generator().manual_seed(5))
    cases = [
        (ValueError, "info_bwd1", (x, y, (infos[0], other[1], infos[2]))),
        (ValueError, "info_bwd2", (x, y, (infos[0], infos[1], other[2]))),
        (TypeError, "infos", (x, y, infos[:2])),
        (ValueError, "size1", (x[:, :-1], y, infos)),
        (ValueError, "size2", (x, y[..., :-1, :], infos)),
        (ValueError, "batch sizes", (x, y[:1], infos)),
        (ValueError, "channel dims", (x, y[..., :2], infos)),
        (ValueError, "shape", (x.unsqueeze(0), y, infos)),
        (TypeError, "dtype", (x.float(), y, infos)),
        (ValueError, "device", (x.to("meta"), y, infos)),
    ]
    for error, match, (a, b, structure) in cases:
        with pytest.raises(error, match=match):
            sparse_product("mul", a, b, structure)
    with pytest.raises(ValueError, match="unknown sparse product"):
        sparse_product("matmul", x, y, infos)
    with pytest.raises(ValueError, match="in_size"):
        sparse_scale(torch.randn(2, 4, 3, dtype=torch.float64), *scale_info_pair)
    with pytest.raises(ValueError, match="transpose"):
        sparse_scale(torch.randn(2, 5, 3, dtype=torch.float64), scale_info_pair[0], scale_info_pair[0])


# ---- determinism


@pytest.mark.parametrize("op", OPS)
def test_non_accumulating_path_is_deterministic(infos, op):
    def run():
        x, y = make_inputs(op, False, True, seed=3, requires_grad=True)
        z = sparse_product(op, x, y, infos)
        weight = torch.linspace(-1, 1, z.numel(), dtype=z.dtype).view_as(z)
        return (z, *torch.autograd.grad((z * weight).sum(), (x, y)))

    for first, second in zip(run(), run()):
        assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_scale_reference_past_the_dense_cap_is_the_same_function(monkeypatch, dtype):
    """A scale matrix past DENSE_SCALE_ENTRIES (the sweep's N 1e6 segment sum: 465 GiB dense) runs as torch's sparse
    matmul of the same coefficients: equal to the dense einsum, forward and both derivatives, with repeated terms,
    empty rows and leading batch dims (float64 to rounding; bf16 x: fp32 sums rounded once, so within one bf16
    rounding of the float64 result, where the dense bf16 einsum on the CPU may round more often)."""
    from attnbench.sparse import reference

    info = random_scale_infos(23, 11, 60, torch.Generator().manual_seed(3))[0]
    assert (info.seg_out.diff() == 0).any(), "an output row without terms"
    gen = torch.Generator().manual_seed(4)
    x, g, h = (torch.randn(shape, generator=gen, dtype=torch.float64).bfloat16().double()  # exact in bf16 too
               for shape in ((2, 23, 5), (2, 11, 5), (2, 23, 5)))

    def derivatives(t, info=info):
        xs, gs = x.to(t).requires_grad_(), g.to(t).requires_grad_()
        z = sparse_scale_reference(xs, info)
        grad_x, = torch.autograd.grad(z, xs, gs, create_graph=True)
        ggrad_g, = torch.autograd.grad(grad_x, gs, h.to(t))
        return z.detach(), grad_x.detach(), ggrad_g

    # the dense route rounds each term's scale to x's dtype: so must this one
    exact = derivatives(torch.float64, dataclasses.replace(info, scale=info.scale.to(dtype).double()))
    built = []
    monkeypatch.setattr(reference, "DENSE_SCALE_ENTRIES", 0)
    monkeypatch.setattr(reference, "sparse_scale_matrix",
                        lambda *a, build=reference.sparse_scale_matrix: built.append(1) or build(*a))
    monkeypatch.setattr(reference, "dense_scale_matrix", None)  # the dense route must not run
    for out, want in zip(derivatives(dtype), exact):
        assert out.dtype == dtype and want.abs().max() > 0
        if dtype == torch.float64:
            torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-13)
        else:  # one rounding of the exact value: |out - exact| <= 2**-8 |exact| elementwise
            assert ((out.double() - want).abs() <= 2.0 ** -8 * want.abs()).all()
    assert built == [1], "the sparse route ran (its derivatives are torch's, through the same matrix)"


def test_infos_of_another_structure_or_role_are_refused():
    """Backward infos of another structure with the same sizes, or this structure's infos in another order, pass
    every size check and gave wrong gradients (grad_x off by 3.6 on a random structure): refused now; the rotated
    triples the backward passes its siblings still run (the gradient check below)."""
    gen = torch.Generator().manual_seed(0)
    a = random_product_infos(3, 3, 3, 8, gen, empty_segments=False)
    b = random_product_infos(3, 3, 3, 8, gen, empty_segments=False)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    for infos, match in [((a[0], a[2], a[1]), "another role"), ((a[0], b[1], a[2]), "not built with info_fwd"),
                         ((a[0], a[1], b[2]), "not built with info_fwd")]:
        with pytest.raises(ValueError, match=match):
            sparse_mul(x, y, infos)
    s, t = random_scale_infos(5, 4, 9, gen), random_scale_infos(5, 4, 9, gen)
    with pytest.raises(ValueError, match="not built with info_fwd"):
        sparse_scale(torch.randn(5, 3, dtype=torch.float64), s[0], t[1])
    # hand-built infos carry no structure: their sizes are all that can be checked, and they still run
    hand = tuple(dataclasses.replace(info) for info in a)
    assert torch.autograd.gradcheck(lambda u, v: sparse_mul(u, v, hand), (x, y))
    assert torch.autograd.gradgradcheck(lambda u, v: sparse_mul(u, v, a), (x, y))


def test_a_copy_with_other_terms_is_refused_and_one_with_the_same_terms_runs():
    """dataclasses.replace on a built info had copied its structure tag onto other terms: the forward used the new
    scales and the backward the old ones (grad_x off by 0.67 relative, no error). A copy carries no tag now, so the
    ops compare its terms with its siblings'; hand-built triples are tagged once their terms agree."""
    i1, i2, i3 = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([1, 0, 2, 1, 2]), torch.tensor([0, 1, 1, 0, 1])
    infos = product_infos(i1, i2, i3, torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5], dtype=torch.float64), 3, 3, 2)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    tripled = dataclasses.replace(infos[0], scale=infos[0].scale * 3)
    assert tripled.structure is None
    for trio, bad in [((tripled, infos[1], infos[2]), "info_bwd1"), ((infos[1], infos[2], tripled), "info_bwd2"),
                      ((infos[0], dataclasses.replace(infos[1], scale=infos[1].scale.flip(0)), infos[2]),
                       "info_bwd1")]:
        with pytest.raises(ValueError, match=f"{bad} does not hold .* terms"):
            sparse_mul(x, y, trio)
    copies = tuple(dataclasses.replace(info) for info in infos)  # the same terms: they run, and are right
    assert torch.autograd.gradcheck(lambda u, v: sparse_mul(u, v, copies), (x, y))
    assert copies[0].structure is not None and copies[0].structure[0] == copies[2].structure[0]
    mixed = (dataclasses.replace(infos[0]), infos[1], infos[2])  # untagged beside tagged: compared each call
    assert torch.autograd.gradgradcheck(lambda u, v: sparse_mul(u, v, mixed), (x, y))
    assert mixed[0].structure is None and infos[1].structure[0] == infos[0].structure[0]
    s = random_scale_infos(5, 4, 9, torch.Generator().manual_seed(2))
    doubled = dataclasses.replace(s[0], scale=2 * s[0].scale)
    with pytest.raises(ValueError, match="info_bwd does not hold"):
        sparse_scale(torch.randn(5, 3, dtype=torch.float64), doubled, s[1])


@pytest.mark.parametrize("field", ["scale", "index1", "index2", "seg_out", "gather_index", "index_out"])
def test_terms_modified_in_place_are_refused(field):
    """The derived tables and the sibling infos were built from the terms: a term tensor changed in place
    afterwards (the caller's scale, which the backward infos share, included) would split forward and backward."""
    infos = random_product_infos(3, 3, 3, 8, torch.Generator().manual_seed(3), empty_segments=False)
    x, y = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    sparse_mul(x, y, infos)
    holder = next(i for i in infos if getattr(i, field) is not None)
    getattr(holder, field).add_(0)  # any in-place op, even one that changes no value
    with pytest.raises(ValueError, match=rf"\.{field} was modified in place"):
        sparse_mul(x, y, infos)
    s = random_scale_infos(5, 4, 9, torch.Generator().manual_seed(4))
    s[1].index.add_(0)
    with pytest.raises(ValueError, match=r"info_bwd\.index was modified in place"):
        sparse_scale(torch.randn(5, 3, dtype=torch.float64), *s)


def test_untagged_infos_under_torch_compile_are_refused_until_verified():
    """Under torch.compile the terms cannot be compared inside the graph: untagged infos are refused with the way
    out, verify_structure, which tags them (and refuses a copy with other terms)."""
    from attnbench.sparse import verify_structure

    infos = random_product_infos(3, 3, 3, 8, torch.Generator().manual_seed(5), empty_segments=False)
    x, y = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    copies = tuple(dataclasses.replace(info) for info in infos)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="verify_structure"):
        torch.compile(lambda a, b: sparse_mul(a, b, copies), backend="aot_eager", fullgraph=True)(x, y)
    verify_structure(*copies)
    compiled = torch.compile(lambda a, b: sparse_mul(a, b, copies), backend="aot_eager", fullgraph=True)(x, y)
    torch.testing.assert_close(compiled, sparse_mul(x, y, infos), rtol=0, atol=0)
    with pytest.raises(ValueError, match="info_bwd1 does not hold"):
        verify_structure(copies[0], dataclasses.replace(infos[1], scale=-infos[1].scale), copies[2])


def test_the_functions_check_their_arguments_when_applied_directly():
    """SparseScale, SparseMul, ... are public: `.apply` gets the wrappers' errors before any kernel (it had read
    out of bounds on the Triton path, and returned garbage)."""
    gen = torch.Generator().manual_seed(1)
    s = random_scale_infos(5, 4, 9, gen)
    with pytest.raises(ValueError, match="in_size=5"):
        functional.SparseScale.apply(torch.randn(2, 3, dtype=torch.float64), *s)
    infos = random_product_infos(3, 4, 5, 10, gen)
    x, y = torch.randn(2, 3, 3, dtype=torch.float64), torch.randn(2, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="channel dims"):
        functional.SparseMul.apply(x, y, *infos, False)
    with pytest.raises(TypeError, match="one dtype"):
        functional.SparseMul.apply(x, y[..., :1].expand(2, 4, 3).float(), *infos, False)


def test_a_scale_that_requires_grad_is_refused():
    """The ops hold an info's scales constant: a scale with requires_grad got no gradient, silently."""
    scale = torch.rand(4, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="scale requires grad"):
        product_infos(index, index, index.flip(0), scale, 3, 3, 3)
    with pytest.raises(ValueError, match="scale requires grad"):
        scale_infos(index, index, scale, 3, 3)
    product_infos(index, index, index.flip(0), scale.detach(), 3, 3, 3)  # detached: fine
