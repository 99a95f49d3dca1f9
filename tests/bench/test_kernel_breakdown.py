"""scripts/kernel_breakdown.py: the per-call tally of a profile's GPU events, and a clear refusal without a GPU."""
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import load_script

breakdown = load_script("scripts/kernel_breakdown.py")


def _event(name, start, end, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, device_time=end - start,
                           time_range=SimpleNamespace(start=start, end=end))


def test_the_tally_is_per_call_and_leaves_host_events_out():
    events = [_event("dq", 0, 10), _event("dkdv", 12, 32), _event("dq", 40, 50), _event("dkdv", 52, 72),
              _event("aten::empty", 0, 500, torch.autograd.DeviceType.CPU)]
    table, span = breakdown.tally(events, calls=2)
    assert table == {"dq": (10.0, 1.0), "dkdv": (20.0, 1.0)}
    assert span == 36.0  # 0 to 72 over two calls: the gaps between launches count
    assert breakdown.tally([], calls=3) == ({}, 0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_without_a_gpu_it_refuses_before_any_case(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["kernel_breakdown.py", "--match", "B1 "])
    with pytest.raises(SystemExit):
        breakdown.main()
    assert "no GPU here" in capsys.readouterr().err


def test_an_unknown_variant_is_refused_by_name_before_any_case(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["kernel_breakdown.py", "--variant", "triton@nope"])
    with pytest.raises(SystemExit):
        breakdown.main()
    assert "unknown variant 'triton@nope'" in capsys.readouterr().err
