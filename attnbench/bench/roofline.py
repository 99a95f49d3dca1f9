"""The machine's own ceilings, and how close a measurement comes to them.

Datasheet peaks are leads, not ceilings: ``calibrate`` measures a large bf16 matmul (TF/s), a
large device-to-device copy (GB/s, bytes read plus bytes written) on random data, and an empty
Triton launch (the least time the timing core reads for any call that launches a kernel, and the
host time the launch takes to submit), once per GPU and software stack, cached in
``~/.cache/attnbench`` (``ATTNBENCH_CACHE_DIR`` moves it).

% of roofline = the least time the ceilings allow (the binding one: max of FLOPs / peak TF/s and
bytes / peak GB/s) over the measured time: 100% means nothing is left on the table. The FLOP
ceiling is the bf16 tensor-core rate, so fp32 (full-precision dots) and fp64 cases read low.
"""
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .timing import Timing, measure, synchronize


def machine_info(device) -> dict:
    """What every result records: the device and the software that produced the numbers."""
    import numpy
    import triton

    device = torch.device(device)
    info = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return info


def machine_slug(device) -> str:
    """A file-system-safe machine name from the GPU name, e.g. 'nvidia-h200' (asv's machine name)."""
    name = machine_info(device)["device_name"].lower()
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-") or "cpu"


@dataclass
class Ceilings:
    device_name: str
    matmul_tflops: float  # bf16, 8192^3, random data
    copy_gbps: float  # device-to-device, bytes read + written
    torch: str
    triton: str
    # An empty Triton kernel (one program, two arguments): its GPU time as the timing core reads every call
    # (CUDA events, L2 flushed; no call that launches a kernel reads less), and the host time of submitting it
    # (back-to-back launches without a sync); the figures are in docs/measurements/shared_context.md. None in a
    # cache written before these were measured.
    launch_floor_us: float | None = None
    launch_host_us: float | None = None


def _cache_path() -> Path:
    root = Path(os.environ.get("ATTNBENCH_CACHE_DIR", Path.home() / ".cache" / "attnbench"))
    return root / "ceilings.json"


_EMPTY_KERNEL = []


def _empty_kernel():
    """A Triton kernel that does nothing: what a launch costs before any work."""
    if not _EMPTY_KERNEL:
        import triton

        @triton.jit
        def empty_kernel(X, n):
            pass

        _EMPTY_KERNEL.append(empty_kernel)
    return _EMPTY_KERNEL[0]


def launch_costs(device, calls: int = 200) -> tuple:
    """(GPU time, host time) of one empty Triton launch, in us: the first as ``measure`` reads any call, the
    second the wall time of ``calls`` back-to-back launches without a sync, per launch."""
    kernel, x = _empty_kernel(), torch.empty(16, device=device)

    def launch():
        kernel[(1,)](x, 1)

    floor = measure(launch, device).median_ms * 1e3
    for _ in range(20):
        launch()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        launch()
    host = (time.perf_counter() - start) / calls * 1e6
    synchronize(device)
    return floor, host


def calibrate(device, size: int = 8192, copy_bytes: int = 2 << 30) -> Ceilings:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("ceilings are calibrated on a CUDA device; CPU timings are interpreter timings")
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    matmul = measure(lambda: a @ b, device, rep_ms=300)
    src = torch.randn(copy_bytes // 4, device=device, generator=gen)
    dst = torch.empty_like(src)
    copy = measure(lambda: dst.copy_(src), device, rep_ms=300)
    copied = 2 * src.numel() * src.element_size()
    del a, b, src, dst  # the launch below times an empty kernel, not an allocator holding 2.3 GB
    info = machine_info(device)
    floor_us, host_us = launch_costs(device)
    return Ceilings(info["device_name"], 2 * size**3 / matmul.median_ms / 1e9, copied / copy.median_ms / 1e6,
                    info["torch"], info["triton"], floor_us, host_us)


def ceilings(device, refresh: bool = False) -> Ceilings | None:
    """The cached ceilings of this GPU and stack, measured on first use; None on a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    info = machine_info(device)
    key = f"{info['device_name']}|torch {info['torch']}|triton {info['triton']}"
    path = _cache_path()
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):  # unreadable (two runs wrote it at once, a full disk): measured again
        cache = {}
    if refresh or key not in cache:
        cache[key] = asdict(calibrate(device))
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: a reader never sees half a file (a temporary beside it, then one rename)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(cache, indent=2))
        os.replace(scratch, path)
    return Ceilings(**cache[key])


@dataclass
class Achieved:
    tflops: float
    gbps: float
    roofline_pct: float | None  # None without ceilings (CPU)


# exp2 results per SM per clock on Hopper's special-function units (CUDA C++ Programming Guide, arithmetic
# instruction throughput, compute capability 9.0). Softmax needs one per visible (row, key) pair; at small
# head dims (shared_context's D 32) that, not the matmuls or the bytes, sets the least time.
SFU_EXP2_PER_CLOCK = 16
# The highest SM clock of the H100 and H200 (SXM), so that exp_floor_s is the least time the unit allows.
MAX_SM_CLOCK_GHZ = 1.98


def exp_floor_s(exps: float, multiprocessors: int, sm_clock_ghz: float = MAX_SM_CLOCK_GHZ) -> float:
    """Seconds the special-function units need for ``exps`` exponentials at full rate on every SM."""
    return exps / (multiprocessors * SFU_EXP2_PER_CLOCK * sm_clock_ghz * 1e9)


def attainable_copy_pct(nbytes: float, copy_gbps: float, *floors_s: float) -> float:
    """The largest % of the copy bandwidth a kernel that moves ``nbytes`` can show when it also needs at least
    ``floors_s`` seconds of other work (the exponentials' exp_floor_s, the matmuls at the matmul ceiling): 100
    where the bytes take longest, else the bytes' time over the longest floor (launch latency and every other
    instruction ignored, so a true ceiling)."""
    copy_s = nbytes / (copy_gbps * 1e9)
    return 100.0 * copy_s / max((copy_s, *floors_s))


def achieved(flops: float, nbytes: float, timing: Timing, ceil: Ceilings | None) -> Achieved:
    seconds = timing.median_ms / 1e3
    tflops, gbps = flops / seconds / 1e12, nbytes / seconds / 1e9
    if ceil is None or not timing.is_gpu:
        return Achieved(tflops, gbps, None)
    floor_s = max(flops / (ceil.matmul_tflops * 1e12), nbytes / (ceil.copy_gbps * 1e9))
    return Achieved(tflops, gbps, 100.0 * floor_s / seconds)
