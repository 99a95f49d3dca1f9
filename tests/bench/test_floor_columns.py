"""Every GPU bench row carries its attainable floor (bench/floors.py) and the share of it reached; the report shows
the share beside % roofline, only where it was measured."""
from types import SimpleNamespace

from attnbench.bench import floors, report
from attnbench.bench.runner import BenchRow, _set_floor
from attnbench.bench.timing import Timing


class _Op:
    name = "toy"

    def bytes(self, case, mode):
        return 3.0e9  # 1 ms at 3000 GB/s

    def flops(self, case, mode):
        return 0.4e12  # 0.5 ms at 800 TF/s


RATES = floors.Rates(copy_gbps=3000.0, matmul_tflops=800.0, multiprocessors=132, launch_floor_us=4.0)
CASE = SimpleNamespace(label="c1")


def _row(ms, method="cuda-events"):
    row = BenchRow("toy", "c1", "fwd", "triton")
    row.timing = Timing(ms, ms, ms, 10, method)
    return row


def test_a_gpu_row_gets_its_floor_and_share():
    row = _row(1.25)
    _set_floor(row, _Op(), CASE, "fwd", RATES)
    assert row.floor_binding == "bytes"
    assert abs(row.floor_ms - 1.0) < 1e-9 and abs(row.floor_pct - 80.0) < 1e-9


def test_no_floor_off_the_gpu_clocks_or_without_a_cost_model():
    cpu = _row(1.25, method="interpreter")
    _set_floor(cpu, _Op(), CASE, "fwd", RATES)
    assert cpu.floor_ms is None and cpu.floor_pct is None

    class NoModel(_Op):
        def bytes(self, case, mode):
            raise NotImplementedError

    gpu = _row(1.25)
    _set_floor(gpu, NoModel(), CASE, "fwd", RATES)
    assert gpu.floor_pct is None
    none = _row(1.25)
    _set_floor(none, _Op(), CASE, "fwd", None)  # a CPU run has no rates
    assert none.floor_pct is None


def test_the_report_shows_the_share_only_where_measured(tmp_path):
    def row(variant, ms, floor_pct=None):
        r = {"op": "toy", "case": "c1", "mode": "fwd", "variant": variant, "tflops": 10.0, "max_error": 1e-3,
             "timing": {"median_ms": ms, "method": "cuda-events"}}
        if floor_pct is not None:
            r.update(floor_ms=1.0, floor_pct=floor_pct, floor_binding="exps")
        return r

    data = {"machine": {"device_name": "Test GPU"},
            "operators": {"toy": {"ratio_subject": "fast", "ratio_peers": ["slow"]}},
            "bench": [row("fast", 1.25, 80.0), row("slow", 2.5)]}
    text = report.markdown(data)
    assert "% of floor (binding)" in text and "| 80 (exps) |" in text
    data["bench"][0].pop("floor_pct")
    assert "% of floor" not in report.markdown(data)


def test_the_results_pages_take_the_rows_floor_or_compute_it_from_the_runs_rates():
    """A row that carries its floor is shown as it is; an older row without one gets it from its run's recorded
    ceilings (as `report --floors` computes it); a run that records no rates shows none rather than a guess."""
    from attnbench.bench import site

    def line(row, data):
        run = site.Run(path="r.json", rel="gpu/flash/r.json", data=data, date="", order=0)
        return site.Line(case=row["case"], mode=row["mode"], run=run, subject="triton",
                         variants={"triton": row}, baseline=None, kinds={})

    carried = {"op": "flash", "case": "B1 H1 N64 D64 bf16", "mode": "fwd", "variant": "triton",
               "timing": {"median_ms": 1.0, "method": "cuda-events"}, "floor_pct": 42.0, "floor_binding": "compute"}
    assert site.floor_shares([line(carried, {})]) == [("B1 H1 N64 D64 bf16 · fwd", 42.0, "compute")]
    import attnbench
    case = attnbench.get("flash").cases("anchor")[0]
    old = {"op": "flash", "case": case.label, "mode": "fwd", "variant": "triton",
           "timing": {"median_ms": 1.0, "method": "cuda-events"}}
    with_rates = {"ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 800.0}, "machine": {"multiprocessors": 132}}
    (label, pct, binding), = site.floor_shares([line(old, with_rates)])
    assert label == f"{case.label} · fwd" and binding == "compute" and 0 < pct < 100
    assert site.floor_shares([line(old, {})]) == []  # no rates recorded: nothing invented
