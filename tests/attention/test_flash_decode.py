"""flash's split-KV forward (attnbench/kernels/attention/flash_decode.py) on the interpreter: against the float64
reference and FA2's query tiles, over GQA packing, row tiles, key splits (empty ones included),
both causal alignments, rows that see no key, non-finite inputs and strided views."""
import math

import pytest
import torch

from attnbench.bench import verify
from attnbench.attention import flash_attention, flash_fwd
from attnbench.kernels.attention import flash_decode
from attnbench.kernels.attention.flash_decode import DECODE_MAX_NQ, decode_applies, decode_splits, flash_decode_launch
from attnbench.kernels.attention.flash_fwd import forward_route
from attnbench.bench.verify import BOUNDS

pytestmark = pytest.mark.interpreter

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16}


def _inputs(batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, n, head_dim, generator=gen, dtype=torch.float64).to(dtype)
            for h, n in ((heads_q, n_q), (heads_kv, n_k), (heads_kv, n_k))]


def _reference(q, k, v, scale, offset):
    """float64 attention with row i seeing keys j <= i + offset; rows that see no key: (0, -inf)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * scale
    if offset is not None:
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(k.shape[2])[None, :]
        s = s.masked_fill(j > i + offset, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


def _max_rel(a, b):
    a, b = a.double(), b.double()
    both_inf = torch.isneginf(a) & torch.isneginf(b)
    diff = torch.where(both_inf, 0.0, (a - b).abs())
    return (diff.max() / b[torch.isfinite(b)].abs().max().clamp_min(1e-30)).item()


# (B, Hq, Hkv, Nq, Nk, D, causal offset, splits): interpreter blocks are 16 keys
SHAPES = [
    (2, 4, 2, 1, 37, 16, None, None),  # decode: one row per head, GQA group of 2 in one tile
    (1, 6, 2, 3, 50, 24, None, 3),  # head dim not a power of two
    (2, 2, 1, 5, 33, 32, 0, 4),  # top-left causal: row i sees keys 0..i only
    (1, 4, 4, 7, 29, 16, 22, 2),  # bottom-right causal
    (1, 2, 1, 9, 5, 16, -4, 3),  # Nq > Nk bottom-right: rows 0-3 see no key; splits past the keys are empty
    (1, 3, 1, 4, 70, 80, 66, None),
    (2, 8, 2, 20, 100, 16, 80, 5),  # 80 packed rows: two row tiles
    (1, 2, 2, 1, 70, 64, None, 9),  # more splits than key blocks
    # two column blocks (decode_head_blocks, WIDE_BLOCK lowered below): 48 = 32 + 16 with a split's blind rows,
    # 96 = 64 + 32 GQA causal
    (1, 4, 1, 6, 45, 48, -2, 3),
    (2, 6, 3, 2, 37, 96, 35, 2),
]


def test_two_column_blocks_only_where_they_fit_a_wide_head_exactly(monkeypatch):
    assert flash_decode.decode_head_blocks(160) == (128, 32) and flash_decode.decode_head_blocks(192) == (128, 64)
    # 96 = 64 + 32 ran slower on the GPU at one shape: one block of 128; 40 = 32 + 16 would mask a second block's
    # columns: one masked block of 64; powers of two stay one block
    assert flash_decode.decode_head_blocks(96) == (128, 0) and flash_decode.decode_head_blocks(40) == (64, 0)
    assert flash_decode.decode_head_blocks(72) == (128, 0) and flash_decode.decode_head_blocks(128) == (128, 0)
    assert flash_decode.decode_head_blocks(24) == (32, 0) and flash_decode.decode_head_blocks(144) == (128, 16)
    monkeypatch.setattr(flash_decode, "WIDE_BLOCK", 16)  # what the interpreter tests below run at 48 and 96
    assert flash_decode.decode_head_blocks(96) == (64, 32) and flash_decode.decode_head_blocks(48) == (32, 16)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_float64_reference(shape, monkeypatch):
    monkeypatch.setattr(flash_decode, "WIDE_BLOCK", 16)  # two column blocks at D 48, 80 and 96 (wide heads' route)
    *dims, offset, splits = shape
    q, k, v = _inputs(*dims)
    scale = dims[-1] ** -0.5
    o, lse = flash_decode_launch(q, k, v, scale, offset, num_splits=splits)
    ref_o, ref_lse = _reference(q, k, v, scale, offset)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert _max_rel(o, ref_o) < BOUNDS[torch.float64] and _max_rel(lse, ref_lse) < BOUNDS[torch.float64]
    blind = torch.isneginf(ref_lse)
    assert torch.all(o[blind] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", SHAPES[:5] + SHAPES[-2:], ids=str)
def test_low_precision_within_the_dtype_bound(shape, dtype, monkeypatch):
    monkeypatch.setattr(flash_decode, "WIDE_BLOCK", 16)  # the last two shapes in two column blocks
    *dims, offset, splits = shape
    q, k, v = _inputs(*dims, dtype=DTYPES[dtype], seed=1)
    scale = dims[-1] ** -0.5
    o, lse = flash_decode_launch(q, k, v, scale, offset, num_splits=splits)
    ref_o, ref_lse = _reference(q, k, v, scale, offset)
    assert o.dtype == DTYPES[dtype] and lse.dtype == torch.float32
    assert _max_rel(o, ref_o) < BOUNDS[DTYPES[dtype]] and _max_rel(lse, ref_lse) < BOUNDS[DTYPES[dtype]]


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_counts_agree(splits):
    """Every split count computes the same function (to fp64 rounding): the merge is exact."""
    q, k, v = _inputs(2, 4, 1, 6, 61, 32, seed=2)
    one = flash_decode_launch(q, k, v, 0.3, 55, num_splits=1)
    many = flash_decode_launch(q, k, v, 0.3, 55, num_splits=splits)
    assert all(_max_rel(a, b) < 1e-13 for a, b in zip(many, one))


def test_public_forward_takes_the_route_by_shape_and_routes_agree(monkeypatch):
    """Nq <= DECODE_MAX_NQ goes to the split-KV route, longer queries to the tiles; forcing either
    route gives the same function through the public API, and the override ends with its block."""
    from attnbench.kernels.attention import flash_fwd as module

    calls = []
    real = module.flash_decode_launch
    monkeypatch.setattr(module, "flash_decode_launch", lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    assert decode_applies(1) and decode_applies(DECODE_MAX_NQ) and not decode_applies(DECODE_MAX_NQ + 1)
    q, k, v = _inputs(2, 6, 3, 4, 45, 24, dtype=torch.float32, seed=4)
    results = {}
    for route in ("tiles", "decode", None):
        calls.clear()
        with forward_route(route):
            results[route] = flash_fwd(q, k, v, causal="bottom_right")
        assert calls == ([] if route == "tiles" else [4]), route
    assert all(_max_rel(a, b) < BOUNDS[torch.float32] for a, b in zip(results["tiles"], results["decode"]))
    calls.clear()
    long_q, long_k, long_v = _inputs(1, 2, 1, DECODE_MAX_NQ + 1, 20, 16, dtype=torch.float32)
    flash_fwd(long_q, long_k, long_v)
    assert calls == []  # no override left behind, and Nq 65 takes the tiles
    with pytest.raises(ValueError, match="route"):
        with forward_route("fast"):
            pass


def test_gradients_through_the_decode_forward():
    """The backward reads the (O, LSE) the split-KV forward saved: gradcheck in fp64, GQA, causal."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 3, 21, 16, seed=5))
    assert decode_splits(2, 21, q.device) == 2  # the forward below merges two splits
    with forward_route("decode"):
        assert verify.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal="bottom_right"), (q, k, v),
                                atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("where", ["q", "k_late", "v_late"])
def test_non_finite_input_in_one_split_is_nan_not_blind(where):
    """A NaN in a key or value that only the last split reads must still reach the merged row."""
    q, k, v = _inputs(1, 2, 1, 2, 60, 16, seed=6)
    {"q": q[0, 1, 0], "k_late": k[0, 0, 55], "v_late": v[0, 0, 55]}[where][3] = float("nan")
    o, lse = flash_decode_launch(q, k, v, 0.25, None, num_splits=4)
    if where == "q":
        assert torch.isnan(o[0, 1, 0]).all() and torch.isnan(lse[0, 1, 0])
        assert torch.isfinite(o[0, 0]).all() and torch.isfinite(o[0, 1, 1]).all()
    elif where == "k_late":
        assert torch.isnan(lse).all() and torch.isnan(o).all()
    else:
        assert torch.isnan(o[..., 3]).all() and torch.isfinite(lse).all()


def test_a_split_whose_keys_all_score_minus_inf_adds_nothing():
    """Key 16 scores -inf for every row (an infinite key): the second of two splits holds only
    that key. Its share is empty, so the answer is the one-split answer (and the reference's),
    not NaN: the split count (a function of the GPU) must not change the result."""
    q, k, v = _inputs(1, 2, 1, 3, 17, 16, seed=8)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[0, 0, 16, 0] = -math.inf
    one = flash_decode_launch(q, k, v, 0.25, None, num_splits=1)
    two = flash_decode_launch(q, k, v, 0.25, None, num_splits=2)
    ref_o, ref_lse = _reference(q, k, v, 0.25, None)
    assert torch.isfinite(two[0]).all() and torch.isfinite(two[1]).all()
    assert _max_rel(two[0], ref_o) < 1e-12 and _max_rel(two[1], ref_lse) < 1e-12
    assert _max_rel(two[0], one[0]) < 1e-13


@pytest.mark.parametrize("splits", [1, 3])
def test_every_visible_score_minus_inf_is_nan_not_blind(splits):
    """Every key scores -inf for the rows that see any: NaN there (a non-finite input), whatever the
    split count; the rows the causal mask leaves without a key stay (0, -inf)."""
    q, k, v = _inputs(1, 2, 1, 6, 40, 16, seed=9)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[..., 0] = -math.inf
    o, lse = flash_decode_launch(q, k, v, 0.25, -2, num_splits=splits)  # rows 0, 1 see no key
    assert torch.isneginf(lse[..., :2]).all() and torch.all(o[..., :2, :] == 0)
    assert torch.isnan(lse[..., 2:]).all() and torch.isnan(o[..., 2:, :]).all()


def test_strided_views_match_contiguous():
    """[B, N, H, D] storage seen as [B, H, N, D]: the kernel takes the strides, no copy needed."""
    q, k, v = _inputs(2, 4, 2, 3, 40, 16, seed=7)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    a = flash_decode_launch(*views, 0.25, 37, num_splits=3)
    b = flash_decode_launch(q, k, v, 0.25, 37, num_splits=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("width", [41, 44, 48])
def test_row_strides_off_the_vector_width_match_contiguous(width):
    """Head dim 40 read from rows of ``width`` elements: the launcher claims only the alignment the strides have
    (tiling.stride_align: 1, 4 and 8 here), and a claim too large would move every row of the interpreter's
    reads as it would the GPU's."""
    q, k, v = _inputs(2, 4, 2, 3, 40, 40, seed=8)
    views = []
    for t in (q, k, v):
        wide = torch.zeros(*t.shape[:3], width, dtype=t.dtype)
        wide[..., :40] = t
        views.append(wide[..., :40])
    a = flash_decode_launch(*views, 0.25, 37, num_splits=3)
    b = flash_decode_launch(q, k, v, 0.25, 37, num_splits=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_stride_align():
    from attnbench.kernels.tiling import stride_align

    assert stride_align(40, 40 * 7, 0) == 8
    assert stride_align(64, 128) == 16  # never above 16: Triton's own specialization covers the rest
    assert stride_align(40, 41) == 1
    assert stride_align(72, 36) == 4


def test_split_rule():
    """Enough programs for two an SM, never a split shorter than the minimum, the fewest splits
    that balance (interpreter: 4 SMs, 16 keys)."""
    cpu = torch.device("cpu")
    assert decode_splits(64 * 8, 8192, cpu) == 1  # B x Hkv already fills the "GPU"
    assert decode_splits(1, 8192, cpu) == 8
    assert decode_splits(3, 8192, cpu) == 4  # 12 programs, 3 an SM; 3 splits (9) would leave SMs uneven
    assert decode_splits(1, 20, cpu) == 2
    assert decode_splits(1, 3, cpu) == 1


def test_splits_divide_the_visible_keys(monkeypatch):
    """A top-left causal decode reads Nq keys, not Nk: the plan splits those (row i sees j <= i + offset)."""
    from attnbench.kernels.attention import flash_decode
    from attnbench.kernels.tiling import visible_key_count

    assert visible_key_count(12, 15778, 0) == 12
    assert visible_key_count(4, 100, 96) == 100  # bottom-right: every key
    assert visible_key_count(5, 9, -7) == 0  # no row sees a key
    assert visible_key_count(5, 9, None) == 9
    planned = []
    monkeypatch.setattr(flash_decode, "decode_plan", lambda *a: planned.append(a) or (16, 1, 1))
    q, k, v = _inputs(1, 2, 2, 3, 200, 16)
    flash_decode_launch(q, k, v, 0.25, 0)
    assert planned[-1][4] == 3  # three rows, top-left: keys 0-2 are all any row sees


def test_the_launch_plan_of_a_shape_is_worked_out_once(monkeypatch):
    """decode_plan remembers its answer per sizes and device: a decode loop does not score every split count on
    every call; another size is worked out again."""
    from attnbench.kernels.attention import flash_decode

    flash_decode._decode_plan.cache_clear()
    searched = []
    real = flash_decode.decode_splits
    monkeypatch.setattr(flash_decode, "decode_splits", lambda *a: searched.append(a) or real(*a))
    cpu = torch.device("cpu")
    first = flash_decode.decode_plan(2, 8, 1, 2, 8192, cpu)
    assert flash_decode.decode_plan(2, 8, 1, 2, 8192, cpu) == first and len(searched) == 1
    assert first == (16, 1, real(4, 8192, cpu))
    flash_decode.decode_plan(2, 8, 1, 2, 4096, cpu)
    assert len(searched) == 2
