"""``attnbench report --floors`` (attnbench/bench/floors.py): each case's least time by resource (bytes at the copy
bandwidth, compute at the matmul or FMA rate, exponentials at the special-function rate, one launch) and the
share of the copy bandwidth any kernel can show; the logic of scripts/shared_context_floors.py and
scripts/sparse_floors.py, checked on their figures."""
import json

import pytest

import attnbench
from attnbench.bench import floors
from attnbench.bench.roofline import exp_floor_s
from attnbench.cli import main
from attnbench.operators.shared_context import SharedContextCase
from attnbench.operators.sparse import PRODUCTS, SparseCase, cg_block_macs, largest_batch

SPARSE = attnbench.get("sparse")
SHARED = attnbench.get("shared_context")
H100_PEAKS = floors.Rates(copy_gbps=3020.0, matmul_tflops=989.0, multiprocessors=132)  # sparse_floors' defaults


def test_clebsch_gordan_blocks_count_every_path():
    """L 1: paths (0,0,0), (0,1,1), (1,0,1), (1,1,0), (1,1,1): 1 + 9 + 9 + 9 + 27."""
    assert cg_block_macs(1) == 55
    assert cg_block_macs(6) == 98245  # 84% of 49**3: the triangle rule excludes little


def test_design_caps_count_the_sibling_products():
    """vecsca (z as large as x, y small): backward reads g twice, 2 (X + Z) against 2X + Z, 3/4; double backward
    4X + 7Z against 3X + 2Z, 5/11. mul (X = Y = Z): 5/6 and 8/15. inner (z small): all but 1 and 6/8."""
    expected = {"vecsca": (3 / 4, 5 / 11), "mul": (5 / 6, 8 / 15), "inner": (1.0, 6 / 8)}
    for op, (bwd, double_bwd) in expected.items():
        case = SparseCase(op, 3, 10_000, 128, "bfloat16")
        cap = {mode: floors.floor(SPARSE, case, mode, H100_PEAKS).design_cap_pct for mode in SPARSE.modes}
        assert cap["fwd"] == pytest.approx(100.0)
        assert cap["bwd"] == pytest.approx(100 * bwd, abs=1.0), op
        assert cap["double_bwd"] == pytest.approx(100 * double_bwd, abs=1.0), op
    assert floors.floor(SPARSE, SparseCase("scale", 3, 10_000, 32), "bwd", H100_PEAKS).design_cap_pct is None


def test_peaks_bound_mul_at_l6_and_the_shared_weight_at_c128():
    mul = floors.floor(SPARSE, SparseCase("mul", 6, 100_000, 32, "bfloat16"), "fwd", H100_PEAKS)
    # 294 bytes a column at 3020 GB/s against 98245 multiply-adds at 989 TF/s
    assert mul.attainable_pct == pytest.approx(100 * (294 / 3020e9) / (2 * 98245 / 989e12), rel=0.01)
    assert mul.attainable_pct < 60 and mul.binding == "compute"
    case = SparseCase("vecmat", 3, 100_000, 128, "bfloat16", "y")
    fc = floors.floor(SPARSE, case, "fwd", H100_PEAKS)
    fma_s = SPARSE.flops(case, "fwd") / 67e12
    assert fc.attainable_pct < 60 and fc.floors_s["compute"] < fma_s  # the tensor cores' dense form is faster
    small = floors.floor(SPARSE, SparseCase("vecsca", 2, 1_000_000, 32, "bfloat16"), "fwd", H100_PEAKS)
    assert small.attainable_pct == 100.0 and small.design_cap_pct == pytest.approx(100.0)


def test_a_model_table_over_the_sweep_at_its_largest_n():
    cases = [c for c in largest_batch(SPARSE.cases("sweep")) if c.op in ("mul", "vecsca")]
    assert {c.batch for c in cases if c.op == "mul" and c.l_max == 2 and c.channels == 32} == {1_000_000}
    assert len({(c.op, c.l_max, c.channels, c.dtype) for c in cases}) == len(cases)
    rows = floors.table(SPARSE, cases, SPARSE.modes, H100_PEAKS)
    text = floors.markdown(rows, H100_PEAKS, title="sparse against 60% of copy bandwidth")
    assert "| mul L6 N100000 C32 bf16 | fwd |" in text and "design cap %" in text and "vecmat" not in text
    assert {r.op for r in rows} == {"sparse"} and set(PRODUCTS) >= {c.op for c in cases}


def _made_up_report(tmp_path, method="cuda-events", launch=None):
    exp_bound = SharedContextCase(4096, 4, 4, 2, 10000, 0, 32)  # 9.4 MB against 328M exponentials
    byte_bound = SharedContextCase(4096, 4, 4, 1, 512, 32, 32)  # 69.5 MB against 8.9M
    rows = []
    for case, triton_ms in ((exp_bound, 0.155), (byte_bound, 0.045)):
        for variant, ms in (("triton", triton_ms), ("fold_flash", 2 * triton_ms), ("split", 9.0)):
            rows.append({"op": "shared_context", "case": case.label, "mode": "fwd", "variant": variant,
                         "skipped": "", "timing": {"median_ms": ms, "method": method}})
    rows.append({"op": "flash", "case": "B1 nowhere", "mode": "fwd", "variant": "triton", "skipped": "",
                 "timing": {"median_ms": 1.0, "method": method}})
    report = {"format": 1, "status": "complete", "bench": rows,
              "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 800.0, "launch_floor_us": launch},
              "machine": {"multiprocessors": 132, "device_name": "test GPU"}}
    return report, exp_bound, byte_bound


def test_floors_bound_the_copy_share_of_each_case(tmp_path):
    """The attainable share is the bytes' time over the longest floor; the measured share comes from the subject
    variant's row; a label of no case set is named, not guessed."""
    report, exp_bound, byte_bound = _made_up_report(tmp_path)
    rows, unknown = floors.from_report(report, floors.rates_of(report))
    by_case = {r.case: r for r in rows}
    copy_s = SHARED.bytes(exp_bound, "fwd") / 3000e9
    exp_s = exp_floor_s(SHARED.exponentials(exp_bound, "fwd"), 132)
    matmul_s = SHARED.flops(exp_bound, "fwd") / 800e12
    assert by_case[exp_bound.label].attainable_pct == pytest.approx(100 * copy_s / max(exp_s, matmul_s))
    assert by_case[exp_bound.label].binding == "exps"
    assert by_case[byte_bound.label].attainable_pct == 100.0
    assert by_case[byte_bound.label].copy_pct == pytest.approx(100 * SHARED.bytes(byte_bound, "fwd") / 3000e9 / 45e-6)
    assert by_case[exp_bound.label].of_floor_pct == pytest.approx(100 * exp_s / 155e-6)
    assert unknown == ["flash B1 nowhere"]
    # twice the exponential rate and a faster matmul move the ceiling up
    faster = floors.rates_of(report, "exp_rate_factor=2,matmul_tflops=1e6")
    rows, _ = floors.from_report(report, faster)
    assert rows[0].attainable_pct == pytest.approx(200 * copy_s / exp_s)
    text = floors.report_section(report)
    assert "### shared_context" in text and "Not placed" in text and "launch us" not in text


def test_the_launch_floor_counts_for_event_timings_only(tmp_path):
    report, *_ = _made_up_report(tmp_path, launch=3.648)
    section = floors.report_section(report)
    assert "one launch 3.648 us" in section and "| launch us |" in section
    graphs, *_ = _made_up_report(tmp_path, method="cuda-graph", launch=3.648)
    assert "one launch not counted" in floors.report_section(graphs)
    assert "one launch 5 us" in floors.report_section(graphs, "launch_floor_us=5")


def test_rates_must_be_known_and_numbers():
    for text, message in (("bogus=1", "expected name=value"), ("copy_gbps", "expected name=value"),
                          ("copy_gbps=fast", "not a number"), ("matmul_tflops=0", "must be > 0")):
        with pytest.raises(ValueError, match=message):
            floors.parse_overrides(text)
    with pytest.raises(ValueError, match="the run records no copy_gbps, matmul_tflops, multiprocessors"):
        floors.rates_of({"ceilings": None, "machine": {}})


def test_report_floors_on_a_cpu_run_asks_for_the_rates(tmp_path, capsys):
    """A CPU run has no ceilings: --floors says what to give; given, the floors come without measured columns
    (CPU wall time is no GPU time)."""
    path = tmp_path / "cpu.json"
    assert main(["bench", "--quiet", "--op", "flash", "--mode", "fwd", "--variant", "split", "--match",
                 "N37x29 D24 fp32", "--json", str(path)]) == 0
    capsys.readouterr()
    assert main(["report", str(path), "--floors"]) == 2
    assert "--floors: the run records no copy_gbps" in capsys.readouterr().err
    assert main(["report", str(path), "--floors", "copy_gbps=3020,matmul_tflops=785,multiprocessors=132"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("## Floors"):]
    assert "| B1 H2 N37x29 D24 fp32 | fwd |" in section and "exps us" in section and "measured us" not in section
    assert json.loads(path.read_text())["status"] == "complete"
