"""The ``flash`` operator: FlashAttention-2 forward (O and logsumexp) and backward.

Modes: ``fwd`` -> (o, lse); ``bwd`` -> (dq, dk, dv) given the forward's saved state, timed
alone; ``fwd_bwd`` -> o and the three gradients, forward and backward together.

Cost model (FlashAttention's convention, so numbers compare with published ones): the forward
does 4 * B * Hq * D FLOPs per visible (query, key) pair (two matmuls), the backward 2.5x that
(five matmuls; our dQ pass recomputes two more, which is our cost, not the problem's), and the
minimum bytes read each input once and write each output once.
"""
import functools
import math
from dataclasses import dataclass

import torch

from ...bench.cases import DtypeNamed, case_rows, seeded_inputs, table_sets
from ...bench.registry import Operator, Variant, register
from ...bench.timing import not_graph_capturable
from ..peers import probed
from .. import external
from . import peers, reference, routes, split
from ...attention.spec import causal_offset, softmax_scale
from ...kernels.tiling import visible_pairs

OUTPUTS = {"fwd": ("o", "lse"), "bwd": ("dq", "dk", "dv"), "fwd_bwd": ("o", "dq", "dk", "dv")}


@dataclass(frozen=True)
class FlashCase(DtypeNamed):
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: str | None = None  # None, "top_left" or "bottom_right"
    dtype: str = "bfloat16"
    scale: float | None = None  # None: 1 / sqrt(head_dim)

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self.scale, self.head_dim)

    @property
    def causal_offset(self):
        return causal_offset(self.causal, self.seqlen_q, self.seqlen_k)

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs that the mask leaves visible, per batch and head."""
        return visible_pairs(self.seqlen_q, self.seqlen_k, self.causal_offset)

    @property
    def forward_flops(self) -> float:
        """The forward's FLOPs: 4 B Hq D per visible (query, key) pair (two matmuls)."""
        return 4.0 * self.batch * self.heads_q * self.visible_pairs * self.head_dim

    @property
    def tensor_bytes(self):
        """(q_like, kv_like, rows): bytes of one [B, Hq, Nq, D] tensor (q, o, do), one [B, Hkv, Nk, D] tensor
        (k, v) and one [B, Hq, Nq] row statistic (lse: float32, float64 for float64 inputs)."""
        item = self.torch_dtype.itemsize
        q_like = self.batch * self.heads_q * self.seqlen_q * self.head_dim * item
        kv_like = self.batch * self.heads_kv * self.seqlen_k * self.head_dim * item
        rows = self.batch * self.heads_q * self.seqlen_q * (8 if self.dtype == "float64" else 4)
        return q_like, kv_like, rows

    @property
    def label(self) -> str:
        heads = f"H{self.heads_q}" if self.heads_q == self.heads_kv else f"H{self.heads_q}/{self.heads_kv}"
        seq = f"N{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"N{self.seqlen_q}x{self.seqlen_k}"
        mask = {None: "", "top_left": " causal", "bottom_right": " causal-br"}[self.causal]
        scale = "" if self.scale is None else f" s{self.scale:g}"
        return f"B{self.batch} {heads} {seq} D{self.head_dim}{mask}{scale} {self.short_dtype}"


_shapes = functools.partial(case_rows, FlashCase)  # (rows, dtypes) -> cases


# Tiny shapes for the CPU gate: lengths that are not block multiples, Nq != Nk both ways, length 1,
# GQA and MQA, head dims that are not powers of two, both causal alignments, rows that see no key.
TINY_SHAPES = [
    (1, 2, 2, 37, 29, 24, None),
    (2, 4, 2, 33, 17, 16, "top_left"),
    (1, 2, 1, 40, 23, 80, "bottom_right"),  # Nq > Nk: the first 17 rows see no key
    (1, 3, 1, 20, 50, 16, "bottom_right"),
    (1, 2, 2, 1, 70, 64, None),
    (1, 1, 1, 19, 19, 32, "top_left"),
]
# Real sizes for the GPU gate, the same coverage at scale: these four for flash and jvp_attention alike (GQA and
# MQA, both causal alignments, Nq != Nk, head dims 24 to 128 off powers of two) ...
ATTENTION_GPU_SHAPES = [
    (2, 8, 8, 1024, 1024, 64, None),
    (2, 8, 2, 1000, 777, 128, "bottom_right"),
    (1, 4, 4, 513, 1031, 96, "top_left"),
    (1, 4, 1, 1537, 1537, 24, "top_left"),
]
# ... and flash's own: a long D 80 case, D = 256, decode, the split-KV route and two column blocks.
GPU_SHAPES = ATTENTION_GPU_SHAPES + [
    (1, 8, 8, 2048, 2048, 80, "top_left"),
    (2, 4, 4, 256, 384, 256, "bottom_right"),
    (3, 8, 8, 1, 1024, 128, None),
    # the split-KV route (Nq <= 64): GQA groups packed into a tile, row tiles, D up to 256
    (4, 32, 8, 1, 4099, 128, None),
    (2, 16, 2, 16, 2049, 96, "bottom_right"),
    (2, 8, 1, 40, 3001, 256, "bottom_right"),
    # head dims tiled in two column blocks (160 = 128 + 32, 192 = 128 + 64), GQA, odd lengths
    (1, 4, 2, 700, 900, 160, "bottom_right"),
    (2, 4, 4, 333, 333, 192, None),
]
# Odd shapes for compute-sanitizer (scripts/gpu_gate.sh's sanitize stage: every forced route over them),
# each kernel specialization once: lengths off every block size, GQA, head dims in one and in two column
# blocks (24, 80 = 64 + 16, 160 = 128 + 32) and 256, head dims whose second block is masked (40, 72, 88:
# padded on CUDA, kernels/attention/head_padding.py), the Gluon forward's head dims in bf16, and the
# split-KV route's rows (Nq <= 64: packed GQA rows, row tiles, empty splits, blind rows).
ODD_SHAPES = {
    "float16": [
        (1, 4, 2, 37, 29, 80, None),
        (2, 2, 1, 70, 41, 24, "bottom_right"),
        (1, 2, 1, 130, 97, 160, "top_left"),
        (1, 2, 1, 77, 130, 256, "bottom_right"),
        (1, 2, 2, 129, 257, 72, "top_left"),
        (1, 2, 2, 129, 257, 88, None),
        (1, 2, 2, 129, 257, 40, "top_left"),
    ],
    "bfloat16": [
        (1, 4, 2, 37, 29, 64, None),
        (2, 2, 1, 130, 97, 128, "top_left"),
        (1, 2, 2, 200, 300, 64, "bottom_right"),
        (1, 2, 1, 129, 385, 128, None),
        (1, 2, 2, 77, 200, 96, None),
        (1, 2, 1, 150, 130, 256, "bottom_right"),
        # the split-KV route
        (3, 6, 2, 1, 1001, 24, None),
        (2, 8, 1, 17, 333, 80, "bottom_right"),
        (1, 4, 4, 50, 31, 256, "bottom_right"),
        (2, 32, 8, 5, 4097, 128, None),
        (1, 2, 1, 64, 70, 96, "top_left"),
        (5, 12, 3, 3, 129, 64, "bottom_right"),
        (2, 8, 2, 16, 1031, 72, "bottom_right"),
    ],
}
ANCHOR_SHAPES = [
    (4, 16, 16, 4096, 4096, 64, None),
    (4, 16, 16, 4096, 4096, 64, "top_left"),
    (2, 16, 16, 8192, 8192, 128, None),
    (2, 16, 16, 8192, 8192, 128, "top_left"),
]


SWEEP_HEADS = {64: (16, 16), 96: (16, 16), 128: (16, 4), 256: (8, 8)}  # (Hq, Hkv): D 128 as GQA 16/4
SWEEP_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_DECODE_KEYS = 8192


def _sweep():
    """The Hopper issue's grid: D 64, 96, 128 (GQA 16/4) and 256, N 512 to 32K at 32K tokens a
    batch, causal and not; then the decode shapes of every D at Nk 8192 (Nq 1, and 16
    bottom-right causal; GQA 32/8)."""
    cases = []
    for head_dim, (heads_q, heads_kv) in SWEEP_HEADS.items():
        for n in SWEEP_LENGTHS:
            for causal in (None, "top_left"):
                cases.append(FlashCase(max(1, 32768 // n), heads_q, heads_kv, n, n, head_dim, causal))
    return cases + [c for c in _decode() if c.seqlen_k == SWEEP_DECODE_KEYS]


def _decode():
    """Decode and short-query shapes (the split-KV route): Nq 1 (no mask) and 16 (bottom-right
    causal, speculative decoding), GQA 32/8, head dims 64-256, Nk 2K-32K at 0.5-1 GB of K/V, so
    that the bandwidth figure is not a launch-latency figure (and the float64 oracle fits)."""
    cases = []
    for head_dim in (64, 96, 128, 256):
        for n_k in (2048, 8192, 32768):
            batch = max(1, 32 * 8192 // n_k * 128 // max(head_dim, 128))
            cases.append(FlashCase(batch, 32, 8, 1, n_k, head_dim, None))
            cases.append(FlashCase(batch, 32, 8, 16, n_k, head_dim, "bottom_right"))
    return cases


# Host-bound shapes: what a Python caller pays per call when the kernels take microseconds (the eager
# clock; bench --host-time), the tiny one and a small batch.
HOST_SHAPES = [(1, 2, 2, 128, 128, 64, None), (8, 16, 16, 512, 512, 64, None)]
RANDOM_SEED = 20261127
RANDOM_COUNT = 128
RANDOM_HEAD_DIMS = (32, 40, 48, 64, 64, 72, 80, 96, 112, 128, 128, 160, 192, 256)
RANDOM_MAX_TENSOR_BYTES = 256 << 20  # per q, k or v: the whole set fits an H100 with its peers and oracles


def _random(seed=RANDOM_SEED, count=RANDOM_COUNT):
    """Shapes drawn by a seed, not chosen: a kernel tuned to a fixed sweep loses elsewhere. Thirds of
    decode (Nq 1-16 against Nk up to 16K), self-attention (Nq = Nk) and cross lengths (Nq != Nk, both
    log-uniform in 1..16K); Hkv 1-16 and GQA groups 1-8; head dims 32-256 with non-powers of two;
    no mask, top-left or bottom-right causal; bf16 and fp16; the batch log-uniform in 1..64, cut so
    that no tensor passes RANDOM_MAX_TENSOR_BYTES."""
    import random

    rng = random.Random(seed)

    def log_uniform(low, high):
        return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))

    cases = []
    for i in range(count):
        kind = ("decode", "self", "cross")[i % 3]
        n_k = log_uniform(64 if kind == "decode" else 1, 16384)
        n_q = {"decode": rng.randint(1, 16), "self": n_k, "cross": log_uniform(1, 16384)}[kind]
        heads_kv = rng.choice((1, 2, 4, 8, 16))
        heads_q = heads_kv * rng.choice((1, 1, 2, 4, 8))
        head_dim = rng.choice(RANDOM_HEAD_DIMS)
        causal = rng.choice((None, "top_left", "bottom_right"))
        dtype = rng.choice(("bfloat16", "float16"))
        per_sample = 2 * head_dim * max(heads_q * n_q, heads_kv * n_k)
        batch = max(1, min(log_uniform(1, 64), RANDOM_MAX_TENSOR_BYTES // per_sample))
        cases.append(FlashCase(batch, heads_q, heads_kv, n_q, n_k, head_dim, causal, dtype))
    return cases


CASE_SETS = {
    **table_sets(FlashCase, TINY_SHAPES, GPU_SHAPES, ANCHOR_SHAPES),
    "sweep": _sweep,
    "decode": _decode,
    "odd": lambda: [FlashCase(*row, dtype=dt) for dt, rows in ODD_SHAPES.items() for row in rows],
    "random": _random,
    "host": lambda: _shapes(HOST_SHAPES, ("bfloat16",)),
}


def _tensors(x):
    return x["q"], x["k"], x["v"], x["do"]


def manual_variant(fwd, bwd):
    """prepare() for variants with an explicit backward: fwd(q, k, v) -> (o, lse), bwd(do, q, k, v, o, lse)."""

    def prepare(case, x, mode):
        q, k, v, do = _tensors(x)
        if mode == "fwd":
            return lambda: dict(zip(OUTPUTS["fwd"], fwd(q, k, v)))
        o, lse = fwd(q, k, v)
        if mode == "bwd":
            return lambda: dict(zip(OUTPUTS["bwd"], bwd(do, q, k, v, o, lse)))

        def fwd_bwd():
            o, lse = fwd(q, k, v)
            return dict(zip(OUTPUTS["fwd_bwd"], (o, *bwd(do, q, k, v, o, lse))))

        return fwd_bwd

    return prepare


def autograd_variant(make_forward):
    """prepare() for variants differentiated by autograd: make_forward(case, x) -> f(q, k, v) -> o or (o, lse)."""

    def prepare(case, x, mode):
        forward = make_forward(case, x)
        q, k, v, do = _tensors(x)

        def named(out):
            return dict(zip(OUTPUTS["fwd"], out)) if isinstance(out, tuple) else {"o": out}

        if mode == "fwd":
            def fwd():
                with torch.no_grad():
                    return named(forward(q, k, v))

            return fwd
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def run_forward():
            return forward_output(forward(*leaves))

        if mode == "bwd":
            o = run_forward()

            def bwd():
                return dict(zip(OUTPUTS["bwd"], torch.autograd.grad(o, leaves, do, retain_graph=True)))

            return not_graph_capturable(bwd)

        def fwd_bwd():
            o = run_forward()
            return dict(zip(OUTPUTS["fwd_bwd"], (o.detach(), *torch.autograd.grad(o, leaves, do))))

        return not_graph_capturable(fwd_bwd)

    return prepare


class FlashOperator(Operator, cases=CASE_SETS):
    name = "flash"
    description = "FlashAttention-2: forward with logsumexp, backward by Algorithm 4"
    modes = ("fwd", "bwd", "fwd_bwd")
    baselines = ("sdpa_flash", "reference")
    ratio_peers = ("sdpa_flash", "sdpa_cudnn", "flex", "fa4", "fa4_deterministic", "flashinfer")

    def make_inputs(self, case, device, seed=0):
        q_shape = (case.batch, case.heads_q, case.seqlen_q, case.head_dim)
        kv_shape = (case.batch, case.heads_kv, case.seqlen_k, case.head_dim)
        shapes = {"q": q_shape, "k": kv_shape, "v": kv_shape, "do": q_shape}
        return seeded_inputs(seed, shapes, device, case.torch_dtype)

    def flops(self, case, mode):
        self.check_mode(mode)
        return case.forward_flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]

    def exponentials(self, case, mode):
        """Softmax's exponentials (``attnbench report --floors``): one per visible (query, key) pair and query head
        for each pass that forms P: the forward once, the backward once (P recomputed from the LSE, the least
        without storing P, which would take O(N^2) memory), forward and backward twice."""
        self.check_mode(mode)
        return float(case.batch * case.heads_q * case.visible_pairs) * {"fwd": 1, "bwd": 1, "fwd_bwd": 2}[mode]

    def bytes(self, case, mode):
        self.check_mode(mode)
        q_like, kv_like, rows = case.tensor_bytes
        return {
            "fwd": q_like + 2 * kv_like + q_like + rows,  # read q k v, write o lse
            "bwd": 3 * q_like + 2 * kv_like + rows + q_like + 2 * kv_like,  # read do q o k v lse, write dq dk dv
            "fwd_bwd": 2 * q_like + 2 * kv_like + 2 * q_like + 2 * kv_like,  # read q k v do, write o dq dk dv
        }[mode]

    def outputs(self, mode):
        self.check_mode(mode)
        return OUTPUTS[mode]

    def oracle(self, case, inputs, dtype=torch.float64):
        q, k, v, do = _tensors(inputs)
        return reference.evaluate(q, k, v, do, case.softmax_scale, case.causal_offset, dtype)

    def tunables(self):
        from ...bench.tune import tunable_table

        return tunable_table("attnbench.kernels.attention", [
            ("fwd", "the forward's query tiles through pointers (flash_fwd_kernel)", "flash_fwd.flash_fwd_kernel", "fwd",
             "triton@tiles"),
            ("fwd_tma", "the forward's query tiles through tensor descriptors (flash_fwd_tma_kernel)",
             "flash_fwd.flash_fwd_tma_kernel", "fwd", "triton@tma"),
            ("decode", "the split-KV forward (flash_decode_kernel)", "flash_decode.flash_decode_kernel", "fwd",
             "triton@decode"),
            ("dkdv", "the backward's dK/dV pass, or both passes of the split route (flash_bwd_dkdv_kernel)",
             "flash_bwd.flash_bwd_dkdv_kernel", "bwd"),
            ("dq", "the backward's dQ pass (flash_bwd_dq_kernel)", "flash_bwd.flash_bwd_dq_kernel", "bwd"),
        ])

    def register_variants(self):
        from ...attention import flash_bwd as triton_bwd, flash_fwd as triton_fwd, unavailable_reason

        self.add_variant(Variant(
            "reference", "reference",
            autograd_variant(lambda case, x: lambda q, k, v: reference.attention(q, k, v, case.softmax_scale, case.causal_offset)),
            self.modes, "eager PyTorch math, autograd backward (the oracle, run in the case dtype)"))
        self.add_variant(Variant(
            "split", "split",
            _with_case(lambda case: manual_variant(
                lambda q, k, v: split.flash_fwd(q, k, v, case.softmax_scale, case.causal_offset),
                lambda do, q, k, v, o, lse: split.flash_bwd(do, q, k, v, o, lse, case.softmax_scale, case.causal_offset))),
            self.modes, "FA2 in PyTorch: tiled online-softmax forward, Algorithm-4 backward, no autograd"))
        self.add_variant(Variant(
            "triton", "triton",
            _with_case(lambda case: manual_variant(
                lambda q, k, v: triton_fwd(q, k, v, scale=case.softmax_scale, causal=case.causal),
                lambda do, q, k, v, o, lse: triton_bwd(do, q, k, v, o, lse, scale=case.softmax_scale, causal=case.causal))),
            self.modes, "Triton: fused forward saving LSE; delta + dK/dV + dQ backward, no atomics",
            unavailable_reason))
        for route in routes.flash_routes(self.variants["triton"]):
            self.add_route(route)
        for name, backend in peers.SDPA_BACKENDS.items():
            self.add_variant(Variant(
                name, "peer", _probed(functools.partial(peers.sdpa_forward, backend)), self.modes,
                f"torch SDPA pinned to the {backend} backend",
                functools.partial(peers.sdpa_unavailable, backend)))
        self.add_variant(Variant(
            "flex", "peer", _probed(lambda case, offset: peers.flex_forward(case, offset, "cuda")), self.modes,
            "torch.compile(flex_attention) with a causal block mask", peers.flex_unavailable))
        self.add_variant(Variant(
            "fa4", "peer", _probed(peers.fa4_forward), self.modes,
            "FlashAttention-4 (flash-attn-4, CuTe DSL), its sm_90 kernels and autograd backward",
            external.fa4_unavailable))
        self.add_variant(Variant(
            "fa4_deterministic", "peer", _probed(functools.partial(peers.fa4_forward, deterministic=True)),
            ("bwd", "fwd_bwd"),  # its forward is fa4's
            "FlashAttention-4 with its deterministic backward (semaphore-ordered dQ), the peer of ours",
            external.fa4_unavailable))
        self.add_variant(Variant(
            "flashinfer", "peer",
            _probed(peers.flashinfer_decode_forward, on_device=True), ("fwd",),
            "FlashInfer's paged decode (Nq = 1) or append (Nq <= 64) kernels, a page per sequence",
            external.flashinfer_unavailable))


def _with_case(make_prepare):
    return lambda case, x, mode: make_prepare(case)(case, x, mode)


def _probed(make_forward, on_device=False):
    """An autograd variant whose forward (``make_forward(case, causal offset)``, with the inputs' device
    as a third argument when ``on_device``) is tried once first, so unsupported cases say why."""
    def build(case, x):
        return make_forward(case, case.causal_offset, *([x["q"].device] if on_device else []))

    return autograd_variant(probed(build,
                                   lambda forward, x: forward_output(forward(*_tensors(x)[:3]))))


def forward_output(out):
    """O of a forward that returns O or (O, LSE)."""
    return out[0] if isinstance(out, tuple) else out


FLASH = register(FlashOperator())
