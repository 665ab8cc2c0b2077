"""Checkpoints in per-host folders, as SageMaker and EC2 keep them: each host writes its own
ranks' shards, a sync merges the hosts' folders into one S3 prefix, and a restarted job starts
from that merged copy on every host. Two spawned ranks pose as two hosts, each with its own
folder; the test does the merge. A copy that lost a rank's shard is passed over for the
checkpoint before it, found by the rank that wrote the shard, even where rank 0's copy is whole.

    pytest tests/integration/test_checkpoint_per_host.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _tensor_parallel import run_worker, spawn

pytestmark = pytest.mark.slow
CORPUS = Path(__file__).read_text() * 4


def _fit(rt, folder: Path, steps: int):
    import torch
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.recipes.causal_lm import next_token_loss
    from dtrain.runtime.train.data import DistributedTokenLoader
    from dtrain.runtime.train.tokenize import encode_bytes
    from dtrain.runtime.train.trainer import Trainer, TrainerConfig

    ctx = rt.init(distribution={"sharding_degree": 2})
    torch.manual_seed(0)
    model = rt.shard(from_preset("gpt-neox-tiny"), ctx)
    loader = DistributedTokenLoader(encode_bytes([CORPUS]), window=33, micro_batch_size=2,
                                    dp_rank=ctx.dp_rank, dp_world_size=ctx.dp_world_size)
    trainer = Trainer(model, ctx, next_token_loss, checkpoint_dir=folder,
                      model_dir=folder.parent / "model",
                      config=TrainerConfig(steps=steps, checkpoint_interval=2, keep_last=2))
    return trainer.fit(loader)


def _merge(root: Path) -> None:
    """What the checkpoint sync does: every host's files in every host's copy."""
    import shutil

    hosts = [root / "host0" / "checkpoints", root / "host1" / "checkpoints"]
    for source in hosts:
        for target in hosts:
            if target != source:
                shutil.copytree(source, target, dirs_exist_ok=True)


def _worker(rank: int, port: int, result_dir: str) -> None:
    def body(rt, results: dict) -> None:
        import torch.distributed as dist

        root = Path(result_dir)
        folder = root / f"host{rank}" / "checkpoints"  # this host's own
        results["first"] = _fit(rt, folder, 4).resumed_from
        results["files"] = sorted(p.name for p in (folder / "step-000004").iterdir())
        dist.barrier()
        if rank == 0:
            _merge(root)
        dist.barrier()
        results["restart"] = _fit(rt, folder, 6).resumed_from  # steps 4-6, from the merge
        dist.barrier()
        if rank == 0:
            _merge(root)
            # host 1's copy of step 6 lost the shard rank 1 wrote; host 0's (rank 0's) is whole
            (root / "host1" / "checkpoints" / "step-000006" / "__1_0.distcp").unlink()
        dist.barrier()
        results["broken"] = _fit(rt, folder, 8).resumed_from

    run_worker(rank, port, result_dir, world=2, per_host=1, body=body)


def test_each_host_resumes_from_its_own_folder_and_a_lost_shard_falls_back(tmp_path):
    results = spawn(_worker, world=2, per_host=1, result_dir=tmp_path)
    for rank, res in enumerate(results):
        assert res["first"] is None
        # this host's folder holds this host's shard only (and the shared files)
        assert f"__{rank}_0.distcp" in res["files"] and f"__{1 - rank}_0.distcp" not in \
            res["files"]
        assert res["restart"] == 4
        assert res["broken"] == 4  # step 6 passed over on every rank, as rank 1 found it
