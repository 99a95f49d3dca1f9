"""Head dims whose second column block the pointer kernels would mask, run zero-padded on the GPU.

head_dim_blocks tiles a head dim that is not a power of two in two column blocks (72 = 64 + 16 with
columns 72-79 masked, 88 = 64 + 32 with 88-95 masked). On an H100 with Triton 3.6 the forward's pointer
kernel miscompiles some of these: D 72 causal at Nq 129 reads shared memory out of range in every config
but one, and D 88 at Nq 129 returns wrong outputs (relative error 0.84-0.95) in every config, while the
interpreter, D 68, D 80 and the same dims at Nq 128 are right (results/gpu/nvidia-h100/odd-dims-configs.log,
memcheck-odd-dims.log; scripts/gpu_dev_odd_head_dims.py). Until that is understood, the launchers run such
head dims on CUDA as zero-padded copies at the blocks' width, which no block masks: zero columns add
nothing to the scores, and the outputs' padding is cut off. The copies cost one extra read and write of
the inputs (a few percent of a long attention).
"""
import torch
import torch.nn.functional as F

from .tuning import head_dim_blocks

# Devices on which the launchers pad (tests add "cpu" to run the padded path through the interpreter).
PAD_ON = {"cuda"}


def padded_width(head_dim: int, device) -> int:
    """The head width the pointer kernels run ``head_dim`` at on ``device``: the width of its two
    column blocks where the second would be masked there, else head_dim itself."""
    block_d, block_d2 = head_dim_blocks(head_dim)
    if torch.device(device).type in PAD_ON and block_d2 and head_dim < block_d + block_d2:
        return block_d + block_d2
    return head_dim


def pad_heads(width: int, *tensors):
    """Each tensor's last dim zero-padded to ``width`` (contiguous copies)."""
    return [F.pad(t, (0, width - t.shape[-1])) for t in tensors]


def cut_heads(head_dim: int, *tensors):
    """Each tensor's first ``head_dim`` columns, contiguous."""
    return [t[..., :head_dim].contiguous() for t in tensors]
