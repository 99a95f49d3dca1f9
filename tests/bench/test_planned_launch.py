"""planned(kernel): the first launch of a signature goes through Triton's launcher, later ones call the
compiled kernel with the same arguments, the grid the first launch resolved and its constexprs; any argument
that differs (a size, a dtype, an alignment, a constexpr, the autotune switch) goes through the launcher again.
Triton's own objects need a GPU; these stand-ins have their interface."""
import pytest
import torch

from attnbench.kernels import launch


class Compiled:
    def __init__(self, runs):
        self.runs = runs

    def __getitem__(self, grid):
        return lambda *args: self.runs.append((grid, args))


class Config:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def all_kwargs(self):
        return dict(self.kwargs, num_warps=4)


class Kernel:
    """A JIT function (or, with ``tuned``, an autotuner over one) taking X, n and two constexprs."""

    arg_names = ["X", "n", "BLOCK", "ACC"]

    def __init__(self, tuned=False):
        self.launches, self.runs = [], []
        if tuned:
            self.fn = self
            self.best_config = Config(BLOCK=32)

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return Compiled(self.runs)
        return launch_


@pytest.fixture(autouse=True)
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    launch.forget_plans()
    yield
    launch.forget_plans()


@pytest.mark.parametrize("tuned", [False, True])
def test_a_repeated_signature_skips_the_launcher(tuned):
    kernel = Kernel(tuned)
    x = torch.zeros(10)
    grid = lambda meta: (meta["n"] // meta["BLOCK"], 2)  # noqa: E731
    kwargs = {"ACC": "fp32"} if tuned else {"BLOCK": 4, "ACC": "fp32"}
    launch.planned(kernel)[grid](x, 64, **kwargs)
    launch.planned(kernel)[grid](torch.ones(10), 64, **kwargs)  # new data, same signature
    assert len(kernel.launches) == 1
    block = 32 if tuned else 4
    assert kernel.runs == [((64 // block, 2, 1), (kernel.runs[0][1][0], 64, block, "fp32"))]
    assert torch.equal(kernel.runs[0][1][0], torch.ones(10))
    for changed in [(torch.zeros(12), 64), (torch.zeros(10, dtype=torch.float64), 64), (x, 65),
                    (torch.zeros(11)[1:], 64)]:  # shape, dtype, a scalar, 16-byte alignment
        launch.planned(kernel)[grid](*changed, **kwargs)
    assert len(kernel.launches) == 5 and len(kernel.runs) == 1
    launch.planned(kernel)[grid](x, 64, **dict(kwargs, ACC="fp64"))  # a constexpr
    assert len(kernel.launches) == 6


def test_the_autotune_switch_and_the_interpreter_bypass_plans(monkeypatch):
    kernel = Kernel(tuned=True)
    x = torch.zeros(10)
    launch.planned(kernel)[(1,)](x, 64, ACC="fp32")
    monkeypatch.setenv("ATTNBENCH_AUTOTUNE", "0")
    launch.planned(kernel)[(1,)](x, 64, ACC="fp32")
    assert len(kernel.launches) == 2
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    launch.planned(kernel)[(1,)](x, 64, ACC="fp32")
    launch.planned(kernel)[(1,)](x, 64, ACC="fp32")
    assert len(kernel.launches) == 4 and kernel.runs == []


def test_a_launch_missing_a_trailing_argument_is_not_planned():
    kernel = Kernel()
    launch.planned(kernel)[(1,)](torch.zeros(4), 8, BLOCK=4)  # ACC left to its default: nothing to replay with
    launch.planned(kernel)[(1,)](torch.zeros(4), 8, BLOCK=4)
    assert len(kernel.launches) == 2 and kernel.runs == []
