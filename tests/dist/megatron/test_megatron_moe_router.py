"""MoE router statistics and the aux-loss-free expert bias against hand computations.

One update of a tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2, aux loss 0.01, z-loss 1e-3) on one
rank and at EP=2 (same weights, same tokens). The test captures every training router forward's
input and computes, from the router's weight, the logits itself; from them: the tokens per expert of
the top-k (with the expert bias: top-k of sigmoid + bias), Megatron-Core's load-balancing loss
E/(k·T²)·Σ_i P_i·f_i and z-loss mean(logsumexp²) per micro-batch, and the router entropy. The
expert bias must move by rate × sign(mean load − load) over the loads of all ranks.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from megatron_fixtures import tiny_llama
from moe_cases import BIAS_UPDATE_RATE, hand_made_loads, router_update_case

from rltrain.config.moe import MoEConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.model_config import transformer_config_from_hf

pytestmark = pytest.mark.dist
TOP_K = 2
NUM_EXPERTS = 4


def _expected(ranks: list[dict], *, sigmoid: bool) -> dict[str, torch.Tensor]:
    """Per layer [2]: hand-computed tokens per expert [2, E] and the loss / entropy means."""
    out: dict[str, list] = {"counts": [], "aux_loss": [], "z_loss": [], "router_entropy": []}
    for layer in (1, 2):
        bias = ranks[0]["bias_before"].get(layer)
        bias = None if bias is None else torch.tensor(bias, dtype=torch.float64)
        counts = torch.zeros(NUM_EXPERTS, dtype=torch.float64)
        aux, z, entropy, tokens = [], [], 0.0, 0
        for rank in ranks:
            for logits in map(torch.tensor, rank["logits"][layer]):
                scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
                ranked = scores + bias if bias is not None else logits
                counts += torch.bincount(ranked.topk(TOP_K, -1).indices.flatten(), minlength=NUM_EXPERTS)
                p = scores / scores.sum(-1, keepdim=True)
                f = torch.bincount(p.topk(TOP_K, -1).indices.flatten(), minlength=NUM_EXPERTS)
                num_tokens = logits.shape[0]
                aux.append(NUM_EXPERTS / (TOP_K * num_tokens**2) * (p.sum(0) * f).sum())
                z.append((torch.logsumexp(logits, -1) ** 2).mean())
                entropy += float(-(p * p.log()).sum())
                tokens += num_tokens
        out["counts"].append(counts)
        out["aux_loss"].append(torch.stack(aux).mean())
        out["z_loss"].append(torch.stack(z).mean())
        out["router_entropy"].append(torch.tensor(entropy / tokens))
    return {k: torch.stack(v) for k, v in out.items()}


def _check_metrics(metrics: dict[str, float], expected: dict[str, torch.Tensor], label: str) -> None:
    counts = expected["counts"]
    balance = counts.max(-1).values / counts.mean(-1)
    print(f"{label}: tokens per expert {counts.tolist()}, metrics {metrics}")
    for i, layer in enumerate((1, 2)):
        assert metrics[f"moe/layer_{layer}/tokens_per_expert_max"] == float(counts[i].max()), label
        assert metrics[f"moe/layer_{layer}/tokens_per_expert_min"] == float(counts[i].min()), label
        assert metrics[f"moe/layer_{layer}/load_max_over_mean"] == pytest.approx(float(balance[i]), abs=1e-12)
        for name in ("aux_loss", "z_loss", "router_entropy"):
            want = float(expected[name][i])
            assert metrics[f"moe/layer_{layer}/{name}"] == pytest.approx(want, rel=1e-5), (label, name)
    assert metrics["moe/load_max_over_mean"] == pytest.approx(float(balance.mean()), abs=1e-12)
    for name in ("aux_loss", "z_loss", "router_entropy"):
        assert metrics[f"moe/{name}"] == pytest.approx(float(expected[name].mean()), rel=1e-5), (label, name)


def _run_both(tmp_path, expert_bias: bool) -> tuple[list[dict], list[dict]]:
    single = run_ranks(router_update_case, 1, str(tmp_path), expert_bias)
    ep2 = run_ranks(router_update_case, 2, str(tmp_path), expert_bias)
    for rank in ep2[1:]:
        assert rank["metrics"] == ep2[0]["metrics"], "ranks report different MoE metrics"
    return single, ep2


def test_router_metrics_equal_hand_counts_and_megatron_losses_at_ep2_and_one_rank(tmp_path) -> None:
    single, ep2 = _run_both(tmp_path, expert_bias=False)
    for label, ranks in (("one rank", single), ("EP=2", ep2)):
        _check_metrics(ranks[0]["metrics"], _expected(ranks, sigmoid=False), label)
    for key, value in single[0]["metrics"].items():
        assert ep2[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-12), key


@pytest.mark.parametrize("layout", ["pp", "tp_sp"])
def test_router_metrics_at_pp2_and_tp2_equal_one_rank(tmp_path, layout: str) -> None:
    """Each layer on its own stage (summed over PP); TP ranks with their own sequence shards
    (sequence parallelism, which Megatron-Core requires for MoE with TP: summed over TP). Rows of
    even length: SP pads a packed micro-batch to a multiple of TP, and the routers count padding."""
    single = run_ranks(router_update_case, 1, str(tmp_path), False, "ep", True)[0]["metrics"]
    ranks = run_ranks(router_update_case, 2, str(tmp_path), False, layout, True)
    print(f"one rank: {single}\n{layout}=2: {ranks[0]['metrics']}")
    for rank in ranks:
        assert rank["metrics"].keys() == single.keys()
        for key, value in single.items():
            assert rank["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-12), key


def test_expert_bias_moves_by_megatron_rule_in_a_train_step_at_ep2_and_is_checkpointed(tmp_path) -> None:
    single, ep2 = _run_both(tmp_path, expert_bias=True)
    for key, value in single[0]["metrics"].items():
        assert ep2[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-12), key
    for label, ranks in (("one rank", single), ("EP=2", ep2)):
        expected = _expected(ranks, sigmoid=True)
        _check_metrics(ranks[0]["metrics"], expected, label)
        for i, layer in enumerate((1, 2)):
            counts = expected["counts"][i]
            want = (
                torch.tensor(ranks[0]["bias_before"][layer])
                + BIAS_UPDATE_RATE * torch.sign(counts.mean() - counts).float()
            )
            print(f"{label} layer {layer}: loads {counts.tolist()} bias {ranks[0]['bias_after'][layer]}")
            assert counts.mean() not in counts, "a load equal to the mean leaves the bias: pick other tokens"
            for rank in ranks:
                torch.testing.assert_close(torch.tensor(rank["bias_after"][layer]), want, rtol=0, atol=1e-7)
        largest = max(abs(b) for bias in ranks[0]["bias_after"].values() for b in bias)
        assert ranks[0]["metrics"]["moe/expert_bias_abs_max"] == largest
        # Hand-made loads, then rltrain's grad-finalize hook: the loads of all ranks are summed.
        for layer in (1, 2):
            loads = sum(hand_made_loads(r, layer) for r in range(len(ranks)))
            step = BIAS_UPDATE_RATE * torch.sign(loads.mean() - loads)
            print(f"{label} layer {layer}: hand-made loads {loads.tolist()} -> step {step.tolist()}")
            for rank in ranks:
                after, before = (
                    torch.tensor(rank["hand_after"][layer]),
                    torch.tensor(rank["hand_before"][layer]),
                )
                torch.testing.assert_close(after, before + step)
                assert rank["loaded"][layer] == rank["hand_after"][layer], "bias not checkpointed"
    _check_conversion_refuses(tmp_path / "after")


def _check_conversion_refuses(root) -> None:
    """The checkpoint records the trained routing, and ``rltrain convert`` refuses to put it into a
    Qwen3-MoE HF model (softmax, no bias), which would route differently."""
    from moe_cases import tiny_qwen3_moe

    from rltrain.convert.inputs import check_inputs
    from rltrain.convert.report import ConversionError
    from rltrain.megatron.checkpoint import saved_routing

    assert saved_routing(root / "step_1") == {"score_function": "sigmoid", "expert_bias": True}
    tiny_qwen3_moe().save_pretrained(root / "hf")
    with pytest.raises(ConversionError) as refused:
        check_inputs(
            "mcore-to-hf", root, root.parent / "hf_out", hf_config_dir=None, tp=1, pp=1, ep=1, overwrite=False
        )
    message = str(refused.value)
    assert message.startswith(
        f"{root / 'step_1'}: its routers were trained with model.moe.moe_router_score_function: sigmoid, "
        "model.moe.moe_router_enable_expert_bias: true (it holds decoder.layers.mlp.router.expert_bias), "
        "but the qwen3_moe model of"
    ), message


def test_router_options_errors_name_the_key() -> None:
    problems = MoEConfig(moe_router_enable_expert_bias=True).validate("model.moe")
    assert problems == [
        "model.moe.moe_router_enable_expert_bias needs model.moe.moe_router_score_function: sigmoid (got None)"
    ]
    with pytest.raises(ValueError, match=r"^model.moe.moe_z_loss_coeff is set but llama has no experts$"):
        transformer_config_from_hf(
            tiny_llama(), parallel=ParallelConfig(), params_dtype=torch.float32,
            moe_options=MoEConfig(moe_z_loss_coeff=1e-3),
        )  # fmt: skip
