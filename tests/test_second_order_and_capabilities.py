"""Second-order consistency (seed 003) and the capability matrix, on the CPU."""
import json

import pytest
import torch

from attnbench.bench import second_order
from attnbench.cli import main
from attnbench.operators.flash import FlashCase
from attnbench.operators.jvp_attention import capabilities


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


@pytest.mark.interpreter
def test_capability_cells_say_verified_wrong_or_error():
    case = FlashCase(1, 2, 2, 9, 11, 16, None, "float32")
    import attnbench

    x = attnbench.get("jvp_attention").make_inputs(case, "cpu")
    want = capabilities._oracle(case, x)
    ours = capabilities._ours(case)
    for column in ("fwd", "bwd", "jvp", "jvp∘vjp", "vjp∘vjp", "vjp∘jvp"):
        assert capabilities.cell(column, ours, x, want, torch.float32) == "verified", column
    assert capabilities.cell("jvp", lambda q, k, v: 1.01 * ours(q, k, v), x, want, torch.float32).startswith("wrong: rel. err 0.01")

    def raises(q, k, v):
        raise RuntimeError("no forward AD here\nsecond line")

    assert capabilities.cell("jvp", raises, x, want, torch.float32) == "error: RuntimeError: no forward AD here"


@pytest.mark.interpreter
def test_capabilities_command_writes_json_and_markdown(tmp_path, capsys):
    js, md = tmp_path / "cap.json", tmp_path / "cap.md"
    assert main(["capabilities", "--impl", "sdpa_math", "--impl", "sdpa_cudnn", "--quiet", "--json", str(js),
                 "--markdown", str(md)]) == 0
    data = json.loads(js.read_text())
    assert data["columns"] == list(capabilities.COLUMNS)
    assert set(data["cells"]) == {"sdpa_math", "sdpa_cudnn"}
    for shape in data["cells"]["sdpa_math"].values():
        assert set(shape.values()) == {"verified"}
    assert all(v.startswith("unavailable") for s in data["cells"]["sdpa_cudnn"].values() for v in s.values())
    text = md.read_text()
    assert "| sdpa_math | verified |" in text and "Not available on this device: sdpa_cudnn" in text
    assert "sdpa_math" in capsys.readouterr().out


def test_capabilities_rejects_an_unknown_implementation(capsys):
    assert main(["capabilities", "--impl", "nosuch"]) == 2
    assert "--impl nosuch: not an implementation" in capsys.readouterr().err
