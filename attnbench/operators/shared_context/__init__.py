"""The ``shared_context`` operator: one context K/V shared by the whole batch, per-sample buffers.

Mode ``fwd`` -> (o, lse): the decode step of TabPFN-style joint sampling and of LLM shared-prefix
decoding is this forward (spec.py says exactly what it computes).

Cost model. FLOPs use FlashAttention's convention: 4 * H * D per visible (query, key) pair,
context and buffer. Bytes are the minimum the shared layout must move: q once, the context K/V
once (not once per sample), each sample's valid buffer entries once, o and lse written once.
``memory_traffic`` also gives what the per-batch layout (context copied into every sample's
cache) must read, the seed's table: 13 MB vs 25.6 KB per layer at B512 H4 Nctx100 D32 bf16.
"""
import functools
from dataclasses import dataclass

import torch

from ...bench.cases import DtypeNamed, case_rows, seeded_normal, table_sets
from ...bench.registry import Operator, Variant, register
from ..peers import probed
from .. import external
from . import peers
from ...shared_context import reference, split
from ...attention.spec import softmax_scale
from ...shared_context.spec import check_inputs, visible_buffer_keys

OUTPUTS = {"fwd": ("o", "lse")}
# Unused buffer slots hold these (finite, large) so that a kernel reading past a sample's length
# gets a visibly wrong answer instead of a plausible one.
UNUSED_K, UNUSED_V = 25.0, -40.0


@dataclass(frozen=True)
class SharedContextCase(DtypeNamed):
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int  # Lq: new tokens per sample this step
    n_ctx: int
    n_buf: int  # buffer capacity per sample
    head_dim: int
    causal: bool = False  # causal inside the buffer (the Lq queries are its last Lq valid entries)
    lengths: str = "full"  # "full": every buffer holds n_buf entries; "varied": 0 ... n_buf across samples
    dtype: str = "bfloat16"
    scale: float | None = None  # None: 1 / sqrt(head_dim)

    def __post_init__(self):
        if self.lengths not in ("full", "varied"):
            raise ValueError(f"lengths must be 'full' or 'varied', got {self.lengths!r}")

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self.scale, self.head_dim)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def buffer_lengths(self) -> torch.Tensor | None:
        """Per-sample valid lengths (int32, CPU), None when every buffer is full. "varied" spreads
        them evenly from 0 (first sample) to n_buf (last)."""
        if self.lengths == "full":
            return None
        if self.batch == 1:
            return torch.tensor([self.n_buf // 2], dtype=torch.int32)
        return (torch.arange(self.batch, dtype=torch.int64) * self.n_buf // (self.batch - 1)).to(torch.int32)

    @property
    def buffer_pairs(self) -> int:
        """Visible (query row, buffer key) pairs summed over samples, per query head."""
        if not self.n_buf:
            return 0
        return visible_buffer_keys(self.buffer_lengths(), self.batch, self.n_buf, self.seqlen_q, self.causal)

    @property
    def buffer_entries(self) -> int:
        """Valid buffer entries summed over samples (per KV head): what must be read."""
        lens = self.buffer_lengths()
        return self.batch * self.n_buf if lens is None else int(lens.sum())

    @property
    def label(self) -> str:
        heads = f"H{self.heads_q}" if self.heads_q == self.heads_kv else f"H{self.heads_q}/{self.heads_kv}"
        extra = (" causal" if self.causal else "") + (" varlen" if self.lengths == "varied" else "")
        scale = "" if self.scale is None else f" s{self.scale:g}"
        return (f"B{self.batch} {heads} Lq{self.seqlen_q} ctx{self.n_ctx} buf{self.n_buf} D{self.head_dim}"
                f"{extra}{scale} {self.short_dtype}")


_cases = functools.partial(case_rows, SharedContextCase)  # (rows, dtypes) -> cases


# (B, H, Hkv, Lq, Nctx, Nbuf, D, causal, lengths)
# The CPU gate: context and buffer lengths that are not block multiples (the interpreter uses
# 16-key context blocks and buffer steps of 8 keys over 4 rows, i.e. 2-8 keys a sample), an empty
# buffer, varied lengths including 0 and full, GQA and MQA, head dims 24 and 80, Lq 1, 2 and 3
# (causal), rows that see no buffer key, a context-free case whose rows see nothing at all, and
# enough samples for several row tiles.
TINY_SHAPES = [
    (3, 2, 2, 1, 37, 11, 24, False, "varied"),
    (2, 4, 2, 3, 21, 9, 16, True, "varied"),  # sample 0: length 0; sample 1: row 0 sees no buffer key
    (5, 3, 1, 2, 50, 0, 32, False, "full"),  # MQA, no buffer: batched point prediction
    (2, 2, 2, 1, 17, 20, 80, False, "varied"),
    (3, 2, 2, 2, 0, 6, 16, True, "varied"),  # no context: rows with an empty buffer see nothing
    (12, 2, 1, 1, 33, 7, 16, False, "full"),  # 24 packed rows per KV head: two row tiles
    (4, 4, 4, 2, 45, 5, 32, True, "full"),
    (7, 3, 1, 1, 19, 10, 16, False, "varied"),  # 3 rows per sample: a sample straddles two row tiles
]
# Real sizes for the GPU gate, same coverage: odd lengths, varied lengths, GQA, D 24..256.
GPU_SHAPES = [
    (37, 4, 4, 2, 1000, 45, 32, True, "varied"),
    (5, 32, 8, 1, 3001, 77, 128, False, "varied"),
    (130, 6, 2, 3, 777, 19, 80, True, "varied"),
    (3, 2, 2, 1, 5000, 0, 256, False, "full"),
    (300, 4, 4, 1, 2048, 32, 32, False, "full"),
    (64, 16, 2, 1, 1537, 129, 64, False, "full"),
    (7, 4, 1, 5, 4096, 300, 24, True, "varied"),
]
# The regimes, bf16, every buffer full (all samples decode in step): the decode step of
# TabPFN joint sampling (H4 D32; Lq 2 = the previous sample's completed entry + the new query,
# which both see the whole buffer; Lq 1 with no buffer = batched point prediction) and LLM
# shared-prefix decoding (H32/8 D128 Lq1).
TABPFN_ANCHORS = [(1024, 2, 2048, 32),  # (B, Lq, ctx, buf); the first is the measured case in the issue
                  (256, 1, 512, 0), (4096, 1, 10000, 0), (4096, 2, 512, 32), (256, 2, 10000, 32)]
LLM_ANCHORS = [(256, 4096, 512), (512, 8192, 256), (1024, 16384, 128)]  # (B, ctx, buf)
ANCHOR_SHAPES = ([(b, 4, 4, lq, ctx, buf, 32, False, "full") for b, lq, ctx, buf in TABPFN_ANCHORS]
                 + [(b, 32, 8, 1, ctx, buf, 128, False, "full") for b, ctx, buf in LLM_ANCHORS])


def _sweep():
    """The speedup curve: B x Nctx x Nbuf at the TabPFN shape (H4 D32 Lq2, bf16)."""
    return [SharedContextCase(b, 4, 4, 2, n_ctx, n_buf, 32)
            for b in (64, 256, 1024, 4096) for n_ctx in (512, 2048, 10000) for n_buf in (0, 32, 128)]


def _tabpfn_grid():
    """Issue 7's TabPFN regime, every point: B x Lq x Nctx x Nbuf at H4 D32 (bf16, buffers full)."""
    return [SharedContextCase(b, 4, 4, lq, n_ctx, n_buf, 32)
            for b in (256, 1024, 4096) for lq in (1, 2) for n_ctx in (512, 2048, 10000) for n_buf in (0, 32)]


# The split counts forced as routes (``triton@splits8``): the fused kernel's candidates of the GPU studies, and the
# composed path's (its context kernel splits; the buffer kernel does not).
FUSED_SPLITS = (1, 2, 4, 8, 16, 32)
COMPOSED_SPLITS = (1, 2, 8)
# compute-sanitizer's set (scripts/gpu_gate.sh): the tiny set's odd shapes in the GPU dtypes (empty buffers,
# lengths 0 to full, rows that see nothing, lengths off every block), and two real-size ones with varied lengths.
ODD_SHAPES = [
    (37, 4, 4, 2, 1000, 45, 32, True, "varied"),
    (130, 6, 2, 3, 777, 19, 80, True, "varied"),
]

CASE_SETS = {
    **table_sets(SharedContextCase, TINY_SHAPES, GPU_SHAPES, ANCHOR_SHAPES),
    "sweep": _sweep,
    "tabpfn": _tabpfn_grid,
    "odd": lambda: _cases(TINY_SHAPES, ("bfloat16", "float32")) + _cases(ODD_SHAPES, ("bfloat16",)),
}


def _tensors(x):
    return x["q"], x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], x["buf_lens"]


def _forward_variant(make_run):
    """prepare() for a forward-only variant: make_run(case, x) -> () -> (o, lse or None), built
    outside the timed region (argument checks that sync, caches, compilation probes)."""

    def prepare(case, x, mode):
        if mode not in OUTPUTS:
            raise ValueError(f"shared_context: mode must be one of {tuple(OUTPUTS)}, got {mode!r}")
        run = make_run(case, x)

        def fwd():
            with torch.no_grad():
                o, lse = run()
            return {"o": o} if lse is None else {"o": o, "lse": lse}

        return fwd

    return prepare


def memory_traffic(case) -> dict:
    """Bytes one layer's attention must move in the shared layout and in the per-batch one."""
    item = case.torch_dtype.itemsize
    rows = case.batch * case.heads_q * case.seqlen_q
    q_o = 2 * rows * case.head_dim * item
    lse = rows * (8 if case.dtype == "float64" else 4)
    lens = 0 if case.lengths == "full" else 4 * case.batch
    context_shared = 2 * case.heads_kv * case.n_ctx * case.head_dim * item
    context_per_batch = case.batch * context_shared
    buffer = 2 * case.heads_kv * case.buffer_entries * case.head_dim * item
    shared = q_o + lse + lens + context_shared + buffer
    per_batch = q_o + lse + lens + context_per_batch + buffer
    return {"q_o_lse": q_o + lse + lens, "context_shared": context_shared, "context_per_batch": context_per_batch,
            "buffer": buffer, "shared_total": shared, "per_batch_total": per_batch,
            "per_batch_over_shared": per_batch / shared}


class SharedContextOperator(Operator, cases=CASE_SETS):
    name = "shared_context"
    description = "attention over one context K/V shared by the batch plus per-sample buffers (decode step)"
    modes = ("fwd",)
    # the "x baseline" column: today's per-batch cache with the best backend there is
    baselines = ("per_batch_cudnn", "per_batch_flash", "reference")
    # what the shipped Triton path must beat by the decision rule (attnbench.bench.decisions): the issue's
    # "best of {per-batch flash, split-PyTorch, folded flash + merge}" plus the stride-0 expand
    # (also FlashAttention-2). The cuDNN peers are measured and judged too ("triton vs best peer").
    gate_baselines = ("per_batch_flash", "split", "expand0_flash", "fold_flash")
    # the side-by-side claim the CLI and `attnbench report` print per case
    ratio_subject = "triton"
    ratio_peers = ("per_batch_flash", "per_batch_cudnn", "split", "expand0_flash", "fold_flash", "fold_cudnn",
                   "flashinfer_cascade")

    def make_inputs(self, case, device, seed=0):
        randn = seeded_normal(seed)  # float32 on the CPU, masked there, then moved and cast
        # q as a model produces it: [B, Lq, H, D] memory seen as [B, H, Lq, D]
        q = randn(case.batch, case.seqlen_q, case.heads_q, case.head_dim).transpose(1, 2)
        k_ctx = randn(case.heads_kv, case.n_ctx, case.head_dim)
        v_ctx = randn(case.heads_kv, case.n_ctx, case.head_dim)
        k_buf = randn(case.batch, case.heads_kv, case.n_buf, case.head_dim)
        v_buf = randn(case.batch, case.heads_kv, case.n_buf, case.head_dim)
        lens = case.buffer_lengths()
        if lens is not None:
            unused = torch.arange(case.n_buf).view(1, 1, -1, 1) >= lens.view(-1, 1, 1, 1).long()
            k_buf = k_buf.masked_fill(unused, UNUSED_K)
            v_buf = v_buf.masked_fill(unused, UNUSED_V)

        def to(t):
            return t.to(device=device, dtype=case.torch_dtype)

        return {"q": to(q), "k_ctx": to(k_ctx), "v_ctx": to(v_ctx), "k_buf": to(k_buf), "v_buf": to(v_buf),
                "buf_lens": None if lens is None else lens.to(device)}

    def flops(self, case, mode):
        return 4.0 * case.head_dim * self.exponentials(case, mode)

    def exponentials(self, case, mode="fwd"):
        """Softmax's exponentials: one per visible (query row, key) pair of every query head."""
        self.check_mode(mode)
        return float(case.heads_q * (case.batch * case.seqlen_q * case.n_ctx + case.buffer_pairs))

    def bytes(self, case, mode):
        self.check_mode(mode)
        return memory_traffic(case)["shared_total"]

    def outputs(self, mode):
        self.check_mode(mode)
        return OUTPUTS[mode]

    def oracle(self, case, inputs, dtype=torch.float64):
        return reference.evaluate(*_tensors(inputs), case.causal, case.softmax_scale, dtype)

    def tunables(self):
        from ...bench.tune import tunable_table

        # kernels.FUSED, CONTEXT, BUFFER: an autotuner per head-dim class (one compiled kernel underneath); the split
        # picks and launch plans are forgotten between configs, so each config gets its own split count
        return tunable_table("attnbench.kernels.shared_context", [
            ("fused", "the one-launch kernel (context, buffer and merge)", "kernels.FUSED", "fwd", "triton"),
            ("context", "the composed path's context kernel", "kernels.CONTEXT", "fwd", "triton_composed"),
            ("buffer", "the composed path's buffer kernel", "kernels.BUFFER", "fwd", "triton_composed"),
        ], forget="clear_split_picks")

    def register_variants(self):
        from ...shared_context import shared_context_attention, shared_context_attention_composed, unavailable_reason

        def checked_once(api):
            """Check the inputs (lengths included) once in prepare; the timed call skips the
            length check, which would wait for the GPU."""
            def make(case, x):
                check_inputs(*_tensors(x), causal=case.causal, scale=case.scale)
                return functools.partial(api, *_tensors(x), causal=case.causal, scale=case.scale,
                                         check_lengths=False)
            return make

        self.add_variant(Variant(
            "reference", "reference",
            _forward_variant(lambda case, x: functools.partial(reference.attention, *_tensors(x), case.causal,
                                                               case.softmax_scale)),
            self.modes, "per-batch cache: context expanded to the batch, concatenated with the buffer, masked "
                        "softmax (eager, the oracle run in the case dtype)"))
        self.add_variant(Variant(
            "split", "split",
            _forward_variant(lambda case, x: functools.partial(split.shared_context_fwd, *_tensors(x), case.causal,
                                                               case.softmax_scale)),
            self.modes, "the seed's split-PyTorch: context einsum without expand, buffer matmul, merge_states"))
        self.add_variant(Variant(
            "triton", "triton", _forward_variant(checked_once(shared_context_attention)), self.modes,
            "Triton, one fused launch: batch folded into the rows, split-K over context and buffer, "
            "in-kernel merge", unavailable_reason))
        self.add_variant(Variant(
            "triton_composed", "triton", _forward_variant(checked_once(shared_context_attention_composed)),
            self.modes, "Triton path (a): context kernel (+ split reduction), buffer kernel, merge_states kernel",
            unavailable_reason))
        # Forced split-K counts (the default measures the count once per shape on CUDA): where an error sits
        # and what a count costs, each verified and timed like the default
        for base, api, counts in (("triton", shared_context_attention, FUSED_SPLITS),
                                  ("triton_composed", shared_context_attention_composed, COMPOSED_SPLITS)):
            for count in counts:
                self.add_route(Variant(
                    f"{base}@splits{count}", "triton",
                    _forward_variant(checked_once(functools.partial(api, num_splits=count))), self.modes,
                    f"{base} with the keys split {count} way{'s' if count > 1 else ''} (num_splits={count})",
                    unavailable_reason))
        for name, backend in peers.PER_BATCH.items():
            self.add_variant(Variant(
                name, "peer", _forward_variant(_probed(functools.partial(peers.per_batch_forward, backend))),
                self.modes, f"SDPA {backend} on the materialized per-batch cache (context copied B times, untimed)",
                functools.partial(peers.sdpa_unavailable, backend)))
        descriptions = {
            "expand0_flash": "SDPA FLASH over the context expanded to the batch with stride 0 (a view: every "
                             "sample re-reads it), SDPA FLASH over each buffer, merge_states (Triton)",
            "fold_flash": "Hydragen-style: SDPA FLASH over the context with the batch folded into the query rows, "
                          "SDPA FLASH over each buffer, merge_states (Triton)",
            "fold_cudnn": "Hydragen-style with SDPA cuDNN: batch-folded context, per-sample buffer, merge_states "
                          "(Triton)",
        }
        for name, description in descriptions.items():
            self.add_variant(Variant(
                name, "peer", _forward_variant(_probed(functools.partial(peers.split_peer_forward, name))),
                self.modes, description, peers.lse_unavailable))
        self.add_variant(Variant(
            "flashinfer_cascade", "peer", _forward_variant(_probed(peers.flashinfer_cascade_forward)), self.modes,
            "FlashInfer's cascade attention (MultiLevelCascadeAttentionWrapper's two levels): the context as one "
            "shared page under all B*Lq rows, a page per sample's buffer, merge_state_in_place",
            external.flashinfer_unavailable))


def _probed(make_forward):
    """A peer's forward (``make_forward(case, x)`` -> () -> (o, lse)), tried once first so that unsupported
    cases say why."""
    return probed(make_forward, lambda forward, x: forward()[0])


SHARED_CONTEXT = register(SharedContextOperator())
