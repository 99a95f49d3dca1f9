"""shared_context's FlashInfer cascade peer on the CPU, through a stand-in of FlashInfer (tests/peer_fakes.py):
the shared-prefix layout (the context one page under every query row, a page per sample's buffer), the
base-2 states and their merge, the head-dim padding, what it declines and why, and the check machinery's
verdict against the float64 oracle."""
import dataclasses

import pytest
import torch

import attnbench
from attnbench.bench.registry import Unsupported
from attnbench.bench.verify import check_variant
from attnbench.operators.shared_context import TINY_SHAPES, SharedContextCase, peers

from .. import peer_fakes

OP = attnbench.get("shared_context")
TINY = [SharedContextCase(*row, dtype="bfloat16") for row in TINY_SHAPES]
RUNS = [c for c in TINY if c.n_ctx and not (c.causal and c.seqlen_q > 1 and c.lengths == "varied")] + [
    SharedContextCase(5, 8, 2, 1, 40, 9, 64, False, "varied", "float16"),  # a head dim FlashInfer takes: no copy
    SharedContextCase(3, 4, 4, 3, 20, 6, 128, True, "full", "bfloat16"),
    SharedContextCase(2, 2, 1, 2, 30, 0, 256, True, "full", "float16"),  # no buffer: the shared level alone
]


def test_registered_and_unavailable_here():
    variant = OP.variants["flashinfer_cascade"]
    assert variant.kind == "peer" and "flashinfer_cascade" not in OP.available_variants("cpu")
    assert "FlashInfer" in variant.unavailable_reason(torch.device("cpu"))


@pytest.mark.parametrize("case", RUNS, ids=lambda c: c.label)
def test_cascade_verified_against_the_oracle(monkeypatch, oracles, case):
    fi = peer_fakes.install(monkeypatch, flashinfer=True)["flashinfer"]
    x, oracle, lowp = oracles(case)
    result = check_variant(OP, "flashinfer_cascade", case, "fwd", x, oracle, lowp)
    assert result.passed and not result.skipped, result
    assert [o.name for o in result.outputs] == ["o", "lse"]
    wrappers = fi.PagedWrapper.instances
    assert len(wrappers) == (2 if case.n_buf else 1)
    assert all(w.kv_layout == "HND" and w.backend == "fa2" and not w.decode for w in wrappers)
    width = {16: 64, 24: 64, 32: 64, 64: 64, 80: 128, 128: 128, 256: 256}[case.head_dim]
    rows = case.batch * case.seqlen_q
    shared = wrappers[0]
    plan, run = shared.plan_args, shared.runs[0]
    # the shared level: every query row of the batch one request over the context, one page of Nctx entries
    assert plan["qo_indptr"].tolist() == [0, rows] and plan["kv_indptr"].tolist() == [0, 1]
    assert plan["page_size"] == plan["last_page_len"].item() == case.n_ctx and plan["causal"] is False
    assert plan["head_dim"] == width and plan["sm_scale"] == case.softmax_scale
    assert run["q"].shape == (rows, case.heads_q, width) and run["k_cache"].shape == (1, case.heads_kv, case.n_ctx,
                                                                                      width)
    if width == case.head_dim:  # read in place: the context stored once, ours
        assert run["k_cache"].data_ptr() == x["k_ctx"].data_ptr() and run["v_cache"].data_ptr() == x["v_ctx"].data_ptr()
    if case.n_buf:
        plan, run = wrappers[1].plan_args, wrappers[1].runs[0]
        lens = case.buffer_lengths()
        lens = [case.n_buf] * case.batch if lens is None else lens.tolist()
        assert plan["qo_indptr"].tolist() == [b * case.seqlen_q for b in range(case.batch + 1)]
        assert plan["page_size"] == case.n_buf and plan["causal"] == case.causal
        assert plan["kv_indices"].tolist() == [b for b in range(case.batch) if lens[b]]  # an empty buffer: no page
        assert plan["last_page_len"].tolist() == lens
        if width == case.head_dim:
            assert run["k_cache"] is x["k_buf"] and run["v_cache"] is x["v_buf"]


@pytest.mark.parametrize("case, reason", [
    (TINY[4], "no shared context"),
    (TINY[1], "rows that see no buffer key"),  # causal Lq 3, sample 0's buffer empty
    (dataclasses.replace(TINY[0], dtype="float32"), "fp16/bf16, not float32"),
    (SharedContextCase(2, 2, 2, 1, 10, 4, 288, dtype="bfloat16"), "up to 256, not 288"),
], ids=lambda v: v if isinstance(v, str) else v.label)
def test_cascade_declines_with_the_reason(monkeypatch, case, reason):
    fi = peer_fakes.install(monkeypatch, flashinfer=True)["flashinfer"]
    assert reason in peers.flashinfer_cascade_declines(case)
    with pytest.raises(Unsupported, match=reason):
        peers.flashinfer_cascade_forward(case, OP.make_inputs(case, "cpu"))
    assert not fi.PagedWrapper.instances


def test_levels_describe_varied_buffers():
    case = SharedContextCase(4, 2, 1, 2, 7, 6, 64, False, "varied")  # lengths 0, 2, 4, 6
    shared, unique = peers.flashinfer_cascade_levels(case, torch.device("cpu"))
    assert unique["kv_indptr"].tolist() == [0, 0, 1, 2, 3] and unique["kv_indices"].tolist() == [1, 2, 3]
    assert unique["last_page_len"].tolist() == [0, 2, 4, 6] and unique["qo_indptr"].tolist() == [0, 2, 4, 6, 8]
    assert shared["qo_indptr"].tolist() == [0, 8] and shared["page_size"] == 7
    assert all(t.dtype == torch.int32 for level in (shared, unique) for t in level.values()
               if isinstance(t, torch.Tensor))
