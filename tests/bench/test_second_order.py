"""Second-order consistency (seed 003) on the CPU (jvp_attention's capability matrix:
tests/attention/test_jvp_attention_capabilities.py)."""
import torch

from attnbench.bench import second_order


class SquareWithFrozenBackward(torch.autograd.Function):
    """x**2 whose backward forgets that it depends on x: first order right, second order wrong."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x.detach() * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2 * x * t


def test_norms_and_our_attention_are_consistent_to_second_order():
    rows = second_order.consistency_checks("cpu", dtypes=[torch.float64, torch.float32])
    names = {r.case.split(" (")[0] for r in rows}
    assert {"attention", "layer_norm", "batch_norm", "rms_norm"} <= {n.split(" ")[0] for n in names}
    for row in rows:
        assert not row.skipped and row.passed, (row.case, row.outputs)
        assert [o.name for o in row.outputs] == ["fwd-over-rev vs truth", "rev-over-rev vs truth",
                                                 "fwd-over-rev vs rev-over-rev"]


def test_a_backward_that_is_not_differentiable_is_caught():
    rows = second_order.consistency_checks("cpu", dtypes=[torch.float64], functions={
        "frozen square": ((5, 4), lambda device, dtype: lambda x: SquareWithFrozenBackward.apply(x).sin())})
    (row,) = rows
    assert not row.passed
    verdicts = {o.name: o.passed for o in row.outputs}
    assert verdicts["rev-over-rev vs truth"] is False  # its double backward misses d(2x)/dx
