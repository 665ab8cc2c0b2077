"""Latency–bandwidth (α–β) model of a sharded-data-parallel training step (stdlib only).

The planner uses it to predict communication bytes, what of that communication the step cannot
hide behind compute (*exposed*), step time and tokens/s; the emulated-cluster benchmark puts its
predictions next to measurements. Per GPU and per optimizer step of ``A`` micro-batches:

* FLOPs per token = 6·N + 12·L·h·s (PaLM appendix B: weights plus attention scores), ×4/3
  with activation checkpointing (one extra forward). Compute time = FLOPs / (peak · efficiency);
  a third of it is forward, two thirds backward, split evenly over the ``U = L + 1`` FSDP units
  (each block, plus the root).
* Collectives are rings over node-contiguous ranks. For a group of ``n`` ranks with ``k`` per
  node and a full tensor of ``S`` bytes, each rank moves ``S·(n-1)/n`` (all-gather,
  reduce-scatter; twice that for all-reduce). On gloo a partition group reduce-scatters with
  dtrain's all-to-all where that moves less than gloo's own, which runs as an all-reduce
  (:func:`dtrain.core.collective_choices.gloo_reduce_scatter_factor`).
  When the group spans nodes, a flat ring crosses each node boundary with the whole ring volume,
  so a node's NIC carries ``S·(n-1)/n`` and one GPU's share is ``S·(n-1)/(n·k)``. The
  hierarchical all-gather first gathers among the ``N`` ranks with the same local rank (a node's
  NIC carries ``S·(N-1)/N``), then inside the node. A collective takes max(intra bytes / NVLink
  bandwidth, node NIC bytes / network bandwidth) + α per ring step.
* Each unit all-gathers its parameters twice per micro-batch (forward, and backward after
  resharding) and reduce-scatters its gradients once, inside the partition group; once per
  optimizer step the replicas all-reduce their gradient shard (MiCS's 2-hop sync).
* **What overlaps** (:func:`step_timeline`). With NCCL, FSDP2 runs collectives on side streams:
  in forward the next unit's all-gather hides behind this unit's compute, in backward the next
  unit's all-gather and the previous unit's reduce-scatter (and, with ``gradient_sync: fsdp``,
  its replica all-reduce) hide behind this unit's backward; what does not fit in a unit's
  compute is exposed, and so are the first all-gather and the last unit's reductions, which have
  no compute to hide behind. With gloo (CPU), FSDP2's collectives block the rank, so all of
  them are exposed. With ``gradient_sync: overlapped`` the replica all-reduce leaves the units'
  critical path: a background communicator sends the shards as units finish backward, and only
  what is still in flight when backward ends is exposed (at least the last unit's share).
* Tensor parallelism over ``t`` ranks (inside a node) divides each rank's compute and its FSDP
  bytes by ``t`` (data-parallel groups are ``t`` ranks apart) and adds its own traffic, which sits
  between a layer's products and so adds to compute instead of overlapping it: in 1-D, four
  all-reduces of the layer's ``b·s·h`` activations per layer (forward and backward of attention
  and MLP; with sequence parallelism the same bytes as reduce-scatters and all-gathers), plus
  two for the embedding and the head; in 2-D (``q × q``), per linear layer ``in → out``, SUMMA's
  broadcasts and reduces of ``3·q`` activation blocks (``b·s·in/q²``) and ``3·q`` weight blocks
  (``in·out/q²``) over ``q`` ranks.
* Step time = A · compute + exposed communication; tokens/s = A · b · s · W / (t · step).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from dtrain.core.collective_choices import gloo_reduce_scatter_factor, group_layout
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
    backend: str = "nccl"  # "gloo": FSDP2's collectives block the rank (CPU)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def overlaps_collectives(self) -> bool:
        """FSDP2's collectives run beside compute (CUDA streams), not in the rank's path."""
        return self.backend == "nccl"


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
class Exposed:
    """Seconds of communication per optimizer step that compute does not hide, by collective."""

    all_gather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    all_reduce_s: float = 0.0
    point_to_point_s: float = 0.0  # pipeline stages' sends while the pipeline fills and drains

    @property
    def total_s(self) -> float:
        return self.all_gather_s + self.reduce_scatter_s + self.all_reduce_s + self.point_to_point_s


@dataclass
class StepEstimate:
    strategy: str
    sharding_degree: int
    hierarchical: bool
    compute_s: float
    micro_comm: Traffic
    boundary_comm: Traffic
    step_s: float | None  # None: the strategy's memory does not fit the device
    tokens_per_s: float | None
    intra_bytes: float
    inter_bytes: float
    tensor_parallel: int = 1
    tp_bytes: float = 0.0  # of intra_bytes: tensor parallelism's, per device and step
    pipeline: int = 1  # pipeline ranks (dtrain.planning.pipeline estimates pp > 1)
    gradient_sync: str = "fsdp"
    exposed: Exposed = field(default_factory=Exposed)
    memory_gib: float | None = None  # per device, when the planner knows the model
    device_gib: float | None = None

    @property
    def fits(self) -> bool:
        return self.memory_gib is None or not self.device_gib or self.memory_gib <= self.device_gib

    @property
    def label(self) -> str:
        """``MiCS hier. overlapped``: the strategy and what differs from its defaults."""
        return " ".join([self.strategy, *(["hier."] if self.hierarchical else []),
                         *(["overlapped"] if self.gradient_sync == "overlapped" else [])])

    def to_dict(self) -> dict:
        return {**asdict(self), "exposed_s": self.exposed.total_s, "fits": self.fits}


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
                  tp_mode: str = "1d", gradient_sync: str = "fsdp",
                  reduce_scatter_factor: float | None = None) -> StepEstimate:
    """Predict one optimizer step of FSDP2/MiCS at ``sharding_degree`` over ``tp``-way
    tensor-parallel ranks.

    ``reduce_scatter_factor``: the reduce-scatter's bytes over a ring's; default
    :func:`reduce_scatter_factor_of`."""
    world = cluster.world_size
    degree = sharding_degree
    units = work.num_layers + 1
    params = work.num_parameters * work.compute_bytes / units / tp  # one unit's all-gather
    grads = work.num_parameters * GRAD_REDUCE_BYTES / units / tp
    nodes, per_node = group_layout(degree, stride=tp, gpus_per_node=cluster.gpus_per_node)
    shape = {"ranks": degree, "nodes": nodes, "per_node": per_node, "cluster": cluster}

    gather = reduce = Traffic()
    if degree > 1:
        gather = (hierarchical_allgather(params, **shape) if hierarchical and nodes > 1
                  else ring(params, **shape))
        if reduce_scatter_factor is None:
            reduce_scatter_factor = reduce_scatter_factor_of(cluster, ranks=degree, nodes=nodes)
        reduce = ring(grads, **shape, factor=reduce_scatter_factor)
    micro = Traffic()
    micro.add(gather, 2 * units)
    micro.add(reduce, units)
    replicas = world // (degree * tp)
    r_nodes, r_per_node = group_layout(replicas, stride=degree * tp,
                                       gpus_per_node=cluster.gpus_per_node)
    all_reduce = ring(grads / degree, ranks=replicas, nodes=r_nodes, per_node=r_per_node,
                      cluster=cluster, factor=2)
    boundary = Traffic()
    boundary.add(all_reduce, units)
    sync = gradient_sync if replicas > 1 else "fsdp"

    tp_traffic = tensor_parallel_traffic(work, cluster, tp=tp, mode=tp_mode)
    compute = compute_seconds(work, cluster) / tp + tp_traffic.seconds
    exposed = Exposed()
    for index in range(accumulation):
        last = index == accumulation - 1
        add_exposed(exposed, step_timeline(
            compute / units, gather.seconds, reduce.seconds,
            all_reduce.seconds if last else 0.0, units=units,
            overlapped=cluster.overlaps_collectives, background=sync == "overlapped"))
    step = accumulation * compute + exposed.total_s
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
        gradient_sync=sync, exposed=exposed,
    )


def reduce_scatter_factor_of(cluster: Cluster, *, ranks: int, nodes: int) -> float:
    """A partition group's reduce-scatter bytes over a ring's: 1 with NCCL; on gloo, dtrain's
    all-to-all or gloo's own (an all-reduce: 2), whichever moves less. ``nodes`` as
    :func:`group_layout` gives it, as the runtime reads it."""
    if cluster.backend == "nccl":
        return 1.0
    return gloo_reduce_scatter_factor(ranks, nodes)


def step_timeline(unit_compute: float, gather: float, reduce: float, all_reduce: float, *,
                  units: int, overlapped: bool, background: bool) -> Exposed:
    """Exposed communication of one micro-batch (module docstring, "What overlaps").

    ``unit_compute`` is one unit's forward + backward; ``gather``, ``reduce`` and
    ``all_reduce`` one unit's collectives (``all_reduce`` 0 off the accumulation boundary);
    ``overlapped``: FSDP2's collectives run beside compute; ``background``: the replica
    all-reduce is the overlapped sync's, not FSDP2's.
    """
    forward, backward = unit_compute / 3, 2 * unit_compute / 3
    in_path = 0.0 if background else all_reduce  # FSDP2's own all-reduce, unit by unit
    if not overlapped:  # every collective blocks the rank
        out = Exposed(2 * units * gather, units * reduce, units * in_path)
    else:
        out = Exposed(gather + (units - 1) * max(0.0, gather - forward))  # forward
        slot = gather + reduce + in_path  # backward: next gather, previous reductions
        spill = (units - 1) * max(0.0, slot - backward)
        _share(out, spill, gather, reduce, in_path)
        out.reduce_scatter_s += reduce  # the last unit's reductions: nothing left to hide them
        out.all_reduce_s += in_path
    if background and all_reduce:
        # units hand their shards over one unit-slot apart; the link drains them in order
        slot = backward + (0.0 if overlapped else gather + reduce)
        backward_end = units * slot
        link_end = slot + units * all_reduce
        out.all_reduce_s += max(all_reduce, link_end - backward_end)
    return out


def _share(out: Exposed, seconds: float, gather: float, reduce: float, all_reduce: float) -> None:
    total = gather + reduce + all_reduce
    if seconds <= 0 or total <= 0:
        return
    out.all_gather_s += seconds * gather / total
    out.reduce_scatter_s += seconds * reduce / total
    out.all_reduce_s += seconds * all_reduce / total


def add_exposed(into: Exposed, more: Exposed) -> None:
    into.all_gather_s += more.all_gather_s
    into.reduce_scatter_s += more.reduce_scatter_s
    into.all_reduce_s += more.all_reduce_s
    into.point_to_point_s += more.point_to_point_s


def with_memory(estimate: StepEstimate, *, memory_gib: float, device_gib: float) -> StepEstimate:
    """``estimate`` with its memory; a strategy that does not fit keeps no step time."""
    marked = replace(estimate, memory_gib=memory_gib, device_gib=device_gib)
    if marked.fits:
        return marked
    return replace(marked, step_s=None, tokens_per_s=None)
