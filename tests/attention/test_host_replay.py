"""Host replays (attnbench/kernels/replay.py): from a signature's third call an eager op repeats its recorded
allocations and launches instead of running the launchers' Python. Through Triton's interpreter here (the same
recording and mapping as on a GPU, where the steps are launch plans): every differentiation route must give
bitwise what the launchers give, on new data of the signature, and anything a replay could not repeat must be
refused, not replayed."""
import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import triton
import triton.language as tl

import attnbench.attention as api
from attnbench.kernels import launch, new_output, replay
from attnbench.kernels.attention.flash_fwd import forward_route


@pytest.fixture
def replaying(monkeypatch):
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    launch.forget_plans()
    yield
    launch.forget_plans()


def _routes(causal):
    def f(q, k, v):
        return api.flash_attention(q, k, v, causal=causal)

    def fwd(q, k, v, u, w):
        with torch.no_grad():
            return f(q, k, v),

    def fwd_bwd(q, k, v, u, w):
        x, y, z = (t.detach().requires_grad_() for t in (q, k, v))
        f(x, y, z).backward(u)
        return x.grad, y.grad, z.grad

    def func_jvp(q, k, v, u, w):  # one tangent for both k and v: arguments that are one object
        return torch.func.jvp(f, (q, k, v), (u, w, w))

    def hvp_rev_rev(q, k, v, u, w):
        x = q.detach().requires_grad_()
        (g,) = torch.autograd.grad((f(x, k, v) * u).sum(), x, create_graph=True)
        return torch.autograd.grad(g, x, u)

    def hvp_fwd_rev(q, k, v, u, w):
        x = q.detach().requires_grad_()
        with fwAD.dual_level():
            (g,) = torch.autograd.grad((f(fwAD.make_dual(x, u), k, v) * u).sum(), x)
            return fwAD.unpack_dual(g).tangent,

    return dict(fwd=fwd, fwd_bwd=fwd_bwd, func_jvp=func_jvp, hvp_rev_rev=hvp_rev_rev, hvp_fwd_rev=hvp_fwd_rev)


# (B, Hq, Hkv, Nq, Nk, D, causal): the query-tile route, split-KV decode with GQA, a bottom-right mask
SHAPES = [(1, 2, 2, 70, 70, 16, None), (2, 4, 2, 3, 37, 16, "bottom_right"), (1, 2, 2, 20, 33, 32, "top_left")]
ROUTES = ["fwd", "fwd_bwd", "func_jvp", "hvp_rev_rev", "hvp_fwd_rev"]


def _inputs(shape, seed, device="cpu", dtype=torch.float32):
    b, hq, hkv, nq, nk, d, _ = shape
    g = torch.Generator().manual_seed(seed)
    q, u = (torch.randn(b, hq, nq, d, generator=g).to(device, dtype) for _ in range(2))
    k, v, w = (torch.randn(b, hkv, nk, d, generator=g).to(device, dtype) for _ in range(3))
    return q, k, v, u, w


def _without_replays(monkeypatch, call):
    with monkeypatch.context() as m:
        m.setattr(replay, "ENABLED", False)
        return call()


SHAPE_IDS = {"ids": lambda s: f"B{s[0]} H{s[1]}/{s[2]} N{s[3]}x{s[4]} D{s[5]} {s[6]}"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's replays (the GPU twin below)")
@pytest.mark.parametrize("shape", SHAPES, **SHAPE_IDS)
@pytest.mark.parametrize("route", ROUTES)
def test_replays_give_bitwise_the_launchers_results(route, shape, replaying, monkeypatch):
    _replays_match(route, shape, monkeypatch, "cpu", torch.float32)


# the GPU's routes at bf16: the Gluon forward and dK/dV pass (host descriptors), the pointer tiles, split-KV
# decode with GQA, odd lengths
GPU_SHAPES = [(2, 4, 4, 300, 300, 64, "top_left"), (3, 2, 2, 77, 190, 128, "bottom_right"),
              (2, 4, 4, 129, 129, 96, None), (5, 8, 2, 3, 1000, 64, "bottom_right"), (1, 2, 1, 200, 257, 72, None)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, **SHAPE_IDS)
@pytest.mark.parametrize("route", ROUTES)
def test_gpu_replays_give_bitwise_the_launchers_results(route, shape, monkeypatch):
    launch.forget_plans()
    _replays_match(route, shape, monkeypatch, "cuda", torch.bfloat16, every_op=False)
    launch.forget_plans()


def _replays_match(route, shape, monkeypatch, device, dtype, every_op=True, refusals_checked=True):
    run = _routes(shape[-1])[route]
    used = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, args: used.append(1) or real_call(self, args))
    for seed in range(4):  # calls 1 and 2 run the launchers (2 records), 3 and 4 replay
        inputs = _inputs(shape, seed, device, dtype)
        got = run(*inputs)
        want = _without_replays(monkeypatch, lambda: run(*inputs))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"call {seed + 1}"
    if not refusals_checked:  # the caller asserts which bodies were refused
        return
    made = replay.replays()
    refused = {key[0]: why for key, why in made.items() if type(why) is replay.Refusal}
    # on a GPU some routes copy or sum (a padded head width, a per-head GQA backward): they may refuse
    assert made and (not refused if every_op else len(refused) < len(made)), refused
    assert used, "no call replayed"


# the backward bodies that copy or sum besides their kernels: a padded head width (the GPU's rule, turned on here),
# the dQ pass's keys split over programs, a dK/dV program per query head (K and V repeated, shares summed)
COPYING = {"padded": ((1, 2, 2, 20, 20, 40, None), None, "aten.constant_pad_nd"),
           "split dQ": ((1, 2, 1, 4, 90, 16, "bottom_right"), "split", "aten.sum"),
           "per head": ((1, 4, 2, 20, 20, 16, None), "per-head", "aten.clone")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's replays")
@pytest.mark.parametrize("body,copies", [("padded", "torch"), ("split dQ", "torch"), ("padded", "triton"),
                                         ("split dQ", "triton"), ("per head", "triton"), ("padded", "grouped"),
                                         ("per head", "grouped")])
def test_copies_by_kernel_let_the_copying_backward_bodies_replay(body, copies, replaying, monkeypatch):
    """With PyTorch's ops the backward of these shapes is refused (each call pays the launchers' Python: 0.3-0.9 ms
    of host time on an H200, docs/measurements/flash.md); with copies.py's kernels it replays, bit for bit."""
    from attnbench.kernels.attention import head_padding
    from attnbench.kernels.attention.copies import copy_route
    from attnbench.kernels.attention.flash_bwd import dq_route, group_route

    shape, route, op = COPYING[body]
    monkeypatch.setattr(head_padding, "PAD_ON", {"cuda", "cpu"})

    def routes(copies):
        stack = contextlib.ExitStack()
        for switch in (copy_route(copies), dq_route(route if route == "split" else None),
                       group_route(route if route == "per-head" else None)):
            stack.enter_context(switch)
        return stack

    with routes(copies):
        _replays_match("fwd_bwd", shape, monkeypatch, "cpu", torch.float32, refusals_checked=copies != "torch")
    refused = {key[0]: why for key, why in replay.replays().items() if type(why) is replay.Refusal}
    if copies == "torch":
        assert op in refused.get("attention_bwd", ""), refused
        return
    assert not refused
    # and the kernels' values are PyTorch's ops' (tested against float64 in test_flash_interpreter.py): the copies
    # bit for bit, the sums of fp32 shares in another order (a few fp32 roundings)
    inputs = _inputs(shape, 7)
    with routes(copies):
        got = _routes(shape[-1])["fwd_bwd"](*inputs)
    with routes("torch"):
        want = _routes(shape[-1])["fwd_bwd"](*inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's replays")
def test_a_new_signature_or_route_is_recorded_afresh(replaying):
    q, k, v, _, _ = _inputs(SHAPES[0], 0)
    for _ in range(3):
        with torch.no_grad():
            api.flash_attention(q, k, v)
    assert len(replay.replays()) == 1
    with torch.no_grad():
        for _ in range(3):
            api.flash_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # other strides
        with forward_route("decode"):  # a forced route is part of the key
            for _ in range(3):
                got = api.flash_attention(q, k, v)
        want = api.flash_attention(q, k, v)
    assert len(replay.replays()) == 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # decode's split order against the tiles'
    launch.forget_plans()
    assert not replay.replays()


@triton.jit
def _add_one(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) + 1, mask=offs < N)


def _body_with(extra, planned=True):
    """An op body that allocates its output, launches a kernel (through a plan, or Triton's launcher), then does
    ``extra``."""
    def body(x):
        y = new_output(x.shape, x.dtype, x.device)
        (launch.planned(_add_one) if planned else _add_one)[(1,)](x, y, x.numel(), BLOCK=16)
        return extra(y, x)

    return body


@pytest.mark.parametrize("extra, planned, refused", [
    (lambda y, x: (y,), True, None),
    (lambda y, x: (y[1:],), True, None),  # a view of an allocation comes back as that view
    (lambda y, x: (y, x), True, None),  # an input comes back as the new call's input
    (lambda y, x: (y.fill_(0.0),), True, "aten.fill_"),  # a tensor operation a replay would not repeat
    (lambda y, x: (y, x * 2), True, "aten.mul"),
    (lambda y, x: (y,), False, "not made through launch.planned"),
    (lambda y, x: (y, [y]), True, "a value of type list"),  # a container could hold the recorded call's tensors
])
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's replays")
def test_a_body_is_replayed_only_when_a_replay_repeats_it(extra, planned, refused, replaying):
    op = replay.replayed("toy", _body_with(extra, planned))
    for seed in range(4):
        x = torch.randn(12, generator=torch.Generator().manual_seed(seed))
        got = op(x)
        want = _body_with(extra, planned)(x)
        for a, b in zip(got, want, strict=True):
            a, b = (a[0], b[0]) if type(a) is list else (a, b)
            assert torch.equal(a, b)
    (made,) = replay.replays().values()
    if refused is None:
        assert type(made) is replay.Replay
    else:
        assert type(made) is replay.Refusal and refused in made, made


_UNMARKED = torch.zeros(16)
_MARKED = launch.kept(torch.zeros(16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's replays")
@pytest.mark.parametrize("marked", [True, False])
def test_a_tensor_from_outside_the_call_replays_only_when_a_launcher_keeps_it(marked, replaying):
    """A tensor that is neither an input nor an allocation of the call (a module cache's) is passed again as it is
    only when marked launch.kept; any other could be stale on the next call."""
    outside = _MARKED if marked else _UNMARKED

    def body(x):
        y = new_output(x.shape, x.dtype, x.device)
        launch.planned(_add_one)[(1,)](outside, y, x.numel(), BLOCK=16)
        return (y,)

    op = replay.replayed("outside", body)
    for _ in range(4):
        assert torch.equal(op(torch.randn(12))[0], torch.ones(12))
    (made,) = replay.replays().values()
    assert (type(made) is replay.Replay) if marked else ("not launch.kept" in made)


def test_the_key_holds_the_pointers_remainder_not_only_its_alignment():
    base = torch.zeros(64)
    a, b = base[1:33], base[2:34]  # 4 and 8 bytes past a 16-byte boundary: a view of either aligns differently
    assert replay._signature(a) != replay._signature(b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's replays")
def test_two_threads_recording_at_once_each_see_their_own_strays(replaying):
    """The stray-launch counter is one wrapper for the process, reading the thread's own recorder: two recordings
    that overlap must not restore each other's wrapper (the later one would miss its raw launch and replay none)."""
    import threading

    barrier, planned_done = threading.Barrier(2), threading.Event()

    def waiting(planned):
        inner = _body_with(lambda y, x: (y,), planned)

        def body(x):
            barrier.wait(timeout=60)  # both recordings under way
            if not planned:
                planned_done.wait(timeout=60)  # and the other one over before this one launches
            return inner(x)
        return body

    ops = {"planned": replay.replayed("planned", waiting(True)), "raw": replay.replayed("raw", waiting(False))}
    for _ in range(2):  # the first call of each only counts the signature (no recording yet)
        barrier.reset()
        planned_done.clear()
        threads = [threading.Thread(target=lambda: (ops["planned"](torch.randn(12)), planned_done.set())),
                   threading.Thread(target=ops["raw"], args=(torch.randn(12),))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    made = {key[0]: why for key, why in replay.replays().items()}
    assert type(made["planned"]) is replay.Replay
    assert "not made through launch.planned" in made["raw"]
    from triton.runtime.jit import KernelInterface
    assert KernelInterface.__getitem__ is replay._COUNTING[0]


def test_every_default_switch_of_the_launchers_keys_the_replays(monkeypatch):
    """A module switch that picks a route by default (``*_BY_DEFAULT``, and the rules' thresholds) changes what a
    launcher does with the same arguments: a replay recorded before a study flips it would keep timing the old route.
    Each one must change ops._launch_state(), which keys the replays."""
    from attnbench.attention import ops
    from attnbench.kernels.attention import copies, flash_bwd, flash_decode, flash_fwd

    switches = [(module, name) for module in (flash_fwd, flash_bwd, flash_decode, copies)
                for name in dir(module) if name.endswith("_BY_DEFAULT")]
    assert (copies, "GROUPED_COPIES_BY_DEFAULT") in switches and len(switches) >= 7
    for module, name in switches:
        before = ops._launch_state()
        monkeypatch.setattr(module, name, not getattr(module, name))
        assert ops._launch_state() != before, f"{module.__name__}.{name} is not in ops._launch_state()"
        monkeypatch.undo()
