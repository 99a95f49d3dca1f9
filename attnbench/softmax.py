"""The oracles' softmax: probabilities and row logsumexp of masked scores, in plain torch ops.

Both eager references (flash's and shared_context's) take it, so the float64 truth is computed one way.
"""
import torch


def softmax_and_lse(s, blind=None):
    """(P, LSE) of scores ``s`` [..., N] over the last dimension, -inf where a key is masked.

    Max-subtracted: P = exp(s - m) / sum exp(s - m) and LSE = m + log(sum), m the row max. Not
    exp(s - LSE): that exponent carries LSE's rounding, |LSE| ulps, which in float64 grows past the
    1e-12 bar from |LSE| near 1e4 and at |LSE| near 1e30 loses log(ties) whole (two tied keys then
    weigh 1 each, not 1/2). m is detached: P and LSE do not depend on it, so gradients and tangents
    of every order are those of the softmax itself. ``blind`` [...] flags rows that see no key: they
    give P = 0 and LSE = -inf, with zero gradients, never NaN.
    """
    if s.shape[-1] == 0:  # no key at all: an empty P, and LSE = log 0 = -inf (as logsumexp)
        return s, s.sum(dim=-1) - torch.inf
    filled = s if blind is None else s.masked_fill(blind.unsqueeze(-1), 0.0)
    top = filled.detach().amax(dim=-1, keepdim=True)
    e = torch.exp(filled - top)  # exp(-inf - finite) = 0 on masked keys
    z = e.sum(dim=-1, keepdim=True)
    lse = (top + torch.log(z)).squeeze(-1)
    if blind is not None:  # computed over zeros (no inf - inf), then set
        e, lse = e.masked_fill(blind.unsqueeze(-1), 0.0), lse.masked_fill(blind, float("-inf"))
    return e / z, lse
