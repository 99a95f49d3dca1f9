"""GPU gate for the flash operator (skipped without CUDA; scripts/gpu_gate.sh runs it).

bf16 and fp16 at real sizes against the float64 oracle, every mode, for our variants and the peers
that support the case; bitwise determinism of the backward; and a perf gate: the shipped Triton
kernels must still beat the baseline they replace (SDPA FLASH) on an anchor case.
"""
import pytest
import torch

import attnbench
from attnbench.bench import verify
from attnbench.operators.flash import FlashCase
from attnbench.bench.runner import bench

from .helpers import check_tma_route_refuses_40_byte_rows

pytestmark = pytest.mark.gpu


def gpu_cases():
    return attnbench.get("flash").cases("gpu")


@pytest.mark.parametrize("case", gpu_cases(), ids=lambda c: c.label)
def test_our_variants_match_oracle_at_real_sizes(flash, oracles, case):
    x, oracle, lowp = oracles(case)
    for variant in ("triton", "split"):
        for mode in flash.modes:
            result = verify.check_variant(flash, variant, case, mode, x, oracle, lowp)
            assert result.passed, (variant, mode, result.skipped, [o for o in result.outputs if not o.passed])


@pytest.mark.parametrize("case", [c for c in gpu_cases() if (c.causal_offset or 0) >= 0][:4], ids=lambda c: c.label)
def test_peers_that_run_are_correct_too(flash, oracles, case):
    """A peer may not support a case (it says why), but when it runs it must be right, or our
    side-by-side numbers compare against a wrong answer. (Cases with rows that see no key are
    left out: SDPA declines them, see peers.sdpa_forward.)"""
    x, oracle, lowp = oracles(case)
    ran = 0
    for variant in ("sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn"):
        result = verify.check_variant(flash, variant, case, "fwd_bwd", x, oracle, lowp)
        if not result.skipped:
            ran += 1
            assert all(o.error <= verify.BOUNDS[case.torch_dtype] for o in result.outputs), (variant, result.outputs)
    assert ran >= 1


@pytest.mark.parametrize("case", [FlashCase(2, 8, 2, 1000, 777, 128, "bottom_right", "bfloat16"),
                                  FlashCase(1, 8, 8, 2048, 2048, 64, "top_left", "float16"),
                                  FlashCase(1, 4, 2, 700, 900, 160, "bottom_right", "bfloat16")],  # two column blocks
                         ids=lambda c: c.label)
def test_backward_is_bitwise_deterministic(flash, case):
    x = flash.make_inputs(case, "cuda", 0)
    assert verify.bitwise_equal_runs(flash.variants["triton"].prepare(case, x, "bwd"), runs=3)


def _repeats_and_agrees_with_the_tiles(flash, case, x, route):
    """The triton forward on ``route`` repeats bit for bit (three runs) and computes what FA2's pointer tiles
    compute, to the dtype's bound."""
    from attnbench.kernels.attention.flash_fwd import forward_route

    with forward_route(route):
        fn = flash.variants["triton"].prepare(case, x, "fwd")
        assert verify.bitwise_equal_runs(fn, runs=3)
        ours = fn()
    with forward_route("tiles"):
        tiles = flash.variants["triton"].prepare(case, x, "fwd")()
    for name in ("o", "lse"):
        assert verify.relative_error(ours[name], tiles[name]) < verify.BOUNDS[case.torch_dtype], name


@pytest.mark.parametrize("route", ["atomic", "tma_atomic"])
@pytest.mark.parametrize("case", [FlashCase(2, 8, 2, 1000, 777, 128, "bottom_right", "bfloat16"),
                                  FlashCase(1, 4, 2, 700, 900, 160, "top_left", "float16"),  # 128 + 32 columns
                                  FlashCase(2, 4, 4, 333, 517, 96, None, "bfloat16"),  # 64 + 32 columns
                                  FlashCase(1, 2, 1, 65, 4099, 64, "bottom_right", "float16")],  # one query tile
                         ids=lambda c: c.label)
def test_atomic_dq_routes_match_the_oracle_on_their_first_call_after_tuning(flash, oracles, case, route,
                                                                           tuned_kernels):
    """The atomic dQ routes add into a buffer the autotuner runs every config on: the call that tunes
    must still return dS K summed once (reset_to_zero), within the dtype's bound. "tma_atomic" adds
    whole tiles through the copy engine: rows past N_Q and columns past D are clipped by the
    descriptor (a query length off the tile, head dims in two column blocks)."""
    from attnbench.kernels.attention.flash_bwd import dq_route

    x, oracle, lowp = oracles(case, 0)
    with dq_route(route):
        result = verify.check_variant(flash, "triton", case, "bwd", x, oracle, lowp)
    assert result.passed, [o for o in result.outputs if not o.passed]


@pytest.mark.parametrize("route", [None, "tiles", "tma"])
@pytest.mark.parametrize("case", [FlashCase(1, 2, 2, 129, 257, 72, "top_left", "float16"),
                                  FlashCase(1, 2, 2, 129, 257, 88, None, "float16"),
                                  FlashCase(2, 4, 2, 333, 517, 72, "bottom_right", "bfloat16"),
                                  FlashCase(1, 2, 1, 129, 257, 40, None, "bfloat16")], ids=lambda c: c.label)
def test_head_dims_with_a_masked_column_block_match_the_oracle(flash, oracles, case, route):
    """D 72 and 88 at an odd query length: Triton 3.6 miscompiled the pointer forward there (out-of-range
    shared memory, or outputs off by 0.85; results/gpu/nvidia-h100/odd-dims-configs.log), so the launchers
    run them zero-padded to the column blocks' width (attnbench/kernels/attention/head_padding.py)."""
    from attnbench.kernels.attention.flash_fwd import forward_route

    x, oracle, lowp = oracles(case, 0)
    with forward_route(route):
        result = verify.check_variant(flash, "triton", case, "fwd_bwd", x, oracle, lowp)
    assert result.passed, [o for o in result.outputs if not o.passed]


def hopper_cases():
    """The GPU cases the Gluon forward takes (D 40-256 in steps of 8), and shapes that stress its key ring:
    many key blocks, keys ending one past a block, GQA with odd lengths, blind rows, D past a power of two, and
    head dims beyond the 64/128/256-column anchors (D 40, 72, 112: the default's too, D 40 by size; 136, 248: the
    forced route's only)."""
    from attnbench.kernels.attention.flash_fwd_hopper import HOPPER_HEAD_DIMS

    return [c for c in gpu_cases() if c.head_dim in HOPPER_HEAD_DIMS] + [
        FlashCase(1, 4, 4, 4096, 4096, 128, None, "bfloat16"),
        FlashCase(1, 4, 4, 4096, 4096, 128, "top_left", "float16"),
        FlashCase(2, 4, 1, 130, 129, 64, None, "bfloat16"),
        FlashCase(1, 6, 3, 257, 1029, 64, "top_left", "float16"),
        FlashCase(1, 4, 2, 1500, 1000, 64, "bottom_right", "bfloat16"),
        FlashCase(2, 4, 2, 1000, 1300, 256, "top_left", "bfloat16"),
        FlashCase(1, 4, 4, 700, 900, 96, None, "float16"),
        # head dims past a tile's anchor width: each tile width, the columns past D zero-filled
        FlashCase(2, 4, 2, 300, 333, 40, "top_left", "bfloat16"),
        FlashCase(1, 4, 4, 257, 257, 72, None, "float16"),
        FlashCase(1, 4, 1, 190, 400, 112, "bottom_right", "bfloat16"),
        FlashCase(1, 2, 2, 300, 300, 136, "top_left", "float16"),
        FlashCase(1, 2, 2, 129, 260, 248, None, "bfloat16")]


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward runs on sm_90 only")


ROUTE_CASES = [("tma", c) for c in gpu_cases()] + [("hopper", c) for c in hopper_cases()]


@pytest.mark.parametrize("route,case", ROUTE_CASES, ids=lambda x: x if isinstance(x, str) else x.label)
def test_forward_route_matches_oracle_repeats_bitwise_and_agrees_with_the_tiles(flash, oracles, route, case):
    """A Hopper forward route: the query tiles through tensor descriptors ("tma", every GPU shape: odd
    lengths, GQA, D 80/96/160/192 in two column blocks) or the Gluon wgmma kernel ("hopper", its head
    dims): the forward and the backward that reads its (O, LSE) against float64, bit-for-bit repeats,
    and the pointer tiles' answer to the dtype's bound."""
    from attnbench.kernels.attention.flash_fwd import forward_route

    if route == "hopper":
        _needs_sm90()
    elif torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors (TMA) need compute capability 9.0")
    x, oracle, lowp = oracles(case)
    with forward_route(route):
        for mode in ("fwd", "fwd_bwd"):
            result = verify.check_variant(flash, "triton", case, mode, x, oracle, lowp)
            assert result.passed, (mode, [o for o in result.outputs if not o.passed])
    _repeats_and_agrees_with_the_tiles(flash, case, x, route)


def _hopper_dkdv_cases():
    from attnbench.kernels.attention.flash_bwd_hopper import HOPPER_DKDV_HEAD_DIMS

    return [c for c in hopper_cases() if c.head_dim in HOPPER_DKDV_HEAD_DIMS and c.seqlen_q > 1]


@pytest.mark.parametrize("case", _hopper_dkdv_cases(), ids=lambda c: c.label)
def test_hopper_dkdv_route_matches_oracle_and_repeats_bitwise(flash, oracles, case):
    """The Gluon dK/dV pass (dkdv_route("hopper"), not the default): the backward against float64 and
    bit-for-bit repeats, at the shapes the forward route is tested on (GQA groups, blind rows, odd lengths)."""
    from attnbench.kernels.attention.flash_bwd import dkdv_route

    _needs_sm90()
    x, oracle, lowp = oracles(case)
    with dkdv_route("hopper"):
        result = verify.check_variant(flash, "triton", case, "bwd", x, oracle, lowp)
        assert result.passed, [o for o in result.outputs if not o.passed]
        assert verify.bitwise_equal_runs(flash.variants["triton"].prepare(case, x, "bwd"), runs=3)


def test_hopper_route_reads_any_aligned_strides_and_keeps_nan_and_blind_rows_apart():
    """[B, N, H, D] storage seen as [B, H, N, D] (strided heads) gives the contiguous answer; a NaN
    key makes the rows that see it NaN while rows that see no key stay (O = 0, LSE = -inf)."""
    from attnbench.attention import flash_fwd
    from attnbench.kernels.attention.flash_fwd import forward_route

    _needs_sm90()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, n, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
               for n, h in ((300, 8), (200, 2), (200, 2)))
    with forward_route("hopper"):
        o, lse = flash_fwd(q, k, v, causal="bottom_right")
    with forward_route("tiles"):
        o_ref, lse_ref = flash_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal="bottom_right")
    assert verify.relative_error(o, o_ref) < verify.BOUNDS[torch.bfloat16]
    blind = torch.arange(300, device="cuda") < 100  # bottom-right: row i sees keys j <= i - 100
    assert torch.all(o[:, :, blind] == 0) and torch.all(lse[:, :, blind] == float("-inf"))
    k = k.clone()
    k[0, 0, 5, 0] = float("nan")  # key 5 of batch 0, KV head 0: seen by query heads 0-3 from row 105
    with forward_route("hopper"):
        o, lse = flash_fwd(q, k, v, causal="bottom_right")
    assert torch.all(torch.isnan(lse[0, :4, 105:])) and torch.all(torch.isnan(o[0, :4, 105:]))
    assert torch.all(lse[0, :4, :100] == float("-inf")) and torch.all(torch.isfinite(lse[0, 4:, 100:]))


def test_hopper_route_refuses_what_it_does_not_take():
    """D 36 (rows of 72 bytes: not whole 16-byte groups), fp32 and a 16-byte-misaligned base: the forced route
    says so before any kernel runs."""
    from attnbench.attention import flash_fwd
    from attnbench.kernels.attention.flash_fwd import forward_route

    _needs_sm90()
    bad = [torch.randn(1, 2, 100, 36, device="cuda", dtype=torch.bfloat16),
           torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float32),
           torch.randn(1, 2, 100, 64 * 2 + 4, device="cuda", dtype=torch.bfloat16)[..., 4:68]]
    for q in bad:
        with pytest.raises(ValueError, match="route 'hopper'"):
            with forward_route("hopper"):
                flash_fwd(q, q, q)


def test_tma_route_refuses_strides_the_copy_engine_cannot_take():
    """A row stride of 40 bytes (D 20 in fp16) cannot be a descriptor's: the forced route
    says so before any kernel runs, and the default route takes the pointer tiles."""
    check_tma_route_refuses_40_byte_rows("cuda", 100)


def test_decode_route_is_bitwise_deterministic_and_agrees_with_the_tiles(flash):
    """The split-KV forward (several splits here, merged in a fixed order) repeats bit for bit and
    computes what FA2's query tiles compute, to the dtype's bound."""
    case = FlashCase(4, 32, 8, 3, 8191, 128, "bottom_right", "bfloat16")
    x = flash.make_inputs(case, "cuda", 0)
    _repeats_and_agrees_with_the_tiles(flash, case, x, "decode")


def test_decode_route_past_65535_batch_times_kv_heads():
    """B x Hkv = 65536 (MHA decode, B 2048 H 32): batch and heads have grid axes of their own, so the
    launch stays within CUDA's 65535 a non-leading axis (it failed with 'invalid argument')."""
    from attnbench.attention import flash_fwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2048, 32, 1, 16, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn(2048, 32, 8, 16, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    o, lse = flash_fwd(q, k, v)
    ref = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / 4, -1) @ v.double()
    assert verify.relative_error(o, ref) < verify.BOUNDS[torch.float16]


def test_rows_that_see_no_key_on_gpu(flash):
    for case in (FlashCase(1, 4, 4, 300, 100, 64, "bottom_right", "bfloat16"),
                 FlashCase(1, 4, 2, 50, 20, 64, "bottom_right", "bfloat16")):  # the second: split-KV route
        x = flash.make_inputs(case, "cuda", 0)
        blind = case.seqlen_q - case.seqlen_k
        fwd = verify.run_poisoned(flash, "triton", case, x, "fwd")
        assert torch.isneginf(fwd["lse"][:, :, :blind]).all() and torch.isfinite(fwd["lse"][:, :, blind:]).all()
        out = verify.run_poisoned(flash, "triton", case, x, "fwd_bwd")
        assert torch.all(out["o"][:, :, :blind] == 0)
        assert all(torch.isfinite(t).all() for t in out.values())


@pytest.mark.perf
def test_triton_beats_sdpa_flash_on_an_anchor_case(flash, tuned_kernels):
    """Perf gate: the Triton kernels earn their place only while they beat what they replace.
    Measured on an H200 (bf16): fwd 1.37x, bwd 1.30x SDPA FLASH; the gate asks for >= 1.0x."""
    case = flash.cases("anchor")[0]
    rows = bench(flash, [case], "cuda", variants=["triton", "sdpa_flash"], modes=["fwd", "bwd"],
                 baseline="sdpa_flash", progress=False)
    for row in rows:
        assert row.timing is not None, row.skipped
        assert row.max_error < verify.BOUNDS[case.torch_dtype]
        if row.variant == "triton":
            assert row.speedup >= 1.0, f"{row.mode}: triton is {row.speedup:.2f}x SDPA FLASH"


@pytest.mark.perf
def test_decode_reads_kv_near_copy_bandwidth_and_beats_sdpa_flash(flash, tuned_kernels):
    """Perf gate for the split-KV route at the issue's decode anchor (B64 H32/8 Nq1 Nk8192 D128,
    2.1 GB of K/V): >= 1.0x SDPA FLASH and >= 80% of the measured copy bandwidth. Measured on an
    H200 at B32 (scripts/gpu_dev_flash_decode.py, 160a5e3): 1.60x FLASH, 101.6% of copy bandwidth."""
    from attnbench.bench.roofline import ceilings

    case = FlashCase(64, 32, 8, 1, 8192, 128, None, "bfloat16")
    rows = bench(flash, [case], "cuda", variants=["triton", "sdpa_flash"], modes=["fwd"], baseline="sdpa_flash",
                 progress=False)
    ours = next(r for r in rows if r.variant == "triton")
    assert ours.timing is not None and ours.max_error < verify.BOUNDS[case.torch_dtype]
    assert ours.speedup >= 1.0, f"triton is {ours.speedup:.2f}x SDPA FLASH"
    copy_pct = 100 * ours.gbps / ceilings("cuda").copy_gbps
    assert copy_pct >= 80, f"{copy_pct:.1f}% of copy bandwidth"


@pytest.mark.perf
def test_cuda_graph_timing_agrees_with_cuda_events(flash, tuned_kernels):
    """--graphs replays a captured graph; for a 0.5 ms kernel launch overhead is negligible, so the
    two clocks must agree (graph replays skip the L2 flush, hence a little faster, never slower at the
    same SM clock). A replay holds GRAPH_REPLAY_MS of back-to-back calls, short of the power limit: a
    100 ms replay of our forward held the H100 at 700 W and 1740 MHz and read 12% slower than events."""
    from attnbench.bench.timing import measure

    case = flash.cases("anchor")[0]
    x = flash.make_inputs(case, "cuda", 0)
    for variant in ("triton", "sdpa_flash"):
        fn = flash.variants[variant].prepare(case, x, "fwd")
        events = measure(fn, "cuda")
        graph = measure(fn, "cuda", cuda_graph=True)
        assert graph.method == "cuda-graph" and events.method == "cuda-events"
        assert 0.7 < graph.median_ms / events.median_ms < 1.1, (variant, graph, events)


@pytest.mark.perf
def test_chunked_stack_merge_beats_state_by_state_at_many_states(monkeypatch):
    """Perf gate for merge_stack_chunks_kernel, which stacks of CHUNKS_FROM_STATES states and more take: at the 25
    states of B21 H8/1 N4x11616 D96's decode (fp32 states, fp64 LSEs, read from DRAM), it must take <= 0.9x the
    state-by-state kernel's GPU time, and give the same values to fp32 rounding. Measured on an H200
    (scripts/decode_study.py): 18.8 against 26.7 us, 0.70x (docs/measurements/flash.md)."""
    from attnbench.kernels import merge_states
    from attnbench.kernels.gpu_time import gpu_time_median_ms
    from attnbench.kernels.launch import forget_plans
    from attnbench.kernels.precision import STATE_LSE_DTYPE

    gen = torch.Generator(device="cuda").manual_seed(0)
    o = torch.randn(25, 21, 8, 4, 96, device="cuda", generator=gen)
    lse = torch.randn(25, 21, 8, 4, device="cuda", generator=gen, dtype=STATE_LSE_DTYPE) * 3

    def timed(chunks_from):
        monkeypatch.setattr(merge_states, "CHUNKS_FROM_STATES", chunks_from)
        forget_plans()  # a plan (or a replay) of the other kernel must not answer
        run = lambda: merge_states.merge_stack_launch(o, lse, torch.bfloat16, see_from=0, out_lse_dtype=torch.float32,
                                                      state_lse=True)
        out = run()
        return out, gpu_time_median_ms(run)

    (o_chunks, lse_chunks), chunked = timed(1)
    (o_steps, lse_steps), steps = timed(10 ** 9)
    torch.testing.assert_close(o_chunks.float(), o_steps.float(), rtol=1e-2, atol=1e-2)  # bf16 outputs
    torch.testing.assert_close(lse_chunks, lse_steps, rtol=1e-6, atol=1e-6)
    assert chunked <= 0.9 * steps, f"chunked {chunked * 1e3:.1f} us against state by state {steps * 1e3:.1f} us"
