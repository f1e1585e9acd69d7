"""The sync-plan arithmetic (``megatron_bridge.sync_plan``) against numbers derived by hand.

The model: 2 decoder layers, hidden 8, 2 heads and 2 KV heads of 4, MLP 16, vocabulary 256, untied,
bf16 (2 bytes). Elements: embedding and head 2048 each; a layer 8 + 64 × 4 (q, k, v, o) + 8 + 128 ×
3 (gate, up, down) = 656; final norm 8: 5416 in all, 40 of them in replicated norms.

Trainer TP 2 (GPUs 0 and 1, node 0 of 4 GPUs); two engines of TP 2 (replica 0 on GPUs 4, 5 and
replica 1 on GPUs 6, 7, both on node 1). An engine rank needs half of every split tensor and every
norm whole: (5416 − 40) / 2 + 40 = 2728 elements = 5456 bytes, all from the trainer rank of its own
TP index. Bandwidths (bytes/s): NVLink 1000, network 100, memcpy 10,000, 0.5 s a call.
"""

from __future__ import annotations

import pytest

from megatron_bridge import sync_plan as sp
from megatron_bridge import sync_time as st
from megatron_bridge.reshard import EngineLayout, ShardId, SliceCopy, TrainerLayout
from megatron_bridge.reshard_layouts import decoder_layouts

NEED = 5456
ALL = 5416 * 2
BW = st.Bandwidths(nvlink=1000.0, net=100.0, memcpy=10_000.0, latency=0.5)


def tiny() -> list:
    return decoder_layouts(
        num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4,
        intermediate_size=16, vocab_size=256, tie_word_embeddings=False,
    )  # fmt: skip


def placement(bucket_bytes: int = 1 << 20) -> sp.Placement:
    return sp.Placement(
        trainer=TrainerLayout(tp=2, num_layers=2),
        trainer_dp=1,
        engine=EngineLayout(tp=2),
        engine_replicas=2,
        gpus_per_node=4,
        bucket_bytes=bucket_bytes,
    )


def test_direct_fanout_sends_each_replica_its_copy_from_the_owner():
    plan = sp.shard_to_shard(tiny(), placement(), fanout="direct")
    assert plan.need == {4: NEED, 5: NEED, 6: NEED, 7: NEED}
    (phase,) = plan.phases
    for owner, dsts in ((0, (4, 6)), (1, (5, 7))):
        assert phase.gpus[owner].sent == {"nvlink": 0, "net": 2 * NEED}
        assert phase.gpus[owner].messages == 2
        for dst in dsts:
            assert phase.gpus[dst].received == {"nvlink": 0, "net": NEED}
            assert phase.gpus[dst].messages == 1
    assert phase.calls == 4
    # owner: 2 × 5456 B at 100 B/s, 2 calls, packs 2 × 5456 B at 10,000 B/s
    assert st.predicted_seconds(plan, BW) == pytest.approx(109.12 + 1.0 + 1.0912)
    assert st.lower_bound_seconds(plan, BW) == pytest.approx(54.56)
    # node 1 holds both replicas: it needs the two positions' 2 × 5456 B once, over its 4 GPUs'
    # links (2728 B each, 27.28 s); each GPU gets its other 2728 B over NVLink (2.728 s)
    assert st.node_floor_seconds(plan, placement(), BW) == pytest.approx(27.28)


def test_relay_fanout_forwards_within_the_engine_node():
    plan = sp.shard_to_shard(tiny(), placement(), fanout="relay")
    (phase,) = plan.phases
    assert phase.gpus[0].sent == {"nvlink": 0, "net": NEED}
    assert phase.gpus[4].received == {"nvlink": 0, "net": NEED}
    assert phase.gpus[4].sent == {"nvlink": NEED, "net": 0}
    assert phase.gpus[6].received == {"nvlink": NEED, "net": 0}
    assert phase.calls == 4
    # GPU 4: receives 54.56 s on the network (its NVLink send, 5.456 s, overlaps), 2 calls, unpacks
    # 5456 B; then the chain's fill: one message of 5456 B over NVLink
    assert st.predicted_seconds(plan, BW) == pytest.approx(54.56 + 1.0 + 0.5456 + 5.456)
    summary = st.summarize(plan)
    assert summary.max_sent == {"nvlink": NEED, "net": NEED}
    assert summary.total_sent == {"nvlink": 2 * NEED, "net": 2 * NEED}
    assert summary.max_extra == NEED  # one message, smaller than a bucket


def test_shard_to_engine_sends_each_replica_receiver_both_workers_slices():
    """What the shard_to_shard transport runs: owners send to each replica's receiver (GPUs 4 and
    6), which hands its second worker (GPUs 5, 7) that worker's 5456 B over NVLink."""
    plan = sp.shard_to_engine(tiny(), placement(), fanout="direct")
    assert plan.need == {4: NEED, 5: NEED, 6: NEED, 7: NEED}
    send, handoff = plan.phases
    for owner in (0, 1):
        assert send.gpus[owner].sent == {
            "nvlink": 0,
            "net": 2 * NEED,
        }  # its worker's slices, once per replica
    for receiver in (4, 6):
        assert send.gpus[receiver].received == {"nvlink": 0, "net": 2 * NEED}
        assert send.gpus[receiver].extra == 2 * NEED  # the whole model is smaller than two buckets
        assert handoff.gpus[receiver].sent == {"nvlink": NEED, "net": 0}
    assert handoff.gpus[5].received == handoff.gpus[7].received == {"nvlink": NEED, "net": 0}
    # send: an owner's 10,912 B on the network (109.12 s), 2 calls, packs 10,912 B (1.0912 s);
    # hand-off: the receiver sends 5456 B over NVLink (5.456 s), 1 call, unpacks both workers' 10,912 B
    assert st.predicted_seconds(plan, BW) == pytest.approx(109.12 + 1.0 + 1.0912 + 5.456 + 0.5 + 1.0912)


def test_shard_to_engine_relay_passes_each_message_on_receiver_to_receiver():
    plan = sp.shard_to_engine(tiny(), placement(), fanout="relay")
    send, _ = plan.phases
    for owner in (0, 1):
        assert send.gpus[owner].sent == {"nvlink": 0, "net": NEED}  # replica 0's copy only
    assert send.gpus[4].received == {"nvlink": 0, "net": 2 * NEED}
    assert send.gpus[4].sent == send.gpus[6].received == {"nvlink": 2 * NEED, "net": 0}
    assert send.pipeline_fill_bytes == 2 * NEED and send.pipeline_fill_link == "nvlink"
    # send: GPU 4 receives 10,912 B on the network (109.12 s; its NVLink send overlaps), 4 calls (2 in,
    # 2 out); the chain's fill: 10,912 B over NVLink (10.912 s); the hand-off as with direct fan-out
    assert st.predicted_seconds(plan, BW) == pytest.approx(109.12 + 2.0 + 10.912 + 5.456 + 0.5 + 1.0912)


def test_rank0_plan_phase_by_phase():
    plan = sp.rank0(tiny(), placement())
    gather, pack, broadcast, handoff = plan.phases
    # trainer rank 1 sends its halves of the 16 split tensors (2688 elements) to rank 0 over NVLink
    assert gather.gpus[1].sent == {"nvlink": 5376, "net": 0}
    assert gather.calls == 16
    assert st.phase_seconds(gather, BW) == pytest.approx(5.376 + 16 * 0.5)
    assert pack.gpus[0].packed == ALL
    assert pack.gpus[0].extra == 2 * ALL  # one bucket holds everything: gathered + packed
    # chain 0 -> 4 (network) -> 6 (NVLink); 3 calls for the one bucket and the end marker
    assert broadcast.gpus[0].sent == {"nvlink": 0, "net": ALL}
    assert broadcast.gpus[4].received == {"nvlink": 0, "net": ALL}
    assert broadcast.gpus[4].sent == {"nvlink": ALL, "net": 0}
    assert broadcast.calls == 4
    assert st.phase_seconds(broadcast, BW) == pytest.approx(108.32 + 4 * 0.5)
    # each receiver hands its TP peer 5456 B and unpacks both workers' regions
    assert handoff.gpus[4].sent == {"nvlink": NEED, "net": 0}
    assert handoff.gpus[4].packed == 2 * NEED
    assert st.phase_seconds(handoff, BW) == pytest.approx(5.456 + 0.5 + 1.0912)
    assert st.predicted_seconds(plan, BW) == pytest.approx(13.376 + 1.0832 + 110.32 + 7.0472)
    summary = st.summarize(plan)
    assert summary.calls == 16 + 4 + 2
    assert (summary.max_extra, summary.max_extra_gpu) == (2 * ALL, 0)


def test_messages_pack_slices_per_destination_into_buckets():
    plan = sp.shard_to_shard(tiny(), placement(bucket_bytes=1000), fanout="direct")
    # 5456 B to each destination in messages of at most 1000 B; the largest slice (a vocab half,
    # 2048 B) is a message of its own size: ceil(5456 / 2048) = 3 messages per pair
    assert plan.phases[0].calls == 4 * 3


def test_engine_pipeline_stages_follow_vllm():
    assert sp.engine_stage_layers(61, 2) == [range(0, 31), range(31, 61)]
    assert sp.engine_stage_layers(5, 4) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]
    place = placement()
    place = sp.Placement(
        trainer=place.trainer, trainer_dp=1, engine=EngineLayout(tp=1), engine_pp=2, gpus_per_node=4
    )
    plan = sp.shard_to_shard(tiny(), place, fanout="direct")
    # stage 0 (GPU 4): embedding 2048 + layer 0's 656; stage 1 (GPU 5): layer 1, norm and head
    assert plan.need == {4: (2048 + 656) * 2, 5: (656 + 8 + 2048) * 2}


def test_owner_of_expert_and_dense_shards():
    place = sp.Placement(
        trainer=TrainerLayout(tp=2, pp=2, ep=2, etp=1, num_layers=2, num_experts=4), trainer_dp=2,
        engine=EngineLayout(tp=1),
    )  # fmt: skip
    copy = SliceCopy("x", ShardId(pp=1, tp=1, ep=1), (), ())
    assert place.owner(copy, expert=False) == 4 + 1  # stage 1 starts at GPU 4; TP rank 1
    assert place.owner(copy, expert=True) == 4 + 1 * 1 + 1  # EP rank 1 × expert TP 1, + expert-TP rank 1
    assert place.engine_base == 8
