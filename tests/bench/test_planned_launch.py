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
                    (torch.zeros(11)[1:], 64),  # shape, dtype, a scalar, 16-byte alignment
                    (x, 64.0), (x, True)]:  # equal values of another type (Triton specializes on the type)
        launch.planned(kernel)[grid](*changed, **kwargs)
    assert len(kernel.launches) == 7 and len(kernel.runs) == 1
    launch.planned(kernel)[grid](torch.zeros(10), 1, **kwargs)  # 1 == True, but not the plan made for True
    assert len(kernel.launches) == 8 and len(kernel.runs) == 1
    launch.planned(kernel)[grid](x, 64, **dict(kwargs, ACC="fp64"))  # a constexpr
    assert len(kernel.launches) == 9


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


# Triton 3.6's CUDA launch path, as stand-ins: the compiled kernel's runner calls its CudaLauncher, whose
# ``launch`` is the C function or, for kernels taking host tensor descriptors, a closure expanding each
# descriptor into the copy engine's encoding, its extents and its strides. A plan calls the C function
# itself; what reaches it must be what Triton's runner gives it.
BASE_ARGS = 13  # grid (3), stream, function, cooperative, pdl, two scratch buffers, metadata, launch metadata, hooks


def fill_tma(ptr, swizzle, elem_size, host_dtype, block, shape, strides, padding):
    return ("tensor map", ptr, swizzle, elem_size, host_dtype, tuple(block), tuple(shape), tuple(strides), padding)


class Descriptor:  # the fields of Triton's host TensorDescriptor the launcher reads
    def __init__(self, base, block, shape=None, padding="zero"):
        self.base, self.shape, self.strides, self.padding = base, list(shape or base.shape), list(base.stride()), padding
        self.block_shape = list(block)


def expanding(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):  # as triton.backends.nvidia.driver.wrap_handle_tensordesc's
        final_args, j = list(args[:BASE_ARGS]), 0
        for i, arg in enumerate(args[BASE_ARGS:]):
            if i in tensordesc_indices:
                m = tensordesc_meta[j]
                j += 1
                host = {8: 10, 9: 8, 10: 9}.get(m["elem_type"], m["elem_type"])
                final_args.extend([fill_tma(arg.base.data_ptr(), m["swizzle"], m["elem_size"], host, m["block_size"],
                                            arg.shape, arg.strides, 1 if arg.padding == "nan" else 0),
                                   *arg.shape, *arg.strides])
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class CudaLauncher:
    def __init__(self, c_calls, descriptor_meta=None):
        def launch(*args):
            c_calls.append(args)
        self.launch = launch if descriptor_meta is None else expanding(launch, set(descriptor_meta), list(
            descriptor_meta.values()))
        self.global_scratch_size = self.profile_scratch_size = 0
        self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, False, True

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


class CompiledKernel:
    def __init__(self, c_calls, descriptor_meta=None):
        self.run, self.function, self.packed_metadata = CudaLauncher(c_calls, descriptor_meta), 1234, ("meta",)

    def __getitem__(self, grid):
        def runner(*args):
            self.run(*grid, 7, self.function, self.packed_metadata, {"launch": "metadata"}, "enter", "exit", *args)
        return runner


class GluonKernel:
    arg_names = ["q_desc", "o_desc", "LSE", "n", "CAUSAL", "STAGES"]


def _c_path(monkeypatch, hooks):
    monkeypatch.setattr(launch, "_c_launch_format", lambda: launch.C_LAUNCH_FORMAT)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 7)
    monkeypatch.setattr(launch, "_fill_tma", lambda: fill_tma)
    monkeypatch.setattr(launch, "_tma_host_dtype", lambda code: {8: 10, 9: 8, 10: 9}.get(code, code))
    monkeypatch.setattr(launch, "_no_launch_hooks", lambda: not hooks)


@pytest.mark.parametrize("descriptors", [False, "tiles", "host"])
def test_a_plan_calls_the_c_launcher_with_what_tritons_runner_gives_it(monkeypatch, descriptors):
    meta = {0: dict(swizzle=128, elem_size=2, elem_type=9, block_size=[1, 1, 64, 64], fp4_padded=False),
            1: dict(swizzle=64, elem_size=2, elem_type=9, block_size=[1, 1, 64, 32], fp4_padded=False)}
    calls = []
    compiled = CompiledKernel(calls, meta if descriptors else None)
    q, o, lse = torch.randn(2, 3, 70, 64), torch.randn(2, 3, 70, 32), torch.randn(2, 3, 70)

    def arguments(q, o, lse):
        if not descriptors:
            return [q, o, lse, 70]
        if descriptors == "host":  # host TensorDescriptors: extents short of the tensor's, NaN padding
            return [Descriptor(q, (1, 1, 64, 64), [2, 3, 50, 64], "nan"), Descriptor(o, (1, 1, 64, 32)), lse, 70]
        return [launch.Tiles(q, (1, 1, 64, 64), "layout"), launch.Tiles(o, (1, 1, 64, 32), "layout"), lse, 70]

    for hooks in (True, False):  # Triton's runner (a launch hook registered), then the C function
        _c_path(monkeypatch, hooks)
        monkeypatch.setattr(launch.Tiles, "descriptor", lambda self: Descriptor(self.tensor, self.block))
        plan = launch.LaunchPlan(GluonKernel, compiled, (2, 3, 4), 4, (), {"CAUSAL": True, "STAGES": 2})
        assert plan.c_launch is not None
        plan(arguments(q, o, lse))
    through_runner, direct = calls
    assert direct[:BASE_ARGS - 4] == through_runner[:BASE_ARGS - 4]  # grid, stream, function, flags, scratch
    assert direct[BASE_ARGS - 4] == through_runner[BASE_ARGS - 4] == ("meta",)
    assert direct[BASE_ARGS - 3:BASE_ARGS] == (None, None, None)  # no launch metadata, no hooks
    assert len(direct) == len(through_runner)
    for a, b in zip(direct[BASE_ARGS:], through_runner[BASE_ARGS:]):
        assert a is b if isinstance(a, torch.Tensor) else a == b
    if descriptors:  # the tensor maps carry the new pointers: another launch of the plan on other tensors
        q2 = torch.randn_like(q)
        plan(arguments(q2, o, lse))
        assert calls[-1][BASE_ARGS][1] == q2.data_ptr() and calls[-1][BASE_ARGS] != direct[BASE_ARGS]
        # a pointer seen before reuses its filled map (the same object), which holds that pointer
        plan(arguments(q, o, lse))
        assert calls[-1][BASE_ARGS] is direct[BASE_ARGS] and calls[-1][BASE_ARGS][1] == q.data_ptr()


def test_launchers_the_plan_cannot_take_apart_go_through_the_runner(monkeypatch):
    _c_path(monkeypatch, hooks=False)
    calls = []
    compiled = CompiledKernel(calls)
    compiled.run.global_scratch_size = 256  # scratch memory the runner allocates per launch
    plan = launch.LaunchPlan(GluonKernel, compiled, (1, 1, 1), 4, (), {"CAUSAL": True, "STAGES": 2})
    assert plan.c_launch is None and plan.run is not None
    fp4 = CompiledKernel(calls, {0: dict(swizzle=128, elem_size=1, elem_type=0, block_size=[64], fp4_padded=True)})
    assert launch.LaunchPlan(GluonKernel, fp4, (1, 1, 1), 4, (), {"CAUSAL": True, "STAGES": 2}).c_launch is None
    assert launch.LaunchPlan(GluonKernel, Compiled([]), (1,), 4, (), {"CAUSAL": True, "STAGES": 2}).c_launch is None
    hip = CompiledKernel(calls)
    hip.run.__class__ = type("HIPLauncher", (CudaLauncher,), {})  # another backend's launcher
    assert launch.LaunchPlan(GluonKernel, hip, (1, 1, 1), 4, (), {"CAUSAL": True, "STAGES": 2}).c_launch is None
    # a Triton whose C launch function takes other leading arguments
    monkeypatch.setattr(launch, "_c_launch_format", lambda: "iiiKKOOOO")
    assert launch.LaunchPlan(GluonKernel, CompiledKernel(calls), (1, 1, 1), 4, (), {"CAUSAL": True, "STAGES": 2}
                             ).c_launch is None
