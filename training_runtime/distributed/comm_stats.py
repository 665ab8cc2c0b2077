"""Communication accounting: calls and bytes per collective kind, split intra-/inter-node.

The counters observe the real calls: :func:`install` wraps the public collective functions of
``torch.distributed`` (and the same names in ``distributed_c10d``), which is where FSDP2 issues
its all-gathers, reduce-scatters and all-reduces (it looks them up on the module at call time),
and the functional collectives DTensor issues for tensor parallelism (forward and backward: its
redistributions look them up on their module at call time too). Nothing is re-derived from the
model. A collective called from inside another wrapped one (e.g. a legacy alias forwarding to the
new name) is counted once, by the outermost call.

Tensor-parallel traffic is its own row, ``"tensor_parallel"``: a collective whose ranks all lie in
one tensor-parallel group (``tp`` consecutive ranks, the innermost mesh axis; set by
:meth:`CommStats.set_tensor_parallel_size`) counts there and not under its kind, so the kinds keep
describing MiCS's data-parallel traffic. Pipeline parallelism's point-to-point transfers (the
activations and gradients crossing stages, sent with ``isend``) are the row
``"pipeline"``: the bytes this rank sends, inter-node when the peer is on another node.
``"total"`` adds every row.

Byte model. Each process records its own calls. For a collective on a group of ``N`` ranks
holding ``S`` bytes of full data (the all-gather output, the reduce-scatter input, the
all-reduce tensor), we count the bytes the whole collective moves over links under the ring
algorithm on the group's ranks in ascending order, divided by ``N`` (so summing every rank's
snapshot gives the collective's total):

* all-gather, reduce-scatter: each of the ``N`` ring links carries ``(N-1)/N * S``;
* all-reduce (reduce-scatter then all-gather): each link carries ``2(N-1)/N * S``;
* broadcast and reduce (a chain): each of the ``N-1`` links carries ``S``;
* all-to-all: as an all-gather of the input, ``(N-1)/N * S`` per link.

Ranks are node-contiguous (node = rank // LOCAL_WORLD_SIZE), so a ring over a group whose ranks
sit on ``k`` nodes has exactly ``k`` links that cross nodes when ``k > 1`` (none when ``k == 1``;
a chain has ``k - 1``). Inter-node bytes = crossing links × bytes per link / N, intra-node bytes
= the rest. A group inside one node is thus all intra; a group with one rank per node (the
inter-node group, a hierarchical all-gather's first stage) is all inter.

Usage::

    stats = ctx.comm_stats          # or CommStats(local_world_size=...) + install()
    stats.reset()
    train_step()
    snap = stats.snapshot()         # {"all_gather": {"calls": 4, "intra_bytes": ..., ...}, ...}
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from dtrain.runtime import torch_private

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all")
TENSOR_PARALLEL = "tensor_parallel"
PIPELINE = "pipeline"
CHAIN_KINDS = ("broadcast", "reduce")

# wrapped function name -> (kind, how to find the full-data bytes from the call's arguments)
_SIZE_FROM = {
    "output": lambda args, kw, _: _nbytes(kw.get("output_tensor", kw.get("output",
                                                                         _arg(args, 0)))),
    "input": lambda args, kw, _: _nbytes(kw.get("input", kw.get("input_tensor", _arg(args, 1)))),
    "list": lambda args, kw, _: sum(_nbytes(t) for t in kw.get("tensor_list", _arg(args, 0))),
    "tensor": lambda args, kw, _: _nbytes(kw.get("tensor", _arg(args, 0))),
    "tensors": lambda args, kw, _: sum(_nbytes(t) for t in kw.get("tensors", _arg(args, 0))),
}
_FUNCTIONAL_SIZE_FROM = {
    "self": lambda args, kw, _: _nbytes(kw.get("self", _arg(args, 0))),
    "input": lambda args, kw, _: _nbytes(kw.get("self", _arg(args, 0))),
    "gathered": lambda args, kw, group: _nbytes(kw.get("self", _arg(args, 0))) * group.size(),
}
_WRAPPED = {
    "all_gather_single": ("all_gather", "output"),
    "all_gather_into_tensor": ("all_gather", "output"),
    "_all_gather_base": ("all_gather", "output"),
    "all_gather": ("all_gather", "list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
}
# DTensor's functional collectives: name -> (kind, full bytes from the call); their group is the
# third positional argument (or ``group=``) and a ProcessGroup, a name, a mesh or (mesh, dim).
_FUNCTIONAL = {
    "all_gather_single": ("all_gather", "gathered"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "self"),
    "broadcast": ("broadcast", "self"),
    "all_to_all_single": ("all_to_all", "self"),
}
_GROUP_POSITION = {
    "all_reduce": 2,
    "all_reduce_coalesced": 2,
    "broadcast": 2,
    "reduce_scatter_single": 3,
    "reduce_scatter_tensor": 3,
    "_reduce_scatter_base": 3,
    "reduce": 3,
}
_FUNCTIONAL_GROUP_POSITION = {"all_gather_single": 2, "reduce_scatter_single": 3,
                              "all_reduce": 2, "broadcast": 2, "all_to_all_single": 3}


def _arg(args: tuple, index: int) -> Any:
    return args[index] if len(args) > index else None


def _nbytes(tensor: Any) -> int:
    if not isinstance(tensor, torch.Tensor):
        return 0
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class _GroupSpan:
    size: int
    num_nodes: int
    tensor_parallel: bool


@dataclass
class _Counter:
    calls: int = 0
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0


class CommStats:
    """Per-process collective counters; :meth:`reset` between steps, :meth:`snapshot` to read."""

    def __init__(self, *, local_world_size: int) -> None:
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
        self.local_world_size = local_world_size
        self.tensor_parallel_size = 1
        self._rows = (*KINDS, TENSOR_PARALLEL, PIPELINE)
        self._counters = {row: _Counter() for row in self._rows}
        self._spans: dict[int, tuple[Any, _GroupSpan]] = {}
        self._lock = threading.Lock()
        self._paused = 0  # > 0: inside paused(), nothing is counted

    def set_tensor_parallel_size(self, size: int) -> None:
        """Groups inside one block of ``size`` consecutive ranks count as tensor-parallel."""
        if size != self.tensor_parallel_size:
            with self._lock:
                self.tensor_parallel_size = size
                self._spans.clear()

    def reset(self) -> None:
        with self._lock:
            self._counters = {row: _Counter() for row in self._rows}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are not counted (a checkpoint's, between training steps), and
        what was counted before stays."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Counters per kind, ``"tensor_parallel"`` and ``"total"``; a copy, safe to keep across
        :meth:`reset`."""
        with self._lock:
            out = {row: vars(c).copy() for row, c in self._counters.items()}
        out["total"] = {
            key: sum(out[row][key] for row in self._rows)
            for key in ("calls", "intra_bytes", "inter_bytes")
        }
        return out

    def record(self, kind: str, group: Any, full_bytes: int) -> None:
        """Count one collective of ``kind`` on ``group`` over ``full_bytes`` of full data."""
        span = self._span(group)
        intra, inter = split_bytes(kind, full_bytes, size=span.size, num_nodes=span.num_nodes)
        with self._lock:
            if self._paused:
                return
            counter = self._counters[TENSOR_PARALLEL if span.tensor_parallel else kind]
            counter.calls += 1
            counter.intra_bytes += intra
            counter.inter_bytes += inter

    def record_send(self, peer: int, nbytes: int) -> None:
        """Count one point-to-point send of ``nbytes`` to global rank ``peer``."""
        crosses = peer // self.local_world_size != dist.get_rank() // self.local_world_size
        with self._lock:
            if self._paused:
                return
            counter = self._counters[PIPELINE]
            counter.calls += 1
            if crosses:
                counter.inter_bytes += nbytes
            else:
                counter.intra_bytes += nbytes

    def _span(self, group: Any) -> _GroupSpan:
        group = group if group is not None else c10d._get_default_group()
        cached = self._spans.get(id(group))
        if cached is not None and cached[0] is group:
            return cached[1]
        ranks = dist.get_process_group_ranks(group)
        tp = self.tensor_parallel_size
        span = _GroupSpan(len(ranks), len({r // self.local_world_size for r in ranks}),
                          tensor_parallel=tp > 1 and len({r // tp for r in ranks}) == 1)
        # Keep the group referenced so its id() cannot be reused by another object.
        self._spans[id(group)] = (group, span)
        return span


def split_bytes(kind: str, full_bytes: int, *, size: int, num_nodes: int) -> tuple[float, float]:
    """This rank's share ``(intra, inter)`` of a collective's link bytes (module docstring)."""
    if size <= 1:
        return 0.0, 0.0
    if kind in CHAIN_KINDS:
        total, crossing_per_link = (size - 1) * full_bytes, num_nodes - 1
        per_link = float(full_bytes)
    else:
        factor = 2.0 if kind == "all_reduce" else 1.0
        per_link = factor * (size - 1) * full_bytes / size
        total = size * per_link
        crossing_per_link = num_nodes if num_nodes > 1 else 0
    inter = crossing_per_link * per_link
    return (total - inter) / size, inter / size


_active: list[CommStats] = []
_state = threading.local()
_installed = False
_process_stats: CommStats | None = None


def install(stats: CommStats) -> None:
    """Start counting into ``stats`` (idempotent); wraps the collectives on first use."""
    global _installed
    if stats not in _active:
        _active.append(stats)
    if _installed:
        return
    for name, (kind, size_from) in _WRAPPED.items():
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapper = _wrap(original, kind, _SIZE_FROM[size_from], _GROUP_POSITION.get(name, 2))
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    original = c10d.isend
    wrapper = _wrap_send(original)
    c10d.isend = wrapper  # P2POp and batch_isend_irecv compare ops with c10d's isend by name
    if dist.isend is original:
        dist.isend = wrapper
    funcol = torch_private.functional_collectives()
    for name, (kind, size_from) in _FUNCTIONAL.items():
        original = getattr(funcol, name, None)
        if original is not None:
            setattr(funcol, name, _wrap(original, kind, _FUNCTIONAL_SIZE_FROM[size_from],
                                        _FUNCTIONAL_GROUP_POSITION[name], functional=True))
    _installed = True


def process_stats(*, local_world_size: int) -> CommStats:
    """The process-wide counters :func:`dtrain.runtime.init` hands out, installed once."""
    global _process_stats
    if _process_stats is None or _process_stats.local_world_size != local_world_size:
        if _process_stats is not None:
            uninstall(_process_stats)
        _process_stats = CommStats(local_world_size=local_world_size)
        install(_process_stats)
    return _process_stats


def uninstall(stats: CommStats) -> None:
    """Stop counting into ``stats``; the wrappers stay (they are no-ops with nothing active)."""
    if stats in _active:
        _active.remove(stats)


def record_collective(kind: str, group: Any, full_bytes: int) -> None:
    """Count one collective of ``kind`` in every active ``CommStats``: what the wrappers see,
    and what dtrain builds from calls they do not (its all-to-all reduce-scatter on gloo)."""
    for stats in _active:
        stats.record(kind, group, full_bytes)


def _wrap(original: Callable, kind: str, size_of: Callable, group_pos: int, *,
          functional: bool = False) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_state, "depth", 0)
        if depth == 0 and _active:
            group = kwargs.get("group", _arg(args, group_pos))
            if functional:
                group = torch_private.resolve_functional_group(group)
            record_collective(kind, group, size_of(args, kwargs, group))
        _state.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _state.depth = depth

    wrapper.__dtrain_wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _wrap_send(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(tensor: torch.Tensor, dst: int | None = None, group: Any = None, *args: Any,
                **kwargs: Any) -> Any:
        if _active:
            group_dst = kwargs.get("group_dst")
            peer = dst if dst is not None else dist.get_global_rank(
                group if group is not None else torch_private.default_group(), group_dst)
            for stats in _active:
                stats.record_send(peer, _nbytes(tensor))
        return original(tensor, dst, group, *args, **kwargs)

    wrapper.__dtrain_wrapped__ = original  # type: ignore[attr-defined]
    return wrapper
