#!/usr/bin/env bash
# Example: Qwen1.5-MoE-A2.7B with GRPO, expert parallelism 4 × tensor parallelism 2, on two 8-GPU
# nodes. Checkpoints go to a shared filesystem so that every node writes its shards there.
#
#   bash tools/slurm/moe_ep_2nodes.sh /shared/checkpoints
set -euo pipefail
SHARED=${1:?usage: $0 SHARED_CHECKPOINT_DIR}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}   # the inter-node interface
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}                   # keep InfiniBand when present
exec sbatch --nodes=2 --gpus-per-node=8 --cpus-per-task=64 --time=24:00:00 \
  "$(dirname "$0")/ray_cluster.sbatch" recipes/gpu/qwen1.5_moe_a2.7b_gsm8k_grpo_ep.yaml \
  "trainer.default_local_dir=$SHARED" \
  actor.parallel.expert_model_parallel_size=4 actor.parallel.tensor_model_parallel_size=2
