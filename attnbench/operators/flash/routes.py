"""flash's forced routes: the Triton variant with one kernel path chosen, whatever the shape would pick.

The launchers choose between routes that compute the same function (kernels/attention/flash_fwd.py:
``forward_route``; flash_bwd.py: ``dq_route``, ``dkdv_route``); each route here is the ``triton``
variant run inside one of those switches, so ``attnbench check`` verifies a route against the float64
oracle and ``attnbench bench`` times it beside the default, side by side in one run:

    attnbench bench --op flash --variant triton --variant triton@tma --mode fwd

Forward routes time ``fwd`` and ``fwd_bwd`` (their backward is the default's), backward routes ``bwd``
and ``fwd_bwd``. A route that cannot run on the device is unavailable there (with the reason); one that
does not apply to a case (a head dim the Gluon kernel lacks, strides tensor descriptors cannot address)
is a skipped row with the launcher's reason.
"""
import torch

from ...bench.registry import forced_route

FORWARD_MODES = ("fwd", "fwd_bwd")
BACKWARD_MODES = ("bwd", "fwd_bwd")
ALL_MODES = ("fwd", "bwd", "fwd_bwd")


def _refused(exc) -> bool:
    """The launchers refuse a forced route that does not apply with a ValueError naming the route."""
    return isinstance(exc, ValueError) and "route" in str(exc)


def _needs_tma(device):
    from ...kernels.launch import tma_capable

    if device.type == "cuda" and not tma_capable(device):
        return "tensor descriptors need a GPU of compute capability 9.0 or later"
    return None


def _needs_hopper(device):
    from ...kernels.attention.flash_fwd_hopper import GLUON, GLUON_TRITON

    if device.type != "cuda":
        return "the Gluon kernels run on an sm_90 GPU only (Gluon has no interpreter)"
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) != (9, 0):
        return "the Gluon kernels need an sm_90 (Hopper) GPU"
    if not GLUON:
        import triton

        return f"the Gluon kernels are written for Triton {GLUON_TRITON}x (this is {triton.__version__})"
    return None


def _needs_bulk_reduction(device):
    if device.type != "cuda":
        return "the copy engine's bulk reduction has no interpreter: a CUDA GPU of compute capability 9.0+"
    return _needs_tma(device)


def _hopper_case(head_dims):
    def declines(case):
        if case.dtype not in ("float16", "bfloat16"):
            return f"the Gluon kernels take fp16/bf16, not {case.dtype}"
        if case.head_dim not in head_dims:
            return f"the Gluon kernels take head dims {', '.join(map(str, head_dims))}, not {case.head_dim}"
        return None

    return declines


def _bulk_reduction_case(case):
    if case.head_dim % 4:
        return f"the bulk reduction adds rows of whole 16-byte groups: head dim {case.head_dim} is not a multiple of 4"
    if case.dtype == "float64":
        return "the copy engine adds no fp64"
    return None


def flash_routes(triton):
    """The forced routes of flash's ``triton`` variant."""
    from ...kernels.attention.copies import copy_route
    from ...kernels.attention.flash_bwd import dkdv_route, dq_route, group_route
    from ...kernels.attention.flash_bwd_hopper import HOPPER_DKDV_HEAD_DIMS
    from ...kernels.attention.flash_fwd import forward_route
    from ...kernels.attention.flash_fwd_hopper import HOPPER_HEAD_DIMS

    def route(name, switch, value, description, modes, **kw):
        return forced_route(triton, name, lambda: switch(value), description, modes=modes, refused=_refused, **kw)

    return [
        route("tiles", forward_route, "tiles", "forward by FA2's query tiles through pointers (the portable route)",
              FORWARD_MODES),
        route("tma", forward_route, "tma", "forward by the query tiles reading K and V through tensor descriptors "
              "(TMA)", FORWARD_MODES, unavailable_reason=_needs_tma),
        route("hopper", forward_route, "hopper", "forward by the Gluon kernel (asynchronous wgmma, a loader warp; "
              "sm_90)", FORWARD_MODES, unavailable_reason=_needs_hopper, declines=_hopper_case(HOPPER_HEAD_DIMS)),
        route("decode", forward_route, "decode", "forward by the split-KV kernel (the default for Nq <= 64) at any "
              "shape", FORWARD_MODES),
        route("dq-atomic", dq_route, "atomic", "backward with dS K added into an fp32 dQ by atomics in the dK/dV "
              "pass, no dQ pass (not deterministic)", BACKWARD_MODES),
        route("dq-tma-atomic", dq_route, "tma_atomic", "backward with each dS K tile added into dQ by one bulk "
              "reduction of the copy engine (not deterministic)", BACKWARD_MODES,
              unavailable_reason=_needs_bulk_reduction, declines=_bulk_reduction_case),
        route("dq-split", dq_route, "split", "backward with the dQ pass's keys split over programs, fp32 shares "
              "summed (few query rows against many keys)", BACKWARD_MODES),
        route("dkdv-tiles", dkdv_route, "tiles", "backward with dK and dV in one pointer-kernel pass at every head "
              "dim", BACKWARD_MODES),
        route("dkdv-split", dkdv_route, "split", "backward with dV and dK in two passes of one accumulator each "
              "(the default from head width 256)", BACKWARD_MODES),
        route("dkdv-hopper", dkdv_route, "hopper", "backward with the dK/dV pass by the Gluon kernel (sm_90)",
              BACKWARD_MODES, unavailable_reason=_needs_hopper, declines=_hopper_case(HOPPER_DKDV_HEAD_DIMS)),
        route("dkdv-per-head", group_route, "per-head", "backward with a dK/dV program per query head, K and V "
              "repeated and the fp32 shares summed over the head group (GQA at small batch)", BACKWARD_MODES,
              declines=_no_head_groups),
        route("dkdv-shared", group_route, "shared", "backward with one dK/dV program per KV head walking its "
              "head group (the default but where GROUP_PER_HEAD's rule picks per-head)", BACKWARD_MODES,
              declines=_no_head_groups),
        route("copies", copy_route, "triton", "the launchers' head padding, cuts, head repeats and share sums as "
              "planned Triton kernels (host replays repeat them), a launch a tensor", ALL_MODES,
              declines=_nothing_grouped),
        route("grouped-copies", copy_route, "grouped", "the Triton copies with the pads and cuts of tensors of one "
              "layout in one launch (at most 4 launches for a padded backward's 5 pads and 3 cuts; the default)",
              ALL_MODES, declines=_nothing_grouped),
        route("torch-copies", copy_route, "torch", "the launchers' head padding, cuts, head repeats and share sums "
              "by PyTorch's ops (the default before the copies were timed)", ALL_MODES,
              declines=_nothing_copied),
    ]


def _padded(case) -> bool:
    """Whether a GPU runs the case's head dim zero-padded (pads and cuts)."""
    from ...kernels.attention.head_padding import padded_width

    return padded_width(case.head_dim, "cuda") != case.head_dim


def _per_head_may_apply(case) -> bool:
    """Whether the per-head rule may take the case's backward (K/V repeats, share sums): head groups over
    GROUP_RULE_MIN_ROWS query rows."""
    from ...kernels.attention.flash_bwd import GROUP_RULE_MIN_ROWS

    return case.heads_q > case.heads_kv and case.seqlen_q >= GROUP_RULE_MIN_ROWS


def _nothing_copied(case):
    """What the copy routes change on a GPU's default routes: a padded head dim (pads and cuts), a backward whose
    dQ keys may split (share sums: DQ_SPLIT_MIN_SPLITS runs of dq_split_min_keys keys at the least), or one the
    per-head rule may take."""
    from ...kernels.attention.flash_bwd import DQ_SPLIT_MIN_SPLITS, dq_split_min_keys

    if (not _padded(case) and case.seqlen_k < dq_split_min_keys(case.seqlen_q) * DQ_SPLIT_MIN_SPLITS
            and not _per_head_may_apply(case)):
        return (f"head dim {case.head_dim} is not padded, {case.seqlen_k} keys are too few for a dQ split and no "
                "head group is spread per head: nothing is copied, the routes are the same")
    return None


def _nothing_grouped(case):
    """Where the grouped copies (the default) differ from triton@copies, a launch a tensor: a padded head dim, or the
    per-head rule's K/V repeats (the share sums are the same kernel either way)."""
    if not _padded(case) and not _per_head_may_apply(case):
        return (f"head dim {case.head_dim} is not padded and no head group is spread per head: no two copies share a "
                "launch, triton@copies and triton@grouped-copies are the default's route")
    return None


def _no_head_groups(case):
    if case.heads_q == case.heads_kv:
        return "no head groups (Hq = Hkv): the route is the default's"
    return None
