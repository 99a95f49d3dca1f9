"""Host replays: an eager op called again with a signature it has already run repeats what that call did on the
host (its output allocations and its kernels' launches) without the launchers' Python.

A small eager call is host-bound: the launchers' route choices, stride reads, output allocation and each launch's
plan key cost more than the kernels (docs/measurements/flash.md, "Where an eager call's host time goes"). Launch
plans (launch.py) skip Triton's launcher; a replay skips ours. The second call of a signature runs the op body
while recording:
- every launch made through ``launch.planned`` (its plan, or the kernel's JIT launch where there is none);
- every tensor the body allocates (``torch.empty`` and its kin);
and refuses (the body then runs on every call, as before) when the body does anything a replay would not repeat:
any other tensor operation (a copy, a fill, a sum), a Triton launch that did not come through ``planned``, a value
it cannot trace back (a host tensor descriptor, a container, a view whose storage two inputs share, a tensor from
outside the call that its launcher did not mark ``launch.kept``). Later calls of the signature allocate the same
outputs and call the same plans on the new tensors.

The key is every tensor argument's shape, strides, dtype, device, pointer remainder mod 16 and negative bit, every
other argument's value, which arguments are one object, and the caller's ``state()`` (ops.py's: the forced routes,
the autotune and determinism switches, the module switches that pick a route): whatever else a launcher reads must
follow from these. Like plans, replays assume Triton's runtime switches and the launchers' code stay as they were:
a process that changes them (a test that swaps a kernel or a launcher) calls ``launch.forget_plans()``, which
forgets replays too. The first call of a signature is never recorded: it compiles and autotunes, which allocates
and copies.
"""
import threading

import torch
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from . import interpreting
from .launch import (DIRECT_LAUNCH, FORGET_WITH_PLANS, RECORDER, Tiles, _described, is_kept, on_device,
                     tensor_signature)
from .outputs import _poisoning

ENABLED = True  # the switch: False runs every call's body (tests compare the two)
ON_INTERPRETER = False  # replays also under Triton's interpreter (tests: the same recording and mapping, on a CPU)
MAX_REPLAYS = 4096  # signatures; past this the table starts over (a sweep of shapes, not a loop of calls)

_REPLAYS = {}  # key -> Replay, or a Refusal
_SEEN = set()  # keys called once


FORGET_WITH_PLANS.append(lambda: (_REPLAYS.clear(), _SEEN.clear()))


class Refusal(str):
    """Why a signature's calls run the body every time (what the recording saw that a replay would not repeat)."""


aten = torch.ops.aten
# what a recorded body may do to tensors besides launching: allocate (replayed), or make views (not replayed:
# a launch argument that is a view is found again from its base's storage)
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
               aten.new_empty_strided.default}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.as_strided.default, aten.alias.default, aten.detach.default, aten.expand.default, aten.slice.Tensor,
         aten.select.int, aten.t.default, aten.transpose.int, aten.permute.default, aten.unflatten.int}


def enabled() -> bool:
    """Whether calls replay here: launches go through plans (or the interpreter, when asked), outputs unpoisoned."""
    return ENABLED and DIRECT_LAUNCH and (ON_INTERPRETER or not interpreting()) and not _poisoning()


def replayed(name, body, state=tuple):
    """``body`` (an op's eager body: tensors and scalars in, a tuple of tensors or None out) with replays: the
    same results, the launchers' host time paid on a signature's first two calls only."""
    def call(*args):
        if RECORDER.steps is not None or not enabled():  # inside a recording: its launches are the outer op's
            return body(*args)
        ids = [id(a) for a in args]  # which arguments are one object: a replay passes them on the same way
        key = (name, state(), tuple([_signature(a) for a in args]), tuple([ids.index(i) for i in ids]))
        known = _REPLAYS.get(key)
        if known is not None:
            return body(*args) if type(known) is Refusal else known(args)
        if key not in _SEEN:
            if len(_SEEN) >= MAX_REPLAYS:
                _SEEN.clear()
            _SEEN.add(key)
            return body(*args)
        out, made = _record(body, args)
        if len(_REPLAYS) >= MAX_REPLAYS:
            _REPLAYS.clear()
        _REPLAYS[key] = made
        return out

    call.__name__ = getattr(body, "__name__", name)
    return call


def _signature(a):
    if type(a) is torch.Tensor:  # the body resolves a negative bit with a copy, which a replay would skip
        return tensor_signature(a), a.is_neg()
    return type(a), a


class _Watch(TorchDispatchMode):
    """The tensor operations of a recorded body: its allocations kept, anything else but a view refuses."""

    def __init__(self):
        super().__init__()
        self.allocations, self.refused = [], None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if RECORDER.inside:  # Triton's own, inside a recorded launch (the interpreter's copies, an autotuner's)
            return out
        if func in ALLOCATIONS:
            self.allocations.append(out)
        elif func not in VIEWS and self.refused is None:
            self.refused = str(func)
        return out


def replays():
    """{(op name, state, argument signatures, which arguments are one object): a Replay, or the Refusal saying why
    that signature runs its body every call}."""
    return dict(_REPLAYS)


_COUNTING = []  # the stray-launch counter, once installed
_INSTALL = threading.Lock()


def _count_strays():
    """Wrap Triton's ``kernel[grid]`` once for the process: a launch that bypasses ``launch.planned`` while this
    thread records counts as a stray. Installed for good, not per recording: two threads recording at once would
    otherwise restore each other's wrapper (and miss a stray)."""
    with _INSTALL:
        if _COUNTING:
            return
        from triton.runtime.jit import KernelInterface

        original = KernelInterface.__getitem__

        def counted(kernel, grid):
            if RECORDER.steps is not None and not RECORDER.inside:
                RECORDER.strays += 1
            return original(kernel, grid)

        KernelInterface.__getitem__ = counted
        _COUNTING.append(counted)


def _record(body, args):
    """Run ``body`` once, recording; returns its output and a Replay, or a Refusal."""
    _count_strays()
    RECORDER.steps, RECORDER.strays = [], 0
    watch = _Watch()
    try:
        with watch:
            out = body(*args)
        steps, strays = RECORDER.steps, RECORDER.strays
    finally:
        RECORDER.steps = None
    if strays:  # first: under the interpreter such a launch's own copies are what the watch saw
        return out, Refusal(f"{strays} Triton launch(es) not made through launch.planned")
    if watch.refused is not None:
        return out, Refusal(f"the body runs {watch.refused}")
    try:
        return out, Replay(args, watch.allocations, steps, out)
    except _Untraceable as why:
        return out, Refusal(str(why))


class _Untraceable(Exception):
    """A recorded launch argument or output that a replay could not make again from new inputs."""


# how a replay finds a value again: from an input (position), a new allocation (index), a view of either, a Tiles
# over any of these, a tensor a launcher keeps (launch.kept: itself), a fresh empty tensor (a zero-size one), or as
# the constant it was
_INPUT, _NEW, _VIEW, _TILES, _KEPT, _FRESH = range(6)


def _constant(a) -> bool:
    """A value a replay may pass again as it was: a number, a string, a dtype, a Triton constexpr, or a tuple of these
    (anything else might hold a tensor of the recorded call)."""
    if a is None or type(a) in (bool, int, float, str, torch.dtype) or isinstance(a, (tl.dtype, tl.constexpr)):
        return True
    return type(a) is tuple and all(_constant(x) for x in a)


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class Replay:
    """The recorded call, repeatable on new inputs of the same signature."""

    def __init__(self, args, allocations, steps, out):
        self.sources = {}
        for i, a in enumerate(args):  # a tensor passed twice maps to its first place (the key holds the pattern)
            if type(a) is torch.Tensor:
                self.sources.setdefault(id(a), (_INPUT, i))
        self.sources.update({id(t): (_NEW, j) for j, t in enumerate(allocations)})
        self.args, self.allocated = args, allocations
        # the strides exactly (is_contiguous() ignores those of size-1 dimensions, which empty_strided may have set)
        self.allocations = [(tuple(t.shape), None if t.stride() == _contiguous_strides(t.shape) else t.stride(),
                             t.dtype, t.device) for t in allocations]
        self.device_of = next(i for i, a in enumerate(args) if type(a) is torch.Tensor)
        if not isinstance(out, tuple):
            raise _Untraceable(f"the body returns a {type(out).__name__}, not a tuple")
        self.steps = [self._step(*step) for step in steps]
        self.outputs = self._traced(out)
        del self.args, self.allocated, self.sources  # the recorded call's tensors are not kept

    def _source(self, t):
        known = self.sources.get(id(t))
        if known is not None:
            return known
        # a view: of the one input or allocation that owns its storage
        storage = t.untyped_storage()
        owners = {self.sources[id(b)] for b in (*[a for a in self.args if type(a) is torch.Tensor], *self.allocated)
                  if b.untyped_storage().data_ptr() == storage.data_ptr()} if storage.nbytes() else set()
        if len(owners) > 1:
            raise _Untraceable("a view whose storage two inputs share")
        if not owners:
            if is_kept(t):  # made before the call and kept by a launcher (a stand-in for an unread pointer)
                return _KEPT, t
            if not storage.nbytes():  # nothing to read or write: a fresh one of the same layout
                return _FRESH, (tuple(t.shape), t.stride(), t.dtype, t.device)
            raise _Untraceable("a tensor that is no input's, no allocation's and not launch.kept")
        owner = owners.pop()
        base = self.args[owner[1]] if owner[0] == _INPUT else self.allocated[owner[1]]
        if (t.shape, t.stride(), t.storage_offset()) == (base.shape, base.stride(), base.storage_offset()):
            return owner  # the owner itself (a tensor the dispatch mode saw is another Python object for it)
        return _VIEW, (owner, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())

    def _traced(self, values):
        """(template, dynamic): the values with constants in place, and (position, how) for those found per call."""
        template, dynamic = list(values), []
        for i, a in enumerate(values):
            if type(a) is torch.Tensor:
                dynamic.append((i, self._source(a)))
                template[i] = None  # the recorded call's tensors are not kept
            elif type(a) is Tiles:
                dynamic.append((i, (_TILES, (self._source(a.tensor), a.block, a.layout))))
                template[i] = None
            elif not _constant(a):
                raise _Untraceable(f"a value of type {type(a).__name__}")
        return template, dynamic

    def _step(self, plan, kernel, grid, args, kwargs):
        if not all(_constant(v) for v in kwargs.values()):
            raise _Untraceable("a keyword argument that is not a constant")
        return plan, kernel, grid, kwargs, self._traced(args)

    def __call__(self, args):
        new = [torch.empty(shape, dtype=dtype, device=device) if stride is None
               else torch.empty_strided(shape, stride, dtype=dtype, device=device)
               for shape, stride, dtype, device in self.allocations]
        with on_device(args[self.device_of]):
            for plan, kernel, grid, kwargs, traced in self.steps:
                values = _filled(traced, args, new)
                if plan is not None:
                    plan(values)
                else:
                    kernel[grid](*_described(values), **kwargs)
        return tuple(_filled(self.outputs, args, new))


def _found(how, args, new):
    kind, where = how
    if kind == _INPUT:
        return args[where]
    if kind == _NEW:
        return new[where]
    if kind == _VIEW:
        owner, shape, stride, delta = where
        base = _found(owner, args, new)
        return base.as_strided(shape, stride, base.storage_offset() + delta)
    if kind == _KEPT:
        return where
    if kind == _FRESH:
        shape, stride, dtype, device = where
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    source, block, layout = where
    return Tiles(_found(source, args, new), block, layout)


def _filled(traced, args, new):
    template, dynamic = traced
    values = template.copy()
    for i, how in dynamic:
        values[i] = _found(how, args, new)
    return values

