"""``attnbench calibrate``: the machine's matmul and copy ceilings and, beside them, what an empty Triton launch
costs (the GPU-time floor every timed call stands on, and the host time to submit it), which the launch-floor and
launch-cost studies measured by hand. On the CPU the command says there is nothing to calibrate."""
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
