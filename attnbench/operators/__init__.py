"""Built-in operators; importing a subpackage registers it."""
from . import flash  # noqa: F401
from . import jvp_attention  # noqa: F401
from . import shared_context  # noqa: F401
from . import sparse  # noqa: F401
