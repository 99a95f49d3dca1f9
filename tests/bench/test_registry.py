"""Registry and variants (flash as the example operator; its case sets, cost model and inputs:
tests/attention/test_flash_cases.py)."""
import pytest
import torch

import attnbench
from attnbench.operators.flash import FlashOperator
from attnbench.bench.registry import Operator, Variant, all_operators, register


def _noop_prepare(case, x, mode):
    return lambda: {}


# ---------------------------------------------------------------- registry

def test_get_flash():
    op = attnbench.get("flash")
    assert isinstance(op, Operator)
    assert op.name == "flash"
    assert op is attnbench.get("flash")
    assert all_operators()["flash"] is op


def test_all_operators_survives_loading_the_builtins():
    """``attnbench.all_operators()`` is public API; importing the ``attnbench.operators``
    subpackage, which get() does, must not shadow it (an earlier name did exactly that)."""
    import importlib

    attnbench.get("flash")
    importlib.import_module("attnbench.operators.flash")
    assert "flash" in attnbench.all_operators()


def test_unknown_operator_names_the_known_ones():
    with pytest.raises(KeyError) as info:
        attnbench.get("no_such_op")
    assert "no_such_op" in str(info.value)
    assert "flash" in str(info.value)


def test_registering_an_operator_twice_raises():
    dup = Operator()
    dup.name = "flash"
    with pytest.raises(ValueError, match="twice"):
        register(dup)
    assert attnbench.get("flash") is not dup


def test_duplicate_variant_raises():
    op = Operator()
    op.name = "scratch"
    v = Variant("v1", "reference", _noop_prepare, ("fwd",))
    op.add_variant(v)
    with pytest.raises(ValueError, match="v1"):
        op.add_variant(Variant("v1", "split", _noop_prepare, ("fwd",)))
    assert op.variants["v1"] is v


def test_duplicate_variant_on_a_flash_operator_raises():
    op = FlashOperator()  # a fresh instance: the registered one is left alone
    with pytest.raises(ValueError, match="triton"):
        op.add_variant(Variant("triton", "triton", _noop_prepare, op.modes))


def test_variant_bad_kind_raises():
    with pytest.raises(ValueError, match="kind"):
        Variant("x", "magic", _noop_prepare, ("fwd",))
    for kind in ("reference", "split", "triton", "peer"):
        assert Variant("x", kind, _noop_prepare, ("fwd",)).kind == kind


def test_variant_default_is_available_everywhere():
    v = Variant("x", "peer", _noop_prepare, ("fwd",))
    assert v.unavailable_reason(torch.device("cpu")) is None


def test_a_refusal_shows_the_first_line_of_its_message_even_an_empty_one():
    """Peers turn a library's error into a reason with first_line; an error without a message (str(exc) == "")
    made the inline ``str(exc).splitlines()[0]`` raise IndexError instead of reporting the refusal."""
    from attnbench.bench.registry import first_line

    assert first_line(RuntimeError("\n  head dim 72 unsupported \nsee docs")) == "head dim 72 unsupported"
    assert first_line(RuntimeError()) == ""
    assert first_line("x" * 300, 200) == "x" * 200


def test_a_mode_the_variant_lacks_is_refused_by_name():
    """Found by review: flash's prepare ran fwd_bwd for any mode it did not know (timing the wrong work under the
    asked name) and jvp_attention's raised a bare KeyError. Every variant refuses a mode it lacks, naming its own."""
    from attnbench.bench.registry import Unsupported

    for op_name, variant, mode in (("flash", "triton", "fwd_jvp"), ("jvp_attention", "split", "bwd"),
                                   ("sparse", "split", "fwd_bwd")):
        op = attnbench.get(op_name)
        case = op.cases("tiny")[0]
        with pytest.raises(Unsupported, match=f"{variant} does not implement mode '{mode}' \\(its modes: "):
            op.variant(variant).prepare(case, op.make_inputs(case, "cpu"), mode)


def test_a_peer_refusal_keeps_the_reason_not_pytorchs_noise():
    """A pinned SDPA backend's refusal, as torch 2.11 words it on a GPU (Flash with is_causal at Nq 9, Nk 79): the
    skip reason keeps the exception and the one warning that says why, without the source locations, the per-backend
    headers and the disabled backends (a report row used to carry all 1.5 KB of it)."""
    import warnings

    from attnbench.bench.registry import Unsupported
    from attnbench.operators.peers import probe

    where = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:{}.)"
    said = ["Memory efficient kernel not used because:" + where.format(986),
            "Memory Efficient attention has been runtime disabled." + where.format(552),
            "Flash attention kernel not used because:" + where.format(988),
            "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. Got seqlen_q: 9 "
            "seqlen_k: 79. If you would like to use causal attention with non-square masks, please see "
            "CausalAttnMask." + where.format(457),
            "cuDNN attention has been runtime disabled." + where.format(706)]

    def refuse():
        for message in said + said[3:4]:  # a reason given twice is kept once
            warnings.warn(message, UserWarning)
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(Unsupported) as refused:
        probe(refuse)
    assert str(refused.value) == ("No available kernel. Aborting execution. (Flash attention does not support the "
                                  "is_causal flag when seqlen_q != seqlen_k. Got seqlen_q: 9 seqlen_k: 79. If you "
                                  "would like to use causal attention with non-square masks, please see "
                                  "CausalAttnMask.)")
    def refuse_silently():
        raise ValueError("nothing to say")

    with pytest.raises(Unsupported, match=r"^nothing to say$"):  # no warning: the exception alone
        probe(refuse_silently)
