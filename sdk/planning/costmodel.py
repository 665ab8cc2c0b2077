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
* Tensor parallelism over ``t`` ranks (inside a node) divides each rank's compute and its FSDP
  bytes by ``t`` (data-parallel groups are ``t`` ranks apart) and adds its own traffic, which sits
  between a layer's products and so adds to compute instead of overlapping it: in 1-D, four
  all-reduces of the layer's ``b·s·h`` activations per layer (forward and backward of attention
  and MLP; with sequence parallelism the same bytes as reduce-scatters and all-gathers), plus
  two for the embedding and the head; in 2-D (``q × q``), per linear layer ``in → out``, SUMMA's
  broadcasts and reduces of ``3·q`` activation blocks (``b·s·in/q²``) and ``3·q`` weight blocks
  (``in·out/q²``) over ``q`` ranks.
"""

from __future__ import annotations

import math
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
    vocab_size: int = 0  # the LM head's width (tensor-parallel traffic of the head)


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
    tensor_parallel: int = 1
    tp_bytes: float = 0.0  # of intra_bytes: tensor parallelism's, per device and step
    pipeline: int = 1  # pipeline ranks (dtrain.planning.pipeline estimates pp > 1)

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


def tensor_parallel_traffic(work: Workload, cluster: Cluster, *, tp: int,
                            mode: str = "1d") -> Traffic:
    """One device's tensor-parallel traffic for one micro-batch (module docstring)."""
    if tp <= 1:
        return Traffic()
    tokens = work.seq_len * work.micro_batch_size
    h, size = work.hidden_size, work.compute_bytes
    out = Traffic()
    if mode == "1d":
        one = ring(tokens * h * size, ranks=tp, nodes=1, per_node=tp, cluster=cluster, factor=2)
        out.add(one, 4 * work.num_layers + 2)
        return out
    q = math.isqrt(tp)
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)] * work.num_layers
    linears.append((h, work.vocab_size))
    for n_in, n_out in linears:
        volume = 3 * (q - 1) * (tokens * n_in + n_in * n_out) / q**2 * size
        calls = 6 * q
        out.add(Traffic(volume, 0.0, volume / (cluster.intra_gbytes_per_s * 1e9)
                        + calls * (q - 1) * cluster.latency_s, calls))
    return out


def estimate_step(work: Workload, cluster: Cluster, *, sharding_degree: int,
                  accumulation: int = 1, hierarchical: bool = False, tp: int = 1,
                  tp_mode: str = "1d") -> StepEstimate:
    """Predict one optimizer step of FSDP2/MiCS at ``sharding_degree`` over ``tp``-way
    tensor-parallel ranks."""
    world = cluster.world_size
    degree = sharding_degree
    gpn = cluster.gpus_per_node
    units = work.num_layers + 1
    params = work.num_parameters * work.compute_bytes / units / tp  # one unit's all-gather
    grads = work.num_parameters * GRAD_REDUCE_BYTES / units / tp
    nodes, per_node = group_layout(degree, stride=tp, gpus_per_node=gpn)
    shape = {"ranks": degree, "nodes": nodes, "per_node": per_node, "cluster": cluster}

    micro = Traffic()
    if degree > 1:
        gather = (hierarchical_allgather(params, **shape) if hierarchical and nodes > 1
                  else ring(params, **shape))
        micro.add(gather, 2 * units)
        micro.add(ring(grads, **shape), units)
    replicas = world // (degree * tp)
    r_nodes, r_per_node = group_layout(replicas, stride=degree * tp, gpus_per_node=gpn)
    boundary = Traffic()
    boundary.add(ring(grads / degree, ranks=replicas, nodes=r_nodes, per_node=r_per_node,
                      cluster=cluster, factor=2), units)

    tp_traffic = tensor_parallel_traffic(work, cluster, tp=tp, mode=tp_mode)
    compute = compute_seconds(work, cluster) / tp + tp_traffic.seconds
    step = (accumulation - 1) * max(compute, micro.seconds) + max(
        compute, micro.seconds + boundary.seconds)
    tokens = accumulation * work.seq_len * work.micro_batch_size * world // tp
    dp = world // tp
    strategy = "DDP" if degree == 1 else "ZeRO-3" if degree == dp else "MiCS"
    return StepEstimate(
        strategy=strategy, sharding_degree=degree, hierarchical=hierarchical and nodes > 1,
        compute_s=accumulation * compute, micro_comm=micro, boundary_comm=boundary,
        step_s=step, tokens_per_s=tokens / step if step else 0.0,
        intra_bytes=accumulation * (micro.intra_bytes + tp_traffic.intra_bytes)
        + boundary.intra_bytes,
        inter_bytes=accumulation * micro.inter_bytes + boundary.inter_bytes,
        tensor_parallel=tp, tp_bytes=accumulation * tp_traffic.intra_bytes,
    )
