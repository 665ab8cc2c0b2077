"""Latency–bandwidth (α–β) model of a sharded-data-parallel training step (stdlib only).

The planner uses it to predict communication bytes, step time and tokens/s; the emulated-cluster
benchmark uses it to put predictions next to measurements. The model, per GPU and per
optimizer step of ``A`` micro-batches:

* FLOPs per token = 6·N + 12·L·h·s (PaLM appendix B: weights plus attention scores), ×4/3
  with activation checkpointing (one extra forward). Compute time = FLOPs / (peak · efficiency).
* Collectives are rings over node-contiguous ranks. For a group of ``n`` ranks with ``k`` per
  node and a full tensor of ``S`` bytes, each rank moves ``S·(n-1)/n`` (all-gather,
  reduce-scatter; twice that for all-reduce). When the group spans nodes, a flat ring crosses
  each node boundary with the whole ring volume, so a node's NIC carries ``S·(n-1)/n`` and one
  GPU's share is ``S·(n-1)/(n·k)``. The hierarchical all-gather first gathers among the ``N``
  ranks with the same local rank (a node's NIC carries ``S·(N-1)/N``), then inside the node.
* A collective takes max(intra bytes / NVLink bandwidth, node NIC bytes / network bandwidth)
  + α per ring step; stages of the hierarchical all-gather add up.
* Each FSDP unit (a block, plus the root) all-gathers parameters twice per micro-batch (forward,
  and backward after resharding) and reduce-scatters gradients once, inside the partition
  group. Replicas all-reduce their gradient shard once per optimizer step (MiCS's 2-hop sync).
  Parameters travel in the compute dtype, gradients are reduced in fp32.
* Step time = (A-1) · max(compute, micro comm) + max(compute, micro comm + boundary
  all-reduce): FSDP overlaps collectives with compute, and the replica all-reduce runs during
  the last micro-batch's backward, unit by unit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dtrain.core.flops import flops_per_token

GRAD_REDUCE_BYTES = 4
DEFAULT_EFFICIENCY = 0.5  # fraction of peak FLOP/s a well-tuned transformer step reaches


@dataclass(frozen=True)
class Cluster:
    """The hardware facts the model needs; bandwidths are one direction."""

    num_nodes: int
    gpus_per_node: int
    tflops_per_gpu: float  # peak, in the compute dtype
    intra_gbytes_per_s: float  # per GPU
    inter_gbits_per_s: float  # per node
    latency_s: float = 25e-6
    efficiency: float = DEFAULT_EFFICIENCY

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    num_parameters: int
    num_layers: int
    hidden_size: int
    seq_len: int
    micro_batch_size: int
    compute_bytes: int = 2  # bytes per parameter element in the all-gather (bf16 = 2)
    activation_checkpointing: bool = False


@dataclass
class Traffic:
    intra_bytes: float = 0.0  # per GPU
    inter_bytes: float = 0.0  # per GPU (a node's NIC carries gpus_per_node times this)
    seconds: float = 0.0
    calls: int = 0

    def add(self, other: Traffic, times: float = 1) -> None:
        self.intra_bytes += other.intra_bytes * times
        self.inter_bytes += other.inter_bytes * times
        self.seconds += other.seconds * times
        self.calls += int(other.calls * times)


@dataclass
class StepEstimate:
    strategy: str
    sharding_degree: int
    hierarchical: bool
    compute_s: float
    micro_comm: Traffic
    boundary_comm: Traffic
    step_s: float
    tokens_per_s: float
    intra_bytes: float
    inter_bytes: float

    def to_dict(self) -> dict:
        return asdict(self)


def group_layout(size: int, *, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes spanned, members per node) of a group of ``size`` ranks ``stride`` apart."""
    span = size * stride
    if span <= gpus_per_node:
        return 1, size
    per_node = max(1, gpus_per_node // stride)
    return max(1, size // per_node), per_node


def ring(size_bytes: float, *, ranks: int, nodes: int, per_node: int, cluster: Cluster,
         factor: float = 1.0) -> Traffic:
    """One ring collective; ``factor`` 2 for all-reduce (reduce-scatter + all-gather)."""
    if ranks <= 1:
        return Traffic()
    volume = factor * size_bytes * (ranks - 1) / ranks
    inter = volume / per_node if nodes > 1 else 0.0
    intra = volume - inter
    seconds = max(intra / (cluster.intra_gbytes_per_s * 1e9),
                  inter * cluster.gpus_per_node / (cluster.inter_gbits_per_s * 1e9 / 8))
    steps = factor * (ranks - 1)
    return Traffic(intra, inter, seconds + steps * cluster.latency_s, 1)


def hierarchical_allgather(size_bytes: float, *, ranks: int, nodes: int, per_node: int,
                           cluster: Cluster) -> Traffic:
    """Inter-node all-gather among same-local-rank peers, then intra-node all-gather."""
    if nodes <= 1:
        return ring(size_bytes, ranks=ranks, nodes=1, per_node=ranks, cluster=cluster)
    inter = size_bytes * (nodes - 1) / ranks
    intra = size_bytes * (per_node - 1) / per_node
    seconds = (inter * cluster.gpus_per_node / (cluster.inter_gbits_per_s * 1e9 / 8)
               + intra / (cluster.intra_gbytes_per_s * 1e9)
               + (nodes - 1 + per_node - 1) * cluster.latency_s)
    return Traffic(intra, inter, seconds, 2)


def compute_seconds(work: Workload, cluster: Cluster) -> float:
    """Seconds of one micro-batch's forward + backward on one GPU."""
    tokens = work.seq_len * work.micro_batch_size
    flops = tokens * flops_per_token(
        num_parameters=work.num_parameters, num_layers=work.num_layers,
        hidden_size=work.hidden_size, seq_len=work.seq_len,
        activation_checkpointing=work.activation_checkpointing)
    return flops / (cluster.tflops_per_gpu * 1e12 * cluster.efficiency)


def estimate_step(work: Workload, cluster: Cluster, *, sharding_degree: int,
                  accumulation: int = 1, hierarchical: bool = False) -> StepEstimate:
    """Predict one optimizer step of FSDP2/MiCS at ``sharding_degree``."""
    world = cluster.world_size
    degree = sharding_degree
    gpn = cluster.gpus_per_node
    units = work.num_layers + 1
    params = work.num_parameters * work.compute_bytes / units  # one unit's all-gather
    grads = work.num_parameters * GRAD_REDUCE_BYTES / units
    nodes, per_node = group_layout(degree, stride=1, gpus_per_node=gpn)
    shape = {"ranks": degree, "nodes": nodes, "per_node": per_node, "cluster": cluster}

    micro = Traffic()
    if degree > 1:
        gather = (hierarchical_allgather(params, **shape) if hierarchical and nodes > 1
                  else ring(params, **shape))
        micro.add(gather, 2 * units)
        micro.add(ring(grads, **shape), units)
    replicas = world // degree
    r_nodes, r_per_node = group_layout(replicas, stride=degree, gpus_per_node=gpn)
    boundary = Traffic()
    boundary.add(ring(grads / degree, ranks=replicas, nodes=r_nodes, per_node=r_per_node,
                      cluster=cluster, factor=2), units)

    compute = compute_seconds(work, cluster)
    step = (accumulation - 1) * max(compute, micro.seconds) + max(
        compute, micro.seconds + boundary.seconds)
    tokens = accumulation * work.seq_len * work.micro_batch_size * world
    strategy = "DDP" if degree == 1 else "ZeRO-3" if degree == world else "MiCS"
    return StepEstimate(
        strategy=strategy, sharding_degree=degree, hierarchical=hierarchical and nodes > 1,
        compute_s=accumulation * compute, micro_comm=micro, boundary_comm=boundary,
        step_s=step, tokens_per_s=tokens / step if step else 0.0,
        intra_bytes=accumulation * micro.intra_bytes + boundary.intra_bytes,
        inter_bytes=accumulation * micro.inter_bytes + boundary.inter_bytes,
    )
