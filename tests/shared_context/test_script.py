"""scripts/gpu_dev_shared_context.py is what the GPU session runs in one call: its code paths must
work before the GPU is there (on the CPU: one tiny case, two variants, through the interpreter)."""
import json

import pytest

from attnbench.operators.shared_context import SharedContextCase

from ..helpers import load_script


def _script():
    return load_script("gpu_dev_shared_context")


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


def _floors():
    return load_script("shared_context_floors")


def test_floors_bound_the_copy_share_of_each_case(tmp_path, monkeypatch):
    """scripts/shared_context_floors.py on a made-up report: the attainable share is the bytes' time over the longest
    floor, the measured share and the speed over the fastest gated baseline on the same clock come from the rows."""
    floors = _floors()
    exp_bound = SharedContextCase(4096, 4, 4, 2, 10000, 0, 32)  # 9.4 MB against 328M exponentials
    byte_bound = SharedContextCase(4096, 4, 4, 1, 512, 32, 32)  # 69.5 MB against 8.9M
    rows = []
    for case, triton_ms in ((exp_bound, 0.155), (byte_bound, 0.045)):
        timed = (("triton", triton_ms, "cuda-events"), ("fold_flash", 2 * triton_ms, "cuda-events"),
                 ("split", 9.0, "cuda-events"), ("fold_cudnn", 0.01, "cuda-events"),  # not a gated baseline
                 ("expand0_flash", 0.001, "cuda-graph"))  # another clock: not comparable
        for variant, ms, method in timed:
            rows.append({"op": "shared_context", "case": case.label, "mode": "fwd", "variant": variant, "skipped": "",
                         "timing": {"median_ms": ms, "method": method}})
    rows.append({"op": "flash", "case": "B1", "mode": "fwd", "variant": "triton", "skipped": "",
                 "timing": {"median_ms": 1.0, "method": "cuda-events"}})
    report = {"format": 1, "status": "complete", "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 800.0},
              "machine": {"multiprocessors": 132, "device_name": "test GPU"}, "bench": rows}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    monkeypatch.setattr(floors, "load", lambda p: json.loads(open(p).read()))  # the made-up report is not validated
    monkeypatch.setattr("sys.argv", ["floors", str(path), "--markdown", str(tmp_path / "f.md")])
    floors.main()
    text = (tmp_path / "f.md").read_text()
    by_case = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| B")}
    copy_s = floors.OP.bytes(exp_bound, "fwd") / 3000e9
    exp_s = floors.exp_floor_s(floors.OP.exponentials(exp_bound, "fwd"), 132)
    matmul_s = floors.OP.flops(exp_bound, "fwd") / 800e12
    assert float(by_case[exp_bound.label][6].strip("*")) == pytest.approx(100 * copy_s / max(exp_s, matmul_s), abs=0.05)
    assert by_case[byte_bound.label][6] == "100.0"
    assert by_case[byte_bound.label][8] == f"{100 * floors.OP.bytes(byte_bound, 'fwd') / 3000e9 / 45e-6:.1f}"
    assert by_case[byte_bound.label][9:11] == ["fold_flash", "2.00x |"]
    assert "above what the floors allow (bold): 1 of 2 cases" in text and "Speed bar met: 2 of 2" in text
    assert "B1" not in by_case  # another operator's rows are not shared_context cases
    # twice the exponential rate and a faster matmul move the ceiling up; a launch floor moves it down
    monkeypatch.setattr("sys.argv", ["floors", str(path), "--exp-rate-factor", "2", "--matmul-tflops", "1e6",
                                     "--markdown", str(tmp_path / "g.md")])
    floors.main()
    faster = [line for line in (tmp_path / "g.md").read_text().splitlines() if line.startswith(f"| {exp_bound.label}")]
    assert float(faster[0].split(" | ")[6].strip("*")) == pytest.approx(200 * copy_s / exp_s, abs=0.05)


def test_floors_refuse_reports_without_shared_context_rows_or_ceilings(tmp_path, monkeypatch):
    floors = _floors()
    monkeypatch.setattr(floors, "load", lambda p: json.loads(open(p).read()))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"ceilings": {"copy_gbps": 1.0, "matmul_tflops": 1.0},
                                 "machine": {"multiprocessors": 1}, "bench": []}))
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"ceilings": None, "machine": {}, "bench": []}))
    for path, message in ((empty, "no timed shared_context fwd rows"), (cpu, "no GPU ceilings")):
        monkeypatch.setattr("sys.argv", ["floors", str(path)])
        with pytest.raises(SystemExit, match=message):
            floors.main()
