"""GPU gate for the shared_context operator (skipped without CUDA; scripts/gpu_gate.sh runs it).

bf16 and fp16 at real sizes against the float64 oracle; the peers that run are right too; the
fused kernel's in-kernel split-K merge is race-free (bitwise repeatable, equal to one split); int64
offsets past 2**31 elements; and the perf gate: at every anchor decode case the shipped Triton path
must stay at "prioritize" (>= 1.30x) over the fastest of its baselines (attnbench.bench.decisions,
the operator's gate_baselines). The decode loop's backends on a GPU: tests/models/test_gpu_tabpfn.py.
"""
import pytest
import torch

import attnbench
from attnbench.bench import decisions
from attnbench.bench import verify
from attnbench.operators.shared_context import SharedContextCase
from attnbench.shared_context import shared_context_attention, shared_context_attention_composed
from attnbench.bench.runner import bench

from tests.helpers import far_scores

from .helpers import api_args

pytestmark = pytest.mark.gpu

OP = attnbench.get("shared_context")


@pytest.mark.parametrize("case", OP.cases("gpu"), ids=lambda c: c.label)
def test_our_variants_match_oracle_at_real_sizes(oracles, case):
    x, oracle, lowp = oracles(case)
    for variant in ("triton", "triton_composed", "split"):
        result = verify.check_variant(OP, variant, case, "fwd", x, oracle, lowp)
        assert result.passed, (variant, result.skipped, [o for o in result.outputs if not o.passed])


@pytest.mark.parametrize("case", [c for c in OP.cases("gpu") if c.lengths == "full"][:3] + OP.cases("anchor")[:1],
                         ids=lambda c: c.label)
def test_peers_that_run_are_correct_too(oracles, case):
    """A peer may decline a case (it says why), but when it runs it must be right, or the
    side-by-side numbers compare against a wrong answer."""
    x, oracle, lowp = oracles(case)
    ran = []
    for variant in ("per_batch_flash", "per_batch_cudnn", "expand0_flash", "fold_flash", "fold_cudnn"):
        result = verify.check_variant(OP, variant, case, "fwd", x, oracle, lowp)
        if not result.skipped:
            ran.append(variant)
            assert all(o.error <= verify.BOUNDS[case.torch_dtype] for o in result.outputs), (variant, result.outputs)
    assert ran, "no peer ran"


@pytest.mark.parametrize("case", [SharedContextCase(48, 4, 4, 2, 3000, 40, 32, False, "varied"),
                                  SharedContextCase(16, 32, 8, 1, 5000, 200, 128, False, "full")],
                         ids=lambda c: c.label)
def test_fused_split_k_is_race_free(oracles, case):
    """The last program of each tile merges the others' partials: repeated runs must be bitwise
    equal, and any split count must agree with one split to rounding."""
    x, oracle, _ = oracles(case)
    single = shared_context_attention(*api_args(x), num_splits=1)
    for splits in (2, 7, 32):
        runs = [shared_context_attention(*api_args(x), num_splits=splits) for _ in range(20)]
        for o, lse in runs[1:]:
            assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1]), splits
        assert verify.relative_error(runs[0][0], oracle["o"]) < verify.BOUNDS[case.torch_dtype]
        assert (runs[0][1] - single[1]).abs().max() < 1e-4
        composed = shared_context_attention_composed(*api_args(x), num_splits=splits)
        assert verify.relative_error(composed[0], oracle["o"]) < verify.BOUNDS[case.torch_dtype]


@pytest.mark.parametrize("case", [SharedContextCase(48, 4, 4, 2, 3000, 40, 32, True, "varied"),
                                  SharedContextCase(300, 4, 4, 1, 700, 0, 32, False, "full"),
                                  SharedContextCase(16, 32, 8, 1, 5000, 200, 128, False, "full")],
                         ids=lambda c: c.label)
def test_launch_plans_repeat_the_usual_launch_bitwise(oracles, case):
    """A repeated call signature launches the compiled kernel from its plan (attnbench/kernels/launch.py),
    skipping Triton's launcher: bitwise what the usual launch gives, on new data too, and inside a
    CUDA graph replayed on new inputs."""
    from attnbench.kernels import launch
    from attnbench.kernels import shared_context as sc

    x, oracle, _ = oracles(case)
    sc.clear_split_picks()  # forgets the plans too
    usual = shared_context_attention(*api_args(x), causal=case.causal, check_lengths=False)
    (made,) = [p for key, p in launch._PLANS.items() if key[0] == "fused"]
    assert made[1].run is not None, "triton >= 3.4 on CUDA: plans call the compiled kernel"
    planned = shared_context_attention(*api_args(x), causal=case.causal, check_lengths=False)
    assert torch.equal(usual[0], planned[0]) and torch.equal(usual[1], planned[1])
    assert verify.relative_error(planned[0], oracle["o"]) < verify.BOUNDS[case.torch_dtype]
    side = torch.cuda.Stream()  # another stream gets scratch of its own (kept per plan and stream)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = shared_context_attention(*api_args(x), causal=case.causal, check_lengths=False)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(usual[0], on_side[0]) and torch.equal(usual[1], on_side[1])
    assert len(made[2]) == (2 if case.n_buf or made[0] > 1 else 0)
    static = {k: (v.clone() if v is not None else None) for k, v in x.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = shared_context_attention(*api_args(static), causal=case.causal, check_lengths=False)
    y = OP.make_inputs(case, "cuda", seed=1)
    for name, t in static.items():
        if t is not None:
            t.copy_(y[name])
    graph.replay()
    fresh = shared_context_attention(*api_args(y), causal=case.causal, check_lengths=False)
    assert torch.equal(captured[0], fresh[0]) and torch.equal(captured[1], fresh[1])


def test_rows_that_see_no_key_on_gpu():
    case = SharedContextCase(9, 4, 2, 3, 0, 40, 64, True, "varied")
    x = OP.make_inputs(case, "cuda", 0)
    for variant in ("triton", "triton_composed"):
        out = verify.run_poisoned(OP, variant, case, x, "fwd")
        assert torch.all(out["o"][0] == 0) and torch.isneginf(out["lse"][0]).all()  # sample 0: empty buffer
        assert torch.isfinite(out["o"]).all()


def test_offsets_past_int32_in_the_buffer():
    """k_buf with more than 2**31 elements: the last samples must be right (int64 offsets)."""
    from attnbench.shared_context import reference

    batch, heads_kv, n_buf, d = 2200, 8, 1024, 128
    assert batch * heads_kv * n_buf * d > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 16, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_ctx = torch.randn(heads_kv, 64, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_ctx = torch.randn(heads_kv, 64, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_buf = torch.randn(batch, heads_kv, n_buf, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_buf = torch.randn(batch, heads_kv, n_buf, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    for api in (shared_context_attention, shared_context_attention_composed):
        o, lse = api(q, k_ctx, v_ctx, k_buf, v_buf)
        tail = slice(batch - 3, batch)
        o_ref, lse_ref = reference.attention(q[tail].double(), k_ctx.double(), v_ctx.double(), k_buf[tail].double(),
                                             v_buf[tail].double(), None, False, d ** -0.5)
        assert verify.relative_error(o[tail], o_ref) < verify.BOUNDS[torch.bfloat16]
        assert verify.relative_error(lse[tail], lse_ref) < 1e-4


@pytest.mark.perf
@pytest.mark.parametrize("case", OP.cases("anchor"), ids=lambda c: c.label)
def test_triton_stays_prioritized_over_the_best_baseline(oracles, tuned_shared_context, case):
    """Perf gate (the decision rule of attnbench.bench.decisions): the fused Triton kernel must be
    >= 1.30x the fastest of the issue's baselines {per-batch SDPA flash, split-PyTorch, Hydragen
    folding (SDPA flash) + merge} and the stride-0 expand that can run the case, side by side in
    one run. (cuDNN peers are judged in the decisions file, not gated.)"""
    x, oracle, _ = oracles(case)
    out = OP.variants["triton"].prepare(case, x, "fwd")()
    assert verify.relative_error(out["o"], oracle["o"]) < verify.BOUNDS[case.torch_dtype]
    del out
    rows = bench(OP, [case], "cuda", variants=["triton", *OP.gate_baselines], verify_outputs=False, progress=False)
    (gate,) = [v for v in decisions.decide(rows) if v.comparison.startswith("triton vs best of")]
    assert gate.verdict == "prioritize", (f"{case.label}: triton {gate.candidate_ms:.4f} ms vs {gate.baseline} "
                                          f"{gate.baseline_ms:.4f} ms = {gate.speedup:.2f}x ({gate.verdict})")


@pytest.fixture(scope="module")
def tuned_shared_context():
    """Kernels autotuned as shipped (the GPU gate runs correctness with ATTNBENCH_AUTOTUNE=0, and
    Triton's autotuners and the split-count picks are remembered per key: clear them and tune again)."""
    from attnbench.kernels import shared_context as sc

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNBENCH_AUTOTUNE", "1")
        for tuner in sc.autotuners():
            tuner.cache.clear()
        sc.clear_split_picks()
        yield
        for tuner in sc.autotuners():
            tuner.cache.clear()
        sc.clear_split_picks()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_nan_poisons_its_rows_and_extreme_scores_are_attended_on_gpu(dtype):
    """The compiled twins of tests/shared_context/test_nonfinite.py: a NaN in a visible context key makes every row
    NaN, one in a sample's visible buffer key that sample's rows, one in an unused slot nothing (fused and composed,
    1 and 8 splits); finite scores far below -1e30 are attended, not read as 'no key' (kernels/precision.py; powers of two:
    tests.helpers.far_scores)."""
    from attnbench.shared_context import reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, hq, hkv, n_q, n_ctx, n_buf, d = 6, 8, 2, 2, 700, 96, 64
    q = torch.randn(batch, hq, n_q, d, device="cuda", generator=gen).to(dtype)
    kc, vc = (torch.randn(hkv, n_ctx, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    kb, vb = (torch.randn(batch, hkv, n_buf, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([96, 5, 0, 40, 1, 77], device="cuda", dtype=torch.int32)
    bad_buf, bad_slot = kb.clone(), kb.clone()
    bad_buf[1, 0, 2, 3] = float("nan")  # sample 1 (length 5) sees slot 2
    bad_slot[3, 1, 50, 0] = float("nan")  # sample 3 has length 40: slot 50 is unused
    for api in (shared_context_attention, shared_context_attention_composed):
        for splits in (1, 8):
            clean = api(q, kc, vc, kb, vb, lens, num_splits=splits)
            o, lse = api(q, kc, vc, bad_buf, vb, lens, num_splits=splits)
            rows = torch.zeros(batch, dtype=torch.bool, device="cuda")
            rows[1] = True
            assert torch.isnan(lse[1, :2]).all() and torch.isfinite(lse[~rows]).all(), (api.__name__, splits)
            assert torch.equal(o[~rows], clean[0][~rows])
            assert all(torch.equal(a, b) for a, b in zip(api(q, kc, vc, bad_slot, vb, lens, num_splits=splits), clean))
    qx, kcx, kbx = (t.to("cuda", dtype) for t in far_scores(q.shape, kc.shape, kb.shape, generator=torch.Generator()))
    o_ref, lse_ref = reference.attention(*(t.double() for t in (qx, kcx, vc, kbx, vb)), lens, False, d ** -0.5)
    assert lse_ref.max() < -1e30
    for api in (shared_context_attention, shared_context_attention_composed):
        o, lse = api(qx, kcx, vc, kbx, vb, lens)
        assert verify.relative_error(o, o_ref) < verify.BOUNDS[dtype], api.__name__
        assert ((lse.double() / lse_ref) - 1).abs().max() < 1e-3, api.__name__  # bf16 inputs: relative to |LSE|
