"""Plain helpers of the shared_context tests (and of tests/bench/test_launch_plans.py, which drives its launchers)."""


def api_args(x):
    """The positional arguments of shared_context_attention (and _composed) from an input dict of the operator."""
    return x["q"], x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], x["buf_lens"]
