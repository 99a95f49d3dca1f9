"""The attention launchers' copies and sums as planned Triton kernels (attnbench/kernels/attention/copies.py), through
the interpreter: the same values as the PyTorch ops they stand for (the copies bit for bit, over dtypes, strides,
head repeats, empty tensors; the sums in fp32 or fp64, rounded once), and a refusal where the shares' layout is not
what the kernel reads."""
import pytest
import torch
import torch.nn.functional as F

from attnbench.kernels.attention.copies import by_kernel, copy_heads, copy_heads_each, copy_route, grouped, sum_shares

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(autouse=True)
def kernels():
    """copy_heads and sum_shares run PyTorch's ops unless the route says otherwise: these tests hold the kernels."""
    with copy_route("triton"):
        yield


def _sources(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 40, generator=g).to(dtype)
    transposed = torch.randn(2, 5, 3, 40, generator=g).to(dtype).transpose(1, 2)  # heads and rows swapped in memory
    columns_strided = torch.randn(2, 3, 40, 5, generator=g).to(dtype).transpose(2, 3)  # a column stride of 5
    expanded = x[:, :1].expand(2, 3, 5, 40)  # head stride 0
    rows_41 = torch.randn(2, 3, 5, 41, generator=g).to(dtype)[..., :40]  # strides claim alignment 1 (tiling.aligned)
    rows_44 = torch.randn(2, 3, 5, 44, generator=g).to(dtype)[..., :40]  # ... and 4
    return {"contiguous": x, "transposed": transposed, "narrow": x[..., :37], "one row": x[:, :, :1],
            "column stride 5": columns_strided, "expanded": expanded, "rows of 41": rows_41, "rows of 44": rows_44}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_heads_pads_cuts_and_repeats_bitwise_like_torch(dtype):
    for name, src in _sources(dtype).items():
        for width in (48, 64, src.shape[-1], 16):  # a pad, a wider pad, a plain copy, a cut
            want = (F.pad(src, (0, width - src.shape[-1])) if width >= src.shape[-1]
                    else src[..., :width].contiguous())
            got = copy_heads(src, width)
            assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, want), (name, width)
        for repeat in (1, 3):
            got = copy_heads(src, repeat=repeat)
            assert torch.equal(got, src.repeat_interleave(repeat, dim=1)), (name, repeat)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_grouped_copies_are_each_copy_bit_for_bit_in_a_launch_per_layout(dtype, monkeypatch):
    """copy_heads_each by the "grouped" route: each result is copy_heads' own, bit for bit, while the sources of one
    layout (up to GROUP_MAX) share a launch: a padded backward's do, q, o and k, v make two, not five."""
    from attnbench.kernels.attention import copies

    sources = _sources(dtype)
    g = torch.Generator().manual_seed(5)
    group = [sources["contiguous"], *(torch.randn(2, 3, 5, 40, generator=g).to(dtype) for _ in range(3))]
    mixed = [*group, sources["transposed"], sources["rows of 41"], sources["expanded"]]
    launches = []
    real = copies._launch_copies
    monkeypatch.setattr(copies, "_launch_copies", lambda s, w, r: launches.append(len(s)) or real(s, w, r))
    for width, repeat in ((48, 1), (40, 1), (16, 1), (None, 3)):
        want = [copy_heads(t, width, repeat) for t in mixed]
        launches.clear()
        with copy_route("grouped"):
            got = copy_heads_each(width, *mixed, repeat=repeat)
        assert all(a.is_contiguous() and torch.equal(a, b) for a, b in zip(got, want, strict=True)), width
        # four of one layout: three, then one; each other source alone
        assert sorted(launches) == [1, 1, 1, 1, 3], launches
    launches.clear()
    copy_heads_each(48, *group)  # this file's fixture (triton@copies): a launch a tensor
    assert launches == [1, 1, 1, 1]
    launches.clear()
    with copy_route(None):  # the default since timed: grouped
        copy_heads_each(48, *group)
    assert sorted(launches) == [1, 3]


def test_copy_heads_of_an_empty_tensor_allocates_only():
    src = torch.empty(2, 3, 0, 40)
    assert copy_heads(src, 48).shape == (2, 3, 0, 48)
    assert copy_heads(torch.empty(0, 3, 4, 8), repeat=2).shape == (0, 6, 4, 8)


def _summed_in_order(shares, dim):
    """The shares along ``dim`` added one after another in index order, in their dtype."""
    total = shares.select(dim, 0).clone()
    for i in range(1, shares.shape[dim]):
        total += shares.select(dim, i)
    return total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sum_shares_is_the_sum_in_the_accumulator_dtype_rounded_once(dtype):
    g = torch.Generator().manual_seed(1)
    shares = torch.randn(3, 2, 4, 5, 7, generator=g).to(dtype if dtype == torch.float64 else torch.float32)
    exact = shares.to(torch.float64)
    for dim in range(shares.dim()):
        got = sum_shares(shares, dim, dtype)
        want = exact.sum(dim)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.float64:  # fp64 shares added in index order, as torch adds a few: exact here
            assert torch.equal(got, shares.sum(dim))
        elif dtype == torch.float32:  # the fp32 adds in index order, bit for bit (four shares loaded at a time)
            assert torch.equal(got, _summed_in_order(shares, dim)), dim
        else:  # fp32 sums of 2-7 terms (a few fp32 roundings), then one rounding to the dtype: within 2 ulp
            ulp = torch.finfo(dtype).eps
            assert torch.allclose(got.double(), want, rtol=2 * ulp, atol=2 * ulp), dim


def test_sum_shares_refuses_shares_that_are_not_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        sum_shares(torch.randn(4, 3).t(), 0, torch.float32)
    assert sum_shares(torch.empty(3, 0, 2), 0, torch.float32).shape == (0, 2)


def test_the_route_switch_forces_either_way_and_the_default_is_the_kernels_since_timed():
    from attnbench.kernels.attention import copies

    with copy_route(None):
        assert copies.TRITON_COPIES_BY_DEFAULT is True and by_kernel()
        assert copies.GROUPED_COPIES_BY_DEFAULT is True and grouped()  # since timed (grouped-copies.json)
    assert by_kernel() and not grouped()  # this file's fixture: triton@copies
    with copy_route("torch"):
        assert not by_kernel() and not grouped()
    with copy_route("triton"):
        assert by_kernel() and not grouped()
    with copy_route("grouped"):
        assert by_kernel() and grouped()
    with pytest.raises(ValueError, match="expected one of"):
        with copy_route("cuda"):
            pass


def test_the_copy_routes_decline_only_where_they_differ_from_the_default():
    """triton@torch-copies runs where a GPU's default copies or sums: a padded head dim, a dQ split (runs of 128 keys
    where the rows fit one block, 512 otherwise), a head group the per-head rule may take (its K/V repeats and share
    sums). triton@copies (a launch a tensor) and triton@grouped-copies run where the default groups copies: a padded
    head dim or the per-head K/V repeats; elsewhere each is the default's route."""
    from attnbench.operators.flash import FlashCase
    from attnbench.operators.flash.routes import _nothing_copied, _nothing_grouped

    def case(hq, hkv, nq, nk, d):
        return FlashCase(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d)

    assert "nothing is copied" in _nothing_copied(case(8, 8, 512, 512, 64))
    assert "nothing is copied" in _nothing_copied(case(8, 2, 512, 512, 64))  # too few rows for the per-head rule
    assert _nothing_copied(case(8, 8, 512, 512, 72)) is None  # padded to 80
    assert _nothing_copied(case(8, 2, 2048, 512, 64)) is None  # per-head: repeats and sums
    assert _nothing_copied(case(8, 8, 4, 8192, 64)) is None  # the dQ pass's keys may split
    assert _nothing_copied(case(8, 8, 4, 512, 64)) is None  # 4 runs of the few-row split's 128 keys
    assert "nothing is copied" in _nothing_copied(case(8, 8, 4, 511, 64))
    assert "nothing is copied" in _nothing_copied(case(8, 8, 65, 2047, 64))  # 65 rows: runs of 512
    assert _nothing_grouped(case(8, 8, 512, 512, 72)) is None
    assert _nothing_grouped(case(8, 2, 2048, 512, 64)) is None
    assert "default's route" in _nothing_grouped(case(8, 8, 4, 8192, 64))  # a split's sum: one kernel either way


def test_a_gpu_sized_sum_spreads_and_keeps_the_order(monkeypatch):
    """The GPU's block rule (two programs an SM, at least SUM_MIN_BLOCK elements; the interpreter's blocks are 64):
    32 shares of a 2688-element dQ were one program on an H200 (10.8 us); each element's adds stay in index order."""
    from attnbench.kernels.attention import copies

    monkeypatch.setattr(copies, "_block_elements", lambda device: copies.BLOCK_ELEMENTS)
    monkeypatch.setattr(copies, "multiprocessors", lambda device: 132)
    blocks, real = [], copies.planned

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            blocks.append(grid[0])
            return real(self.kernel)[grid]

    monkeypatch.setattr(copies, "planned", Counted)
    g = torch.Generator().manual_seed(3)
    shares = torch.randn(7, 2688, generator=g)
    got = sum_shares(shares, 0, torch.float32)
    assert torch.equal(got, _summed_in_order(shares, 0))
    assert blocks == [11]  # 2688 / 264 programs wants blocks of 16: SUM_MIN_BLOCK's 256, 11 of them (was 1 of 4096)
