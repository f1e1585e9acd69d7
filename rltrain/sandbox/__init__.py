"""The sandbox: an isolated process tree that runs untrusted Python under limits.

Used by the agent's ``python`` tool and by the ``code`` reward; imports nothing of the rest of
rltrain. See :mod:`.runner` (limits, a run and its outcome) and :mod:`.child` (the processes).
"""

from .runner import SandboxLimits, SandboxResult, isolation, run_python

__all__ = ["SandboxLimits", "SandboxResult", "isolation", "run_python"]
