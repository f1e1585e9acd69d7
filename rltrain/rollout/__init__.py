"""The rollout engine side: the engine protocol and settings, and one folder per engine backend.

protocol.py     ``RolloutEngine`` / ``AsyncRolloutEngine`` (what callers use of an engine) and
                ``EngineSettings`` (what every backend takes; backend options in ``options``)
registry.py     backends by ``rollout.name``: ``EngineBackend`` (build an engine, read its options)
vllm/           the vLLM backend (offline and asynchronous engines, weight receive, direct load):
                the only package that imports vLLM
partial.py      partial rollouts: per-token policy versions, batches across weight updates
mismatch.py     the rollout/trainer log-prob gap
types.py        sampling settings, ``Sample``, ``RolloutOutput``
A new backend is one more folder with a ``backend`` module (``BACKEND = EngineBackend(...)``) and
its name in ``registry._BUILTIN``. The trainer side of weight sync (plan execution, transports,
buckets) is ``rltrain.weight_sync``.
"""
