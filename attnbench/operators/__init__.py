"""Built-in operators; importing a subpackage registers it."""
from . import flash  # noqa: F401
