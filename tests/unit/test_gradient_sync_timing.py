"""The overlapped gradient sync's clocks and its thread's lifetime, on a one-rank gloo group.

The multi-rank behaviour (parity with FSDP2, buffers in flight during backward) is in
``tests/integration/test_gradient_sync.py``; here one process checks what a Trainer and a
long-lived process rely on: what ``take_timing()`` reports, and that the communicator's thread does
not outlive its model.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from dtrain.runtime.distributed import gradient_sync
from dtrain.runtime.train import metrics
from torch import nn


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def backward(model: nn.Module, features: int = 64) -> None:
    model(torch.ones(3, features)).square().sum().backward()


def test_timing_counts_each_synced_backward_and_resets(group, monkeypatch):
    delay = 0.02  # each all-reduce takes at least this long
    all_reduce = dist.all_reduce

    def slow_all_reduce(*args, **kwargs):
        time.sleep(delay)
        return all_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", slow_all_reduce)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    sync = gradient_sync.attach(model, group, device=torch.device("cpu"), buffer_bytes=4096)
    for _ in range(3):
        backward(model)
    buffers = len(sync.communicator.history)
    assert buffers > 3  # several buffers a backward
    timing = sync.take_timing()
    assert timing["windows"] == 3
    assert timing["busy_s"] >= buffers * delay  # every buffer's all-reduce was timed
    # each backward's end waited at least for its last buffer, sent only then
    assert timing["exposed_s"] >= 3 * delay
    assert sync.take_timing() == {"windows": 0, "busy_s": 0.0, "exposed_s": 0.0}

    sync.boundary = False  # an accumulation micro-step: nothing is sent, nothing is timed
    backward(model)
    assert sync.take_timing()["windows"] == 0
    sync.boundary = True
    backward(model)
    record = metrics.gradient_sync_metrics(sync, steps=2)
    assert record["sync_busy_s"] >= (len(sync.communicator.history) - buffers) * delay / 2
    assert record["sync_exposed_s"] >= delay / 2
    assert sync.take_timing()["windows"] == 0  # the metrics took the clocks


def test_the_communicator_thread_ends_with_its_model(group):
    model = nn.Linear(8, 8)
    thread = gradient_sync.attach(model, group, device=torch.device("cpu")).communicator._thread
    assert thread.is_alive()
    del model
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_close_is_idempotent_ends_the_thread_and_refuses_more_work(group):
    model = nn.Linear(8, 8)
    sync = gradient_sync.attach(model, group, device=torch.device("cpu"))
    sync.close()
    sync.close()
    assert not sync.communicator._thread.is_alive()
    with pytest.raises(RuntimeError, match="was closed"):
        backward(model, features=8)
