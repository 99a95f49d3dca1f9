"""scripts/gpu_dev_shared_context.py is what the GPU session runs in one call: its code paths must
work before the GPU is there (on the CPU: one tiny case, two variants, through the interpreter)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_dev_shared_context", ROOT / "scripts/gpu_dev_shared_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_predictions_use_the_cost_model():
    dev = _script()
    case = dev.OP.cases("anchor")[0]  # B1024 H4 Lq2 ctx2048 buf32 D32: the buffer's bytes dominate
    p = dev.predict(case, sms=132, matmul_tflops=700)
    assert p["min_bytes"] == dev.OP.bytes(case, "fwd")
    assert p["floor_ms"]["bytes"] == pytest.approx(p["min_bytes"] / 3.75e12 * 1e3)
    assert p["binding"] == "bytes" and p["predicted_ms"] == p["floor_ms"]["bytes"]


@pytest.mark.interpreter
def test_script_runs_end_to_end_on_cpu(tmp_path, capsys):
    dev = _script()
    assert dev.main(["--limit", "1", "--variant", "split", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## B3 H2 Lq1 ctx37 buf11 D24 varlen fp32" in out and "fused[splits=3]" in out
    report = json.loads((tmp_path / "shared_context_dev.json").read_text())
    (case,) = report["cases"]
    names = {e["variant"] for e in case["entries"]}
    assert {"split", "fused[autotuned]", "fused[splits=3]"} <= names
    assert all(e["error"] < 1e-5 for e in case["entries"] if "error" in e)
    assert (tmp_path / "shared_context_decisions.md").exists()
