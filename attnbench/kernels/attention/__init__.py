"""Triton kernels of attention: FlashAttention-2 forward and backward (pointer tiles, the Hopper routes, decode),
the forward with its tangent and the tangent of the backward, and the pieces they share."""
