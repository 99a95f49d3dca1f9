"""Launch plans (attnbench/kernels/launch.py) on the shared_context launchers: a call signature seen before
is launched from its plan, never with the previous call's data, and a plan is made only where its
key fixes everything the kernel specializes on. Through the interpreter (plans there launch through
the JIT function with the remembered arguments; on a GPU they call the compiled kernel, which
tests/shared_context/test_gpu_operator.py checks against the usual launch bitwise).
"""
import pytest
import torch

import attnbench
from attnbench.kernels import launch
from attnbench.kernels import shared_context as sc
from attnbench.operators.shared_context import SharedContextCase
from attnbench import shared_context as api

from ..shared_context.helpers import api_args

pytestmark = pytest.mark.interpreter

OP = attnbench.get("shared_context")
CASE = SharedContextCase(3, 4, 2, 2, 40, 24, 16, causal=True, lengths="varied", dtype="float64")


@pytest.fixture(autouse=True)
def fresh_plans():
    sc.clear_split_picks()
    api._CHECKED.clear()
    yield
    sc.clear_split_picks()
    api._CHECKED.clear()


def _call(x, **kw):
    return api.shared_context_attention(*api_args(x), causal=CASE.causal, check_lengths=False, **kw)


def _close(out, oracle):
    torch.testing.assert_close(out[0], oracle["o"], rtol=1e-10, atol=1e-10)  # fp64 kernels: ~1e-15 measured
    torch.testing.assert_close(out[1], oracle["lse"], rtol=1e-10, atol=1e-10)


def test_second_call_launches_from_a_plan_with_the_new_data():
    first, second = OP.make_inputs(CASE, "cpu", seed=0), OP.make_inputs(CASE, "cpu", seed=1)
    _close(_call(first), OP.oracle(CASE, first))
    assert len(launch._PLANS) == 1
    (made,) = launch._PLANS.values()
    launched = []
    plan_call = launch.LaunchPlan.__call__

    def counting(self, tensors):
        launched.append(self)
        return plan_call(self, tensors)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch.LaunchPlan, "__call__", counting)
        _close(_call(second), OP.oracle(CASE, second))
    assert launched == [made[1]], "the repeated signature must launch from its plan"
    assert len(launch._PLANS) == 1


def test_new_lengths_with_the_same_signature_are_read_not_remembered():
    x = OP.make_inputs(CASE, "cpu")
    _call(x)
    y = dict(x, buf_lens=torch.tensor([0, CASE.n_buf, 5], dtype=x["buf_lens"].dtype))
    _close(_call(y), OP.oracle(CASE, y))
    assert len(launch._PLANS) == 1


def test_each_signature_gets_its_own_plan():
    x = OP.make_inputs(CASE, "cpu")
    _call(x)
    # a misaligned view of the same shape (its pointer is 8 bytes off a 16-byte boundary)
    storage = torch.empty(x["q"].numel() + 1, dtype=x["q"].dtype)
    shifted = storage[1:].view(x["q"].shape).copy_(x["q"])
    y = dict(x, q=shifted)
    _close(_call(y), OP.oracle(CASE, y))
    _call(x, num_splits=2)
    half = {k: (v[:2] if k in ("q", "k_buf", "v_buf", "buf_lens") else v) for k, v in x.items()}
    small = SharedContextCase(2, *list(vars(CASE).values())[1:])
    _close(_call(half), OP.oracle(small, half))
    assert len(launch._PLANS) == 4


def test_context_and_buffer_launchers_plan_too():
    x = OP.make_inputs(CASE, "cpu")
    for _ in range(2):
        o, lse = api.context_attention(x["q"], x["k_ctx"], x["v_ctx"])
        ref = api.shared_context_attention_composed(x["q"], x["k_ctx"], x["v_ctx"])
        torch.testing.assert_close(o, ref[0], rtol=0, atol=0)
        o, lse = api.buffer_attention(x["q"], x["k_buf"], x["v_buf"], x["buf_lens"], causal=True)
        empty = x["k_ctx"][:, :0]
        ref = api.shared_context_attention_composed(x["q"], empty, empty, x["k_buf"], x["v_buf"], x["buf_lens"],
                                                    causal=True)
        torch.testing.assert_close(lse, ref[1], rtol=0, atol=0)
    assert {key[0] for key in launch._PLANS} == {"context", "buffer"}


def test_explicit_configs_make_no_plan():
    x = OP.make_inputs(CASE, "cpu")
    _call(x, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_NB=8, num_warps=1, num_stages=1))
    assert not launch._PLANS


def test_remembered_checks_still_refuse_what_changes_per_call():
    x = OP.make_inputs(CASE, "cpu")
    _call(x)
    assert len(api._CHECKED) == 1
    grad_q = x["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no backward"):
        _call(dict(x, q=grad_q))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # the kernels then need CUDA tensors
        with pytest.raises(ValueError, match="need CUDA tensors"):
            _call(x)


def test_lengths_checked_on_request_every_time():
    x = OP.make_inputs(CASE, "cpu")
    api.shared_context_attention(*api_args(x), causal=True)
    bad = dict(x, buf_lens=torch.tensor([0, CASE.n_buf + 1, 5], dtype=x["buf_lens"].dtype))
    with pytest.raises(ValueError, match="buf_lens must lie in"):
        api.shared_context_attention(*api_args(bad), causal=True)
    assert not api._CHECKED, "a call that reads the lengths' values is never memoized"


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "MAX_PLANS", 2)
    for n in range(3):
        launch.remember(("k", n), object())
    assert list(launch._PLANS) == [("k", 2)]
