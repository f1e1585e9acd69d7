"""Samples traced end to end through the real driver, role handles and ``PolicyWorker`` update loop
over fake engines and a fake Megatron model (two data-parallel ranks, no Ray): each sample's id in
the run log's rollout, reward, advantage and training lines, and the per-step JSONL dumps
(``trainer.rollout_data_dir``, ``trainer.validation_data_dir``) holding the values the driver
computed, checked against hand-derived scores and GRPO / ReMax advantages; a resumed run rewrites
the file of the step it runs again."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltrain.algo.token_batch import ModelOutput
from rltrain.config import load_config
from rltrain.data.loader import PromptBatch
from rltrain.data.prompt_rows import PromptExample
from rltrain.logging.console import TRACE
from rltrain.orchestrator.placement import rollout_placement
from rltrain.rewards import RewardManager, get_reward_fn
from rltrain.rollout.types import RolloutOutput
from rltrain.trainer.driver import PPOTrainer, Roles
from rltrain.trainer.roles import PolicyRole
from rltrain.workers.model_workers import PolicyWorker

PAD, PLUS, EQUALS, EOS = 0, 11, 12, 13
N = 2
RESPONSE_LENGTH = 6
GRPO_ADV = 0.5 / (math.sqrt(0.5) + 1e-6)  # a group scored (1, 0): ± 0.5 over its unbiased std (+ eps)


class DigitTokenizer:
    """Ids 1..10 are the digits 0..9, then ``+``, ``=`` and EOS (a special token)."""

    pad_token_id = PAD

    def encode(self, text: str) -> list[int]:
        return [PLUS if c == "+" else EQUALS if c == "=" else int(c) + 1 for c in text]

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        chars = {PLUS: "+", EQUALS: "=", EOS: "" if skip_special_tokens else "<eos>", PAD: ""}
        return "".join(chars.get(t, str(t - 1)) for t in token_ids)


TOKENIZER = DigitTokenizer()


def answers(a: int, b: int) -> list[tuple[str, str]]:
    """(response text, finish reason) of the two samples of ``a+b=``: sample 0 (and any greedy one)
    answers right; sample 1 too when the sum is even, else it runs to the length limit on 9s."""
    right = (str(a + b), "stop")
    return [right, right if (a + b) % 2 == 0 else ("9" * RESPONSE_LENGTH, "length")]


class FakeEngine:
    def wake_up(self) -> None: ...

    def sleep(self) -> None: ...

    def generate(self, prompts: list[list[int]], sampling) -> RolloutOutput:
        samples, reasons = [], []
        for ids in prompts:
            a, b = TOKENIZER.decode(ids, skip_special_tokens=True).rstrip("=").split("+")
            for text, reason in answers(int(a), int(b))[: sampling.n]:
                samples.append(TOKENIZER.encode(text) + ([EOS] if reason == "stop" else []))
                reasons.append(reason)
        return RolloutOutput(
            prompt_ids=[list(p) for p in prompts],
            response_ids=samples,
            response_logprobs=[[-0.5] * len(s) for s in samples],
            finish_reasons=reasons,
            n=sampling.n,
        )


class FakeModel:
    """The actor's Megatron worker: zero log-probs, a no-op optimizer step."""

    def compute_log_prob(self, batch):
        shape = (batch.input_ids.size(0), batch.response_len)
        return ModelOutput(logprobs=torch.zeros(shape), entropy=torch.zeros(shape))

    def update(self, batch, loss_fn):
        return SimpleNamespace(
            metrics={"pg_loss": 0.0}, grad_norm=0.0, lr=1e-6, skipped=False, param_max_abs=0.5, moe_metrics={}
        )


class ShellPolicyWorker(PolicyWorker):
    """``PolicyWorker``'s own generate / log-prob / update methods over the fakes on rank ``rank``."""

    def __init__(self, config, rank: int, world: int) -> None:
        self.config = config
        self.ctx = SimpleNamespace(rank=rank, tp_rank=0, pp_rank=0, dp_rank=rank, dp_size=world)
        self.actor, self.ref, self.engine = FakeModel(), None, FakeEngine()
        self.engine_ranks = list(range(world))

    def sync_weights(self, index: int | None = None) -> dict[str, float]:
        return {}

    def save_checkpoint(self, root: str, step: int) -> str:
        path = Path(root) / "actor"
        path.mkdir(parents=True, exist_ok=True)
        (path / f"rank{self.ctx.rank}").write_text(str(step))
        return str(path)

    def load_checkpoint(self, root: str) -> int:
        return int((Path(root) / "actor" / f"rank{self.ctx.rank}").read_text())


class LocalGroup:
    """The worker-group interface over in-process workers."""

    role = "actor_rollout_ref"

    def __init__(self, workers: list) -> None:
        self.workers, self.world_size = workers, len(workers)

    def call(self, method: str, *args, **kwargs) -> list:
        return [getattr(w, method)(*args, **kwargs) for w in self.workers]

    def call_each(self, method: str, per_rank_args: list[tuple], **kwargs) -> list:
        return [getattr(w, method)(*args, **kwargs) for w, args in zip(self.workers, per_rank_args)]


def example(i: int, a: int, b: int) -> PromptExample:
    text = f"{a}+{b}="
    return PromptExample(
        index=i,
        prompt=text,
        ground_truth=str(a + b),
        data_source="arithmetic",
        extra_info={},
        origin=f"test:{i}",
        prompt_text=text,
        prompt_ids=TOKENIZER.encode(text),
    )


# Batches of four prompts; odd sums give groups scored (1, 0), even ones (1, 1).
TRAIN = [
    example(i, a, b)
    for i, (a, b) in enumerate([(1, 2), (2, 2), (3, 4), (5, 3), (2, 7), (4, 4), (1, 1), (6, 3)])
]
VAL = [example(100 + i, a, b) for i, (a, b) in enumerate([(4, 5), (2, 6)])]


@dataclass
class Loader:
    examples: list[PromptExample]
    position: int = 0
    batch_size: int = 4

    def next_batch(self) -> PromptBatch:
        start = (self.position * self.batch_size) % len(self.examples)
        self.position += 1
        return PromptBatch(
            examples=self.examples[start : start + self.batch_size], epoch=0, position=self.position - 1
        )

    def state_dict(self) -> dict:
        return {"position": self.position, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


@dataclass
class Data:
    train: Loader = field(default_factory=lambda: Loader(TRAIN))
    val: list[PromptExample] = field(default_factory=lambda: list(VAL))


class Records:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics, *, step: int) -> None:
        self.logged.append((step, dict(metrics)))


def trainer_for(tmp_path: Path, *overrides: str, total_steps: int = 2) -> PPOTrainer:
    config = load_config(
        "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            f"trainer.validation_data_dir={tmp_path / 'val'}",
            "trainer.val_before_train=true",
            "trainer.test_freq=2",
            "cluster.n_gpus_per_node=2",
            "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=false",
            f"rollout.n={N}",
            f"rollout.response_length={RESPONSE_LENGTH}",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size_per_gpu=2",
            *overrides,
        ],
    )
    workers = [ShellPolicyWorker(config, rank, 2) for rank in range(2)]
    policy = PolicyRole(LocalGroup(workers), placement=rollout_placement(config, gpu=False))
    return PPOTrainer(
        config,
        roles=Roles(policy=policy, critic=None),
        tokenizer=TOKENIZER,
        data=Data(),
        rewards=RewardManager.from_config(config.reward),
        tracker=Records(),
        total_steps=total_steps,
    )


def expected_rows(step: int, prompts: list[PromptExample], prefix: str, advantage) -> list[dict]:
    """The dump rows of ``prompts``' samples, by hand: score 1 for a right answer, else 0 (what the
    arithmetic reward function says too); reward = score (no KL in the reward)."""
    rows = []
    for p, ex in enumerate(prompts):
        a, b = map(int, ex.prompt.rstrip("=").split("+"))
        scores = [1.0 if text == ex.ground_truth else 0.0 for text, _ in answers(a, b)]
        for s, (text, reason) in enumerate(answers(a, b)):
            assert get_reward_fn("arithmetic")(text, ex.ground_truth).score == scores[s]
            rows.append(
                {
                    "uid": f"{prefix}-p{p}-s{s}",
                    "step": step,
                    "input": ex.prompt,
                    "output": text,
                    "gts": ex.ground_truth,
                    "data_source": "arithmetic",
                    "score": scores[s],
                    "reward": scores[s],
                    "advantage": advantage(scores, s),
                    "response_length": len(text) + (reason == "stop"),
                    "finish_reason": reason,
                }
            )
    return rows


def grpo(scores: list[float], s: int) -> float:
    return 0.0 if scores[0] == scores[1] else (GRPO_ADV if scores[s] == 1.0 else -GRPO_ADV)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["uid"] for r in got] == [r["uid"] for r in want]
    for g, w in zip(got, want):
        assert g == {**w, "advantage": pytest.approx(w["advantage"], abs=1e-6)}, w["uid"]


def trace_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rltrain.samples" and r.levelno == TRACE]


def trained_ids(lines: list[str], step: int) -> dict[tuple[int, int], list[str]]:
    """(rank, mini-batch) -> the ids that rank's actor update line names, for ``step``."""
    out = {}
    for line in lines:
        m = re.fullmatch(r"train actor rank (\d) \(dp \d/2\) mini-batch (\d)/2: (.*)", line)
        if m and m.group(3).startswith(f"step{step}-"):
            out[int(m.group(1)), int(m.group(2))] = m.group(3).split(" ")
    return out


def test_ids_and_values_of_every_sample_reach_the_run_log_and_the_dumps(tmp_path, caplog):
    caplog.set_level(TRACE, logger="rltrain")
    trainer = trainer_for(tmp_path)
    assert trainer.fit() == 2
    lines = trace_lines(caplog)
    for step in (1, 2):
        want = expected_rows(step, TRAIN[4 * (step - 1) : 4 * step], f"step{step}", grpo)
        same_rows(read_rows(tmp_path / "rollouts" / f"{step}.jsonl"), want)
        for row in want:
            uid, score = row["uid"], row["score"]
            assert f"rollout {uid}: finish={row['finish_reason']} length={row['response_length']}" in lines
            assert f"reward {uid}: score={score:.6g} correct={score == 1.0}" in lines
        advantage_lines = {
            line.split(":")[0].split(" ")[1]: line
            for line in lines
            if line.startswith(f"advantage step{step}-")
        }
        assert sorted(advantage_lines) == sorted(r["uid"] for r in want)
        for row in want:
            assert advantage_lines[row["uid"]] == (
                f"advantage {row['uid']}: mean={row['advantage']:+.6g} reward={row['reward']:+.6g} "
                f"tokens={row['response_length']}"
            )
        trained = trained_ids(lines, step)
        assert sorted(trained) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        assert all(len(ids) == 2 for ids in trained.values())  # 2 prompts × n=2 over 2 ranks
        assert sorted(u for ids in trained.values() for u in ids) == sorted(r["uid"] for r in want)
    val_rows = [
        {
            "uid": f"{prefix}-p{p}-s0",
            "step": step,
            "input": ex.prompt,
            "output": ex.ground_truth,
            "gts": ex.ground_truth,
            "data_source": "arithmetic",
            "score": 1.0,
            "acc": True,
            "response_length": len(ex.ground_truth) + 1,
            "finish_reason": "stop",
        }
        for step, prefix in ((0, "step0-val"), (2, "step2-val"))
        for p, ex in enumerate(VAL)
    ]
    assert read_rows(tmp_path / "val" / "0.jsonl") == val_rows[:2]
    assert read_rows(tmp_path / "val" / "2.jsonl") == val_rows[2:]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]


def test_dynamic_sampling_rounds_and_remax_baselines_get_ids_of_their_own(tmp_path, caplog):
    # Round 0 (prompts 0-3) keeps its two odd sums (p0, p2); round 1 (prompts 4-7) adds its p0 and p3.
    caplog.set_level(TRACE, logger="rltrain")
    trainer = trainer_for(
        tmp_path, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", total_steps=1
    )
    assert trainer.fit() == 1
    rows = read_rows(tmp_path / "rollouts" / "1.jsonl")
    assert [r["uid"] for r in rows] == [
        "step1-p0-s0", "step1-p0-s1", "step1-p2-s0", "step1-p2-s1",
        "step1-r1-p0-s0", "step1-r1-p0-s1", "step1-r1-p3-s0", "step1-r1-p3-s1",
    ]  # fmt: skip
    assert [r["gts"] for r in rows[::2]] == ["3", "7", "9", "9"]
    assert [r["advantage"] for r in rows] == pytest.approx([GRPO_ADV, -GRPO_ADV] * 4, abs=1e-6)
    lines = trace_lines(caplog)
    rolled = [line.split(":")[0].split(" ")[1] for line in lines if line.startswith("rollout ")]
    assert rolled == [f"step1-{r}p{p}-s{s}" for r in ("", "r1-") for p in range(4) for s in range(2)]
    assert len([line for line in lines if line.startswith("reward ")]) == 16  # dropped groups too
    assert sorted(u for ids in trained_ids(lines, 1).values() for u in ids) == sorted(r["uid"] for r in rows)

    caplog.clear()
    trainer = trainer_for(tmp_path / "remax", "algorithm.adv_estimator=remax", total_steps=1)
    assert trainer.fit() == 1
    lines = trace_lines(caplog)
    greedy = [line for line in lines if line.startswith("rollout step1-greedy-")]
    assert greedy == [
        f"rollout step1-greedy-p{p}-s0: finish=stop length={len(ex.ground_truth) + 1}"
        for p, ex in enumerate(TRAIN[:4])
    ]
    # ReMax: the score minus the greedy response's (always right here: 1)
    want = expected_rows(1, TRAIN[:4], "step1", lambda scores, s: scores[s] - 1.0)
    same_rows(read_rows(tmp_path / "remax" / "rollouts" / "1.jsonl"), want)


def test_a_step_run_again_after_a_resume_replaces_its_dump(tmp_path):
    first = trainer_for(tmp_path, "trainer.save_freq=1", "trainer.val_before_train=false", total_steps=1)
    assert first.fit() == 1
    kept = tmp_path / "rollouts" / "1.jsonl"
    same_rows(read_rows(kept), expected_rows(1, TRAIN[:4], "step1", grpo))
    kept.write_text('{"uid": "step 1, not run again"}\n')
    stale = tmp_path / "rollouts" / "2.jsonl"
    stale.write_text('{"uid": "from a run that died in step 2"}\n')
    again = trainer_for(tmp_path, "trainer.save_freq=1", "trainer.val_before_train=false", total_steps=2)
    assert again.fit() == 2
    assert kept.read_text() == '{"uid": "step 1, not run again"}\n'  # resumed after step 1
    same_rows(read_rows(stale), expected_rows(2, TRAIN[4:], "step2", grpo))
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]


def test_log_samples_off_writes_no_sample_lines_but_keeps_the_dump(tmp_path, caplog):
    caplog.set_level(TRACE, logger="rltrain")  # as the run's logging sets it
    trainer = trainer_for(tmp_path, "trainer.log_samples=false", total_steps=1)
    trainer.fit()
    assert trace_lines(caplog) == []
    assert len(read_rows(tmp_path / "rollouts" / "1.jsonl")) == 4 * N
    # on again in a later trainer of the same process: the lines come back
    trainer_for(tmp_path / "again", total_steps=1).fit()
    assert any(line.startswith("rollout step1-p0-s0") for line in trace_lines(caplog))
