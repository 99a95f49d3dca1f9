"""jvp_attention's capability matrix (attnbench capabilities) on the CPU: each cell says verified, wrong or
error, and the command writes its JSON and markdown."""
import json

import pytest
import torch

from attnbench.cli import main
from attnbench.operators.flash import FlashCase
from attnbench.operators.jvp_attention import capabilities


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


def test_a_wrong_cell_of_ours_fails_the_command(monkeypatch, capsys):
    """The command exited 0 whatever the matrix said (found by review): a silent wrong answer of ours now exits 1,
    naming how many cells; a peer's wrong cell is reported in the table only."""
    def matrix(cells):
        return capabilities.Matrix({"device": "cpu"}, [("small", "B1 H2 N9x11 D16")], cells)

    shape = "small"
    verdicts = dict.fromkeys(capabilities.COLUMNS, "verified")
    for impl, want in ((capabilities.OURS, 1), ("sdpa_math", 0)):
        cells = {impl: {shape: dict(verdicts, jvp="wrong: rel. err 0.5")}}
        monkeypatch.setattr(capabilities, "compute", lambda device, impls, progress, cells=cells: matrix(cells))
        assert main(["capabilities", "--quiet"]) == want
    assert "attnbench triton answered wrong without an error in 1 cell(s)" in capsys.readouterr().err
