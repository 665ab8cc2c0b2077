"""With NCCL, the default process group also serves CPU tensors (over gloo): the Trainer's stop
vote and metrics and the checkpoint's shared-folder probe are CPU all-reduces, which a group made
with ``init_process_group("nccl")`` refuses ("No backend type associated with device type cpu").
No GPU here: the test reads what ``init`` asks torch for, and torch's own map of it."""

from __future__ import annotations

import types

import pytest
from dtrain.runtime.distributed import context
from torch.distributed.distributed_c10d import BackendConfig


@pytest.mark.parametrize("backend, devices", [("nccl", {"cpu": "gloo", "cuda": "nccl"}),
                                              ("gloo", {"cpu": "gloo", "cuda": "gloo"})])
def test_the_default_group_has_a_backend_for_cpu_tensors(monkeypatch, backend, devices):
    asked = []
    monkeypatch.setattr(context.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(context.dist, "init_process_group",
                        lambda backends, **kwargs: asked.append(backends))
    monkeypatch.delenv("RANK", raising=False)
    context._init_process_group(backend, types.SimpleNamespace(world_size=1), 10.0)
    assert BackendConfig(asked[0]).device_backend_map == devices
