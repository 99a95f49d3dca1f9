"""A kernel's choice between routes that compute the same function, forced for a block of code.

The launchers pick a route from the shape (flash's forward: query tiles or split-KV) or default to
the safe one (flash's backward: the deterministic dQ pass); tests, benchmarks and users who accept
what a route costs force one with ``with switch("route"):``. Module-wide, not thread-local.
"""
import contextlib


SWITCHES = []  # every RouteSwitch made


def forced_routes() -> tuple:
    """The route each switch forces now (None: by shape): what a replay of a launch must match (kernels/replay.py)."""
    return tuple([s.forced for s in SWITCHES])


class RouteSwitch:
    def __init__(self, routes: tuple, what: str):
        self.routes, self.what, self.forced = routes, what, None
        SWITCHES.append(self)

    @contextlib.contextmanager
    def __call__(self, route):
        if route is not None and route not in self.routes:
            raise ValueError(f"{self.what} {route!r}: expected one of {self.routes} or None")
        before, self.forced = self.forced, route
        try:
            yield
        finally:
            self.forced = before
