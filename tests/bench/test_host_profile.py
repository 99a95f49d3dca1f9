"""scripts/host_profile.py: the rounds fit a time budget, and a backend that refuses a route reads '-'."""
import time

import torch

from tests.helpers import load_script

host_profile = load_script("scripts/host_profile.py")


def test_a_slow_call_gets_fewer_calls_a_round_not_a_longer_profile():
    """A 3 ms route at 1500 calls a round, 5 rounds and 4 levels took 90 s on the H200 and the device call's limit
    cut the profile after three routes: rounds now stop at --round-s."""
    start = time.perf_counter()
    us = host_profile.per_call_us(lambda: time.sleep(0.002), torch.device("cpu"), calls=1500, round_s=0.05)
    assert 2000 <= us < 20000 and time.perf_counter() - start < 5  # 20 warm-up + 5 x 20 calls, not 7500


def test_a_backend_that_refuses_a_route_reads_none():
    def refuses():
        raise RuntimeError("derivative for aten::_scaled_dot_product_flash_attention_backward is not implemented")
    assert host_profile.peer_us(refuses, torch.device("cpu"), calls=10, round_s=0.01) is None


def test_each_level_starts_and_leaves_without_replays():
    """A replay made at one level would run at the next: one recorded under stubbed launches repeats no launch, one
    recorded for real launches past the stubs."""
    from attnbench.kernels import replay

    replay._REPLAYS["made before"] = replay.Refusal("a stand-in")
    for level in ("unreplayed", "launches", "ops"):
        with host_profile.Stubbed(level):
            assert not replay.replays()
            assert replay.ENABLED is (level != "unreplayed")
            replay._REPLAYS["made inside"] = replay.Refusal("a stand-in")
        assert not replay.replays() and replay.ENABLED
