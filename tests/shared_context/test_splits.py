"""The split-K count of the shared_context kernels: measured on CUDA (the fastest of a few
candidates, remembered per key), the heuristic elsewhere, an explicit count always.

No GPU here: the timer is a module-level hook (``time_ms``) that these tests replace, and the
gate that allows measuring is forced open where a test needs the measured path on CPU tensors.
"""
import pytest
import torch

import attnbench
from attnbench.kernels import shared_context as sc
from attnbench.kernels import tuning
from attnbench.kernels.shared_context import split_count
from attnbench.operators.shared_context import SharedContextCase
from attnbench.shared_context import context_attention, shared_context_attention

from .helpers import api_args

pytestmark = pytest.mark.interpreter

OP = attnbench.get("shared_context")
H200_SMS = 132


@pytest.fixture(autouse=True)
def fresh_picks():
    sc.clear_split_picks()
    yield
    sc.clear_split_picks()


@pytest.fixture
def no_timing(monkeypatch):
    def refuse(fn):
        raise AssertionError("split counts were timed where they must not be")

    monkeypatch.setattr(split_count, "time_ms", refuse)


@pytest.fixture
def measuring(monkeypatch):
    """The measured path on CPU tensors: the gate open, no CUDA stream capturing (the CPU build of
    torch cannot even ask)."""
    monkeypatch.setattr(split_count, "_measured_splits_enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _h200(monkeypatch):
    monkeypatch.setitem(tuning._SM_COUNT, 0, H200_SMS)
    return torch.device("cuda", 0)


def test_candidates_are_the_heuristic_and_powers_of_two_capped(monkeypatch):
    cuda = _h200(monkeypatch)
    # B256 H32/8 Lq1 Nctx4096 Nbuf512: 16 row tiles x 8 KV heads = 128 programs; the heuristic says 3
    assert sc.choose_splits(1024, 8, 4608, cuda) == 3
    assert sc.split_candidates(1024, 8, 4608, cuda) == [1, 2, 3, 4, 8]
    # B512 H32/8 Lq1 Nctx8192 Nbuf256: the GPU is full, the heuristic says 1
    assert sc.split_candidates(2048, 8, 8448, cuda) == [1, 2, 4, 8]
    assert sc.split_candidates(64, 1, 700, cuda) == [1, 2]  # 256 keys a split at least
    assert sc.split_candidates(64, 1, 300, cuda) == [1]


def test_no_measuring_in_the_interpreter_or_with_autotune_off(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert not sc._measured_splits_enabled(cuda)  # this gate runs under TRITON_INTERPRET=1
    assert not sc._measured_splits_enabled(torch.device("cpu"))
    monkeypatch.setattr(split_count, "interpreting", lambda: False)
    monkeypatch.setenv("ATTNBENCH_AUTOTUNE", "1")
    assert sc._measured_splits_enabled(cuda)
    assert not sc._measured_splits_enabled(torch.device("cpu"))
    monkeypatch.setenv("ATTNBENCH_AUTOTUNE", "0")
    assert not sc._measured_splits_enabled(cuda)


def test_interpreter_calls_use_the_heuristic_and_remember_nothing(no_timing):
    case = SharedContextCase(2, 2, 1, 1, 40, 8, 16, False, "varied", "float64")
    x = OP.make_inputs(case, "cpu", 0)
    heuristic = sc.choose_splits(4, 1, 48, "cpu")
    assert heuristic == 3
    o, lse = shared_context_attention(*api_args(x))
    o_h, lse_h = shared_context_attention(*api_args(x), num_splits=heuristic)
    assert torch.equal(o, o_h) and torch.equal(lse, lse_h)
    assert not sc._SPLIT_PICKS


def _tagged_runner(prepared):
    def runner(splits):
        prepared.append(splits)

        def launch():
            return splits

        launch.splits = splits
        return launch

    return runner


def test_pick_is_the_fastest_and_timed_once_per_key(monkeypatch):
    times = {1: 0.291, 2: 0.196, 3: 0.328, 4: 0.235, 8: 0.350}  # the H200 row of the B256 case
    timed = []
    monkeypatch.setattr(split_count, "time_ms", lambda fn: timed.append(fn.splits) or times[fn.splits])
    prepared = []
    runner = _tagged_runner(prepared)
    candidates = [1, 2, 3, 4, 8]
    assert sc.pick_splits("key a", candidates, runner) == 2
    assert prepared == candidates  # each candidate with its own outputs ...
    assert timed == candidates * sc.PICK_ROUNDS  # ... timed in interleaved rounds
    assert sc.pick_splits("key a", candidates, runner) == 2
    assert timed == candidates * sc.PICK_ROUNDS  # remembered
    times[8] = 0.1
    assert sc.pick_splits("key b", candidates, runner) == 8
    assert sc.pick_splits("key a", candidates, runner) == 2
    sc.clear_split_picks()
    assert sc.pick_splits("key a", candidates, runner) == 8
    assert len(timed) == 3 * len(candidates) * sc.PICK_ROUNDS


def test_ties_go_to_fewer_splits(monkeypatch):
    monkeypatch.setattr(split_count, "time_ms", lambda fn: 1.0)
    assert sc.pick_splits("key", [1, 2, 4], _tagged_runner([])) == 1


def test_fused_and_context_picks_are_kept_apart(monkeypatch, measuring):
    q = torch.zeros(2, 2, 1, 16)
    key = (16, 64, 16, 16, 4, False, True, None)  # the same shape key for both kernels
    monkeypatch.setattr(split_count, "time_ms", lambda fn: {1: 2.0, 2: 1.0, 3: 3.0}[fn.splits])
    assert sc._split_count("fused", None, 4, 1, 48, q, key, _tagged_runner([])) == 2
    monkeypatch.setattr(split_count, "time_ms", lambda fn: {1: 1.0, 2: 2.0, 3: 3.0}[fn.splits])
    assert sc._split_count("context", None, 4, 1, 48, q, key, _tagged_runner([])) == 1
    assert sc._split_count("fused", None, 4, 1, 48, q, key, _tagged_runner([])) == 2
    assert len(sc._SPLIT_PICKS) == 2


def test_explicit_num_splits_wins(monkeypatch, measuring):
    """Over the measured pick, without timing anything, and past the candidates' cap."""
    q = torch.zeros(2, 2, 1, 16)
    monkeypatch.setattr(split_count, "time_ms", lambda fn: pytest.fail("timed although num_splits was given"))
    assert sc._split_count("fused", 5, 4, 1, 48, q, ("key",), None) == 5
    assert not sc._SPLIT_PICKS
    sc._SPLIT_PICKS[("fused", "key", 1, q.dtype, None)] = 2
    assert sc._split_count("fused", None, 4, 1, 48, q, ("key",), None) == 2
    assert sc._split_count("fused", 7, 4, 1, 48, q, ("key",), None) == 7


def test_one_candidate_is_not_timed(measuring, no_timing):
    q = torch.zeros(2, 2, 1, 16)
    assert sc._split_count("fused", None, 4, 1, 20, q, ("key",), None) == 1  # 20 keys: one split of 16+
    assert not sc._SPLIT_PICKS


@pytest.mark.parametrize("hook", ["capture", "compile"])
def test_capture_and_compile_never_time_but_reuse_a_pick(monkeypatch, measuring, hook):
    """Nothing may be timed inside a CUDA-graph capture or a torch.compile trace: the count is
    the one measured before (so the graph splits like the eager calls before it), else the heuristic's."""
    q = torch.zeros(2, 2, 1, 16)
    heuristic = sc.choose_splits(4, 1, 48, q.device)
    monkeypatch.setattr(split_count, "time_ms", lambda fn: {1: 2.0, 2: 1.0, 3: 3.0}[fn.splits])
    assert sc._split_count("fused", None, 4, 1, 48, q, ("measured",), _tagged_runner([])) == 2
    monkeypatch.setattr(split_count, "time_ms", lambda fn: pytest.fail("timed inside a capture or trace"))
    if hook == "capture":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert sc._split_count("fused", None, 4, 1, 48, q, ("measured",), _tagged_runner([])) == 2
    assert sc._split_count("fused", None, 4, 1, 48, q, ("new",), _tagged_runner([])) == heuristic
    assert list(sc._SPLIT_PICKS) == [("fused", "measured", 1, q.dtype, None)]


def test_measured_launches_leave_tickets_at_zero_and_the_result_alone(monkeypatch, measuring):
    """The timed launches write their own outputs and leave the merge tickets at zero; the
    caller's call then runs at the picked count into fresh outputs: the same bits as forcing it."""
    case = SharedContextCase(2, 2, 1, 1, 40, 8, 16, False, "varied", "float64")
    x = OP.make_inputs(case, "cpu", 0)
    timed_outputs = []
    fake_times = iter([3.0, 1.0, 2.0] * sc.PICK_ROUNDS)  # candidates 1, 2, 3 (the heuristic's): 2 is fastest

    def run_once(fn):
        timed_outputs.append(fn())
        assert all(not c.any() for c in sc._COUNTERS.values())
        return next(fake_times)

    monkeypatch.setattr(split_count, "time_ms", run_once)
    o, lse = shared_context_attention(*api_args(x))
    assert len(timed_outputs) == 3 * sc.PICK_ROUNDS and sc._COUNTERS  # the split candidates took tickets
    assert list(sc._SPLIT_PICKS.values()) == [2]
    ours = {o.data_ptr(), lse.data_ptr()}
    assert not ours & {t.data_ptr() for pair in timed_outputs for t in pair}
    o_2, lse_2 = shared_context_attention(*api_args(x), num_splits=2)
    assert torch.equal(o, o_2) and torch.equal(lse, lse_2)
    oracle = OP.oracle(case, x)
    torch.testing.assert_close(o, oracle["o"], rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, oracle["lse"], rtol=0, atol=1e-13)
    for o_t, lse_t in timed_outputs:  # every candidate gave the right answer too
        torch.testing.assert_close(o_t, oracle["o"], rtol=0, atol=1e-13)
        torch.testing.assert_close(lse_t, oracle["lse"], rtol=0, atol=1e-13)


def test_measured_context_pick_is_used(monkeypatch, measuring):
    case = SharedContextCase(2, 2, 1, 1, 40, 0, 16, False, "full", "float64")
    x = OP.make_inputs(case, "cpu", 0)
    fake_times = iter([1.0, 2.0] * sc.PICK_ROUNDS)  # candidates 1 and 2 (the heuristic's): 1 is fastest

    def run_once(fn):
        fn()
        return next(fake_times)

    monkeypatch.setattr(split_count, "time_ms", run_once)
    o, lse = context_attention(x["q"], x["k_ctx"], x["v_ctx"])
    assert list(sc._SPLIT_PICKS.values()) == [1]
    o_1, lse_1 = context_attention(x["q"], x["k_ctx"], x["v_ctx"], num_splits=1)
    assert torch.equal(o, o_1) and torch.equal(lse, lse_1)
