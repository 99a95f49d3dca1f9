"""The sparse operator in the registry: case sets, cost model, and every tiny case x mode x variant that runs on
the CPU against the float64 oracle (reference, split, triton through the interpreter; torch_csr on the scale
cases)."""
import importlib.util
import math

import pytest
import torch

import attnbench
from attnbench.bench import runner
from attnbench.cli import main
from attnbench.operators.sparse import (ANCHOR_C, ANCHOR_L, ANCHOR_N, LAYER_BYTE_CAP, OPS, SWEEP_BYTE_CAP, SparseCase,
                                        num_terms, peers, work_terms)
from attnbench.bench.registry import Unsupported

OP = attnbench.get("sparse")


@pytest.mark.parametrize("set_name", ["tiny", "gpu", "anchor", "layer", "sweep"])
def test_case_sets_non_empty_with_unique_labels(set_name):
    cases = OP.cases(set_name)
    labels = [c.label for c in cases]
    assert cases and len(set(labels)) == len(labels)
    with pytest.raises(ValueError, match="bogus"):
        OP.cases("bogus")


def test_label_names_what_matters():
    assert SparseCase("vecsca", 3, 100000, 32).label == "vecsca L3 N100000 C32 fp32"
    assert SparseCase("vecmat", 2, 10, 4, "bfloat16", "y").label == "vecmat L2 N10 C4 shared-y bf16"
    assert SparseCase("scale", 2, 10, 4, structure="random").label == "scale-rand L2 N10 C4 fp32"
    with pytest.raises(ValueError):
        SparseCase("scale", 2, 10, 4, shared="x")
    with pytest.raises(ValueError):
        SparseCase("conv", 2, 10, 4)


def test_tiny_set_covers_every_op_cheaply():
    cases = OP.cases("tiny")
    assert {c.op for c in cases} == set(OPS)
    assert {c.structure for c in cases if c.is_scale} == {"segment", "random"}
    assert {c.shared for c in cases} == {"", "x", "y"} and {c.dtype for c in cases} == {"float32", "float64"}
    assert all(c.l_max <= 2 and c.batch <= 5 and c.channels <= 8 for c in cases) and len(cases) <= 24


def test_anchor_is_the_issues_grid_and_the_sweep_respects_the_cap():
    anchor = OP.cases("anchor")
    assert {c.op for c in anchor} == {"vecsca", "vecmat", "scale"}
    assert {c.l_max for c in anchor} == set(ANCHOR_L) and {c.channels for c in anchor} == set(ANCHOR_C)
    assert {c.batch for c in anchor} == set(ANCHOR_N) and {c.dtype for c in anchor} == {"float32", "bfloat16"}
    assert all(c.shared == "y" for c in anchor if c.op == "vecmat")
    sweep = OP.cases("sweep")
    assert all(c.tensor_bytes <= SWEEP_BYTE_CAP for c in sweep)
    assert {c.op for c in sweep} == set(OPS) - {"fc"} and 1_000_000 in {c.batch for c in sweep}  # the layer: "layer"
    assert {c.label for c in anchor if c.tensor_bytes <= SWEEP_BYTE_CAP} <= {c.label for c in sweep}


@pytest.mark.parametrize("case", OP.cases("tiny") + OP.cases("anchor")[::7], ids=lambda c: c.label)
def test_cost_model(case):
    item = case.torch_dtype.itemsize
    inputs = (case.numel("x") + case.numel("y")) * item
    for mode in OP.modes:
        assert OP.flops(case, mode) > 0 and OP.bytes(case, mode) > 0
    assert OP.bytes(case, "fwd") >= inputs + case.numel("z") * item
    assert OP.bytes(case, "bwd") >= inputs + case.numel("z") * item  # x, y and g read
    assert OP.bytes(case, "double_bwd") >= OP.bytes(case, "fwd")
    forward = OP.flops(case, "fwd")
    if case.is_scale:
        assert forward == 2 * num_terms(case) * case.width == OP.flops(case, "bwd") == OP.flops(case, "double_bwd")
    elif case.is_layer:  # its own product counts (test_the_layers_product_counts_are_what_autograd_launches)
        assert OP.flops(case, "bwd") == 2 * forward and OP.flops(case, "double_bwd") > 4 * forward
        assert OP.bytes(case, "fwd") >= inputs + (case.numel("w") + case.numel("z")) * item
    else:
        assert OP.flops(case, "bwd") == 2 * forward and OP.flops(case, "double_bwd") == 4 * forward
        matrix_operand = case.op in ("outer", "vecmat", "mat_t_vec")  # C x C channel work per term
        assert forward == 2 * work_terms(case) * case.batch * case.channels ** (2 if matrix_operand else 1)


def test_cost_model_counts_a_shared_weight_by_its_folded_pairs():
    """vecmat with y shared (mat_t_vec with x shared) folds the terms of each (output row, batched row) pair into one
    C x C block of the weight: CG L 6 has 11896 terms in 2401 pairs (49 x 49), L 2 137 in 81; unshared, or with the
    vector operand shared, every term counts."""
    for op, shared in (("vecmat", "y"), ("mat_t_vec", "x")):
        for l_max, terms, pairs in ((2, 137, 81), (6, 11896, 2401)):
            case = SparseCase(op, l_max, 10, 4, "float32", shared)
            assert num_terms(case) == terms and work_terms(case) == pairs
            assert OP.flops(case, "fwd") == 2 * pairs * 16 * 10
    for op, shared in (("vecmat", ""), ("vecmat", "x"), ("mat_t_vec", "y"), ("outer", "")):
        case = SparseCase(op, 6, 10, 4, "float32", shared)
        assert work_terms(case) == num_terms(case) == 11896


def test_the_layer_set_and_its_cost_model():
    """fc: FullyConnectedTensorProduct with the weight an input, on the anchor grid under a 4 GiB cap that counts the
    coupled features u. L2 has 15 paths whose 51 coupled rows (2 l3 + 1 a path) the coupling's 137 CG terms fill (as
    vecsca's), each row then a C x C product with its path's weight block: fwd = 2 N (137 C + 51 C^2); bwd twice
    that; double bwd 6 coupling and 4 mixing products (counted in the next test); the weight [15, C, C] read (and its
    gradient written) as x."""
    layer = OP.cases("layer")
    assert {c.op for c in layer} == {"fc"} and all(c.tensor_bytes <= LAYER_BYTE_CAP for c in layer)
    assert {c.l_max for c in layer} == set(ANCHOR_L) and {"fc L2 N100000 C128 fp32", "fc L6 N10000 C128 bf16"} <= {
        c.label for c in layer} and "fc L6 N100000 C128 fp32" not in {c.label for c in layer}  # u: 73 GB
    case = SparseCase("fc", 2, 10, 4)
    assert case.shape("w") == (15, 4, 4) and case.shape("y") == (10, 9) and case.shape("z") == (10, 9, 4)
    assert OP.flops(case, "fwd") == 2 * 10 * (137 * 4 + 51 * 16)
    assert OP.flops(case, "bwd") == 2 * OP.flops(case, "fwd")
    assert OP.flops(case, "double_bwd") == 2 * 10 * (6 * 137 * 4 + 4 * 51 * 16)
    x, y, w, z, u = 360 * 4, 90 * 4, 240 * 4, 360 * 4, 10 * 51 * 4 * 4  # u: N x U x C floats
    assert OP.bytes(case, "fwd") == x + y + w + z + (137 + 51) * 32 and num_terms(case) == 137 + 51
    assert OP.bytes(case, "double_bwd") == 3 * (x + w) + 3 * y + 2 * z + (6 * 137 + 4 * 51) * 32
    assert OP.design_bytes(case, "bwd") == 2 * (x + y + u) + 2 * (u + w + z) + 2 * (137 + 51) * 32
    with pytest.raises(ValueError):
        SparseCase("fc", 2, 10, 4, shared="y")
    with pytest.raises(ValueError, match="two products"):
        work_terms(case)


def test_the_layers_product_counts_are_what_autograd_launches(monkeypatch):
    """LAYER_PRODUCTS against the Functions autograd actually calls over the layer, mode by mode."""
    import collections

    from attnbench.operators.sparse import LAYER_PRODUCTS, _forward, evaluate
    from attnbench.sparse import functional

    coupling_family = {"vecsca", "scavec", "inner"}
    counts = collections.Counter()
    case = SparseCase("fc", 1, 3, 2, "float64")
    inputs = OP.make_inputs(case, "cpu")
    for name, cls in functional.PRODUCT_FUNCTIONS.items():
        def counted(*args, _apply=cls.apply, _name=name):
            counts.update([_name])
            return _apply(*args)
        monkeypatch.setattr(cls, "apply", counted)
    for mode in OP.modes:
        run = evaluate(case, inputs, _forward(case, inputs["infos"], lambda: functional.use_implementation("split")),
                       mode)
        counts.clear()
        run()
        coupling = sum(n for op, n in counts.items() if op in coupling_family)
        assert (coupling, sum(counts.values()) - coupling) == (
            LAYER_PRODUCTS["coupling"][mode], LAYER_PRODUCTS["mixing"][mode]), (mode, counts)


def test_cost_model_numbers():
    """vecsca L2 (137 CG terms), N 10, C 4, fp32: x 10x9x4, y 10x9, z 10x9x4 floats."""
    case = SparseCase("vecsca", 2, 10, 4)
    assert num_terms(case) == 137
    assert OP.flops(case, "fwd") == 2 * 137 * 4 * 10
    x, y, z = 360 * 4, 90 * 4, 360 * 4
    assert OP.bytes(case, "fwd") == x + y + z + 137 * 32
    assert OP.bytes(case, "double_bwd") == 3 * x + 3 * y + 2 * z + 4 * 137 * 32


def test_make_inputs_shapes_and_seed():
    case = SparseCase("vecmat", 2, 3, 4, shared="y")
    x = OP.make_inputs(case, "cpu", seed=1)
    assert x["x"].shape == (3, 9, 4) and x["y"].shape == (9, 4, 4) and x["g"].shape == (3, 9, 4)
    assert x["h_y"].shape == (9, 4, 4)
    assert torch.equal(x["x"], OP.make_inputs(case, "cpu", seed=1)["x"])
    assert not torch.equal(x["x"], OP.make_inputs(case, "cpu", seed=2)["x"])
    scale = SparseCase("scale", 1, 40, 2)
    s = OP.make_inputs(scale, "cpu")
    assert s["x"].shape == (40, 8) and s["g"].shape == (2, 8) and s["y"] is None and "h_y" not in s
    assert OP.case_outputs(scale, "double_bwd") == ("ggrad_g",)
    assert OP.case_outputs(case, "double_bwd") == OP.outputs("double_bwd") == ("ggrad_x", "ggrad_y", "ggrad_g")


# the tiny set's checks in parts the gate's workers share (135 s as one test): the peers per dtype (every mode), Triton's
# forward on fp32, and Triton on each fp64 case, a mode a part (vecmat L2's three modes took 72 s as one part on CI)
TINY_PARTS = ([("peers", dtype, None, None) for dtype in ("float32", "float64")] + [("triton", "float32", None, "fwd")]
              + [("triton", "float64", c.label, mode) for c in OP.cases("tiny") if c.dtype == "float64"
                 for mode in OP.modes])


@pytest.mark.parametrize("group,dtype,label,mode", TINY_PARTS, ids=lambda v: v or "all")
def test_every_tiny_case_mode_and_variant_passes_on_cpu(group, dtype, label, mode):
    """Every variant, case and mode, except that the Triton variant's backward and double backward (four
    interpreted launches each) are checked on the fp64 half of the tiny set: those took 5 of the CPU gate's 14
    minutes on both halves. tests/sparse/test_segment.py checks every op's derivatives through the kernels in fp32
    too."""
    tiny = [c for c in OP.cases("tiny") if c.dtype == dtype and label in (None, c.label)]
    assert tiny
    peers_here = list(OP.available_variants("cpu"))
    if group == "peers":
        results = runner.check(OP, tiny, "cpu", variants=[n for n in OP.variants if n != "triton"], progress=False)
    else:
        results = runner.check(OP, tiny, "cpu", variants=["triton"], modes=[mode], progress=False)
    failed = [(r.case, r.mode, r.variant, [o.detail for o in r.outputs if not o.passed]) for r in results
              if not r.skipped and not r.passed]
    assert not failed
    ran = {(r.variant, r.case, r.mode) for r in results if r.passed}
    for case in tiny:
        for checked in OP.modes:
            if group == "peers":
                assert all((v, case.label, checked) in ran for v in ("reference", "split"))
                assert (("torch_csr", case.label, checked) in ran) == case.is_scale
                if "cuequivariance" in peers_here:  # the tensor products, not SparseScale
                    assert (("cuequivariance", case.label, checked) in ran) == (not case.is_scale)
            else:
                assert (("triton", case.label, checked) in ran) == (checked == mode)
    skipped = {r.skipped for r in results if r.skipped}
    if group == "peers":
        declines = ("torch_csr: only SparseScale", "cuequivariance: SparseScale is a sparse matrix")
        assert skipped and all(any(d in s for d in declines) for s in skipped), skipped
    else:
        assert not skipped


@pytest.mark.parametrize("mode", ["fwd", "bwd", "double_bwd"])
def test_split_variant_runs_split_where_triton_is_the_default(monkeypatch, mode):
    """On CUDA tensors the Functions default to the Triton kernels: the split baseline must force its own
    implementation (a first GPU run timed Triton twice, once under the name "split")."""
    from attnbench.sparse import functional

    def no_triton(*args, **kwargs):
        raise AssertionError("the split variant launched a Triton kernel")

    monkeypatch.setattr(functional, "implementation_for", lambda x: functional._implementation or "triton")
    monkeypatch.setattr(functional, "sparse_product_triton", no_triton)
    monkeypatch.setattr(functional, "sparse_scale_triton", no_triton)
    op = attnbench.get("sparse")
    for case in [c for c in op.cases("tiny") if c.op in ("vecsca", "scale")][:2]:
        x = op.make_inputs(case, "cpu")
        op.variants["split"].prepare(case, x, mode)()


def test_double_backward_is_not_trivially_zero():
    case = SparseCase("vecsca", 1, 3, 2)
    out = OP.oracle(case, OP.make_inputs(case, "cpu"))
    assert all(out[k].abs().sum() > 0 for k in ("ggrad_x", "ggrad_y", "ggrad_g"))


def test_torch_csr_declines_what_it_cannot_do():
    case = SparseCase("vecsca", 1, 3, 2)
    with pytest.raises(Unsupported, match="only SparseScale"):
        peers.torch_csr_prepare(case, OP.make_inputs(case, "cpu"), "fwd")
    bf16 = SparseCase("scale", 1, 5, 2, "bfloat16")
    with pytest.raises(Unsupported, match="BFloat16"):  # CPU: no bf16 CSR matmul (addmm_out_sparse_csr_impl_mkl)
        peers.torch_csr_prepare(bf16, OP.make_inputs(bf16, "cpu"), "fwd")


@pytest.mark.skipif(importlib.util.find_spec("e3nn") is not None, reason="e3nn is installed")
def test_e3nn_unavailable_says_why():
    assert "e3nn is not installed" in OP.variants["e3nn"].unavailable_reason(torch.device("cpu"))
    assert "e3nn" not in OP.available_variants("cpu")


def test_e3nn_layout_round_trip():
    t = torch.randn(3, 16, 5)
    flat = peers._to_e3nn(t, 3)
    assert flat.shape == (3, 80) and torch.equal(flat[:, 5:8], t[:, 1:4, 0])  # l=1, channel 0, m = -1..1
    assert torch.equal(peers._from_e3nn(flat, 3, 5), t)


def test_cli_lists_sparse(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "sparse" in out and "torch_csr" in out
    assert math.isfinite(OP.flops(OP.cases("tiny")[0], "fwd"))


@pytest.mark.parametrize("short_of", ["oracle", "make_inputs"])
def test_a_case_out_of_memory_is_kept_and_the_run_goes_on(monkeypatch, short_of):
    """The sweep's N 1e6 scale case once built a 465 GiB dense oracle: the OutOfMemoryError ended the whole
    `attnbench run`. Now a case whose inputs or oracle run out of memory keeps its check rows, skipped with the
    reason; its bench rows are timed and marked unverified (the oracle) or skipped (the inputs); the cases after
    it run."""
    from attnbench.bench.tables import bench_table, summary_line

    cases = [c for c in OP.cases("tiny") if c.is_scale][:2]
    original = getattr(OP, short_of)

    def short_of_memory(case, *args, **kwargs):
        if case == cases[0]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(case, *args, **kwargs)

    monkeypatch.setattr(OP, short_of, short_of_memory)
    checked = runner.check(OP, cases, "cpu", variants=["split"], progress=False)
    assert [(r.case, r.skipped) for r in checked if r.skipped] == [
        (cases[0].label, "inputs or oracle out of memory")] * len(OP.modes)
    assert all(r.passed for r in checked if r.case == cases[1].label) and len(checked) == 2 * len(OP.modes)

    rows = runner.bench(OP, cases, "cpu", variants=["split"], modes=["fwd"], progress=False)
    assert [r.case for r in rows] == [cases[0].label, cases[1].label]
    assert not rows[1].unverified and not rows[1].skipped and rows[1].max_error < 1e-6  # fp32 against float64
    assert rows[0].skipped == ("inputs out of memory" if short_of == "make_inputs" else "")
    if short_of == "oracle":  # timed, no error figure, and said so in the table and the summary
        assert rows[0].timing and math.isnan(rows[0].max_error) and "oracle ran out of memory" in rows[0].unverified
        table = bench_table(rows, lambda case: 1e-3)
        assert "unverified [1]" in table and "[1] not verified: the float64 oracle ran out of memory" in table
        summary = summary_line(bench_rows=rows)  # "noisy" may come between on a loaded CPU
        assert summary.startswith("summary: bench 2 timed, 0 skipped") and summary.endswith(", 1 unverified")
    else:
        assert rows[0].timing is None and not rows[0].unverified


def test_the_layer_runs_on_the_routes_of_its_products():
    """The forced routes that change one of the layer's products take it (the dense routes its coupling, a vecsca;
    the unfolded route its mixing, a vecmat with the weight shared) and pass against float64 in every mode; the
    16-bit fold routes need CUDA."""
    case = SparseCase("fc", 1, 3, 2, "float64")
    routes = ["triton@two-launch", "triton@fused-dense", "triton@channelwise", "triton@gather-kernel", "triton@unfolded",
              "triton@segment"]
    results = runner.check(OP, [case], "cpu", variants=routes, progress=False)
    assert {(r.variant, r.mode) for r in results if r.passed and not r.skipped} == {
        (v, m) for v in routes for m in OP.modes}
