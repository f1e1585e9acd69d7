"""The rollout engine side: engine settings and outputs, and one folder per engine backend.

vllm/           the vLLM backend (offline and asynchronous engines, weight receive, direct load):
                the only package that imports vLLM
partial.py      partial rollouts: per-token policy versions, batches across weight updates
mismatch.py     the rollout/trainer log-prob gap
types.py        engine settings, sampling settings, ``RolloutOutput``
The trainer side of weight sync (plan execution, transports, buckets) is ``rltrain.weight_sync``.
"""
