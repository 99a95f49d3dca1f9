"""The fused kernel's scratch: the buffer states, the split partials and their merge tickets.

The buffer states pass from the buffer phase to the context phase through L2; the partials and
tickets exist only with more than one split. Tickets are kept per device and stream; launch plans
keep the rest per stream, within one byte budget for all plans together.
"""
import torch

from ..outputs import new_output
from ..precision import STATE_LSE_DTYPE, accumulator_torch_dtype
from ..tuning import cdiv

_COUNTERS = {}


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _counters(device, count):
    """Zeroed per-tile tickets for the in-kernel merge, kept per device and stream: the last
    program of each tile resets its ticket, so the buffer is zero again after every launch. A
    CUDA graph being captured gets tickets of its own, zeroed by the graph itself: two graphs
    captured on one (recycled) stream and replayed at once must not share them."""
    if _capturing(device):
        return torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < count:
        have = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = have
    return have


def _state_dtype(q):
    return accumulator_torch_dtype(q.dtype)


def _new_scratch(q, heads_kv, n_buf, splits, stand_ins):
    """(wb_o, wb_l, ws_o, ws_l, counters): the buffer states (passed from the buffer phase to the
    context phase through L2), the split partials and their merge tickets. An absent part points at
    the other part's tensors, or at ``stand_ins`` (an (o, lse) pair) when both are absent: never
    read (HAS_BUFFER / IN_KERNEL_MERGE are off)."""
    batch, heads_q, n_q, head_dim = q.shape

    def states(*lead):
        return (new_output((*lead, batch, heads_q, n_q, head_dim), _state_dtype(q), q.device),
                new_output((*lead, batch, heads_q, n_q), STATE_LSE_DTYPE, q.device))

    wb = states() if n_buf else None
    ws = states(splits) if splits > 1 else None
    wb = wb or ws or stand_ins
    ws = ws or wb
    counters = _counters(q.device, heads_kv * cdiv(batch * heads_q * n_q // heads_kv, 16)) if splits > 1 else wb[1]
    return (*wb, *ws, counters)


# Bytes of scratch (the fused kernel's buffer states and split partials) that plans keep between
# calls, all plans together: a decode loop's few shapes fit; a sweep of many shapes allocates.
# Keeping them saves four allocations a call, host time paid on every decode step
# (docs/measurements/shared_context.md).
MAX_KEPT_SCRATCH_BYTES = 1 << 30
_kept_bytes = 0


def _kept_scratch(kept, q, heads_kv, n_buf, splits):
    """The scratch a plan keeps for the current stream (made on first use), or None: allocate. Calls
    on one stream are ordered, so they may share it; another stream gets its own, and a CUDA graph
    being captured allocates its own (graph-owned) scratch, as it must for replays on any stream.
    Under the interpreter nothing is kept (one launch is milliseconds of numpy)."""
    global _kept_bytes
    if not (n_buf or splits > 1) or q.device.type != "cuda" or _capturing(q.device):
        return None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    scratch = kept.get(stream)
    if scratch is None:
        scratch = _new_scratch(q, heads_kv, n_buf, splits, None)
        size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in scratch[:4]}.values())
        if _kept_bytes + size > MAX_KEPT_SCRATCH_BYTES:
            return None
        _kept_bytes += size
        kept[stream] = scratch
    return scratch


def forget_kept_scratch():
    """Start the kept-scratch budget afresh: with ``forget_plans``, which drops what the plans kept."""
    global _kept_bytes
    _kept_bytes = 0
