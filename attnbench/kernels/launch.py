"""Launch plans: a kernel launched again with the same sizes, strides, dtypes and alignments skips
Triton's Python launcher.

A decode step's kernels run for microseconds, and Triton's launcher (autotuner key, argument
binding and specialization, cache lookup) costs tens of them with fifty arguments: the host time
of a shared_context decode call exceeds its GPU time (docs/measurements/shared_context.md). The
first launch of a call signature goes the usual way (autotuning, compiling); a ``LaunchPlan`` then
keeps what it resolved (the compiled kernel, its grid, every non-tensor argument) and later
launches pass only the new tensors, calling the compiled kernel the way torch.compile's generated
code does.

Keys must fix every argument the kernel specializes on: ``tensor_signature`` gives a tensor's
part (shape, strides, dtype, device, its pointer's remainder mod 16); the launcher adds its
scalars. They do not read Triton's runtime switches (``knobs.runtime.debug``, instrumentation
modes, JIT pre-run hooks): a process that changes those after its first launches should
``forget_plans()``. A Tiles is keyed by its tensor and box, so its layout must follow from them.
"""
import contextlib
import threading
import weakref
from typing import NamedTuple

import torch
import triton

from . import interpreting
from .tuning import autotune_enabled, gpu_property

# Triton 3.4+ (with ``triton.knobs``): a CompiledKernel's runner takes every argument of the
# function in order, constexprs included. Older runners take another list, so those (and the
# interpreter, which has no compiled kernel) launch through the JIT function with the plan's
# arguments instead: the same arguments, the usual launcher cost.
DIRECT_LAUNCH = hasattr(triton, "knobs")

_PLANS = {}
MAX_PLANS = 4096  # past this the cache starts over (a sweep of shapes, not a decode loop)


def on_device(t):
    """The tensor's GPU made current for a launch (a no-op context when it already is, or on the CPU)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def readable(t):
    """``t`` as a kernel may read it: a tensor whose negative bit is set (torch._neg_view, the imaginary part of a
    conjugate) resolved into a copy, since a kernel reads the raw storage and would drop the sign. The custom
    ops' dispatch resolves it on its own; the eager paths that skip the op call this."""
    return t.resolve_neg() if t.is_neg() else t


def tensor_signature(t):
    """What a kernel's specialization and a launch's sizes read of a tensor (None stays None). The pointer's
    remainder mod 16, not only whether it is aligned: a view a launcher makes at an offset from the tensor is
    aligned for one remainder and not for another (kernels/replay.py keys by this too)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


class Tiles(NamedTuple):
    """A host tensor descriptor (TMA) made at launch: ``tensor`` read or written in ``block`` boxes
    with the shared-memory ``layout`` (which must follow from the box and the dtype: plans key a
    Tiles by the tensor's signature and the box). A repeated launch fills the copy engine's
    descriptor straight from the tensor's pointer, without the descriptor object and its checks."""
    tensor: torch.Tensor
    block: tuple
    layout: object

    def descriptor(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        t = self.tensor
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(self.block), self.layout)


def _described(args):
    return [a.descriptor() if type(a) is Tiles else a for a in args]


class _Descriptor:
    """How the launcher expands one host descriptor: the copy engine's encoding of everything but the
    pointer (swizzle, element bytes, host dtype code, box), and the extents and strides the kernel receives
    beside it (``padding`` 1: out-of-bounds elements read as NaN, 0: as zeros). The rest of a plan's
    arguments fix every one of these, so the expansion is a function of the pointer alone: kept for the last
    pointers seen (a loop's inputs, and its outputs, which the caching allocator hands out at the same
    addresses), a repeated one costs a lookup instead of filling a descriptor. The launch copies the
    descriptor into the kernel's parameters, so one object serves any number of launches."""
    __slots__ = ("encoding", "shape", "strides", "padding", "filled")
    KEPT = 64  # pointers a descriptor position remembers

    def __init__(self, encoding, shape, strides, padding):
        self.encoding, self.shape, self.strides, self.padding, self.filled = encoding, shape, strides, padding, {}

    def expand(self, tensor, fill):
        pointer = tensor.data_ptr()
        known = self.filled.get(pointer)
        if known is None:
            if len(self.filled) >= self.KEPT:
                self.filled.clear()
            known = self.filled[pointer] = (fill(pointer, *self.encoding, self.shape, self.strides, self.padding),
                                            *self.shape, *self.strides)
        return known


# The C launch function's leading arguments as Triton 3.6 spells them (grid x, y, z; stream, function; cooperative,
# pdl; global and profile scratch, packed metadata, launch metadata, enter and exit hooks): plans call it only with
# Triton 3.6's CUDA launcher (what follows the leading arguments, a host descriptor's expansion, moves between
# releases), where the driver declares this same format.
C_LAUNCH_TRITON = "3.6."
C_LAUNCH_FORMAT = "iiiKKppOOOOOO"


def _c_launch_format():
    """The installed CUDA driver's leading-argument format, where the installed Triton is C_LAUNCH_TRITON."""
    if not triton.__version__.startswith(C_LAUNCH_TRITON):
        return None
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return getattr(driver, "_BASE_ARGS_FORMAT", None)


def _c_launcher(compiled, n_args):
    """Triton 3.6's CUDA launcher of ``compiled`` taken apart: (the C launch function, its fixed arguments
    between the stream and the kernel's, {argument position: _Descriptor-to-be (its metadata)}), or None wherever it is not
    that launcher (another Triton or backend, scratch memory, descriptor kinds it does not handle):
    then plans call the compiled kernel's runner. The runner's own per-launch work (the device and stream
    queries, launch metadata for hooks, scratch allocation, the descriptors' Python expansion) is what
    a launch of a few microseconds of GPU time pays for."""
    if _c_launch_format() != C_LAUNCH_FORMAT:
        return None
    try:
        run = compiled.run
        if type(run).__name__ != "CudaLauncher":
            return None
        c_launch, descriptors = run.launch, {}
        if run.global_scratch_size or run.profile_scratch_size or run.num_ctas != 1:
            return None
        if getattr(c_launch, "__name__", None) == "inner":  # wrap_handle_tensordesc's closure: host descriptors
            cells = dict(zip(c_launch.__code__.co_freevars, (c.cell_contents for c in c_launch.__closure__)))
            metadata = list(cells["tensordesc_meta"])
            positions = sorted(cells["tensordesc_indices"])
            if any(m is None or m["fp4_padded"] for m in metadata) or any(i >= n_args for i in positions):
                return None
            descriptors = dict(zip(positions, metadata))
            c_launch = cells["launcher"]
        if getattr(c_launch, "__name__", None) != "launch":
            return None
        head = (compiled.function, bool(run.launch_cooperative_grid), bool(run.launch_pdl), None, None,
                compiled.packed_metadata, None, None, None)
        return c_launch, head, descriptors
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _no_launch_hooks() -> bool:
    """No launch hook is registered (a profiler's, e.g. proton): then a plan may launch without them."""
    runtime = triton.knobs.runtime
    return all(h is None or not getattr(h, "calls", True) for h in (runtime.launch_enter_hook,
                                                                     runtime.launch_exit_hook))


class LaunchPlan:
    """One kernel's launch with everything but its tensor arguments fixed: ``plan(tensors)``
    launches ``fn`` on ``grid`` with ``(*tensors, *scalars)`` and the keyword arguments ``kwargs``
    (constexprs and the launch config) of the launch that made the plan. ``tensors`` may hold
    Tiles, which then must have the signatures of the launch that made the plan."""

    def __init__(self, fn, compiled, grid, n_tensors, scalars, kwargs):
        self.fn, self.grid, self.scalars, self.kwargs = fn, tuple(grid), tuple(scalars), dict(kwargs)
        self.run = self.c_launch = None
        names = fn.arg_names[n_tensors + len(self.scalars):]
        if DIRECT_LAUNCH and compiled is not None and not interpreting() and all(n in kwargs for n in names):
            self.tail = self.scalars + tuple(kwargs[n] for n in names)
            self.run = compiled[self.grid]
            parts = _c_launcher(compiled, n_tensors)
            if parts is not None:
                self.c_launch, self.head, self.descriptors = parts
                self._encodings = {}

    def __call__(self, tensors):
        if self.c_launch is not None and _no_launch_hooks():
            self._launch_c(tensors)
        elif self.run is not None:
            self.run(*_described(tensors), *self.tail)
        else:
            self.fn[self.grid](*_described(tensors), *self.scalars, **self.kwargs)

    def _launch_c(self, tensors):
        """The C launch itself, with the arguments Triton's runner would give it."""
        args = tensors
        if self.descriptors:
            args, last = [], 0
            for i, meta in self.descriptors.items():
                args.extend(tensors[last:i])
                args.extend(self._descriptor(i, meta, tensors[i]).expand(_base_of(tensors[i]), _fill_tma()))
                last = i + 1
            args.extend(tensors[last:])
        # the current device's stream, as Triton's runner takes it: launches run on the tensors' GPU (on_device),
        # which need not be the device current where the plan was made
        self.c_launch(*self.grid, _current_stream(_current_device()), *self.head, *args, *self.tail)

    def _descriptor(self, i, meta, arg):
        known = self._encodings.get(i)
        if known is None:
            encoding = (meta["swizzle"], meta["elem_size"], _tma_host_dtype(meta["elem_type"]), meta["block_size"])
            if type(arg) is Tiles:
                shape, strides, padding = list(arg.tensor.shape), list(arg.tensor.stride()), 0
            else:  # a host TensorDescriptor: its own extents, strides and padding, as Triton's expansion reads them
                shape, strides, padding = list(arg.shape), list(arg.strides), int(arg.padding == "nan")
            known = self._encodings[i] = _Descriptor(encoding, shape, strides, padding)
        return known


# Triton's CUDA driver pieces the C launch path uses (functions: tests stand in for them off a GPU)
def _current_device():
    return torch._C._cuda_getDevice()  # torch.cuda.current_device() without its initialization check: a launch's
    # tensors are on a GPU, so CUDA is initialized


def _current_stream(device):
    return torch._C._cuda_getCurrentRawStream(device)


_FILL_TMA = []


def _fill_tma():
    if not _FILL_TMA:  # the driver's lazy proxy costs a lookup per attribute
        _FILL_TMA.append(triton.runtime.driver.active.utils.fill_tma_descriptor)
    return _FILL_TMA[0]


def _tma_host_dtype(device_code):
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST  # the host enum differs from the device's

    return TMA_DTYPE_DEVICE_TO_HOST[device_code]


def _base_of(arg):
    """The tensor a descriptor argument reads (a Tiles' or a TensorDescriptor's)."""
    return arg.tensor if type(arg) is Tiles else arg.base


def plan(key):
    """The plan made for ``key``, or None."""
    return _PLANS.get(key)


def remember(key, launch_plan):
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = launch_plan
    return launch_plan


def forget_plans():
    """Forget every plan, and every replay made of them (tests do, with the autotuners' picks, to tune again)."""
    _PLANS.clear()
    for forget in FORGET_WITH_PLANS:
        forget()


FORGET_WITH_PLANS = []  # what else forget_plans() clears (kernels/replay.py's replays)


class _Recorder(threading.local):
    """Per thread: ``steps``, a list while an op's launches are recorded (kernels/replay.py), else None;
    ``inside``, True while a recorded launch runs Triton's own launcher; ``strays``, Triton launches that did not
    come through ``planned`` while recording (a replay would miss them)."""
    steps = None
    inside = False
    strays = 0


RECORDER = _Recorder()
_KEPT = {}  # id -> weak reference: tensors launchers keep between calls (kept())


def kept(t):
    """Mark ``t`` as a tensor a launcher keeps between calls (a module cache's, made once): a replay may pass it
    again as it is (kernels/replay.py refuses any other tensor it cannot trace to the call's inputs or allocations)."""
    _KEPT[id(t)] = weakref.ref(t)
    return t


def is_kept(t) -> bool:
    known = _KEPT.get(id(t))
    return known is not None and known() is t


def _argument_key(a):
    """What a launch specializes on of one argument: a tensor's signature; a Tiles' tensor signature
    and box; a host tensor descriptor's tensor, extents, strides, box and layout; any other value itself."""
    if isinstance(a, torch.Tensor):
        return tensor_signature(a)
    if type(a) is Tiles:
        return Tiles, tensor_signature(a.tensor), a.block
    if isinstance(getattr(a, "base", None), torch.Tensor) and hasattr(a, "block_shape"):
        return (type(a), tensor_signature(a.base), tuple(a.shape), tuple(a.strides), tuple(a.block_shape), a.layout,
                getattr(a, "padding", None))
    return (type(a), a)


def planned(kernel):
    """``planned(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](...)`` does (a JIT
    function or an autotuner), and remembers the launch: a later one whose arguments have the same
    signatures (``_argument_key``) and values calls the compiled kernel directly, skipping what
    Triton's launcher does on every call (the autotuner's key and lookup, argument binding and
    specialization, the cache lookup). Host time is what small eager calls pay for; the plan costs a
    key over the arguments. Not under the interpreter, nor for kernels that make tensor
    descriptors on the device (their scratch is set up by the JIT launch)."""
    return _Planned(kernel)


class _Planned:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if RECORDER.steps is not None:  # an op's launches being recorded for a replay (kernels/replay.py)
            return self._record(grid, args, kwargs)
        return self._launch_planned(grid, args, kwargs)[0]

    def _launch_planned(self, grid, args, kwargs):
        """Launch; returns (what the JIT launch returned, or None) and the plan that launched or was made (or None)."""
        if not DIRECT_LAUNCH or interpreting():
            return self.kernel[grid](*_described(args), **kwargs), None
        # ints (sizes, strides, flags: most of a launch's arguments) key as themselves, which no other
        # argument's key equals; the rest through _argument_key (a key per launch is host time)
        key = (id(self.kernel), autotune_enabled(), tuple([a if type(a) is int else _argument_key(a) for a in args]),
               tuple(kwargs.items()))
        known = _PLANS.get(key)
        if known is not None:
            known(args)
            return None, known
        compiled = self.kernel[grid](*_described(args), **kwargs)
        made = self._plan(grid, args, kwargs, compiled)
        if made is not None:
            remember(key, made)
        return compiled, made

    def _record(self, grid, args, kwargs):
        """The launch, and its step in the recording: the plan, or this kernel's JIT launch as made."""
        inside, RECORDER.inside = RECORDER.inside, True  # Triton's own launch below is this step's, not a stray one
        try:
            compiled, made = self._launch_planned(grid, args, kwargs)
        finally:
            RECORDER.inside = inside
        RECORDER.steps.append((made, self.kernel, grid, args, kwargs))
        return compiled

    def _plan(self, grid, args, kwargs, compiled):
        """A LaunchPlan repeating the launch just made with its compiled kernel, or None (nothing to gain)."""
        best = getattr(self.kernel, "best_config", None)
        fn = getattr(self.kernel, "fn", self.kernel) if best is not None else self.kernel
        names = getattr(fn, "arg_names", None)
        if compiled is None or names is None:
            return None
        given = dict(kwargs, **(best.all_kwargs() if best is not None else {}))
        size = grid(dict(zip(names, args), **given)) if callable(grid) else grid
        made = LaunchPlan(fn, compiled, tuple(size) + (1,) * (3 - len(size)), len(args), (), given)
        return made if made.run is not None else None


# Tensor descriptors (TMA) -------------------------------------------------------------------------
_CAPABILITY = {}


def tma_capable(device) -> bool:
    """A GPU with the tensor-memory copy engine (compute capability 9.0+: Hopper and later)."""
    return gpu_property(_CAPABILITY, device, False, lambda index: torch.cuda.get_device_capability(index)[0] >= 9)


def descriptors_apply(tensors, gpu_dtypes=False) -> bool:
    """Whether kernels may read ``tensors`` ([B, H, N, D], last dim contiguous) through tensor
    descriptors made per (batch, head): every base pointer a program forms and every row stride a
    multiple of 16 bytes (the copy engine's rule), on a GPU that has the engine or under the
    interpreter. ``gpu_dtypes`` also asks for fp16/bf16, the dtypes the descriptor kernels are
    measured at (the default route's test)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
        if gpu_dtypes and t.dtype not in (torch.float16, torch.bfloat16):
            return False
    device = tensors[0].device
    return interpreting() if device.type != "cuda" else (not interpreting() and tma_capable(device))


def _scratch_on(device):
    def allocate(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)
    return allocate


@contextlib.contextmanager
def descriptor_scratch(device):
    """Global memory for the descriptors a kernel makes on the device (``tl.make_tensor_descriptor``
    asks Triton's allocator for it at launch). Set for the launch only, and only when the caller has
    not set an allocator of their own (``triton.set_allocator``), which is then used as is."""
    from triton.runtime import _allocation  # Triton's allocator context variable (3.4+)

    if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        yield
        return
    token = _allocation._allocator.set(_scratch_on(device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)
