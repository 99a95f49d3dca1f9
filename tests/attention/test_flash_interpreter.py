"""CPU gate for the flash operator: split-PyTorch and Triton (interpreter) against the float64 oracle.

Tiny shapes cover lengths that are not block multiples (the interpreter uses 16x16 blocks),
Nq != Nk both ways, length 1, GQA/MQA, head dims that are not powers of two, both causal
alignments and rows that see no key; fp32, fp16 and fp64.
"""
from dataclasses import replace

import pytest
import torch

from attnbench.bench import verify
from attnbench.kernels.attention.copies import copy_route
from attnbench.kernels.attention.flash_bwd import dkdv_route, dq_route, group_route
from attnbench.kernels.attention.flash_fwd import forward_route
from attnbench.operators.flash import TINY_SHAPES, FlashCase, reference
from attnbench.attention import flash_attention, flash_bwd, flash_fwd

from .helpers import check_tma_route_refuses_40_byte_rows

pytestmark = pytest.mark.interpreter

CASES = [FlashCase(*shape, dtype=dt) for shape in TINY_SHAPES for dt in ("float32", "float16", "float64")]


@pytest.mark.parametrize("variant", ["split", "triton"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_variant_matches_float64_oracle(flash, oracles, case, mode, variant):
    x, oracle, lowp = oracles(case, 0)
    result = verify.check_variant(flash, variant, case, mode, x, oracle, lowp)
    assert not result.skipped, result.skipped
    assert result.passed, [o for o in result.outputs if not o.passed]
    assert {o.name for o in result.outputs} == set(flash.outputs(mode))


@pytest.mark.parametrize("route", ["tiles", "tma"])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_query_tiles_forward_matches_float64_oracle(flash, oracles, case, mode, route):
    """Every tiny case has Nq <= DECODE_MAX_NQ, so the forward above took the split-KV route; FA2's
    query tiles (the forward of longer queries), through pointers and through tensor descriptors
    (whose zero fill past N_K and D replaces the load masks), are held to the same oracle here."""
    x, oracle, lowp = oracles(case, 0)
    with forward_route(route):
        result = verify.check_variant(flash, "triton", case, mode, x, oracle, lowp)
    assert result.passed, [o for o in result.outputs if not o.passed]


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
@pytest.mark.parametrize("seed", [1, 2])
def test_other_seeds_and_custom_scale(flash, oracles, seed, mode):
    assert mode in flash.modes and len(flash.modes) == 3
    case = replace(FlashCase(2, 4, 2, 45, 31, 40, "bottom_right", "float32"), scale=0.37)
    x, oracle, lowp = oracles(case, seed)
    assert verify.check_variant(flash, "triton", case, mode, x, oracle, lowp).passed


@pytest.mark.parametrize("variant", ["split", "triton"])
def test_rows_that_see_no_key_give_zero_and_minus_inf(flash, variant):
    """Bottom-right causal with Nq > Nk: rows i < Nq - Nk see no key. O = 0, LSE = -inf, grads finite."""
    case = FlashCase(1, 2, 1, 40, 23, 32, "bottom_right", "float32")
    x = flash.make_inputs(case, "cpu", 0)
    out = verify.run_poisoned(flash, variant, case, x, "fwd")
    blind = 40 - 23
    assert torch.all(out["o"][:, :, :blind] == 0)
    assert torch.all(torch.isneginf(out["lse"][:, :, :blind]))
    assert torch.isfinite(out["lse"][:, :, blind:]).all()
    grads = verify.run_poisoned(flash, variant, case, x, "bwd")
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert torch.all(grads["dq"][:, :, :blind] == 0)


def _fp64(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("shape,causal", [
    ((1, 2, 2, 9, 7, 16), None),
    ((1, 2, 1, 12, 5, 24), "bottom_right"),  # GQA, and 7 rows that see no key
    ((2, 1, 1, 17, 17, 16), True),
    ((1, 3, 1, 6, 19, 16), "top_left"),
    # head dims in two column blocks (tuning.head_dim_blocks): 48 = 32 + 16, 80 = 64 + 16
    ((1, 2, 1, 11, 13, 48), "bottom_right"),
    ((1, 2, 2, 9, 17, 80), None),
])
def test_gradcheck_autograd_wrapper_fp64(shape, causal):
    b, hq, hk, nq, nk, d = shape
    q = _fp64(b, hq, nq, d, seed=1).requires_grad_()
    k = _fp64(b, hk, nk, d, seed=2).requires_grad_()
    v = _fp64(b, hk, nk, d, seed=3).requires_grad_()
    assert verify.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=causal), (q, k, v), atol=1e-8, rtol=1e-6)


def test_manual_api_equals_autograd_api():
    q, k, v, do = (_fp64(1, 2, 21, 16, seed=s) for s in range(4))
    o, lse = flash_fwd(q, k, v, causal=True)
    dq, dk, dv = flash_bwd(do, q, k, v, o, lse, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o2, lse2 = flash_attention(*leaves, causal=True, return_lse=True)
    o2.backward(do)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for manual, auto in zip((dq, dk, dv), leaves):
        assert torch.equal(manual, auto.grad)


def test_causal_true_means_top_left_when_lengths_match():
    q, k, v = (_fp64(1, 1, 13, 16, seed=s) for s in range(3))
    assert torch.equal(flash_fwd(q, k, v, causal=True)[0], flash_fwd(q, k, v, causal="top_left")[0])
    assert torch.equal(flash_fwd(q, k, v, causal="bottom_right")[0], flash_fwd(q, k, v, causal="top_left")[0])


def test_strided_inputs_match_contiguous():
    """A [B, N, H, D] tensor viewed as [B, H, N, D] has non-unit sequence strides: same answer."""
    q, k, v, do = (_fp64(2, 19, 3, 16, seed=s).transpose(1, 2) for s in range(4))
    o, lse = flash_fwd(q, k, v)
    o_c, lse_c = flash_fwd(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)
    grads = flash_bwd(do, q, k, v, o, lse)
    grads_c = flash_bwd(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o_c, lse_c)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_c))


def test_poisoning_exposes_an_unwritten_output(flash, monkeypatch):
    """If a launcher skipped a block, poisoned outputs would hold NaN and the check must fail."""
    import attnbench.attention.ops as api

    case = FlashCase(1, 1, 1, 20, 20, 16, None, "float32")
    x = flash.make_inputs(case, "cpu", 0)
    oracle, lowp = flash.oracle(case, x), flash.oracle(case, x, dtype=torch.float32)
    real = api.flash_fwd_launch

    def forgetful(*args):
        o, lse = real(*args)
        from attnbench.kernels import new_output

        o[:, :, -3:] = new_output(o[:, :, -3:].shape, o.dtype, o.device)  # as if never written
        return o, lse

    monkeypatch.setattr(api, "flash_fwd_launch", forgetful)
    result = verify.check_variant(flash, "triton", case, "fwd", x, oracle, lowp)
    assert not result.passed
    assert "NaN: 48" in [o for o in result.outputs if o.name == "o"][0].detail


def test_sdpa_declines_rows_that_see_no_key(flash):
    """SDPA has no defined answer there (cuDNN returned garbage on an H200, torch documents NaN):
    the peer must say so rather than be compared."""
    from attnbench import Unsupported

    case = FlashCase(1, 2, 1, 40, 23, 32, "bottom_right", "float32")
    x = flash.make_inputs(case, "cpu", 0)
    with pytest.raises(Unsupported, match="rows that see no key"):
        flash.variants["sdpa_math"].prepare(case, x, "fwd")


@pytest.mark.parametrize("offset", [None, 0, -17, 17])
def test_oracle_in_query_row_chunks_equals_the_whole(offset):
    """The float64 oracle splits long sequences into query-row chunks (each with its own causal
    offset; dK and dV summed over chunks) to bound its memory: same outputs, blind rows included."""
    q, do = _fp64(1, 6, 40, 8, seed=1), _fp64(1, 6, 40, 8, seed=2)
    k, v = _fp64(1, 2, 23, 8, seed=3), _fp64(1, 2, 23, 8, seed=4)
    whole = reference.evaluate(q, k, v, do, 0.3, offset, torch.float64)
    for max_scores in (1, 3 * 23 * 7, 2000):  # one row a chunk, 7 rows, whole heads
        chunked = reference.evaluate(q, k, v, do, 0.3, offset, torch.float64, max_scores=max_scores)
        for name in whole:
            assert torch.allclose(chunked[name], whole[name], rtol=1e-12, atol=1e-12, equal_nan=False), name


BACKWARD_ROUTES = {"atomic_dq": lambda: dq_route("atomic"), "split_dkdv": lambda: dkdv_route("split"),
                   "per_head": lambda: group_route("per-head"), "split_dq": lambda: dq_route("split")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("route", list(BACKWARD_ROUTES))
def test_backward_route_matches_float64_oracle(flash, oracles, route, case):
    """The backward's other routes are held to the same oracle: "atomic_dq", the non-deterministic dQ
    route (atomics in the dK/dV pass, no dQ pass): GQA (several query heads add into one pass's dQ),
    split head dims, blind rows; "split_dkdv", dkdv_route("split") (a dV pass and a dK pass, the
    default at head width 256, which no tiny case reaches): GQA, split head dims, blind rows, both
    alignments."""
    x, oracle, lowp = oracles(case, 0)
    with BACKWARD_ROUTES[route]():
        result = verify.check_variant(flash, "triton", case, "bwd", x, oracle, lowp)
    assert result.passed, [o for o in result.outputs if not o.passed]


def test_per_head_group_route_gradcheck_fp64_and_the_rule_that_picks_it(spy_kernel, monkeypatch):
    """group_route("per-head"): a dK/dV program per query head over repeated K and V, the fp32 shares summed
    over the group: gradcheck in fp64 (GQA 3:1, causal, a masked column block); the default takes it only when
    the shared grid fills under 0.7 of the GPU and each program walks enough query rows, never without head
    groups."""
    from attnbench.kernels.attention import flash_bwd as kernels

    q = _fp64(1, 6, 11, 40, seed=1).requires_grad_()
    k, v = (_fp64(1, 2, 13, 40, seed=s).requires_grad_() for s in (2, 3))
    with group_route("per-head"):
        assert verify.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal="bottom_right"), (q, k, v),
                                atol=1e-8, rtol=1e-6)
    q, k, v = (t.detach().half() for t in (q, k, v))
    o, lse = flash_fwd(q, k, v)
    do = torch.ones_like(o)
    spy = spy_kernel(kernels, "flash_bwd_dkdv_kernel")
    shared = flash_bwd(do, q, k, v, o, lse)
    assert kernels.GROUP_PER_HEAD_BY_DEFAULT
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 3)  # 2 programs under 0.7 x 3 SMs, 11 query rows
    flash_bwd(do, q, k, v, o, lse)  # rows a program walks: 11, under the rule's minimum
    monkeypatch.setattr(kernels, "GROUP_RULE_MIN_ROWS", 11)
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 2)  # one key block x 2 KV heads: not under 1.4
    flash_bwd(do, q, k, v, o, lse)
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 3)
    per_head = flash_bwd(do, q, k, v, o, lse)
    heads = [args[1].shape[1] for args in spy.args]  # K's heads: a program row per KV head, or per query head
    assert heads == [2, 2, 2, 6], heads
    assert spy.args[3][1].dtype == torch.float16 and spy.args[3][6].dtype == torch.float32  # K copy; dK's share
    # the same fp32 sums in another order, each rounded once to fp16: measured 0 to 3e-8 (normwise); held well
    # under one fp16 rounding (4.9e-4)
    for a, b in zip(shared, per_head):
        assert a.dtype == b.dtype == torch.float16 and verify.relative_error(b, a) < 1e-4
    q1 = q[:, :2].contiguous()  # no head groups: the rule leaves the launch alone
    o1, lse1 = flash_fwd(q1, k, v)
    flash_bwd(torch.ones_like(o1), q1, k, v, o1, lse1)
    assert [args[1].shape[1] for args in spy.args][-1] == 2


def test_split_dq_route_gradcheck_fp64_and_the_rule_that_picks_it(spy_kernel, monkeypatch):
    """dq_route("split"): each dQ program on one run of keys, the fp32 shares summed: gradcheck in fp64 (few query
    rows against many keys, GQA, bottom-right causal: splits that see no key at all), and the rule: it splits only
    where the unsplit grid is at most half the GPU and the rows see keys for DQ_SPLIT_MIN_SPLITS runs."""
    from attnbench.kernels.attention import flash_bwd as kernels

    q = _fp64(2, 4, 3, 24, seed=1).requires_grad_()
    k, v = (_fp64(2, 2, 70, 24, seed=s).requires_grad_() for s in (2, 3))
    spy = spy_kernel(kernels, "flash_bwd_dq_kernel")
    with dq_route("split"):
        assert verify.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal="bottom_right"), (q, k, v),
                                atol=1e-8, rtol=1e-6)
    assert spy.kwargs and all(kw["KEY_SPLIT"] for kw in spy.kwargs)
    # SPLITS: 70 keys hold 4 runs of the interpreter's 16; 4 shares of 18 keys round up to whole runs (32): 3 splits
    splits = spy.args[-1][-3]
    assert splits == 3, splits
    q, k, v = (t.detach().half() for t in (q, k, v))
    o, lse = flash_fwd(q, k, v)
    do = torch.ones_like(o)
    whole = flash_bwd(do, q, k, v, o, lse)
    assert not spy.kwargs[-1]["KEY_SPLIT"]  # the interpreter's 4 SMs: 8 programs fill more than half
    monkeypatch.setattr(kernels, "DQ_SPLIT_BY_DEFAULT", True)
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 15)  # 1 query block x 4 heads x 2: over half
    flash_bwd(do, q, k, v, o, lse)
    assert not spy.kwargs[-1]["KEY_SPLIT"]
    monkeypatch.setattr(kernels, "multiprocessors", lambda device: 16)
    split = flash_bwd(do, q, k, v, o, lse)
    # min(4 runs, cdiv(2 x 16 SMs, 8 programs) = 4) shares of 18 keys, rounded up to whole runs (32): 3 splits
    assert spy.kwargs[-1]["KEY_SPLIT"] and spy.args[-1][-3] == 3
    # top-left causal: the 3 rows see keys 0-2 only, too few for a split, by default or forced
    o_tl, lse_tl = flash_fwd(q, k, v, causal="top_left")
    flash_bwd(do, q, k, v, o_tl, lse_tl, causal="top_left")
    assert not spy.kwargs[-1]["KEY_SPLIT"]
    with dq_route("split"):
        flash_bwd(do, q, k, v, o_tl, lse_tl, causal="top_left")
    assert not spy.kwargs[-1]["KEY_SPLIT"]
    # dQ: the same fp32 sums in another order, rounded once to fp16 (measured 1.6e-8 normwise; held well under
    # one fp16 rounding, 4.9e-4); dK and dV untouched
    assert verify.relative_error(split[0], whole[0]) < 1e-4
    assert torch.equal(split[1], whole[1]) and torch.equal(split[2], whole[2])


def test_the_few_row_dq_split_takes_runs_of_128_keys_and_more_rows_512(monkeypatch):
    """The GPU's rule (the interpreter's runs are 16 keys): a few-row backward over 1247 keys splits in whole runs of
    128 (it was unsplit: the H200 breakdown found its dQ pass most of the call); 65 rows keep runs of 512 (untimed
    there)."""
    from attnbench.kernels.attention import flash_bwd

    monkeypatch.setattr(flash_bwd, "interpreting", lambda: False)
    monkeypatch.setattr(flash_bwd, "multiprocessors", lambda device: 132)
    assert flash_bwd.dq_split_min_keys(64) == 128 and flash_bwd.dq_split_min_keys(65) == 512
    splits, keys = flash_bwd._dq_splits(3, 8, 10, 1247, 1247, "cuda")  # B3 H8 N10x1247: 24 programs
    # min(9 runs, cdiv(2 x 132, 24) = 11) = 9 shares of 139 keys, rounded up to whole runs (256): 5 splits
    assert (splits, keys) == (5, 256)
    assert flash_bwd._dq_splits(3, 8, 10, 511, 511, "cuda") == (1, 511)  # under 4 runs: unsplit
    splits, keys = flash_bwd._dq_splits(1, 4, 65, 4096, 4096, "cuda")  # 2 query blocks x 4 heads
    assert keys % 512 == 0 and splits == 4096 // keys


def test_atomic_dq_route_gradcheck_fp64_and_is_asked_for_by_name():
    q = _fp64(1, 4, 11, 48, seed=1).requires_grad_()
    k, v = (_fp64(1, 2, 13, 48, seed=s).requires_grad_() for s in (2, 3))
    with dq_route("atomic"):
        assert verify.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal="bottom_right"), (q, k, v),
                                atol=1e-8, rtol=1e-6)
    with pytest.raises(ValueError, match="dQ route 'atomics'"):
        with dq_route("atomics"):
            pass


@pytest.mark.parametrize("route", ["recompute", "atomic"])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_rows_with_lse_below_minus_88_keep_finite_gradients(route, causal):
    """Scores near -100 everywhere (LSE < -88): a key past N_K, loaded as zero, would give
    P = exp2(0 - lse) = inf and inf * 0 = NaN in dQ unless it is masked (both dQ routes)."""
    direction = _fp64(32, seed=5)
    direction = direction / direction.norm()
    k = direction * 10 + 0.1 * _fp64(1, 1, 20, 32, seed=6)  # 20 keys: the last block is partial
    q = -direction * 10 + 0.1 * _fp64(1, 1, 20, 32, seed=7)
    v, do = _fp64(1, 1, 20, 32, seed=8), _fp64(1, 1, 20, 32, seed=9)
    q, k, v, do = (t.float() for t in (q, k, v, do))  # fp32: exp2 of ~140 overflows there, not in fp64
    o, lse = flash_fwd(q, k, v, scale=1.0, causal=causal)
    assert lse.max() < -88
    with dq_route(route):
        grads = flash_bwd(do, q, k, v, o, lse, scale=1.0, causal=causal)
    offset = None if causal is None else 0
    oracle = reference.evaluate(q, k, v, do, 1.0, offset, torch.float64)
    eager = reference.evaluate(q, k, v, do, 1.0, offset, torch.float32)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(grad).all(), name
        # Scores of magnitude 100 whose spread is small cost fp32 digits (dS = P (dP - delta) cancels):
        # eager fp32 math is off by ~4e-5 here, our recompute route 2x that, the atomic route 3-4x
        # (measured; both within the fp32 bound on ordinary inputs). Held to 6x eager's error.
        bound = 6 * verify.relative_error(eager[name], oracle[name]) + verify.BOUNDS[torch.float32]
        assert verify.relative_error(grad, oracle[name]) < bound, name


def test_split_dkdv_route_gradcheck_fp64_and_refuses_an_atomic_dq():
    q = _fp64(1, 4, 11, 48, seed=1).requires_grad_()  # 48 = 32 + 16 columns: both column blocks
    k, v = (_fp64(1, 2, 13, 48, seed=s).requires_grad_() for s in (2, 3))
    with dkdv_route("split"):
        assert verify.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal="top_left"), (q, k, v),
                                atol=1e-8, rtol=1e-6)
        o, lse = flash_fwd(q.detach(), k.detach(), v.detach())
        with dq_route("atomic"), pytest.raises(ValueError, match="route 'split' forms dK apart from dV"):
            flash_bwd(torch.ones_like(o), q.detach(), k.detach(), v.detach(), o, lse)


@pytest.mark.parametrize("head_dim,passes", [(256, 2), (192, 1), (160, 1), (64, 1)])
def test_default_dkdv_route_splits_at_head_width_256_and_keeps_one_pass_for_an_atomic_dq(spy_kernel, head_dim,
                                                                                      passes):
    from attnbench.kernels.attention import flash_bwd as kernels

    q, k, v, do = (_fp64(1, 1, 5, head_dim, seed=s).float() for s in range(4))
    o, lse = flash_fwd(q, k, v)
    spy = spy_kernel(kernels, "flash_bwd_dkdv_kernel")
    flash_bwd(do, q, k, v, o, lse)
    assert spy.launches == passes
    assert [(kw["FORM_DK"], kw["FORM_DV"]) for kw in spy.kwargs] == ([(False, True), (True, False)] if passes == 2
                                                                     else [(True, True)])
    with dq_route("atomic"):
        flash_bwd(do, q, k, v, o, lse)
    assert spy.launches == passes + 1 and spy.kwargs[-1]["ATOMIC_DQ"]


def test_tma_atomic_dq_route_says_why_it_cannot_run_here():
    """The copy engine's bulk reduction has no interpreter: asked for on the CPU, the route says why
    before any kernel runs (tests/attention/test_gpu_flash.py holds it to the oracle on a GPU)."""
    q, k, v, do = (_fp64(1, 1, 9, 16, seed=s) for s in range(4))
    o, lse = flash_fwd(q, k, v)
    with dq_route("tma_atomic"), pytest.raises(ValueError, match="needs a CUDA GPU with tensor descriptors"):
        flash_bwd(do, q, k, v, o, lse)


def test_atomic_dq_route_refuses_deterministic_mode():
    q, k, v, do = (_fp64(1, 1, 9, 16, seed=s) for s in range(4))
    o, lse = flash_fwd(q, k, v)
    torch.use_deterministic_algorithms(True)
    try:
        for route in ("atomic", "tma_atomic"):
            with dq_route(route), pytest.raises(RuntimeError, match="not deterministic"):
                flash_bwd(do, q, k, v, o, lse)
        flash_bwd(do, q, k, v, o, lse)  # the default route is deterministic: allowed
    finally:
        torch.use_deterministic_algorithms(False)


def test_tma_route_refuses_strides_the_copy_engine_cannot_take():
    """Descriptors need 16-byte strides and base pointers: a forced "tma" route says so before any
    kernel runs (D 20 in fp16: 40-byte rows; a view starting 2 bytes in), the default takes the tiles
    (the same on a GPU: tests/attention/test_gpu_flash.py)."""
    from attnbench.kernels.launch import descriptors_apply

    q, k, v = check_tma_route_refuses_40_byte_rows("cpu", 70)
    assert not descriptors_apply((k, v))
    wide = torch.randn(1, 2, 70, 17, dtype=torch.float32)[..., 1:]  # rows of 68 bytes, base 4 bytes in
    assert not descriptors_apply((wide,))
    assert descriptors_apply((torch.randn(1, 2, 70, 16, dtype=torch.float16),))


def test_descriptor_scratch_is_set_for_the_launch_only_and_never_over_the_callers_allocator():
    from triton.runtime import _allocation

    from attnbench.kernels.launch import descriptor_scratch

    before = _allocation._allocator.get()
    assert isinstance(before, _allocation.NullAllocator)
    with descriptor_scratch(torch.device("cpu")):
        inside = _allocation._allocator.get()
        assert not isinstance(inside, _allocation.NullAllocator)
        assert inside(256, 128, None).numel() == 256
    assert _allocation._allocator.get() is before

    def users(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    token = _allocation._allocator.set(users)
    try:
        with descriptor_scratch(torch.device("cpu")):
            assert _allocation._allocator.get() is users
    finally:
        _allocation._allocator.reset(token)


def test_gluon_routes_refuse_what_they_cannot_run_here_and_the_default_never_picks_them():
    """The Gluon kernels (sm_90, Triton 3.6 only) have no interpreter: on the CPU a forced "hopper"
    forward or dK/dV route says why before any kernel runs, and the default routes take the tiles
    (whose answer the GPU tests hold the Gluon kernels to)."""
    from attnbench.attention import flash_bwd as bwd
    from attnbench.attention import flash_fwd as fwd
    from attnbench.kernels.attention import flash_fwd_hopper as hopper
    from attnbench.kernels.attention.flash_bwd import dkdv_route

    q, k, v = (torch.randn(1, 2, 70, 64, dtype=torch.float16) for _ in range(3))
    assert not hopper.hopper_applies(q, k, v)
    with pytest.raises(ValueError, match="route 'hopper' needs an sm_90 GPU"):
        with forward_route("hopper"):
            fwd(q, k, v)
    o, lse = fwd(q, k, v)
    with pytest.raises(ValueError, match="dK/dV route 'hopper' needs an sm_90 GPU"):
        with dkdv_route("hopper"):
            bwd(torch.randn_like(q), q, k, v, o, lse)
    with pytest.raises(ValueError, match="dK/dV route"):
        with dkdv_route("somewhere"):
            pass
    # each head dim the route takes has a tile: the next power of two of columns, measured tiles
    for d in hopper.HOPPER_HEAD_DIMS:
        block = hopper.head_block(d)
        assert block >= d and block & (block - 1) == 0 and block // 2 < d
        assert all((block, causal) in hopper._TILES for causal in (False, True))
    # only the Triton the kernels were written for runs them (Gluon's API moves between releases)
    import triton
    assert hopper.GLUON <= triton.__version__.startswith(hopper.GLUON_TRITON)


def test_the_default_forward_takes_the_gluon_kernel_by_head_dim_and_at_narrow_heads_by_size():
    """The rule behind the default forward route (measured: flash_fwd_hopper.py, HOPPER_DEFAULT_HEAD_DIMS): every
    D 56-128 and D 160, 192, 256; D 40 and 48 below HOPPER_NARROW_MAX_PAIRS visible pairs, counted with the mask;
    the head dims of the 256-column tile that were not timed (136-152, ...) keep the pointer tiles."""
    from attnbench.kernels.attention import flash_fwd_hopper as hopper
    from attnbench.kernels.attention.flash_fwd import _hopper_by_default

    def picks(b, h, nq, nk, d, offset=None):
        return _hopper_by_default(torch.empty(b, h, nq, d, device="meta"), torch.empty(b, 1, nk, d, device="meta"),
                                  offset)

    assert [d for d in range(32, 257, 8) if picks(1, 1, 128, 128, d)] == [
        40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 160, 192, 256]
    limit = hopper.HOPPER_NARROW_MAX_PAIRS
    assert picks(1, 8, 9407, 9407, 48, offset=0)  # causal: 3.5e8 visible pairs of 7.1e8
    assert not picks(1, 8, 9407, 9407, 48)
    assert not picks(10, 16, 14031, 14031, 40, offset=0) and picks(10, 16, 14031, 14031, 72, offset=0)
    assert picks(1, 1, 1, int(limit) - 1, 40) and not picks(1, 1, 1, int(limit), 40)


# the pads and cuts by PyTorch's ops, or by copies.py's kernel, a launch a tensor or a launch a layout (test_copies.py
# holds it to torch's ops bit for bit)
@pytest.mark.parametrize("head_dim,causal,route,copies", [
    (72, "top_left", "tiles", "torch"), (88, None, "tiles", "torch"), (40, "bottom_right", "tiles", "torch"),
    (24, "top_left", "tiles", "torch"), (72, "top_left", "tma", "torch"), (88, None, "tma", "torch"),
    (40, "bottom_right", "tma", "torch"), (24, "top_left", "tma", "torch"),
    (72, "top_left", "tiles", "triton"), (40, "bottom_right", "tma", "triton"), (88, None, "tiles", "grouped"),
    (40, "bottom_right", "tma", "grouped")])
def test_masked_column_block_head_dims_run_padded_and_match_float64(route, head_dim, causal, copies):
    """Head dims whose column blocks would be masked (72 = 64 + 16 up to 80, 88 = 64 + 32 up to 96,
    40 = 32 + 16 up to 48, 24 in one block of 32) run zero-padded on CUDA (attnbench/kernels/attention/head_padding.py:
    Triton 3.6 goes wrong at some of them there). Here the padded path runs through the interpreter,
    at an odd query length and GQA, forward and backward, against float64; other head dims are not padded."""
    from attnbench.kernels.attention import head_padding

    assert head_padding.padded_width(head_dim, "cuda") == {72: 80, 88: 96, 40: 48, 24: 32}[head_dim]
    assert head_padding.padded_width(head_dim, "cpu") == head_dim
    assert [head_padding.padded_width(d, "cuda") for d in (64, 80, 96, 160, 192, 256)] == [64, 80, 96, 160, 192, 256]
    q = _fp64(1, 4, 67, head_dim, seed=1).float()
    k, v = (_fp64(1, 2, 45, head_dim, seed=s).float() for s in (2, 3))
    do = _fp64(1, 4, 67, head_dim, seed=4).float()
    offset = {None: None, "top_left": 0, "bottom_right": 45 - 67}[causal]
    oracle = reference.evaluate(q, k, v, do, head_dim ** -0.5, offset, torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(head_padding, "PAD_ON", {"cuda", "cpu"})
        with copy_route(copies):
            with forward_route(route):
                o, lse = flash_fwd(q, k, v, causal=causal)
            grads = flash_bwd(do, q, k, v, o, lse, causal=causal)
    assert o.shape == q.shape and o.is_contiguous()
    for name, got in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads)):
        assert got.shape == oracle[name].shape, name
        assert verify.relative_error(got, oracle[name]) < verify.BOUNDS[torch.float32], name
