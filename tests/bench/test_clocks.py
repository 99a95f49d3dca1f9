"""The two clocks a GPU bench row carries (GPU time and eager latency, and the host's time when asked),
through the result file, the tables, the report and the index; and the seeded random shape set."""
import csv
import json
import math

import pytest

from attnbench.bench import report, results, tables
from attnbench.bench.runner import BenchRow
from attnbench.bench.timing import Timing, measure_eager, measure_host
from attnbench.cli import main


def timing(ms, method):
    return Timing(ms, ms * 0.98, ms * 1.02, 20, method)


def rows():
    """ours is faster on the GPU (1.0 against 1.5 ms) and slower eagerly (0.40 against 0.10 ms: a slow
    launch path in front of a fast kernel, the case the eager clock exists for)."""
    base = BenchRow("flash", "B1 H2 N128 D64 bf16", "fwd", "sdpa_flash", timing=timing(1.5, "cuda-events"),
                    eager=timing(0.10, "eager-wall"), host=timing(0.04, "host"), tflops=100.0)
    ours = BenchRow("flash", "B1 H2 N128 D64 bf16", "fwd", "triton", timing=timing(1.0, "cuda-events"),
                    eager=timing(0.40, "eager-wall"), host=timing(0.35, "host"), tflops=150.0)
    from attnbench.bench.runner import _set_speedup

    for r in (base, ours):
        _set_speedup(r, base)
    return base, ours


def test_speedups_on_both_clocks():
    _, ours = rows()
    assert ours.speedup == pytest.approx(1.5) and ours.speedup_eager == pytest.approx(0.25)


def test_the_table_labels_both_clocks():
    text = tables.bench_table(list(rows()), lambda case: None)
    header = text.splitlines()[0]
    assert "eager ms" in header and "speedup eager" in header and "host us" in header
    line = next(l for l in text.splitlines() if l.startswith("B1") and " triton " in l)
    assert "1.50x" in line and "0.400" in line and "0.25x" in line and " 350 " in line
    assert "eager ms: wall time per call back to back, host included" in text
    assert "triton speed = 1.50x sdpa_flash (0.25x eager)" in tables.ratio_lines(list(rows()), "triton", ("sdpa_flash",))[0]


def test_result_file_report_and_index_carry_both_clocks(tmp_path, capsys):
    doc = {"format": results.FORMAT, "status": "complete", "machine": {"device_name": "Test GPU", "device": "cuda"},
           "operators": {"flash": {"ratio_subject": "triton", "ratio_peers": ["sdpa_flash"]}},
           "bench": [r.as_dict() for r in rows()]}
    path = tmp_path / "nvidia-test" / "flash" / "run.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    data = results.load(str(path))
    assert data["bench"][1]["eager"]["median_ms"] == 0.4 and data["bench"][1]["speedup_eager"] == 0.25
    md = report.markdown(data)
    assert "| triton eager ms | vs sdpa_flash eager |" in md
    assert "| 1.000 | 150 | 1.50x | 0.400 | 0.25x |" in md
    written, _ = report.write_index(str(tmp_path))
    with open(tmp_path / "index.csv") as f:
        clocks = {(r["variant"], r["clock"]): float(r["median_ms"]) for r in csv.DictReader(f)}
    assert clocks[("triton", "gpu_time")] == 1.0 and clocks[("triton", "eager")] == 0.4
    assert clocks[("triton", "host")] == 0.35 and len(written) == 6
    bad = dict(doc, bench=[dict(doc["bench"][1], eager={"median_ms": -1})])
    path.write_text(json.dumps(bad))
    with pytest.raises(results.BadResultFile, match="eager.median_ms must be a positive number"):
        results.load(str(path))


def test_the_gpu_clocks_refuse_a_cpu():
    for clock in (measure_eager, measure_host):
        with pytest.raises(ValueError, match="CUDA"):
            clock(lambda: None, "cpu")


def test_host_time_needs_cuda(capsys):
    assert main(["bench", "--op", "flash", "--device", "cpu", "--host-time", "--quiet"]) == 2
    assert "--host-time times the host's part of CUDA calls" in capsys.readouterr().err


def test_the_random_set_is_drawn_by_its_seed():
    """At least 120 shapes, the same every call, covering decode, self- and cross-attention up to 16K,
    GQA, head dims that are not powers of two, every mask, bf16 and fp16, each tensor within its cap."""
    import attnbench
    from attnbench.operators import flash

    op = attnbench.get("flash")
    cases = op.cases("random")
    assert len(cases) >= 120 and [c.label for c in cases] == [c.label for c in op.cases("random")]
    assert len({c.label for c in cases}) == len(cases)
    assert any(c.seqlen_q <= 16 and c.head_dim == 64 and c.heads_kv <= 2 for c in cases)  # decode, few KV heads
    assert {c.causal for c in cases} == {None, "top_left", "bottom_right"} and {c.dtype for c in cases} == {
        "bfloat16", "float16"}
    assert any(c.head_dim & (c.head_dim - 1) for c in cases) and any(c.heads_q != c.heads_kv for c in cases)
    assert any(c.seqlen_q != c.seqlen_k for c in cases) and max(c.seqlen_k for c in cases) > 8192
    for c in cases:
        biggest = 2 * c.head_dim * max(c.heads_q * c.seqlen_q, c.heads_kv * c.seqlen_k)
        assert c.batch == 1 or c.batch * biggest <= flash.RANDOM_MAX_TENSOR_BYTES
    assert [c.label for c in flash._random(seed=1)] != [c.label for c in cases]
