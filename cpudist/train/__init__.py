"""Training: the engine (the one setup and the one step), the run in phases, checkpoints, output,
the memory plan, signals and injected faults."""

import sys
import types
from typing import Any


class _Package(types.ModuleType):
    """Importing this package makes it `cpudist.train`, in place of the API's cpudist.train()
    (Python sets a subpackage as its parent's attribute): so the package, called, is that
    function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from cpudist.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _Package
