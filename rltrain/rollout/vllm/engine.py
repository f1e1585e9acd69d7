"""``VllmEngine``: vLLM's offline ``LLM`` as the rollout engine of the trainer (``RolloutEngine`` of
``rltrain.rollout.protocol``).

Contract:
- ``generate`` takes token-id prompts or chat conversations (the tokenizer's chat template with the
  assistant turn opened) and returns a ``RolloutOutput``: n samples per prompt, the log-probability
  of every sampled token and why each sample ended.
- ``receive`` / ``load_weights`` and the digests are the engine's ``WeightReceiver``
  (``receive.py``), over the ``LLM`` itself (``front.EngineFront`` exposes them).
- ``sleep``/``wake_up`` release and restore weights and KV cache on GPU; on CPU they log once that
  sleep mode is unsupported and return.
The engine holds an ``EngineCore`` (settings, vLLM arguments, prompts, sampling, sleep state), the
same as the asynchronous engine does.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.rollout.protocol import EngineSettings, Prompt
from rltrain.rollout.types import RolloutOutput, Sample, SamplingConfig
from rltrain.rollout.vllm.core import EngineCore, on_gpu, place_workers
from rltrain.rollout.vllm.front import EngineFront
from rltrain.rollout.vllm.receive import WeightReceiver


class VllmEngine(EngineFront):
    """One vLLM engine (all its TP workers) driven from this process."""

    def __init__(self, model_path: str, *, settings: EngineSettings | None = None) -> None:
        settings = settings or EngineSettings()
        in_process = place_workers(settings)
        from vllm import LLM

        self.core = EngineCore(model_path, settings, in_process=in_process, gpu=on_gpu())
        self.llm = self.calls = LLM(model=self.core.model_path, **self.core.engine_kwargs())
        self.core.tokenizer = self.llm.get_tokenizer()
        self.weights = WeightReceiver(self.core, self.llm, local_model=self._local_model)

    # ----------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutOutput:
        """Sample ``sampling.n`` responses for each prompt; see ``RolloutOutput`` for shapes."""
        self.core.check_awake()
        prompt_ids = [self.core.prompt_ids(p) for p in prompts]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(requests, self.core.sampling_params(sampling), use_tqdm=False)
        return RolloutOutput.from_samples(prompt_ids, [samples_of(r) for r in outputs], n=sampling.n)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The effective weights of an in-process engine by HF name (copies; for tests and debugging)."""
        return self.weights.hf_weights()

    def _local_model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()

    def shutdown(self) -> None:
        """Stop the engine's workers (the engine is unusable afterwards)."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


def samples_of(request: Any) -> list[Sample]:
    """The samples of a finished vLLM ``RequestOutput``, in sample index order."""
    samples = []
    for sample in sorted(request.outputs, key=lambda o: o.index):
        ids = list(sample.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, sample.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(
                f"request {request.request_id}: {len(ids)} tokens but {len(logprobs)} logprobs"
            )
        samples.append(
            Sample(
                ids,
                logprobs,
                sample.finish_reason or "abort",
                sample.stop_reason,
                getattr(sample, "routed_experts", None),
            )
        )
    return samples
