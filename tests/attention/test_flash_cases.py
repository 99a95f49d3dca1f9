"""flash's case sets, cost model (FLOPs, bytes), seeded inputs, modes, the variants that run on this machine and
case labels."""
import pytest
import torch

from attnbench.operators.flash import FlashCase


# ---------------------------------------------------------------- case sets

# ids are spelled out so that no test id reads as a marker name
@pytest.mark.parametrize("set_name", ["tiny", "gpu", "anchor", "sweep", "decode", "random"], ids=lambda s: f"set_{s}")
def test_case_sets_non_empty_with_unique_labels(flash, set_name):
    cases = flash.cases(set_name)
    assert cases
    labels = [c.label for c in cases]
    assert len(set(labels)) == len(labels)
    assert all(isinstance(c, FlashCase) for c in cases)


def test_case_sets_match_declared(flash):
    assert set(flash.case_sets) == {"tiny", "gpu", "anchor", "sweep", "decode", "odd", "random", "host"}


def test_unknown_case_set_raises(flash):
    with pytest.raises(ValueError, match="bogus"):
        flash.cases("bogus")


# ---------------------------------------------------------------- cost model

def _brute_force_pairs(nq, nk, causal):
    if causal is None:
        return nq * nk
    offset = 0 if causal == "top_left" else nk - nq
    return sum(1 for i in range(nq) for j in range(nk) if j <= i + offset)


def test_flops_non_causal(flash):
    c = FlashCase(2, 6, 3, 37, 29, 24, None, "float16")
    fwd = 4 * 2 * 6 * 37 * 29 * 24
    assert flash.flops(c, "fwd") == fwd
    assert flash.flops(c, "bwd") == pytest.approx(2.5 * fwd)
    assert flash.flops(c, "fwd_bwd") == pytest.approx(3.5 * fwd)


def test_flops_causal_top_left_square(flash):
    n = 19
    c = FlashCase(1, 2, 2, n, n, 32, "top_left", "float32")
    assert c.visible_pairs == n * (n + 1) // 2
    assert flash.flops(c, "fwd") == 4 * 1 * 2 * (n * (n + 1) // 2) * 32


def test_flops_causal_bottom_right_square_equals_top_left(flash):
    tl = FlashCase(1, 2, 2, 33, 33, 16, "top_left", "float32")
    br = FlashCase(1, 2, 2, 33, 33, 16, "bottom_right", "float32")
    assert flash.flops(tl, "fwd") == flash.flops(br, "fwd")


@pytest.mark.parametrize("nq, nk, causal", [
    (40, 23, "bottom_right"),  # Nq > Nk: the first 17 rows see no key
    (20, 50, "bottom_right"),
    (33, 17, "top_left"),
    (17, 33, "top_left"),
    (1, 70, "bottom_right"),
    (70, 1, "bottom_right"),
    (37, 29, None),
])
def test_visible_pairs_brute_force(flash, nq, nk, causal):
    c = FlashCase(2, 4, 2, nq, nk, 16, causal, "float16")
    pairs = _brute_force_pairs(nq, nk, causal)
    assert c.visible_pairs == pairs
    assert flash.flops(c, "fwd") == 4 * 2 * 4 * pairs * 16


def test_visible_pairs_closed_form_at_any_offset():
    """kernels.tiling.visible_pairs (the cost model's and the forward route rule's count) against counting, at
    seeded random lengths and offsets, rows that see no key and rows that see every key included."""
    import random

    from attnbench.kernels.tiling import visible_pairs
    rng = random.Random(0)
    for _ in range(300):
        nq, nk = rng.randint(0, 40), rng.randint(0, 40)
        offset = rng.choice([None, rng.randint(-50, 50)])
        brute = sum(1 for i in range(nq) for j in range(nk) if offset is None or j <= i + offset)
        assert visible_pairs(nq, nk, offset) == brute, (nq, nk, offset)


def test_flops_bottom_right_tall_counts_only_visible(flash):
    c = FlashCase(1, 2, 1, 40, 23, 80, "bottom_right", "float32")
    visible = int(torch.tril(torch.ones(40, 23), diagonal=23 - 40).sum())
    assert visible == 23 * 24 // 2  # rows 17..39 see 1..23 keys
    assert flash.flops(c, "fwd") == 4 * 2 * visible * 80
    assert flash.flops(c, "fwd") < 4 * 2 * 40 * 23 * 80


@pytest.mark.parametrize("case", [
    FlashCase(1, 2, 2, 37, 29, 24, None, "float32"),
    FlashCase(2, 4, 2, 33, 17, 16, "top_left", "float16"),
    FlashCase(1, 3, 1, 20, 50, 16, "bottom_right", "bfloat16"),
])
def test_bytes_fwd_reads_inputs_writes_outputs(flash, case):
    x = flash.make_inputs(case, "cpu")
    q, k, v = x["q"], x["k"], x["v"]

    def nbytes(t):
        return t.numel() * t.element_size()

    lse_rows = case.batch * case.heads_q * case.seqlen_q
    expected = nbytes(q) + nbytes(k) + nbytes(v) + nbytes(q) + 4 * lse_rows  # o is shaped like q
    assert flash.bytes(case, "fwd") == expected


def test_bytes_grow_with_mode(flash):
    c = FlashCase(1, 2, 2, 37, 29, 24, None, "float16")
    fwd, bwd, both = (flash.bytes(c, m) for m in ("fwd", "bwd", "fwd_bwd"))
    assert fwd < bwd
    assert fwd < both


def test_cost_model_rejects_unknown_mode(flash):
    c = FlashCase(1, 1, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="mode"):
        flash.flops(c, "forward")
    with pytest.raises(ValueError, match="mode"):
        flash.bytes(c, "backward")


# ---------------------------------------------------------------- inputs

CASE = FlashCase(2, 4, 2, 9, 13, 16, "bottom_right", "float16")


def test_make_inputs_shapes_and_dtype(flash):
    x = flash.make_inputs(CASE, "cpu")
    assert set(x) == {"q", "k", "v", "do"}
    assert x["q"].shape == (2, 4, 9, 16)
    assert x["do"].shape == (2, 4, 9, 16)
    assert x["k"].shape == (2, 2, 13, 16)
    assert x["v"].shape == (2, 2, 13, 16)
    for t in x.values():
        assert t.dtype == torch.float16
        assert t.device.type == "cpu"
        assert t.count_nonzero() > 0


def test_make_inputs_is_seeded(flash):
    a = flash.make_inputs(CASE, "cpu", seed=3)
    b = flash.make_inputs(CASE, "cpu", seed=3)
    c = flash.make_inputs(CASE, "cpu", seed=4)
    for name in a:
        assert torch.equal(a[name], b[name])
        assert not torch.equal(a[name], c[name])


def test_make_inputs_tensors_differ_from_each_other(flash):
    c = FlashCase(1, 2, 2, 8, 8, 16, None, "float32")
    x = flash.make_inputs(c, "cpu")
    assert not torch.equal(x["q"], x["k"])
    assert not torch.equal(x["k"], x["v"])
    assert not torch.equal(x["q"], x["do"])


def test_check_mode(flash):
    for mode in ("fwd", "bwd", "fwd_bwd"):
        flash.check_mode(mode)
    with pytest.raises(ValueError, match="nope"):
        flash.check_mode("nope")
    with pytest.raises(ValueError):
        flash.outputs("nope")
    assert flash.outputs("fwd") == ("o", "lse")
    assert flash.outputs("bwd") == ("dq", "dk", "dv")


# ---------------------------------------------------------------- variants on this machine

def test_available_variants_on_cpu(flash):
    available = flash.available_variants("cpu")
    for name in ("reference", "split", "triton", "sdpa_math"):
        assert name in available
    assert "sdpa_flash" not in available
    assert "flex" not in available
    assert "sdpa_flash" in flash.variants  # registered, just not runnable here
    assert flash.variants["sdpa_flash"].unavailable_reason(torch.device("cpu"))


def test_baseline_on_cpu_is_reference(flash):
    assert flash.baseline("cpu") == "reference"
    assert flash.baseline("cpu", ["split"]) is None


# ---------------------------------------------------------------- labels

def test_label_distinguishes_gqa():
    mha = FlashCase(1, 4, 4, 16, 16, 32)
    gqa = FlashCase(1, 4, 2, 16, 16, 32)
    assert mha.label != gqa.label
    assert "H4/2" in gqa.label and "H4 " in mha.label


def test_label_distinguishes_nq_nk():
    square = FlashCase(1, 2, 2, 16, 16, 32)
    tall = FlashCase(1, 2, 2, 16, 8, 32)
    wide = FlashCase(1, 2, 2, 8, 16, 32)
    assert len({square.label, tall.label, wide.label}) == 3
    assert "N16x8" in tall.label and "N8x16" in wide.label


def test_label_distinguishes_causal_alignments():
    labels = {FlashCase(1, 2, 2, 20, 30, 32, causal).label for causal in (None, "top_left", "bottom_right")}
    assert len(labels) == 3


def test_label_distinguishes_dtype_and_scale():
    assert FlashCase(1, 2, 2, 8, 8, 32, dtype="float16").label != FlashCase(1, 2, 2, 8, 8, 32, dtype="bfloat16").label
    assert FlashCase(1, 2, 2, 8, 8, 32).label != FlashCase(1, 2, 2, 8, 8, 32, scale=0.5).label


def test_softmax_scale_default():
    assert FlashCase(1, 1, 1, 4, 4, 64).softmax_scale == pytest.approx(0.125)
    assert FlashCase(1, 1, 1, 4, 4, 64, scale=0.3).softmax_scale == 0.3
