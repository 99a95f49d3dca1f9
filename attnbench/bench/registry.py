"""The common interface: operators, their variants, and the registry that finds them.

An ``Operator`` owns its named case sets, seeded inputs, analytic cost model per mode,
tolerances and a float64 oracle. A ``Variant`` is one implementation of it: given a case, its
inputs and a mode, ``prepare`` does any setup that must stay out of the timed region (a forward
pass whose saved state a backward needs, say) and returns a zero-argument callable that does the
timed work and returns its outputs by name.

An operator's ``variants`` are what ``attnbench check|bench|run`` take when no ``--variant`` is named.
Its ``routes`` are variants that force one route or launch configuration of another
(``triton@tma``: the Triton variant with its forward through tensor descriptors): they run like any
variant when named, decline where the route cannot run (with the reason), and stay out of the
default set, so a default run times what users get and nothing twice.
"""
import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cases import case_set

VARIANT_KINDS = ("reference", "split", "triton", "peer")


class Unsupported(Exception):
    """A variant cannot run this case or on this device; the reason is reported, never hidden."""


def first_line(message, limit=None) -> str:
    """The first line of an error's or a warning's message, stripped ("" for an empty one), at most ``limit`` long:
    a library's refusal, shown as a reason."""
    lines = str(message).strip().splitlines()
    return (lines[0].strip() if lines else "")[:limit]


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
        # a mode the variant lacks is refused by name: flash's prepare ran fwd_bwd for any other mode (timing the
        # wrong work under the asked name) and others raised a bare KeyError (found by review)
        object.__setattr__(self, "prepare", _mode_checked(self.prepare, self.name, tuple(self.modes)))


def _mode_checked(prepare, name, modes):
    """``prepare`` refusing the modes not in ``modes`` (a Variant copied by dataclasses.replace wraps the original
    again, with its own name and modes)."""
    prepare = getattr(prepare, "unchecked", prepare)

    def checked(case, inputs, mode):
        if mode not in modes:
            raise Unsupported(f"{name} does not implement mode {mode!r} (its modes: {', '.join(modes)})")
        return prepare(case, inputs, mode)

    checked.unchecked = prepare
    return checked


class Operator:
    """Base class; subclasses fill in the class attributes and the methods that raise, and name their case sets
    in the class statement: ``class FlashOperator(Operator, cases=CASE_SETS)``."""

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

    _case_table: dict | None = None

    def __init_subclass__(cls, cases=None, **kwargs):
        """``cases``: the operator's case sets ({set name: () -> cases}), which ``case_sets`` names and ``cases``
        looks up (every operator wrote both out alike)."""
        super().__init_subclass__(**kwargs)
        if cases is not None:
            cls.case_sets, cls._case_table = tuple(cases), cases

    def __init__(self):
        self.variants: dict[str, Variant] = {}  # the default set
        self.routes: dict[str, Variant] = {}  # forced routes ("variant@route"), run when named
        self.register_variants()

    def register_variants(self):
        """Add this operator's variants and forced routes (``add_variant``, ``add_route``); called once by
        ``__init__``. None by default."""

    def add_variant(self, variant: Variant):
        if self.knows(variant.name):
            raise ValueError(f"{self.name}: variant {variant.name!r} registered twice")
        self.variants[variant.name] = variant

    def add_route(self, variant: Variant):
        """Register a forced route: a variant named ``<variant>@<route>``, run only when asked for."""
        if "@" not in variant.name:
            raise ValueError(f"{self.name}: a route variant is named <variant>@<route>, got {variant.name!r}")
        if self.knows(variant.name):
            raise ValueError(f"{self.name}: variant {variant.name!r} registered twice")
        self.routes[variant.name] = variant

    def knows(self, name: str) -> bool:
        return name in self.variants or name in self.routes

    def variant(self, name: str) -> Variant:
        """A variant of the default set or a forced route, by name."""
        if name in self.variants:
            return self.variants[name]
        if name in self.routes:
            return self.routes[name]
        raise KeyError(f"{self.name}: unknown variant {name!r}; known: {', '.join(self.variant_names())}")

    def variant_names(self) -> list:
        """Every variant this operator can run: the default set, then the forced routes."""
        return [*self.variants, *self.routes]

    def cases(self, set_name: str) -> list:
        """The cases of the set ``set_name`` (a ValueError naming the known sets for any other name)."""
        if self._case_table is None:
            raise NotImplementedError
        return case_set(self.name, self._case_table, set_name)

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

    def tunables(self) -> dict:
        """The kernels ``attnbench tune`` can time config by config: {name: bench.tune.Tunable}."""
        return {}

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


def forced_route(base: Variant, route: str, enter, description: str, *, modes=None, unavailable_reason=None,
                 declines=None, refused=None) -> Variant:
    """``base`` with ``enter()`` (a context manager that forces one route or config) around its
    preparation and around every timed call, named ``<base>@<route>``.

    ``unavailable_reason(device)``: why the route cannot run on a device (besides ``base``'s own
    reasons); ``declines(case)``: why it does not apply to a case (the row is skipped with it);
    ``refused(exc)``: True for an exception by which the kernels refuse the forced route on this
    case (a launcher's ValueError), reported as a skip with its first line instead of a failure."""

    def guarded():
        @contextlib.contextmanager
        def scope():
            with enter():
                try:
                    yield
                except Exception as exc:
                    if refused is not None and refused(exc):
                        raise Unsupported(str(exc).strip().splitlines()[0]) from None
                    raise
        return scope()

    def prepare(case, inputs, mode):
        if declines is not None and (reason := declines(case)):
            raise Unsupported(reason)
        with guarded():
            fn = base.prepare(case, inputs, mode)

        def run():
            with guarded():
                return fn()

        run.graph_capturable = getattr(fn, "graph_capturable", True)
        return run

    def unavailable(device):
        return base.unavailable_reason(device) or (unavailable_reason(device) if unavailable_reason else None)

    return Variant(f"{base.name}@{route}", base.kind, prepare, tuple(modes or base.modes), description, unavailable)


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
