"""One file per model family; importing this package imports each and so registers every family.

A family file defines a ``ModelFamily`` (mapping rows, architecture facts, tiny test preset) and
passes it to ``megatron_bridge.registry.register``; ``common`` holds the pieces several families share.
Adding a family is adding its file here: nothing else lists the families.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "common":
        importlib.import_module(f"{__name__}.{_module.name}")
