"""CPU gate for the shared_context operator: every variant against the float64 oracle.

Tiny shapes (operators/shared_context TINY_SHAPES) cover context and buffer lengths that are not
block multiples (the interpreter uses 16-row tiles, 16-key context blocks, buffer steps of 4
rows, whole buffers of up to 16 keys a step and 8-key blocks of longer ones), an empty buffer,
per-sample lengths from 0 to full, GQA and MQA, head dims 24 and 80, Lq 1, 2 and 3 with a causal
buffer, rows that see no key, and several row tiles; fp32, fp16 and fp64 (bf16 runs as a float32
upcast there: the interpreter's bf16 tl.dot is wrong, and the API once returned its garbage
without an error). The split-K paths are forced with explicit split counts; the Hydragen and
stride-0 peers' folding and merging run through torch's CPU flash kernel.
"""
from dataclasses import replace

import pytest
import torch

import attnbench
from attnbench.bench import verify
from attnbench.kernels.shared_context import buffer_steps
from attnbench.operators.shared_context import GPU_SHAPES, TINY_SHAPES, SharedContextCase, peers
from attnbench.shared_context import (buffer_attention, context_attention,
                                                       shared_context_attention, shared_context_attention_composed)

from .helpers import api_args

pytestmark = pytest.mark.interpreter

OP = attnbench.get("shared_context")
CASES = [SharedContextCase(*shape, dtype=dt) for shape in TINY_SHAPES for dt in ("float32", "float16", "float64")]
OURS = ("split", "triton", "triton_composed")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_our_variants_match_float64_oracle(oracles, case):
    x, oracle, lowp = oracles(case)
    for variant in OURS:
        result = verify.check_variant(OP, variant, case, "fwd", x, oracle, lowp)
        assert not result.skipped, (variant, result.skipped)
        assert result.passed, (variant, [o for o in result.outputs if not o.passed])
        assert [o.name for o in result.outputs] == ["o", "lse"]


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"], ids=lambda c: c.label)
def test_reference_and_per_batch_peer_agree_with_oracle(oracles, case):
    """The eager reference in the case dtype and SDPA MATH on the materialized cache (where SDPA
    has an answer: rows that see no key are declined)."""
    x, oracle, lowp = oracles(case)
    ref = verify.check_variant(OP, "reference", case, "fwd", x, oracle, lowp)
    assert all(o.error < verify.BOUNDS[torch.float32] for o in ref.outputs)
    peer = verify.check_variant(OP, "per_batch_math", case, "fwd", x, oracle, lowp)
    if peer.skipped:
        assert "no key" in peer.skipped
    else:
        assert peer.passed, peer.outputs


def _buffer_path(shape, device):
    _, heads_q, heads_kv, seqlen_q, _, n_buf, head_dim = shape[:7]
    keys = buffer_steps(heads_q // heads_kv * seqlen_q, n_buf, head_dim, 2, device)[3]
    return "none" if not n_buf else "whole" if keys else "keyblocks"


@pytest.mark.parametrize("shapes, device", [(TINY_SHAPES, "cpu"), (GPU_SHAPES, "cuda")], ids=["tiny", "gpu"])
def test_case_sets_walk_both_buffer_paths(shapes, device):
    """The whole-buffer steps and the key-block walk are two kernels' worth of code: each case set
    must prove both (and, on the whole path, steps of one sample and of several)."""
    paths = {_buffer_path(shape, device) for shape in shapes}
    assert {"whole", "keyblocks"} <= paths
    samples = {buffer_steps(s[1] // s[2] * s[3], s[5], s[6], 2, device)[2] for s in shapes
               if _buffer_path(s, device) == "whole"}
    assert 1 in samples and max(samples) > 1


def test_buffer_step_rule():
    """TabPFN buffers (32 keys, D 32, 2 rows a sample) take 8 whole samples a step on a GPU (256
    keys, 32 KB of K and V); LLM buffers (hundreds of keys at D 128) and samples with more rows
    than a step holds walk key blocks; a GPU step has at least 16 keys (tl.dot's minimum)."""
    assert buffer_steps(2, 32, 32, 2, "cuda") == (16, 2, 8, 32)
    assert buffer_steps(1, 32, 32, 2, "cuda") == (16, 1, 8, 32)  # a step's key budget binds first
    assert buffer_steps(4, 512, 128, 2, "cuda")[3] == 0
    assert buffer_steps(128, 8, 32, 2, "cuda")[3] == 0  # 128 rows a sample: more than one row chunk
    _, _, samples, keys = buffer_steps(64, 3, 32, 2, "cuda")
    assert (samples, keys) == (1, 16)
    assert buffer_steps(2, 0, 32, 2, "cuda")[3] == 0


@pytest.mark.parametrize("seed", [1, 2])
def test_other_seeds_and_custom_scale(oracles, seed):
    case = replace(SharedContextCase(4, 6, 2, 2, 29, 13, 40, True, "varied", "float32"), scale=0.37)
    x, oracle, lowp = oracles(case, seed)
    for variant in OURS:
        assert verify.check_variant(OP, variant, case, "fwd", x, oracle, lowp).passed, variant


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 8])
def test_forced_split_counts_are_exact_in_fp64(oracles, splits):
    """Split-K over context and buffer, merged in the fused kernel or by merge_stack: any count
    (those a measured pick tries: 1, 2, 4, 8 and the heuristic's), including more splits than key
    blocks (empty splits), gives the oracle to fp64 rounding."""
    case = SharedContextCase(3, 4, 2, 2, 61, 14, 24, True, "varied", "float64")
    x, oracle, _ = oracles(case)
    for api in (shared_context_attention, shared_context_attention_composed):
        o, lse = api(*api_args(x), causal=True, num_splits=splits)
        torch.testing.assert_close(o, oracle["o"], rtol=0, atol=1e-13)
        torch.testing.assert_close(lse, oracle["lse"], rtol=0, atol=1e-13)


def test_split_results_are_bitwise_repeatable():
    case = SharedContextCase(5, 2, 2, 1, 70, 9, 16, False, "varied", "float32")
    x = OP.make_inputs(case, "cpu", 0)
    assert verify.bitwise_equal_runs(lambda: shared_context_attention(*api_args(x), num_splits=4), runs=3)


@pytest.mark.parametrize("variant", OURS)
def test_rows_that_see_no_key_give_zero_and_minus_inf(variant):
    """No context and an empty (or causally unreachable) buffer: O = 0 and LSE = -inf."""
    case = SharedContextCase(3, 2, 2, 2, 0, 6, 16, True, "varied", "float32")  # lengths 0, 3, 6
    x = OP.make_inputs(case, "cpu", 0)
    out = verify.run_poisoned(OP, variant, case, x, "fwd")
    assert torch.all(out["o"][0] == 0) and torch.isneginf(out["lse"][0]).all()  # sample 0: length 0
    assert torch.isfinite(out["lse"][1:]).all()
    assert torch.isfinite(out["o"]).all()


def test_poisoning_exposes_an_unwritten_output(oracles, monkeypatch):
    import attnbench.shared_context as api

    case = CASES[0]
    x, oracle, lowp = oracles(case)
    real = api.fused_launch

    def forgetful(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        from attnbench.kernels import new_output

        o[-1] = new_output(o[-1].shape, o.dtype, o.device)  # as if the last sample were never written
        return o, lse

    monkeypatch.setattr(api, "fused_launch", forgetful)
    result = verify.check_variant(OP, "triton", case, "fwd", x, oracle, lowp)
    assert not result.passed
    assert "NaN" in [o for o in result.outputs if o.name == "o"][0].detail


def test_strided_cache_views_match_contiguous():
    """A decode loop slices its caches: the buffer as [:, :, :capacity] of a larger one, the context
    as a slice of a longer prefill; q in the model's [B, Lq, H, D] memory. Same answer, no copies."""
    g = torch.Generator().manual_seed(3)
    big_kb = torch.randn(4, 2, 19, 16, generator=g, dtype=torch.float64)
    big_vb = torch.randn(4, 2, 19, 16, generator=g, dtype=torch.float64)
    big_kc = torch.randn(2, 50, 16, generator=g, dtype=torch.float64)
    big_vc = torch.randn(2, 50, 16, generator=g, dtype=torch.float64)
    q = torch.randn(4, 2, 4, 16, generator=g, dtype=torch.float64).transpose(1, 2)
    lens = torch.tensor([0, 5, 11, 12], dtype=torch.int32)
    args = (q, big_kc[:, :41], big_vc[:, :41], big_kb[:, :, :12], big_vb[:, :, :12], lens)
    contiguous = tuple(t.contiguous() for t in args)
    for api in (shared_context_attention, shared_context_attention_composed):
        o, lse = api(*args, causal=True)
        o_c, lse_c = api(*contiguous, causal=True)
        torch.testing.assert_close(o, o_c, rtol=0, atol=1e-14)
        torch.testing.assert_close(lse, lse_c, rtol=0, atol=1e-14)


def test_unchecked_lengths_out_of_range_never_read_out_of_bounds(oracles):
    """With check_lengths=False (the decode loop's hot path) the kernels clamp lengths to [0, n_buf]."""
    case = SharedContextCase(3, 2, 2, 1, 20, 8, 16, False, "full", "float64")
    x, oracle, _ = oracles(case)
    wild = torch.tensor([-5, 8, 1000], dtype=torch.int32)
    clamped = torch.tensor([0, 8, 8], dtype=torch.int32)
    args = list(api_args(x))
    for api in (shared_context_attention, shared_context_attention_composed):
        args[5] = wild
        o, lse = api(*args, check_lengths=False)
        args[5] = clamped
        o_c, lse_c = api(*args)
        torch.testing.assert_close(o, o_c, rtol=0, atol=1e-14)
        torch.testing.assert_close(lse, lse_c, rtol=0, atol=1e-14)


def test_context_and_buffer_primitives_alone(oracles):
    """context_attention is the no-buffer case; buffer_attention the no-context case."""
    from attnbench.shared_context import reference

    case = SharedContextCase(4, 4, 2, 2, 27, 10, 24, True, "varied", "float64")
    x, _, _ = oracles(case)
    q, kc, vc, kb, vb, lens = api_args(x)
    scale = case.softmax_scale
    o, lse = context_attention(q, kc, vc)
    o_r, lse_r = reference.attention(q, kc, vc, None, None, None, False, scale)
    torch.testing.assert_close(o, o_r, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=1e-13)
    o, lse = buffer_attention(q, kb, vb, lens, causal=True)
    o_r, lse_r = reference.attention(q, kc[:, :0], vc[:, :0], kb, vb, lens, True, scale)
    torch.testing.assert_close(o, o_r, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", ["fold_flash", "expand0_flash"])
@pytest.mark.parametrize("shape", [(5, 4, 4, 2, 37, 9, 32, True), (3, 8, 2, 1, 40, 6, 16, False),
                                   (4, 2, 2, 1, 33, 0, 24, False)], ids=str)
def test_folded_and_expanded_peers_logic_on_cpu(name, shape):
    """The Hydragen and stride-0 peers' folding, unfolding and merging, through torch's CPU
    flash kernel (their GPU kernels differ only in the attend_with_lse backend)."""
    case = SharedContextCase(*shape, "full", "float32")
    x = OP.make_inputs(case, "cpu", 0)
    o, lse = peers.split_peer_forward(name, case, x, backend="cpu")()
    oracle = OP.oracle(case, x)
    assert verify.relative_error(o, oracle["o"]) < 1e-5
    assert verify.relative_error(lse, oracle["lse"]) < 1e-6


def test_peers_decline_what_they_cannot_express():
    from attnbench import Unsupported

    varied = SharedContextCase(3, 2, 2, 1, 20, 8, 16, False, "varied", "float32")
    x = OP.make_inputs(varied, "cpu", 0)
    with pytest.raises(Unsupported, match="lengths"):
        peers.split_peer_forward("fold_flash", varied, x, backend="cpu")
    with pytest.raises(Unsupported, match="lengths"):
        peers.per_batch_forward("FLASH_ATTENTION", varied, x)
    gqa_causal = SharedContextCase(2, 4, 2, 2, 20, 8, 16, True, "full", "float32")
    x = OP.make_inputs(gqa_causal, "cpu", 0)
    with pytest.raises(Unsupported, match="GQA and Lq > 1"):
        peers.split_peer_forward("fold_flash", gqa_causal, x, backend="cpu")()


def test_bfloat16_runs_as_a_float32_upcast_in_the_interpreter():
    """numpy has no bfloat16 (the interpreter's bf16 dot returned values of 1e8): every entry point
    runs bf16 inputs as float32 and rounds o back, so bf16 on a CPU equals the fp32 run rounded."""
    case = SharedContextCase(3, 4, 2, 2, 40, 24, 16, True, "varied", dtype="bfloat16")
    x = OP.make_inputs(case, "cpu")
    wide = {k: v.float() if v is not None and v.is_floating_point() else v for k, v in x.items()}
    args = lambda t: (t["q"], t["k_ctx"], t["v_ctx"], t["k_buf"], t["v_buf"], t["buf_lens"])  # noqa: E731
    for api in (shared_context_attention, shared_context_attention_composed):
        o, lse = api(*args(x), causal=True)
        o32, lse32 = api(*args(wide), causal=True)
        assert o.dtype == torch.bfloat16 and torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(lse, lse32)
        assert verify.relative_error(o, OP.oracle(case, x)["o"]) < verify.BOUNDS[torch.bfloat16]
    o, _ = context_attention(x["q"], x["k_ctx"], x["v_ctx"])
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, context_attention(wide["q"], wide["k_ctx"], wide["v_ctx"])[0].to(torch.bfloat16))
    o, _ = buffer_attention(x["q"], x["k_buf"], x["v_buf"], x["buf_lens"], causal=True)
    assert torch.equal(o, buffer_attention(wide["q"], wide["k_buf"], wide["v_buf"], wide["buf_lens"],
                                           causal=True)[0].to(torch.bfloat16))
