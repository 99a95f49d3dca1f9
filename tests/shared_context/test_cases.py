"""shared_context case sets, seeded inputs and the analytic cost model (FLOPs, bytes, the seed's
memory-traffic table)."""
import pytest
import torch

import attnbench
from attnbench.operators.shared_context import (ANCHOR_SHAPES, TINY_SHAPES, UNUSED_K, SharedContextCase,
                                                memory_traffic)

OP = attnbench.get("shared_context")


@pytest.mark.parametrize("set_name", ["tiny", "gpu", "anchor", "sweep", "tabpfn"], ids=lambda s: f"set_{s}")
def test_case_sets_non_empty_with_unique_labels(set_name):
    cases = OP.cases(set_name)
    assert cases and all(isinstance(c, SharedContextCase) for c in cases)
    labels = [c.label for c in cases]
    assert len(set(labels)) == len(labels)
    with pytest.raises(ValueError, match="bogus"):
        OP.cases("bogus")


def test_tiny_set_covers_the_corners():
    """What the CPU gate must exercise (interpreter blocks: 16 rows, 16 context keys, 2-8 buffer keys)."""
    cases = [SharedContextCase(*s) for s in TINY_SHAPES]
    assert any(c.n_ctx % 16 and c.n_ctx > 16 for c in cases)
    assert any(c.n_buf % 8 and c.n_buf > 8 for c in cases)
    assert any(c.n_buf == 0 for c in cases) and any(c.n_ctx == 0 for c in cases)
    lens = [c.buffer_lengths() for c in cases if c.lengths == "varied"]
    assert any((l == 0).any() for l in lens) and any((l == c).any() for l, c in zip(lens, [c.n_buf for c in cases
                                                                                          if c.lengths == "varied"]))
    assert any(c.heads_q != c.heads_kv and c.heads_kv > 1 for c in cases)  # GQA
    assert any(c.heads_kv == 1 and c.heads_q > 1 for c in cases)  # MQA
    assert {24, 80} <= {c.head_dim for c in cases}
    assert {1, 2} <= {c.seqlen_q for c in cases} and any(c.seqlen_q > 2 and c.causal for c in cases)
    assert any(c.batch * c.group * c.seqlen_q > 16 for c in cases)  # several row tiles


def test_tabpfn_set_is_the_issues_whole_grid():
    """Issue 7's TabPFN regime, every (B, Lq, Nctx, Nbuf) once, H4 D32 bf16 with full buffers."""
    cases = OP.cases("tabpfn")
    grid = {(c.batch, c.seqlen_q, c.n_ctx, c.n_buf) for c in cases}
    assert len(cases) == len(grid) == 3 * 2 * 3 * 2
    assert {b for b, *_ in grid} == {256, 1024, 4096} and {n for _, _, n, _ in grid} == {512, 2048, 10000}
    assert all((c.heads_q, c.heads_kv, c.head_dim, c.dtype, c.lengths) == (4, 4, 32, "bfloat16", "full")
               for c in cases)
    assert OP.case_sets == ("tiny", "gpu", "anchor", "sweep", "tabpfn", "odd")


def test_anchor_set_is_the_issues_regimes():
    cases = OP.cases("anchor")
    assert all(c.dtype == "bfloat16" and c.lengths == "full" for c in cases)
    assert SharedContextCase(1024, 4, 4, 2, 2048, 32, 32) in cases  # the issue's measured case
    tabpfn = [c for c in cases if c.head_dim == 32]
    llm = [c for c in cases if c.head_dim == 128]
    assert {c.batch for c in tabpfn} == {256, 1024, 4096} and {c.seqlen_q for c in tabpfn} == {1, 2}
    assert {c.n_buf for c in tabpfn} == {0, 32} and {512, 2048, 10000} == {c.n_ctx for c in tabpfn}
    assert all(c.heads_q == 32 and c.heads_kv == 8 and c.seqlen_q == 1 and 4096 <= c.n_ctx <= 16384
               and c.n_buf <= 512 and 256 <= c.batch <= 1024 for c in llm)
    assert len(ANCHOR_SHAPES) == len(cases)


def test_varied_lengths_span_zero_to_full():
    c = SharedContextCase(5, 2, 2, 1, 10, 7, 16, lengths="varied")
    assert c.buffer_lengths().tolist() == [0, 1, 3, 5, 7]
    assert SharedContextCase(5, 2, 2, 1, 10, 7, 16).buffer_lengths() is None
    with pytest.raises(ValueError, match="lengths"):
        SharedContextCase(5, 2, 2, 1, 10, 7, 16, lengths="ragged")


def test_label_distinguishes_what_matters():
    base = SharedContextCase(8, 4, 4, 2, 100, 10, 32)
    variants = [base, SharedContextCase(8, 4, 2, 2, 100, 10, 32), SharedContextCase(8, 4, 4, 2, 100, 10, 32, True),
                SharedContextCase(8, 4, 4, 2, 100, 10, 32, lengths="varied"),
                SharedContextCase(8, 4, 4, 2, 100, 10, 32, dtype="float16"),
                SharedContextCase(8, 4, 4, 2, 100, 10, 32, scale=0.5), SharedContextCase(8, 4, 4, 1, 100, 10, 32)]
    assert len({c.label for c in variants}) == len(variants)
    assert base.label == "B8 H4 Lq2 ctx100 buf10 D32 bf16"


def test_make_inputs_shapes_layout_and_seed():
    case = SharedContextCase(3, 4, 2, 2, 9, 5, 16, True, "varied", "float16")
    x = OP.make_inputs(case, "cpu", seed=1)
    assert x["q"].shape == (3, 4, 2, 16) and x["q"].transpose(1, 2).is_contiguous()  # the model's layout
    assert x["k_ctx"].shape == (2, 9, 16) and x["k_buf"].shape == (3, 2, 5, 16)
    assert x["buf_lens"].tolist() == [0, 2, 5] and x["buf_lens"].dtype == torch.int32
    assert torch.all(x["k_buf"][0] == UNUSED_K) and torch.all(x["k_buf"][1, :, 2:] == UNUSED_K)
    assert not (x["k_buf"][2] == UNUSED_K).any()
    again, other = OP.make_inputs(case, "cpu", seed=1), OP.make_inputs(case, "cpu", seed=2)
    for name in ("q", "k_ctx", "v_ctx", "k_buf", "v_buf"):
        assert torch.equal(x[name], again[name]) and not torch.equal(x[name], other[name])
        assert x[name].dtype == torch.float16


def _brute_force_buffer_pairs(case):
    lens = case.buffer_lengths() if case.lengths == "varied" else torch.full((case.batch,), case.n_buf)
    pairs = 0
    for b in range(case.batch):
        for i in range(case.seqlen_q):
            for j in range(case.n_buf):
                pairs += j < lens[b] and (not case.causal or j <= lens[b] - case.seqlen_q + i)
    return int(pairs)


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=str)
def test_flops_count_visible_pairs(shape):
    case = SharedContextCase(*shape)
    pairs = case.batch * case.seqlen_q * case.n_ctx + _brute_force_buffer_pairs(case)
    assert OP.flops(case, "fwd") == 4 * case.heads_q * case.head_dim * pairs


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=str)
def test_bytes_read_context_once_and_valid_buffer_entries(shape):
    case = SharedContextCase(*shape, dtype="float16")
    x = OP.make_inputs(case, "cpu")
    item = 2
    lens = x["buf_lens"] if x["buf_lens"] is not None else torch.full((case.batch,), case.n_buf)
    expected = (2 * x["q"].numel() * item  # q read, o written
                + case.batch * case.heads_q * case.seqlen_q * 4  # lse
                + (x["k_ctx"].numel() + x["v_ctx"].numel()) * item  # the context, once
                + 2 * case.heads_kv * int(lens.sum()) * case.head_dim * item  # valid buffer entries
                + (4 * case.batch if x["buf_lens"] is not None else 0))
    assert OP.bytes(case, "fwd") == expected


def test_memory_traffic_reproduces_the_seeds_table():
    """The seed: B512 H4 Nc100 D32 in 2-byte floats, K alone: 13 MB per layer per-batch vs 25.6 KB shared
    (~500x). Our table counts K and V, so twice each; the ratio is the batch."""
    t = memory_traffic(SharedContextCase(512, 4, 4, 1, 100, 0, 32))
    assert t["context_per_batch"] == 2 * 13_107_200 and t["context_shared"] == 2 * 25_600
    assert t["context_per_batch"] / t["context_shared"] == 512
    assert t["per_batch_total"] > t["shared_total"]


def test_cost_model_rejects_unknown_mode():
    case = SharedContextCase(2, 2, 2, 1, 8, 4, 16)
    for call in (lambda: OP.flops(case, "bwd"), lambda: OP.bytes(case, "bwd"), lambda: OP.outputs("bwd")):
        with pytest.raises(ValueError, match="mode"):
            call()


def test_variants_and_availability_on_cpu():
    available = OP.available_variants("cpu")
    for name in ("reference", "split", "triton", "triton_composed", "per_batch_math"):
        assert name in available
    for name in ("per_batch_flash", "per_batch_cudnn", "expand0_flash", "fold_flash", "fold_cudnn"):
        assert name in OP.variants and name not in available
    assert OP.baseline("cpu") == "reference"
    assert set(OP.gate_baselines) <= set(OP.variants) and set(OP.ratio_peers) <= set(OP.variants)
    assert [v.kind for v in OP.variants.values()].count("triton") == 2
