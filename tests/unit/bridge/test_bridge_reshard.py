"""Reshard planner coverage: every element of every engine rank's target region is covered exactly
once, and copying through the plan (assembled by the engine-side ``TensorRegions.full``) reproduces
the full tensor there. The reference shards are written here
independently (torch.chunk on padded tensors, vLLM's KV-head replication rule)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_bridge.reshard import (
    EngineLayout,
    ShardId,
    SliceCopy,
    TensorLayout,
    TrainerLayout,
    plan_weight_sync,
)
from megatron_bridge.reshard_layouts import decoder_layouts
from rltrain.weight_sync.types import TensorRegions

DIM = {"column": 0, "kv_heads": 0, "vocab": 0, "row": 1}


def model(num_kv_heads: int = 8, num_experts: int = 0) -> list[TensorLayout]:
    return decoder_layouts(
        num_layers=4, hidden_size=32, num_heads=8, num_kv_heads=num_kv_heads, head_dim=4,
        intermediate_size=64, vocab_size=1000, tie_word_embeddings=False, num_experts=num_experts,
    )  # fmt: skip


def full_tensor(t: TensorLayout) -> torch.Tensor:
    n = 1
    for s in t.shape:
        n *= s
    return torch.arange(n, dtype=torch.float64).reshape(t.shape) + 1.0  # no zeros: a hole shows


def reference_piece(t: TensorLayout, trainer: TrainerLayout, shard: ShardId) -> torch.Tensor:
    """The trainer shard's local piece, derived with torch.chunk over Megatron's padded tensor."""
    full = full_tensor(t)
    if trainer.first_stage_layers is None and trainer.last_stage_layers is None:
        stage_of = [i // (trainer.num_layers // trainer.pp) for i in range(trainer.num_layers)]
    else:  # uneven, written out by hand for the cases below: first, then the middle stages, then last
        first = trainer.first_stage_layers or 0
        last = trainer.last_stage_layers or 0
        middle_stages = trainer.pp - (first > 0) - (last > 0)
        per_middle = (trainer.num_layers - first - last) // middle_stages if middle_stages else 0
        stage_of = [0] * first if first else []
        for s in range(middle_stages):
            stage_of += [s + (first > 0)] * per_middle
        stage_of += [trainer.pp - 1] * last
    stage = (trainer.pp - 1 if t.last_stage else 0) if t.layer is None else stage_of[t.layer]
    assert shard.pp == stage, f"{t.hf_name} read from stage {shard.pp}, it lives on {stage}"
    if t.stacked:  # EP rank k holds its block of experts, each split over expert-TP
        block = full.chunk(trainer.ep, dim=0)[shard.ep]
        if t.split == "replicated":
            return block
        return block.chunk(trainer.etp or trainer.tp, dim=t.dim)[shard.tp]
    if t.expert is not None:
        assert shard.ep == t.expert // (trainer.num_experts // trainer.ep), f"{t.hf_name} wrong EP rank"
    if t.split == "replicated":
        return full
    parts = (trainer.etp or trainer.tp) if t.expert is not None else trainer.tp
    dim = DIM[t.split]
    if t.split == "vocab":
        multiple = trainer.vocab_pad_multiple * parts
        pad = -(-t.shape[0] // multiple) * multiple - t.shape[0]
        padded = torch.cat([full, torch.full((pad, *t.shape[1:]), float("nan"))])
        piece = padded.chunk(parts, dim=0)[shard.tp]
        return piece[~piece[:, 0].isnan()]
    return full.chunk(parts, dim=dim)[shard.tp]


def reference_need(t: TensorLayout, engine: EngineLayout, rank: int, num_experts: int) -> torch.Tensor:
    """Bool mask of the full tensor that engine rank ``rank``'s loader reads (vLLM's sharding rules)."""
    mask = torch.zeros(t.shape, dtype=torch.bool)
    if t.stacked:  # vLLM's GPT-OSS loader: its block of whole experts, or every expert's TP slice
        if engine.ep > 1:
            per = num_experts // engine.ep
            mask[rank * per : (rank + 1) * per] = True
        elif t.split == "replicated":
            mask[...] = True
        else:
            index = torch.arange(t.shape[t.dim]).chunk(engine.tp)[rank]
            mask.narrow(t.dim, int(index[0]), len(index)).fill_(True)
        return mask
    if t.expert is not None and engine.ep > 1:
        if t.expert // (num_experts // engine.ep) == rank:
            mask[...] = True
        return mask
    # vLLM 0.32's DeepSeek-V2/V3 builds fused_qkv_a_proj (these two) with disable_tp=True: whole
    if t.split == "replicated" or t.hf_name.rsplit(".", 2)[-2] in ("q_a_proj", "kv_a_proj_with_mqa"):
        mask[...] = True
        return mask
    dim = DIM[t.split]
    size = t.shape[dim]
    if t.split == "kv_heads" and engine.tp > size // t.head_dim:
        head = rank // (engine.tp // (size // t.head_dim))
        mask[head * t.head_dim : (head + 1) * t.head_dim] = True
        return mask
    if t.split == "vocab":
        padded = -(-size // engine.vocab_pad_multiple) * engine.vocab_pad_multiple
        per = padded // engine.tp
        mask[rank * per : min((rank + 1) * per, size)] = True
        return mask
    index = torch.arange(size).chunk(engine.tp)[rank]
    mask.narrow(dim, int(index[0]), len(index)).fill_(True)
    return mask


def assemble(copies: list[SliceCopy], shapes: dict, fetch) -> dict[str, torch.Tensor]:
    """Each tensor of one engine rank as the engine builds it from its planned regions."""
    updates: dict[str, TensorRegions] = {}
    for c in copies:
        update = updates.setdefault(c.hf_name, TensorRegions(c.hf_name, shapes[c.hf_name], {0: []}))
        update.regions[0].append((c.dst, fetch(c)))
    return {name: update.full(0) for name, update in updates.items()}


def check_plan(tensors: list[TensorLayout], trainer: TrainerLayout, engine: EngineLayout) -> None:
    plan = plan_weight_sync(tensors, trainer, engine)
    assert sorted(plan) == list(range(engine.tp))
    shapes = {t.hf_name: t.shape for t in tensors}
    by_name = {t.hf_name: t for t in tensors}
    for rank, copies in plan.items():
        assembled = assemble(
            copies, shapes, lambda c: reference_piece(by_name[c.hf_name], trainer, c.source)[c.src]
        )
        for t in tensors:
            need = reference_need(t, engine, rank, trainer.num_experts)
            counts = torch.zeros(t.shape, dtype=torch.int32)
            for c in copies:
                if c.hf_name == t.hf_name:
                    counts[c.dst] += 1
            assert torch.equal(counts, need.int()), f"rank {rank} {t.hf_name}: coverage is not exactly once"
            if need.any():
                assert torch.equal(assembled[t.hf_name][need], full_tensor(t)[need]), (
                    f"rank {rank} {t.hf_name}"
                )
            else:
                assert t.hf_name not in assembled


@pytest.mark.parametrize(("trainer_tp", "engine_tp"), list(itertools.product([1, 2, 4, 8], repeat=2)))
def test_dense_tp_to_tp(trainer_tp, engine_tp):
    check_plan(model(), TrainerLayout(tp=trainer_tp, num_layers=4), EngineLayout(tp=engine_tp))


@pytest.mark.parametrize(("trainer_tp", "pp", "engine_tp"), [(1, 2, 4), (2, 2, 1), (2, 4, 8), (4, 2, 2)])
def test_dense_with_pipeline_stages(trainer_tp, pp, engine_tp):
    check_plan(model(), TrainerLayout(tp=trainer_tp, pp=pp, num_layers=4), EngineLayout(tp=engine_tp))


@pytest.mark.parametrize(
    ("pp", "first", "last", "engine_tp"), [(2, 1, 3, 2), (2, 3, None, 1), (3, None, 2, 2), (3, 1, 1, 4)]
)
def test_uneven_pipeline_stages(pp, first, last, engine_tp):
    trainer = TrainerLayout(tp=2, pp=pp, num_layers=4, first_stage_layers=first, last_stage_layers=last)
    check_plan(model(), trainer, EngineLayout(tp=engine_tp))
    stages = {c.source.pp for cs in plan_weight_sync(model(), trainer, EngineLayout(tp=1)).values() for c in cs
              if c.hf_name == "model.layers.1.mlp.down_proj.weight"}  # fmt: skip
    assert stages == {0 if (first or 0) >= 2 else 1}


@pytest.mark.parametrize(("trainer_tp", "engine_tp"), [(1, 4), (2, 4), (2, 8), (1, 8)])
def test_engine_replicates_kv_heads_beyond_their_count(trainer_tp, engine_tp):
    check_plan(model(num_kv_heads=2), TrainerLayout(tp=trainer_tp, num_layers=4), EngineLayout(tp=engine_tp))


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "pp", "engine_tp", "engine_ep"),
    [
        (1, 2, None, 1, 1, 1),  # EP=2 trainer → single-rank engine
        (2, 2, 1, 1, 2, 1),  # EP=2, expert-TP=1 → experts TP-split in the engine
        (2, 2, 2, 1, 4, 4),  # EP×expert-TP → expert-parallel engine
        (1, 4, None, 2, 2, 2),
        (4, 2, 2, 1, 8, 1),
        (2, 4, 1, 2, 4, 4),
    ],
)
def test_moe_expert_parallel_layouts(tp, ep, etp, pp, engine_tp, engine_ep):
    trainer = TrainerLayout(tp=tp, pp=pp, ep=ep, etp=etp, num_layers=4, num_experts=8)
    check_plan(model(num_experts=8), trainer, EngineLayout(tp=engine_tp, ep=engine_ep))


def test_replicated_reads_spread_over_trainer_ranks():
    plan = plan_weight_sync(model(), TrainerLayout(tp=4, num_layers=4), EngineLayout(tp=4))
    sources = {r: {c.source.tp for c in cs if c.hf_name == "model.norm.weight"} for r, cs in plan.items()}
    assert sources == {0: {0}, 1: {1}, 2: {2}, 3: {3}}


def test_errors_name_the_tensor_and_layout():
    with pytest.raises(ValueError, match=r"embed_tokens.*padded vocab 1024 does not split over engine tp=3"):
        plan_weight_sync(model(), TrainerLayout(num_layers=4), EngineLayout(tp=3))
    with pytest.raises(ValueError, match="engine ep=2 must be 1 or equal to engine tp=4"):
        plan_weight_sync(model(), TrainerLayout(num_layers=4), EngineLayout(tp=4, ep=2))


def _bridge_layouts(model_type: str, tmp_path):
    """Layouts from the bridge's table and the shapes of a saved HF checkpoint (its on-disk names)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from megatron_bridge.bridge import Bridge
    from megatron_bridge.reshard_layouts import layouts_from_bridge
    from rltrain.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / model_type, model_type)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    config = AutoConfig.from_pretrained(path)
    layouts = layouts_from_bridge(Bridge.from_hf_config(config), shapes)
    assert {t.hf_name for t in layouts} == set(shapes)  # every checkpoint tensor, nothing else
    return layouts, config


def test_bridge_tables_give_the_same_layouts_as_the_hand_description(tmp_path):
    layouts, cfg = _bridge_layouts("llama", tmp_path)
    hand = decoder_layouts(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, tie_word_embeddings=False,
    )  # fmt: skip
    assert sorted(layouts, key=lambda t: t.hf_name) == sorted(hand, key=lambda t: t.hf_name)


@pytest.mark.parametrize(("tp", "ep", "engine_tp", "engine_ep"), [(1, 2, 1, 1), (2, 2, 2, 2), (1, 4, 2, 1)])
def test_bridge_layouts_of_a_moe_model_plan_exactly_once(tp, ep, engine_tp, engine_ep, tmp_path):
    layouts, cfg = _bridge_layouts("mixtral", tmp_path)
    experts = {t.expert for t in layouts if t.expert is not None}
    assert experts == set(range(cfg.num_local_experts))
    assert {t.split for t in layouts if "block_sparse_moe.gate" in t.hf_name} == {"replicated"}
    trainer = TrainerLayout(tp=tp, ep=ep, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts)
    check_plan(layouts, trainer, EngineLayout(tp=engine_tp, ep=engine_ep))


@pytest.mark.parametrize(("tp", "ep", "engine_tp"), [(2, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 4)])
def test_bridge_layouts_of_deepseek_v3_give_vllm_its_whole_mla_down_projections(tp, ep, engine_tp, tmp_path):
    """Megatron splits MLA's query/KV down projections over TP; vLLM keeps them whole on every rank
    (a TP=2 engine got half of each and generated NaN before ``engine_replicated``)."""
    layouts, cfg = _bridge_layouts("deepseek_v3", tmp_path)
    down = [t for t in layouts if t.hf_name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight"))]
    assert len(down) == 2 * cfg.num_hidden_layers
    assert {(t.split, t.engine_replicated) for t in down} == {("column", True)}
    assert not any(t.engine_replicated for t in layouts if t not in down)
    trainer = TrainerLayout(tp=tp, ep=ep, num_layers=cfg.num_hidden_layers, num_experts=cfg.n_routed_experts)
    check_plan(layouts, trainer, EngineLayout(tp=engine_tp))


def stacked_experts_layer(num_experts: int = 8, hidden: int = 16, ffn: int = 32) -> list[TensorLayout]:
    """GPT-OSS's stacked expert tensors of one layer, as vLLM's loader reads them (hand-written)."""
    p = "model.layers.0.mlp.experts."
    return [
        TensorLayout(
            p + "gate_up_proj", (num_experts, hidden, 2 * ffn), "column", layer=0, stacked=True, dim=2
        ),
        TensorLayout(p + "gate_up_proj_bias", (num_experts, 2 * ffn), "column", layer=0, stacked=True, dim=1),
        TensorLayout(p + "down_proj", (num_experts, ffn, hidden), "column", layer=0, stacked=True, dim=1),
        TensorLayout(p + "down_proj_bias", (num_experts, hidden), "replicated", layer=0, stacked=True),
    ]


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "engine_tp", "engine_ep"),
    [
        (1, 1, None, 1, 1),
        (1, 2, None, 1, 1),  # EP=2 trainer → one engine rank reads both blocks
        (2, 2, 1, 2, 1),  # EP=2, expert-TP=1 → every expert TP-split in the engine
        (1, 4, None, 2, 2),  # EP=4 → expert-parallel engine: two trainer blocks per engine rank
        (2, 2, 2, 4, 1),  # expert-TP=2 pieces → engine TP=4 slices
        (4, 1, 4, 2, 2),
        (2, 4, 1, 4, 4),
        (1, 8, None, 8, 1),
    ],
)
def test_stacked_experts_plan_exactly_once(tp, ep, etp, engine_tp, engine_ep):
    """GPT-OSS's one-tensor-per-layer experts: every engine rank's experts and TP slice, each element
    from the one trainer rank holding it, and nothing else."""
    trainer = TrainerLayout(tp=tp, ep=ep, etp=etp, num_layers=1, num_experts=8)
    check_plan(stacked_experts_layer(), trainer, EngineLayout(tp=engine_tp, ep=engine_ep))


def test_stacked_experts_read_only_the_trainer_blocks_they_need():
    """An expert-parallel engine rank reads its own block only: with trainer EP=2 and engine EP=2 the
    copies of rank r all come from trainer EP rank r, whole experts in one copy per tensor."""
    trainer = TrainerLayout(ep=2, num_layers=1, num_experts=8)
    plan = plan_weight_sync(stacked_experts_layer(), trainer, EngineLayout(tp=2, ep=2))
    for rank, copies in plan.items():
        assert len(copies) == 4 and {c.source.ep for c in copies} == {rank}
        assert all(c.dst[0] == slice(4 * rank, 4 * rank + 4) for c in copies)


def test_stacked_experts_errors_name_the_tensor():
    trainer = TrainerLayout(ep=2, num_layers=1, num_experts=4)
    with pytest.raises(ValueError, match=r"experts.gate_up_proj: 8 stacked experts, the trainer has 4"):
        plan_weight_sync(stacked_experts_layer(), trainer, EngineLayout())
    with pytest.raises(
        ValueError, match=r"experts.gate_up_proj: dim 2 of size 64 does not split over engine tp=3"
    ):
        plan_weight_sync(
            stacked_experts_layer(), TrainerLayout(num_layers=1, num_experts=8), EngineLayout(tp=3)
        )


@pytest.mark.parametrize(
    ("tp", "ep", "engine_tp", "engine_ep"), [(1, 2, 1, 1), (2, 2, 2, 1), (1, 4, 2, 2), (2, 1, 4, 4)]
)
def test_bridge_layouts_of_gpt_oss_stack_the_experts(tp, ep, engine_tp, engine_ep, tmp_path):
    """The GPT-OSS table's stacked tensors get the splits vLLM's loader narrows: gate_up_proj and its
    bias along the interleaved columns, down_proj along its rows, down_proj_bias whole."""
    layouts, cfg = _bridge_layouts("gpt_oss", tmp_path)
    stacked = {t.hf_name.rsplit(".", 1)[-1]: (t.split, t.dim) for t in layouts if t.stacked}
    assert stacked == {
        "gate_up_proj": ("column", 2),
        "gate_up_proj_bias": ("column", 1),
        "down_proj": ("column", 1),
        "down_proj_bias": ("replicated", None),
    }
    assert all(t.expert is None for t in layouts)
    trainer = TrainerLayout(
        tp=tp, ep=ep, etp=1, num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts
    )
    check_plan(layouts, trainer, EngineLayout(tp=engine_tp, ep=engine_ep))


def test_a_fused_gate_up_hf_tensor_is_refused_naming_it():
    """No family ships one, but an HF ``gate_up_proj = [gate; up]`` would give each TP rank two blocks
    that vLLM narrows half by half: the planner refuses it in one line."""
    from megatron_bridge.mappings import FusedGatedMLP
    from megatron_bridge.reshard_layouts import _kinds

    with pytest.raises(NotImplementedError) as err:
        _kinds(FusedGatedMLP("decoder.layers.*.mlp.linear_fc1.weight", "model.layers.*.mlp.gate_up_proj"), 1)
    (line,) = err.value.args
    assert line.startswith("FusedGatedMLP (model.layers.*.mlp.gate_up_proj): ") and "\n" not in line
