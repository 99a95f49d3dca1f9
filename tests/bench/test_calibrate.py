"""``attnbench calibrate``: the machine's matmul and copy ceilings and, beside them, what an empty Triton launch
costs (the GPU-time floor every timed call stands on, and the host time to submit it), which the launch-floor and
launch-cost studies measured by hand. On the CPU the command says there is nothing to calibrate."""
import json

import pytest

from attnbench.bench import roofline
from attnbench.cli import calibration_line, main


def test_calibrate_on_the_cpu_says_there_is_nothing_to_calibrate(capsys):
    assert main(["calibrate", "--device", "cpu"]) == 0
    assert "no CUDA device: nothing to calibrate" in capsys.readouterr().out


def test_a_cache_from_before_the_launch_floor_still_loads():
    old = {"device_name": "NVIDIA H200", "matmul_tflops": 700.0, "copy_gbps": 4270.0, "torch": "2.11", "triton": "3.6"}
    c = roofline.Ceilings(**old)
    assert c.launch_floor_us is None and c.launch_host_us is None
    assert calibration_line(c) == "NVIDIA H200: bf16 matmul 700 TF/s, device copy 4270 GB/s"
    c = roofline.Ceilings(**old, launch_floor_us=3.648, launch_host_us=14.2)
    assert calibration_line(c).endswith("empty Triton launch 3.6 us of GPU time (the least any timed call reads), "
                                        "14.2 us of host time to submit")


@pytest.mark.interpreter
def test_launch_costs_time_an_empty_kernel():
    """In the interpreter the numbers are the interpreter's; the plumbing is the GPU's."""
    floor_us, host_us = roofline.launch_costs("cpu", calls=5)
    assert floor_us > 0 and host_us > 0


def test_an_unreadable_ceilings_cache_is_measured_again_and_rewritten_whole(tmp_path, monkeypatch):
    """The cache was read with a bare json.loads and written in place: half a file (two runs at once, a full disk)
    stopped every later bench with a traceback (found by review). It is measured again, then replaced by rename."""
    from attnbench.bench import roofline

    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(roofline, "machine_info", lambda device: {"device_name": "Test GPU", "torch": "t", "triton": "tr"})
    made = roofline.Ceilings("Test GPU", 700.0, 3000.0, "t", "tr")
    monkeypatch.setattr(roofline, "calibrate", lambda device: made)
    (tmp_path / "ceilings.json").write_text('{"Test GPU|torch t|triton tr": {"device_na')
    assert roofline.ceilings("cuda") == made
    assert json.loads((tmp_path / "ceilings.json").read_text())["Test GPU|torch t|triton tr"]["matmul_tflops"] == 700.0
    assert [p.name for p in tmp_path.iterdir()] == ["ceilings.json"]  # no temporary left beside it
