"""Head dims whose column blocks the pointer kernels would mask, run zero-padded on the GPU.

head_dim_blocks tiles a head dim in one or two power-of-two column blocks; where they are wider than D the
kernels mask the extra columns (72 = 64 + 16 with columns 72-79 masked, 88 = 64 + 32 with 88-95, 24 in one
block of 32). On sm_90 with Triton 3.6 the forward's pointer kernel goes wrong at some of these: D 72 causal
at Nq 129 reads shared memory out of range in most of its configs, and D 88 at Nq 129 returns wrong outputs
in all of them, while the interpreter, D 80 and D 72 at Nq 128 are right (docs/measurements/flash.md;
the flash `odd` case set). Triton 3.6 compiles D 72 and D 68 at Nq 129 to the same PTX for sm_90,
and D 68 runs right there, so the fault would depend on the mask's runtime bound, not on a specialization;
it is not understood. Until it is, the flash launchers run every head dim whose blocks would be masked on
CUDA as zero-padded copies at the blocks' width: zero columns add nothing to the scores, and the outputs' padding
is cut off. The copies cost one extra read and write of the inputs (a few percent of a long attention);
the kernels compute the padded columns either way. copy_route("triton") makes the pads and cuts planned kernels
(copies.py), which a host replay repeats.
"""
import torch

from ..tuning import head_dim_blocks
from .copies import copy_heads_each

# Devices on which the launchers pad (tests add "cpu" to run the padded path through the interpreter).
PAD_ON = {"cuda"}


def padded_width(head_dim: int, device) -> int:
    """The head width the pointer kernels run ``head_dim`` at on ``device``: the width of its column
    blocks where they would mask columns there, else head_dim itself."""
    block_d, block_d2 = head_dim_blocks(head_dim)
    if torch.device(device).type in PAD_ON and head_dim < block_d + block_d2:
        return block_d + block_d2
    return head_dim


def pad_heads(width: int, *tensors):
    """Each tensor's last dim zero-padded to ``width`` (contiguous copies: copies.copy_heads_each)."""
    return copy_heads_each(width, *tensors)


def cut_heads(head_dim: int, *tensors):
    """Each tensor's first ``head_dim`` columns, contiguous (copies.copy_heads_each)."""
    return copy_heads_each(head_dim, *tensors)
