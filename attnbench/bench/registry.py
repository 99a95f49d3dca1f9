"""The common interface: operators, their variants, and the registry that finds them.

An ``Operator`` owns its named case sets, seeded inputs, analytic cost model per mode,
tolerances and a float64 oracle. A ``Variant`` is one implementation of it: given a case, its
inputs and a mode, ``prepare`` does any setup that must stay out of the timed region (a forward
pass whose saved state a backward needs, say) and returns a zero-argument callable that does the
timed work and returns its outputs by name.
"""
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

VARIANT_KINDS = ("reference", "split", "triton", "peer")


class Unsupported(Exception):
    """A variant cannot run this case or on this device; the reason is reported, never hidden."""


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str
    prepare: Callable  # (case, inputs, mode) -> () -> dict[str, Tensor]
    modes: tuple
    description: str = ""
    # (device) -> None when runnable there, otherwise the reason it is not
    unavailable_reason: Callable = field(default=lambda device: None)

    def __post_init__(self):
        if self.kind not in VARIANT_KINDS:
            raise ValueError(f"variant kind must be one of {VARIANT_KINDS}, got {self.kind!r}")


class Operator:
    """Base class; subclasses fill in the class attributes and the methods that raise."""

    name: str = ""
    description: str = ""
    modes: tuple = ()
    case_sets: tuple = ("tiny", "gpu", "anchor", "sweep")
    # preference order for the "x baseline" column: the first variant available on the device
    baselines: tuple = ()
    # the side-by-side claim the CLI and `attnbench report` state per case and mode: the subject's
    # speed as a multiple of each of these peers' ("triton speed = 1.38x sdpa_flash"); none by default
    ratio_subject: str = "triton"
    ratio_peers: tuple = ()

    def __init__(self):
        self.variants: dict[str, Variant] = {}

    def add_variant(self, variant: Variant):
        if variant.name in self.variants:
            raise ValueError(f"{self.name}: variant {variant.name!r} registered twice")
        self.variants[variant.name] = variant

    def cases(self, set_name: str) -> list:
        raise NotImplementedError

    def make_inputs(self, case, device, seed: int = 0) -> dict:
        raise NotImplementedError

    def flops(self, case, mode: str) -> float:
        raise NotImplementedError

    def bytes(self, case, mode: str) -> float:
        raise NotImplementedError

    def oracle(self, case, inputs: dict, dtype=torch.float64) -> dict:
        """Every output and gradient of the reference, evaluated in ``dtype`` (float64: the truth)."""
        raise NotImplementedError

    def outputs(self, mode: str) -> tuple:
        """Names of the outputs a mode produces (a variant may produce a subset, e.g. a peer without lse)."""
        raise NotImplementedError

    def case_outputs(self, case, mode: str) -> tuple:
        """The outputs a mode produces on ``case``; ``outputs(mode)`` unless they depend on the case (sparse: a
        SparseScale case has no y, hence no grad_y)."""
        return self.outputs(mode)

    def extra_checks(self, device, seed: int = 0) -> list:
        """Checks of this operator that are not one variant on one case (verify.CheckResult rows),
        run by ``runner.check`` after the variants when no variant or mode filter was given."""
        return []

    def available_variants(self, device) -> dict[str, Variant]:
        return {n: v for n, v in self.variants.items() if v.unavailable_reason(torch.device(device)) is None}

    def baseline(self, device, candidates=None):
        names = candidates if candidates is not None else self.available_variants(device)
        return next((b for b in self.baselines if b in names), None)

    def check_mode(self, mode: str):
        if mode not in self.modes:
            raise ValueError(f"{self.name}: mode must be one of {self.modes}, got {mode!r}")


_OPERATORS: dict[str, Operator] = {}


def register(op: Operator) -> Operator:
    if op.name in _OPERATORS:
        raise ValueError(f"operator {op.name!r} registered twice")
    _OPERATORS[op.name] = op
    return op


def get(name: str) -> Operator:
    _load_builtin()
    try:
        return _OPERATORS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; known: {sorted(_OPERATORS)}") from None


def all_operators() -> dict[str, Operator]:
    _load_builtin()
    return dict(_OPERATORS)


def _load_builtin():
    importlib.import_module("attnbench.operators")  # importing it registers the built-ins
