"""MiCS runtime pieces that need no second process: settings, errors, the byte model, meta init.

pytest tests/integration/test_mics_config.py -q
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from dtrain.runtime.distributed.comm_stats import split_bytes
from dtrain.runtime.distributed.config import DistributionConfig
from dtrain.runtime.distributed.context import ProcessFacts, resolve_backend
from torch import nn
from torch.distributed.fsdp import FSDPModule


def test_importing_the_runtime_package_does_not_import_torch():
    code = "import sys, dtrain.runtime as rt; rt.__all__; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_distribution_env_fills_missing_keys_with_defaults():
    config = DistributionConfig.from_env({"DTRAIN_DISTRIBUTION": '{"sharding_degree": 2}'})
    assert config == DistributionConfig(sharding_degree=2)
    assert DistributionConfig.from_env({}).sharding_degree == "auto"
    assert DistributionConfig.from_env({}).gradient_accumulation_steps == 1


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"backend": "mpi"}, "backend"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        # a typo in a script's dict; before, a warning and the default
        ({"shardin_degree": 2}, "'shardin_degree' \\(did you mean 'sharding_degree'\\?\\)"),
        # a name cut short means the degree, not the closest spelling (tensor_parallel_mode)
        ({"tensor_parallel": 2},
         "'tensor_parallel' \\(did you mean 'tensor_parallel_degree'\\?\\)"),
    ],
)
def test_bad_distribution_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        DistributionConfig.from_mapping(bad)


def test_bad_distribution_json_says_how_to_fix():
    with pytest.raises(ValueError, match="JSON object"):
        DistributionConfig.from_env({"DTRAIN_DISTRIBUTION": "[1, 2]"})


def test_backend_auto_picks_gloo_on_cpu_and_nccl_without_cuda_is_refused():
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(ValueError, match="'auto' or 'gloo'"):
        resolve_backend("nccl", cuda_available=False)


def test_process_facts_follow_torch_elastic_variables():
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
    }
    facts = ProcessFacts.from_env(env)
    assert (facts.rank, facts.local_rank, facts.node_rank, facts.num_nodes) == (5, 1, 1, 2)
    with pytest.raises(ValueError, match="node-contiguous"):
        ProcessFacts.from_env({**env, "GROUP_RANK": "0"})
    assert ProcessFacts.from_env({}).world_size == 1


def test_ring_model_splits_bytes_by_the_links_that_cross_nodes():
    # 4 ranks on 2 nodes, 400 bytes gathered: 4 links x 300 bytes, 2 of them cross nodes.
    assert split_bytes("all_gather", 400, size=4, num_nodes=2) == (150.0, 150.0)
    assert split_bytes("all_gather", 400, size=2, num_nodes=1) == (200.0, 0.0)
    assert split_bytes("all_gather", 400, size=2, num_nodes=2) == (0.0, 200.0)
    assert split_bytes("all_reduce", 400, size=2, num_nodes=2) == (0.0, 400.0)
    assert split_bytes("broadcast", 400, size=4, num_nodes=2) == (200.0, 100.0)
    assert split_bytes("reduce", 400, size=4, num_nodes=2) == (200.0, 100.0)  # a chain too
    assert split_bytes("all_reduce", 400, size=1, num_nodes=1) == (0.0, 0.0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(x)


class _Model(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.blocks(x))

    def init_weights(self) -> None:
        for p in self.parameters():
            nn.init.constant_(p, 0.5)


@pytest.fixture
def one_process_ctx(monkeypatch):
    import dtrain.runtime as rt

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SM_CHANNEL_TRAIN", "/data/train")
    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", "/tmp/ckpt")
    assert not dist.is_initialized()
    ctx = rt.init(distribution={"sharding_degree": 1, "activation_checkpointing": True})
    yield rt, ctx
    dist.destroy_process_group()


def test_one_process_run_shards_a_meta_model_and_calls_init_weights(one_process_ctx):
    rt, ctx = one_process_ctx
    assert (ctx.world_size, ctx.is_main, ctx.backend) == (1, True, "gloo")
    assert str(ctx.channel("train")) == "/data/train" and str(ctx.checkpoint_dir) == "/tmp/ckpt"
    with pytest.raises(ValueError, match="Add it under inputs"):
        ctx.channel("eval")
    with torch.device("meta"):
        model = _Model()
    rt.shard(model, ctx, mixed_precision="bf16")
    assert all(not p.is_meta for p in model.parameters())
    assert all(torch.all(p.full_tensor() == 0.5) for p in model.parameters())
    assert "CheckpointWrapper" in type(model.blocks[0]).__name__
    with pytest.raises(ValueError, match="_Model is sharded already .* call shard\\(\\) once"):
        rt.shard(model, ctx)  # before, a cryptic DTensor error from deep inside
    for micro in ctx.accumulate(model, [torch.ones(2, 8)] * 3, micro_batches_per_step=2):
        micro.scale(model(micro.batch).float().sum()).backward()
    assert model.out.weight.grad is not None
    # without init_weights a meta model would train on what to_empty left (NaN, 1e35)
    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="Sequential is on the meta device but has no "
                                         "init_weights"):
        rt.shard(bare, ctx)


def test_accumulate_marks_every_window_end_and_the_last_batch_as_boundaries(one_process_ctx):
    _, ctx = one_process_ctx
    flags = [m.is_boundary for m in ctx.accumulate(nn.Linear(1, 1), range(5),
                                                   micro_batches_per_step=2)]
    assert flags == [False, True, False, True, True]


def test_at_a_boundary_the_loader_has_given_exactly_the_batches_trained(one_process_ctx):
    # a checkpoint taken at a boundary saves the loader's position: a batch read ahead would
    # be skipped by the resumed run
    _, ctx = one_process_ctx
    given = []

    def loader():
        for batch in range(7):
            given.append(batch)
            yield batch

    trained = []
    for micro in ctx.accumulate(nn.Linear(1, 1), loader(), micro_batches_per_step=3):
        trained.append(micro.batch)
        if micro.is_boundary:
            assert given == trained
    assert trained == list(range(7))


def test_accumulate_follows_the_spec_and_never_overrides_it_silently(one_process_ctx, caplog):
    _, ctx = one_process_ctx  # gradient_accumulation_steps: 1
    assert [m.num_steps for m in ctx.accumulate(nn.Linear(1, 1), range(2))] == [1, 1]
    with caplog.at_level(logging.WARNING, logger="dtrain.runtime"):
        micro = list(ctx.accumulate(nn.Linear(1, 1), range(4), micro_batches_per_step=2))
    assert [m.num_steps for m in micro] == [2] * 4
    assert "2 micro-batches per optimizer step, overriding the job's " \
        "distribution.gradient_accumulation_steps=1" in caplog.text
    with pytest.warns(DeprecationWarning, match="pass micro_batches_per_step=N"):
        assert [m.is_boundary for m in ctx.accumulate(nn.Linear(1, 1), range(2), steps=2)] \
            == [False, True]


class _Plain(nn.Module):
    """A user's own model: no ``_no_split_modules``, blocks in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.ModuleList([nn.Linear(8, 2)])
        self.layers = nn.ModuleList([_Block(), _Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head[0](x)


def test_a_plain_model_is_sharded_by_its_largest_module_list_and_says_so(one_process_ctx,
                                                                         caplog):
    rt, ctx = one_process_ctx
    model = _Plain()
    with caplog.at_level(logging.INFO, logger="dtrain.runtime"):
        rt.shard(model, ctx)
        rt.shard(nn.Sequential(nn.Linear(2, 2)), ctx)
    assert all(isinstance(layer, FSDPModule) for layer in model.layers)
    assert not isinstance(model.head[0], FSDPModule)
    model(torch.ones(2, 8)).sum().backward()  # it trains
    assert "sharding the 3 children of _Plain.layers (_Block) one by one (pass " \
        "block_classes=[...] to choose others)" in caplog.text
    assert "Sequential has no _no_split_modules and no nn.ModuleList; sharding it as one " \
        "unit" in caplog.text


def test_block_classes_override_the_choice_and_must_match(one_process_ctx):
    rt, ctx = one_process_ctx
    model = rt.shard(_Plain(), ctx, block_classes=[nn.Linear])
    assert isinstance(model.head[0], FSDPModule)
    with pytest.raises(ValueError, match="pass block_classes"):
        rt.shard(_Plain(), ctx, block_classes=[nn.Conv1d])


def test_auto_sharding_degree_is_resolved_from_the_model_at_shard_time(one_process_ctx):
    rt, _ = one_process_ctx
    ctx = rt.init(distribution={"sharding_degree": "auto"})
    assert ctx.mesh is None
    rt.shard(_Model(), ctx)
    assert ctx.sharding_degree == 1 and ctx.mesh is not None
