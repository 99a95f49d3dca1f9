"""merge_states on its own: exact against one-shot softmax in float64, -inf and empty states,
one side only, many-way merges; the Triton kernels (interpreter) against the torch version."""
import math

import pytest
import torch

from attnbench.merge import merge_many, merge_many_triton, merge_states, merge_states_triton


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _attend(q, k, v):
    """(O, LSE) of softmax(q k^T) v over the given keys; (0, -inf) when there are none."""
    if k.shape[-2] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    s = q @ k.transpose(-1, -2)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _problem(seed, rows=(2, 3, 5), n=23, d=24):
    g = _gen(seed)
    q = torch.randn(*rows, d, generator=g, dtype=torch.float64)
    k = torch.randn(*rows[:-1], n, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(*rows[:-1], n, d, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cut", [1, 7, 22])
def test_two_way_merge_is_one_shot_softmax_fp64(seed, cut):
    q, k, v = _problem(seed)
    full_o, full_lse = _attend(q, k, v)
    o_a, lse_a = _attend(q, k[..., :cut, :], v[..., :cut, :])
    o_b, lse_b = _attend(q, k[..., cut:, :], v[..., cut:, :])
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    # Both sides sum the same n products P V in different orders (the matmul's blocking, then the
    # merge's two partial sums): each is within n eps (|P| |V|) of the exact sum, elementwise. A fixed
    # 1e-14 held on one CPU and failed by 2% on another (1.02e-14 on an |O| of 2.9).
    p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    bound = 2 * k.shape[-2] * torch.finfo(torch.float64).eps * (p.abs() @ v.abs())
    assert ((o - full_o).abs() <= bound).all(), float(((o - full_o).abs() / bound).max())
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-14)
    o2, lse2 = merge_states(o_b, lse_b, o_a, lse_a)  # order does not matter beyond rounding
    torch.testing.assert_close(o2, o, rtol=0, atol=1e-15)


@pytest.mark.parametrize("cuts", [(0, 5, 5, 11, 23), (0, 1, 2, 3, 4, 5, 23), (0, 23), (0, 0, 0, 23, 23)])
def test_many_way_merge_with_empty_pieces(cuts):
    """Pieces may be empty (a split past the keys' end): their -inf states add nothing."""
    q, k, v = _problem(3)
    parts = [_attend(q, k[..., a:b, :], v[..., a:b, :]) for a, b in zip(cuts[:-1], cuts[1:])]
    o, lse = merge_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    full_o, full_lse = _attend(q, k, v)
    torch.testing.assert_close(o, full_o, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-14)


def test_one_side_minus_inf_returns_the_other_exactly():
    q, k, v = _problem(4)
    o_a, lse_a = _attend(q, k, v)
    o_b = torch.full_like(o_a, float("nan"))  # SDPA leaves NaN in rows that saw no key
    lse_b = torch.full_like(lse_a, -math.inf)
    for merge in (merge_states, merge_states_triton):
        o, lse = merge(o_a, lse_a, o_b, lse_b)
        assert torch.equal(o, o_a) and torch.equal(lse, lse_a), merge.__name__
        o, lse = merge(o_b, lse_b, o_a, lse_a)
        assert torch.equal(o, o_a) and torch.equal(lse, lse_a), merge.__name__


def test_both_sides_minus_inf_give_zero_and_minus_inf():
    o_a = torch.full((3, 4, 16), float("nan"), dtype=torch.float32)
    lse_a = torch.full((3, 4), -math.inf)
    o_b, lse_b = torch.randn(3, 4, 16), torch.randn(3, 4)
    lse_b[1, 2] = -math.inf
    o_b[1, 2] = float("nan")
    for merge in (merge_states, merge_states_triton):
        o, lse = merge(o_a, lse_a, o_a, lse_a)
        assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all(), merge.__name__
        o, lse = merge(o_a, lse_a, o_b, lse_b)  # a row mixing finite and -inf states
        assert torch.equal(o[1, 2], torch.zeros(16)) and torch.isneginf(lse[1, 2]), merge.__name__
        assert torch.isfinite(o).all()


def test_one_state_only_and_empty_stacks():
    q, k, v = _problem(5)
    o_a, lse_a = _attend(q, k, v)
    o, lse = merge_many(o_a.unsqueeze(0), lse_a.unsqueeze(0))
    assert torch.equal(o, o_a) and torch.equal(lse, lse_a)
    o, lse = merge_many(o_a[:0], lse_a[:0])  # no state at all: rows that saw no key
    assert torch.equal(o, torch.zeros_like(o_a[0])) and torch.isneginf(lse).all()
    empty_o, empty_lse = torch.zeros(0, 4, 16), torch.zeros(0, 4)  # states with no rows
    for merge in (merge_states, merge_states_triton):
        o, lse = merge(empty_o, empty_lse, empty_o, empty_lse)
        assert o.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_low_precision_outputs_merge_in_fp32():
    """fp16 O with fp32 LSE: the merge runs in fp32 and rounds once."""
    q, k, v = _problem(6)
    full_o, full_lse = _attend(q, k, v)
    o_a, lse_a = _attend(q, k[..., :9, :], v[..., :9, :])
    o_b, lse_b = _attend(q, k[..., 9:, :], v[..., 9:, :])
    for merge in (merge_states, merge_states_triton):
        o, lse = merge(o_a.half(), lse_a.float(), o_b.half(), lse_b.float())
        assert o.dtype == torch.float16 and lse.dtype == torch.float32
        assert ((o.double() - full_o).norm() / full_o.norm()) < 1e-3
        assert ((lse.double() - full_lse).abs() / full_lse.abs()).max() < 3e-7  # fp32 rounding of LSE


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_triton_merge_equals_torch_merge_on_strided_states(dtype):
    """[B, N, H, D] memory seen as [B, H, N, D] (the model's layout) merges without a copy."""
    g = _gen(7)
    o_a = torch.randn(3, 7, 5, 40, generator=g).to(dtype).transpose(1, 2)
    o_b = torch.randn(3, 7, 5, 40, generator=g).to(dtype).transpose(1, 2)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse_a = (torch.randn(3, 7, 5, generator=g) * 3).to(lse_dtype).transpose(1, 2)
    lse_b = (torch.randn(3, 7, 5, generator=g) * 3).to(lse_dtype).transpose(1, 2)
    lse_b[0, 1, 2] = -math.inf
    want_o, want_lse = merge_states(o_a, lse_a, o_b, lse_b)
    got_o, got_lse = merge_states_triton(o_a, lse_a, o_b, lse_b)
    tol = 1e-14 if dtype == torch.float64 else (1e-6 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(got_o, want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("width", [41, 42, 44])
def test_triton_merges_of_rows_off_the_vector_width_match_contiguous(width):
    """States of head dim 40 read from rows of ``width`` elements (and a stack whose state stride is odd): the
    launchers claim only the alignment the strides have (tiling.stride_align), and a larger claim would move the
    interpreter's reads as it would the GPU's."""
    g = _gen(9)
    o = torch.randn(3, 2, 5, width, generator=g, dtype=torch.float64)[..., :40]
    lse = torch.randn(3, 2, 5, generator=g, dtype=torch.float64)
    want = merge_states_triton(o[0].contiguous(), lse[0], o[1].contiguous(), lse[1])
    got = merge_states_triton(o[0], lse[0], o[1], lse[1])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    flat = torch.randn(3 * 2 * 5 * width + 1, generator=g, dtype=torch.float64)[1:]
    stack = flat.view(3, 2, 5, width)[..., :40]
    want = merge_many_triton(stack.contiguous(), lse)
    got = merge_many_triton(stack, lse)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.interpreter
@pytest.mark.parametrize("lead", [(), (6,), (2, 3), (2, 3, 4), (2, 1, 3, 2)])
def test_triton_stack_merge_any_leading_shape(lead):
    g = _gen(8)
    o = torch.randn(4, *lead, 24, generator=g, dtype=torch.float64)
    lse = torch.randn(4, *lead, generator=g, dtype=torch.float64) * 2
    lse[1] = -math.inf
    want = merge_many(o, lse)
    got = merge_many_triton(o, lse)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-14)


@pytest.mark.interpreter
@pytest.mark.parametrize("states", [1, 3, 4, 5, 9])
def test_triton_stack_merge_over_several_chunks_and_column_blocks(states):
    """From 4 states (INTERPRETER_CHUNKS_FROM_STATES) the stack merges in chunks: under the interpreter
    INTERPRETER_CHUNK (4) states a load over INTERPRETER_COLUMNS (16) columns a program, so 5 and 9 states end in a
    partial chunk and D 41 in a partial column block; 1 and 3 states merge state by state. Against
    merge_many in float64; an empty state's NaN O adds nothing; one live state among empties comes out bit for bit.
    Head dim 0 still gets its LSEs (the column blocks' first program stores them)."""
    from attnbench.kernels import merge_states as kernels

    # what the sizes above assume
    sizes = (kernels.INTERPRETER_CHUNK, kernels.INTERPRETER_COLUMNS, kernels.INTERPRETER_CHUNKS_FROM_STATES)
    assert sizes == (4, 16, 4)
    g = _gen(11)
    o = torch.randn(states, 3, 5, 41, generator=g, dtype=torch.float64)
    lse = torch.randn(states, 3, 5, generator=g, dtype=torch.float64) * 3
    o_some, lse_some = o.clone(), lse.clone()
    lse_some[states // 2, 1] = -math.inf  # an empty state of some rows, its O NaN
    o_some[states // 2, 1] = float("nan")
    want, got = merge_many(o_some, lse_some), merge_many_triton(o_some, lse_some)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-14, equal_nan=False)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-14)
    live = states - 1  # the last state alone: in the last (partial) chunk
    empty_lse = torch.full_like(lse, -math.inf)
    empty_lse[live] = lse[live]
    empty_o = torch.full_like(o, float("nan"))
    empty_o[live] = o[live]
    o_one, lse_one = merge_many_triton(empty_o, empty_lse)
    assert torch.equal(o_one, o[live]) and torch.equal(lse_one, lse[live])
    o_none, lse_none = merge_many_triton(o[..., :0], lse)
    assert o_none.shape == (3, 5, 0) and torch.allclose(lse_none, torch.logsumexp(lse, 0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("args,exc,words", [
    (lambda: (torch.zeros(2, 8), torch.zeros(3), torch.zeros(2, 8), torch.zeros(2)), ValueError, "LSE's shape"),
    (lambda: (torch.zeros(2, 8), torch.zeros(2), torch.zeros(3, 8), torch.zeros(3)), ValueError, "one shape"),
    (lambda: (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), torch.zeros(2, 8), torch.zeros(2)), TypeError,
     "LSE has dtype torch.int32"),
    (lambda: (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2), torch.zeros(2, 8), torch.zeros(2)), TypeError,
     "O has dtype torch.int64"),
    (lambda: ([0.0], torch.zeros(2), torch.zeros(2, 8), torch.zeros(2)), TypeError, "must be torch.Tensors"),
])
def test_bad_states_are_rejected(args, exc, words):
    for merge in (merge_states, merge_states_triton):
        with pytest.raises(exc, match=words.replace("(", r"\(")):
            merge(*args())


def test_a_nan_state_makes_its_row_nan_not_blind():
    """A state with NaN LSE (a split that read a NaN input) poisons its row, whichever side and
    whatever the other states hold; other rows are untouched. Before, the row came out as the
    (O = 0 or the other side's O, LSE = -inf) of a row that saw no key."""
    q, k, v = _problem(7)
    o_a, lse_a = _attend(q, k, v)
    o_b, lse_b = o_a.clone(), lse_a.clone()
    o_b[1, 2, 3], lse_b[1, 2, 3] = float("nan"), float("nan")
    empty_o, empty_lse = torch.zeros_like(o_a), torch.full_like(lse_a, -math.inf)
    for merge in (merge_states, merge_states_triton):
        for pair in ((o_a, lse_a, o_b, lse_b), (o_b, lse_b, o_a, lse_a), (empty_o, empty_lse, o_b, lse_b)):
            o, lse = merge(*pair)
            assert torch.isnan(lse[1, 2, 3]) and torch.isnan(o[1, 2, 3]).all(), merge.__name__
            rest = torch.ones_like(lse, dtype=torch.bool)
            rest[1, 2, 3] = False
            assert torch.isfinite(lse[rest]).all() and torch.isfinite(o[rest]).all(), merge.__name__
    for many in (merge_many, merge_many_triton):
        o, lse = many(torch.stack([empty_o, o_b, o_a]), torch.stack([empty_lse, lse_b, lse_a]))
        assert torch.isnan(lse[1, 2, 3]) and torch.isnan(o[1, 2, 3]).all(), many.__name__


def test_plus_inf_lse_is_nan_in_both_implementations_and_empty_triton_stack():
    """An LSE of +inf (an infinite score) merges to NaN in PyTorch as in Triton; a Triton stack of
    no state is rows that saw no key, like merge_many's."""
    o = torch.randn(2, 3, 16, dtype=torch.float64)
    lse = torch.tensor([[math.inf, 0.5, -math.inf], [1.0, -math.inf, 2.0]], dtype=torch.float64)
    other = torch.zeros_like(lse)
    for merge in (merge_states, merge_states_triton):
        _, merged = merge(o, lse, o, other)
        assert torch.isnan(merged[0, 0]) and torch.isfinite(merged[0, 1:]).all(), merge.__name__
    for many in (merge_many, merge_many_triton):
        o_m, lse_m = many(torch.zeros(0, 2, 3, 16), torch.zeros(0, 2, 3))
        assert torch.equal(o_m, torch.zeros(2, 3, 16)) and torch.isneginf(lse_m).all(), many.__name__


@pytest.mark.interpreter
def test_a_float64_lse_beside_a_float32_o_merges_in_float64_on_both_implementations():
    """The public contract: any float64 operand makes the merge float64, so merge_states and its Triton twin agree.
    The Triton one had started to take its arithmetic from O alone (a change meant for our own float64 state LSEs,
    kernels/precision.STATE_LSE_DTYPE), and its float64 LSE came back float32-accurate: 5.4e-8 off (found by
    review)."""
    g = torch.Generator().manual_seed(0)
    o_a, o_b = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    lse_a, lse_b = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(2))
    want = torch.logaddexp(lse_a, lse_b)
    for o, lse in (merge_states(o_a, lse_a, o_b, lse_b), merge_states_triton(o_a, lse_a, o_b, lse_b),
                   merge_many_triton(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))):
        assert lse.dtype == torch.float64 and (lse - want).abs().max() < 1e-15
