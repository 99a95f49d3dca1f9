"""What the operators' peers share: SDPA pinned to one backend, and trying a peer once before it is timed.

Each SDPA backend is pinned with ``sdpa_kernel`` so that a backend that cannot run a case fails loudly
(reported as unsupported) instead of silently falling back to another one. A peer is built and run once
in prepare (``probed``), so that a case it cannot run is a skip with the peer's own reason, not a failure.
"""
import re
import warnings

import torch

from ..bench.registry import Unsupported, first_line

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - torch >= 2.11 is required, this guards odd builds
    SDPBackend = sdpa_kernel = causal_lower_right = None


def sdpa_unavailable(backend_name, device):
    if SDPBackend is None:
        return "torch.nn.attention.sdpa_kernel is not importable"
    if backend_name != "MATH" and device.type != "cuda":
        return "needs a CUDA device"
    return None


def probe(run):
    """Run a peer once (``run() -> its output tensor``) so an unsupported case raises Unsupported with the
    backend's own reason (and the warnings it gave: ``_reasons``), or because the output holds NaN."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                out = run()
        except (RuntimeError, ValueError, NotImplementedError, AssertionError) as exc:
            reasons = _reasons(caught)
            raise Unsupported(f"{first_line(exc)}{' (' + reasons + ')' if reasons else ''}") from None
    if torch.isnan(out).any():
        raise Unsupported("returns NaN on this case")


# What a pinned SDPA backend's refusal warns besides its reason: where in PyTorch's source the warning came from, a
# header line per backend ("... kernel not used because:"), and that the backends the pin disables are disabled.
# A report row kept them all: 1.5 KB for "FLASH takes is_causal only at Nq == Nk".
_SOURCE = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")
_NOISE = re.compile(r"(kernel not used because:|has been runtime disabled\.?)$")


def _reasons(caught) -> str:
    """The caught warnings' first lines, less PyTorch's source locations and its lines that say nothing of this
    case, each once, in order."""
    kept = []
    for w in caught:
        line = _SOURCE.sub("", first_line(w.message)).strip()
        if line and not _NOISE.search(line) and line not in kept:
            kept.append(line)
    return "; ".join(kept)


def probed(build, output):
    """make(case, x) -> a peer's forward: ``build(case, x)``, whose refusal (RuntimeError, ValueError,
    NotImplementedError) becomes Unsupported with its first line, then ``probe``d once, ``output(forward, x)``
    giving the output tensor of one call."""

    def make(case, x):
        try:
            forward = build(case, x)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            raise Unsupported(first_line(exc)) from None
        probe(lambda: output(forward, x))
        return forward

    return make
