"""Session-wide test settings.

Ray 2.5x enables token authentication and keeps one token in ~/.ray/auth_token; the tests start
several independent clusters on one machine (in-process, `ray start` heads, Slurm jobs), which would
otherwise race on that file. Every cluster a test starts runs without it (loopback only).
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
