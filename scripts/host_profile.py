"""Where an eager attention call's host time goes, route by route (issue 37: "measure where each microsecond
goes before cutting").

    .venv/bin/python scripts/host_profile.py [--device cuda] [--shape 1 2 128 64] [--calls 1500]
        [--kv-heads HKV] [--keys NK] [--causal top_left|bottom_right]

For each differentiation route (forward, forward + backward, torch.func.jvp, the three HVP routes) it times one
eager call, back to back, at up to four levels:

    real       the call as a user makes it (GPU only: the interpreter's time says nothing about a GPU's)
    unreplayed the same without host replays (kernels/replay.py): every call runs the launchers' Python
    launches   every kernel launch made through kernels.launch.planned returns at once: our Python, the
               launchers' included (routes, output allocation, strides), without Triton's launch and the GPU
    ops        the five eager op bodies (attention/ops.py) return empty outputs at once: our Functions,
               checks and torch's autograd / functorch machinery, without the launchers
    floor      the same route over a function of two elementwise ops (o = q * q + v): what PyTorch itself
               costs for a differentiable call with that many inputs and outputs

real - launches is the launch path and the GPU; launches - ops our launchers' Python (what replays leave of it);
unreplayed - real what replays save; ops - floor our Functions and checks above PyTorch's own. On a GPU, FLASH and
cuDNN and MATH are SDPA pinned to that backend on the same tensors, timed the same way (the issue's bars are ratios to them;
- where the backend refuses the route). The stubbed levels compute garbage (empty outputs) and are for timing
only. --trace and --cprofile profile the real call (GPU only). Each number is the best of 5 rounds' mean per call, in microseconds; a round is at most
--calls calls and --round-s seconds.
"""
import argparse
import time

import torch
import torch.autograd.forward_ad as fwAD

import attnbench  # noqa: F401  first: it sets Triton's interpreter switch on a CPU machine
import attnbench.attention as api
from attnbench.attention import autograd as functions
from attnbench.attention import ops
from attnbench.kernels import launch, replay
from attnbench.kernels.precision import lse_dtype

ROUTES = ("fwd", "fwd_bwd", "func_jvp", "hvp_fwd_rev", "hvp_rev_rev", "hvp_func")


def routes(f, q, k, v, u, uk=None):
    """Each route as a no-argument call over f(q, k, v) -> o. ``u``: o's cotangent and q's tangent (q's shape);
    ``uk``: k's and v's tangent (they may have fewer heads and another length; None: u)."""
    tk = u if uk is None else uk

    def fwd():
        with torch.no_grad():
            f(q, k, v)

    def fwd_bwd():
        x, y, z = (t.detach().requires_grad_() for t in (q, k, v))
        f(x, y, z).backward(u)

    def func_jvp():
        torch.func.jvp(f, (q, k, v), (u, tk, tk))

    def hvp_fwd_rev():  # forward over reverse through autograd: a dual input, then grad
        x = q.detach().requires_grad_()
        with fwAD.dual_level():
            (g,) = torch.autograd.grad((f(fwAD.make_dual(x, u), k, v) * u).sum(), x)
            fwAD.unpack_dual(g)

    def hvp_rev_rev():  # double backward
        x = q.detach().requires_grad_()
        (g,) = torch.autograd.grad((f(x, k, v) * u).sum(), x, create_graph=True)
        torch.autograd.grad(g, x, u)

    def hvp_func():
        torch.func.jvp(torch.func.grad(lambda a: (f(a, k, v) * u).sum()), (q,), (u,))

    return dict(zip(ROUTES, (fwd, fwd_bwd, func_jvp, hvp_fwd_rev, hvp_rev_rev, hvp_func)))


def per_call_us(call, device, calls, round_s):
    """Best of 5 rounds' mean per call. A round is ``calls`` calls, or fewer (at least 20) when that many would take
    longer than ``round_s`` seconds, estimated from the warm-up: a 3 ms HVP at 1500 calls, 5 rounds and 4 levels
    took 90 s, and the device call's limit cut the profile after three routes."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    call()  # first: compiling and autotuning, which must not set the round's length
    warm = 20
    sync()
    start = time.perf_counter()
    for _ in range(warm):
        call()
    sync()
    calls = max(20, min(calls, int(round_s / max((time.perf_counter() - start) / warm, 1e-9))))
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def sdpa_routes(backend, q, k, v, u, uk, causal=None):
    """``routes`` over SDPA pinned to one backend (the issue's bars are ratios to SDPA FLASH and MATH in the same
    process); each call enters the backend's context, as a user's code would around its own calls. SDPA's
    ``is_causal`` is the top-left mask, so a bottom-right one is refused here (the route's cell reads -)."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    gqa = q.shape[1] != k.shape[1]

    def f(q, k, v):
        if causal == "bottom_right" and q.shape[2] != k.shape[2]:
            raise NotImplementedError("SDPA's is_causal is top-left")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal is not None, enable_gqa=gqa)

    return routes(f, q, k, v, u, uk)


def peer_us(call, device, calls, round_s):
    """per_call_us, or None where the backend refuses the route (FLASH has no forward-mode AD)."""
    try:
        return per_call_us(call, device, calls, round_s)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError):
        return None


class Stubbed:
    """Inside the block, a level's stubs replace the code they stand in for (put back on exit)."""

    def __init__(self, level):
        self.level, self.saved = level, []

    def _set(self, owner, name, value):
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        # replays (kernels/replay.py) made outside the block would launch past the stubs, and those made inside
        # would repeat a stub's empty launches after it
        launch.forget_plans()
        if self.level == "unreplayed":
            self._set(replay, "ENABLED", False)
        elif self.level == "launches":
            self._set(launch._Planned, "_launch", lambda self, grid, args, kwargs: None)
        elif self.level == "ops":
            def rows(q):
                return q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
            e = torch.empty_like
            stubs = dict(
                attention_fwd=lambda q, k, v, *_: (e(q), rows(q)),
                attention_fwd_jvp=lambda q, k, v, *_: (e(q), rows(q), e(q), rows(q)),
                eager_fwd_jvp=lambda q, k, v, *_: (e(q), rows(q), e(q), rows(q)),
                attention_jvp=lambda q, *_: (e(q), rows(q)),
                attention_bwd=lambda q, k, v, *_: (e(q), e(k), e(v)),
                attention_bwd_jvp=lambda q, k, v, *_: (e(q), e(k), e(v)),
            )
            for owner in (api, functions, ops):
                for name, stub in stubs.items():
                    if hasattr(owner, name):
                        self._set(owner, name, stub)
        return self

    def __exit__(self, *exc):
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        launch.forget_plans()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 2, 128, 64], metavar=("B", "H", "N", "D"))
    parser.add_argument("--kv-heads", type=int, help="K/V heads (GQA; default: H)")
    parser.add_argument("--keys", type=int, help="key length Nk (default: N, the query length)")
    parser.add_argument("--causal", choices=["top_left", "bottom_right"], help="the causal mask's alignment")
    parser.add_argument("--calls", type=int, default=1500, help="calls per timed round, at most")
    parser.add_argument("--round-s", type=float, default=0.15,
                        help="seconds a timed round may take at most (fewer calls for slow routes; default 0.15)")
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--trace", metavar="DIR",
                        help="also profile each route's real call with torch.profiler (CPU and CUDA activities): "
                             "DIR/<route>.txt, the ops by self host time, and DIR/<route>.json, a Chrome trace")
    parser.add_argument("--cprofile", metavar="DIR",
                        help="also run each route's real call under cProfile: DIR/<route>.pstats.txt, the Python "
                             "functions by own time (where the launchers' microseconds go, function by function)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" and (args.trace or args.cprofile):
        parser.error("--trace and --cprofile profile the real call, which runs on a GPU only")
    if device.type == "cpu":  # replays as on a GPU (kernels/replay.py): only the stubbed levels run here
        replay.ON_INTERPRETER = True
    # the interpreter runs bf16 as a float32 upcast (extra copies that a GPU does not make): time float32 there
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    batch, heads, n_q, head_dim = args.shape
    kv_shape = (batch, args.kv_heads or heads, args.keys or n_q, head_dim)
    q, u = (torch.randn(*args.shape, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(*kv_shape, generator=g).to(device, dtype) for _ in range(2))
    uk = torch.randn(*kv_shape, generator=g).to(device, dtype)
    ours = routes(lambda q, k, v: api.flash_attention(q, k, v, causal=args.causal), q, k, v, u, uk)
    levels = (["real", "unreplayed"] if device.type == "cuda" else []) + ["launches", "ops"]
    if kv_shape == tuple(args.shape):  # the floor's q * q + v needs v shaped like o
        floor = routes(lambda q, k, v: q * q + v, q, k, v, u)
        levels.append("floor")
    peers = {}
    if device.type == "cuda":  # what a user pays for SDPA on the same tensors, in the same process
        from torch.nn.attention import SDPBackend

        peers = {name: sdpa_routes(backend, q, k, v, u, uk, args.causal)
                 for name, backend in (("FLASH", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
                                       ("MATH", SDPBackend.MATH))}
    print(f"host time per eager call (us), {device} {dtype} B{batch} H{heads}/{kv_shape[1]} N{n_q}x{kv_shape[2]} "
          f"D{head_dim} causal {args.causal}, best of 5 rounds of up to {args.calls} calls or {args.round_s} s")
    print(f"{'route':12s}" + "".join(f"{name:>11s}" for name in [*levels, *peers]))
    refused = {}
    for route in args.routes:
        cells = []
        for level in levels:
            if level == "real":
                cells.append(per_call_us(ours[route], device, args.calls, args.round_s))
                refused.update({key[0]: why for key, why in replay.replays().items() if type(why) is replay.Refusal})
            elif level == "floor":
                cells.append(per_call_us(floor[route], device, args.calls, args.round_s))
            else:
                with Stubbed(level):
                    cells.append(per_call_us(ours[route], device, args.calls, args.round_s))
        cells += [peer_us(peer[route], device, args.calls, args.round_s) for peer in peers.values()]
        print(f"{route:12s}" + "".join("          -" if c is None else f"{c:11.1f}" for c in cells), flush=True)
    if "real" in levels:  # ops whose calls run the launchers every time (kernels/replay.py)
        print("replays refused: " + (", ".join(f"{op} ({why})" for op, why in refused.items()) or "none"))
    if args.trace:
        for route in args.routes:
            trace(ours[route], device, route, args.trace)
    if args.cprofile:
        for route in args.routes:
            python_profile(ours[route], device, route, args.cprofile)


def _profiled(call, device, calls, profiler):
    """``profiler`` (a context manager) around ``calls`` real calls of a route after 5 warm ones, the GPU drained
    before and inside (--trace and --cprofile run on a GPU only)."""
    for _ in range(5):
        call()
    torch.cuda.synchronize(device)
    with profiler:
        for _ in range(calls):
            call()
        torch.cuda.synchronize(device)
    return profiler


def python_profile(call, device, route, folder, calls=100):
    """cProfile over ``calls`` warm real calls of one route, the functions sorted by own time."""
    import cProfile
    import io
    import os
    import pstats

    profiler = _profiled(call, device, calls, cProfile.Profile())
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{route}.pstats.txt"), "w") as out:
        out.write(f"{calls} calls of {route}\n{text.getvalue()}")


def trace(call, device, route, folder, calls=50):
    """torch.profiler over ``calls`` warm real calls of one route: where each call's host time goes, op by op and
    launch by launch (the table sorts by self CPU time, the trace shows waits between launches)."""
    import os
    from torch.profiler import ProfilerActivity, profile

    prof = _profiled(call, device, calls, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=70)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{route}.txt"), "w") as out:
        out.write(f"{calls} calls of {route}\n{table}\n")
    prof.export_chrome_trace(os.path.join(folder, f"{route}.json"))


if __name__ == "__main__":
    main()
