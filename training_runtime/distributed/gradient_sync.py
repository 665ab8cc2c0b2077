"""SDP-style overlapped gradient sync: the replicas' all-reduce leaves backward's critical path.

With ``gradient_sync: overlapped`` in the plan, FSDP2 shards each block over the partition group
only (``dp_shard``) and does hop 1 of MiCS's sync, the reduce-scatter inside the group, as usual.
Hop 2, the all-reduce of each gradient shard across the replicas, is dtrain's, as in SageMaker's
data-parallel library (the Herring design):

1. as soon as FSDP2 has put a block's gradient shard in ``.grad`` (its post-accumulate-grad hook,
   after the reduce-scatter and any accumulation), the shard is copied into **fusion buffers of
   one fixed size**, filled in backward order and split across buffer ends, so every rank of a
   replica group fills the same buffers with the same bytes in the same order;
2. each full buffer goes to a **background communicator**, a thread that all-reduces it over the
   rank's replica group on a **separate gloo process group** while backward goes on;
3. at the end of backward (an autograd final callback, after FSDP2's own) the partly filled last
   buffer is sent, the communicator is awaited — by then only the last buffers are still in
   flight — and the sums are copied back into ``.grad``.

On GPUs the buffers are pinned host memory: the shard is copied device-to-host on FSDP2's
post-reduce stream, the communicator waits for that copy's event, and the CPU does the inter-node
work while the GPU computes, as SDP does. On CPU the same path runs with plain host tensors.

Scaling: FSDP2 averages inside the partition group; the communicator sums the replicas' shards and
divides by their number, so ``.grad`` holds the mean over every data-parallel rank, the value
FSDP2's own HSDP path computes. (FSDP2's ``set_gradient_divide_factor`` cannot do the whole
division: on a partition group of one rank, torch 2.13 divides by it twice.) With gradient accumulation the buffers are filled on the
boundary micro-step only (:func:`set_boundary`); earlier micro-steps only reduce-scatter and
accumulate, so MiCS's 2-hop sync keeps its once-per-step all-reduce.

What it hid is measured (:meth:`OverlappedGradientSync.take_timing`): the seconds the communicator
spent all-reducing and the seconds the end of backward waited for it, which the Trainer logs as
``sync_busy_s`` and ``sync_exposed_s``. The communicator's thread ends with the model (or at
exit); :meth:`OverlappedGradientSync.close` ends it sooner.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from dtrain.core.parallelism import ParallelismPlan
from dtrain.runtime import torch_private
from torch import nn

logger = logging.getLogger(__name__)
DEFAULT_BUFFER_BYTES = 4 * 2**20
CLOSE_TIMEOUT_S = 10.0  # a communicator stuck in a collective (a peer died) does not hold exit
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, OverlappedGradientSync] = \
    weakref.WeakKeyDictionary()


def build_replica_group(plan: ParallelismPlan, *, rank: int) -> dist.ProcessGroup:
    """A gloo group over ``rank``'s replica group, separate from the mesh's (collective: every
    rank creates every replica group, in one order)."""
    mine = None
    for members in sorted({tuple(plan.replica_group(r)) for r in range(plan.world_size)}):
        group = dist.new_group(list(members), backend="gloo")
        if rank in members:
            mine = group
    assert mine is not None
    return mine


def attach(model: nn.Module, group: dist.ProcessGroup, *, device: torch.device,
           buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> OverlappedGradientSync:
    """Sync ``model``'s sharded gradients across ``group`` in the background; see module doc."""
    sync = OverlappedGradientSync(group, device=device, buffer_bytes=buffer_bytes)
    for name, param in model.named_parameters():
        if param.requires_grad:
            sync.names[param] = name
            param.register_post_accumulate_grad_hook(sync.on_gradient)
    _ATTACHED[model] = sync
    weakref.finalize(model, sync.close)  # the thread goes with the model, or at exit
    return sync


def attached(model: nn.Module) -> OverlappedGradientSync | None:
    return _ATTACHED.get(model)


def set_boundary(model: nn.Module, boundary: bool) -> None:
    """Fill the buffers in the next backward only when it ends an accumulation window."""
    sync = attached(model)
    if sync is not None:
        sync.boundary = boundary


@dataclass
class _Segment:
    """Elements ``[start, start + numel)`` of a gradient shard sit at ``offset`` in a buffer."""

    grad: torch.Tensor  # the shard's flat local tensor (a view of ``.grad``)
    start: int
    buffer: int
    offset: int
    numel: int


class OverlappedGradientSync:
    """Fusion buffers of ``buffer_bytes`` and the communicator that all-reduces them."""

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.group, self.device, self.buffer_bytes = group, device, buffer_bytes
        self.boundary = True
        self.buffers: list[torch.Tensor] = []
        self.segments: list[_Segment] = []
        self.communicator = BackgroundCommunicator(group)
        self._dtype: torch.dtype | None = None
        self._current, self._fill, self._open = 0, 0, False
        self._copied_back: torch.Event | None = None
        self._windows, self._wait_s = 0, 0.0  # see take_timing()
        self.names: dict[torch.Tensor, str] = {}  # for errors
        # parameters with a gradient from an earlier micro-step of this window, not yet buffered
        self._unsynced: dict[torch.Tensor, None] = {}

    # ---------------------------------------------------------------- backward (autograd thread)

    def on_gradient(self, param: torch.Tensor) -> None:
        """FSDP2 has reduce-scattered (and accumulated) ``param``'s shard: buffer it."""
        if param.grad is None:
            return
        if not self.boundary:  # synced with the window's last micro-step, which must reach it
            self._unsynced[param] = None
            return
        self._unsynced.pop(param, None)
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        if not self._open:
            self._start_window(local.dtype)
        if local.dtype != self._dtype:
            raise ValueError(f"overlapped gradient sync needs one gradient dtype; got "
                             f"{local.dtype} after {self._dtype}: use gradient_sync fsdp")
        assert local.is_contiguous()  # FSDP2's sharded gradients are
        flat, start = local.view(-1), 0
        while start < flat.numel():
            buffer = self._buffer(self._current)
            take = min(flat.numel() - start, buffer.numel() - self._fill)
            buffer[self._fill:self._fill + take].copy_(flat[start:start + take],
                                                       non_blocking=True)
            self.segments.append(_Segment(flat, start, self._current, self._fill, take))
            start, self._fill = start + take, self._fill + take
            if self._fill == buffer.numel():
                self._send(buffer)

    def _start_window(self, dtype: torch.dtype) -> None:
        self._open, self._dtype = True, self._dtype or dtype
        if self._copied_back is not None:  # last step's copy-back read these buffers
            torch.cuda.current_stream().wait_event(self._copied_back)
            self._copied_back = None
        # runs after FSDP2's own final callback (queued earlier), which reduces the root's
        # gradients and so fills the last buffers
        torch_private.queue_autograd_callback(self.finish)

    def _buffer(self, index: int) -> torch.Tensor:
        if index == len(self.buffers):
            numel = self.buffer_bytes // torch.empty((), dtype=self._dtype).element_size()
            self.buffers.append(torch.empty(numel, dtype=self._dtype, device="cpu",
                                            pin_memory=self.device.type == "cuda"))
        return self.buffers[index]

    def _send(self, buffer: torch.Tensor) -> None:
        ready = None
        if self.device.type == "cuda":  # the device-to-host copies are queued on the stream
            ready = torch.cuda.current_stream().record_event()
        self.communicator.submit(buffer, ready)
        self._current, self._fill = self._current + 1, 0

    # ---------------------------------------------------------------- end of backward

    def finish(self) -> None:
        """Send the last, partly filled buffer, await the communicator, copy the sums back."""
        if not self._open:
            return
        if self._fill:
            self._send(self.buffers[self._current][:self._fill])
        start = time.perf_counter()
        self.communicator.wait()
        self._windows, self._wait_s = self._windows + 1, self._wait_s + time.perf_counter() - start
        for seg in self.segments:
            source = self.buffers[seg.buffer][seg.offset:seg.offset + seg.numel]
            seg.grad[seg.start:seg.start + seg.numel].copy_(source, non_blocking=True)
        if self.device.type == "cuda":
            self._copied_back = torch.cuda.current_stream().record_event()
        self.segments.clear()
        self._current, self._fill, self._open = 0, 0, False
        if self._unsynced:
            missed = sorted(self.names.get(p, "?") for p in self._unsynced)
            self._unsynced.clear()
            raise RuntimeError(
                f"overlapped gradient sync: {', '.join(missed)} took a gradient on an earlier "
                "micro-step of this accumulation window but none on its last, so its replicas "
                "would never be averaged; use every such parameter on the last micro-step too "
                "(0 × its output in the loss will do), or set gradient_accumulation_steps 1")

    def take_timing(self) -> dict[str, float]:
        """Since the last call, and start counting again: ``windows`` (backward passes that
        synced), ``busy_s`` (seconds the communicator spent in all-reduces, hidden or not,
        including waits for a slower replica's shards) and ``exposed_s`` (seconds the ends of
        backward waited for it: what was not hidden). Call it between steps (the training
        thread runs ``finish``)."""
        timing = {"windows": self._windows, "busy_s": self.communicator.take_busy_s(),
                  "exposed_s": self._wait_s}
        self._windows, self._wait_s = 0, 0.0
        return timing

    def close(self) -> None:
        """End the communicator's thread (idempotent; the model's finalizer calls it)."""
        self.communicator.close()


class BackgroundCommunicator:
    """A thread that averages submitted host buffers over ``group``, in order."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.history: list[int] = []  # elements of every buffer submitted, in order
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._busy_s = 0.0  # seconds spent in all-reduces (under ``_done``)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dtrain-gradient-sync",
                                        daemon=True)
        self._thread.start()

    def submit(self, buffer: torch.Tensor, ready: torch.Event | None = None) -> None:
        if self._closed:
            raise RuntimeError("the overlapped gradient sync was closed; its model cannot "
                               "train on")
        with self._done:
            self._pending += 1
            self.history.append(buffer.numel())
        self._queue.put((buffer, ready))

    def wait(self) -> None:
        """Block until every submitted buffer is reduced; re-raise the thread's failure."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0 or self._error is not None)
            if self._error is not None:
                raise RuntimeError("overlapped gradient sync failed") from self._error

    def take_busy_s(self) -> float:
        with self._done:
            busy, self._busy_s = self._busy_s, 0.0
        return busy

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:  # finalizers run on any thread
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("overlapped gradient sync: the communicator is still in a "
                               "collective after %.0f s; leaving it behind", CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            buffer, ready = item
            try:
                if ready is not None:
                    ready.synchronize()
                start = time.perf_counter()
                dist.all_reduce(buffer, group=self.group)  # gloo has no AVG: sum, then divide
                buffer.div_(self.group.size())
                elapsed = time.perf_counter() - start
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting thread
                with self._done:
                    self._error = exc
                    self._done.notify_all()
                return
            with self._done:
                self._busy_s += elapsed
                self._pending -= 1
                self._done.notify_all()
