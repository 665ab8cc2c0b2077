"""Tensor parallelism inside MiCS with replicas, on 8 real gloo ranks (2 hosts x 4), for
GPT-NeoX against one process: 1-D ``replicate 2 × shard 2 × tp 2`` (the 3-D mesh, gradient
clipping across its meshes, and two micro-batches per step: MiCS's 2-hop sync with tensor
parallelism) and 2-D ``shard 2 × tp 4`` (a 2 × 2 grid on each host).

Spawned once for the module; eight processes on two cores take about a minute.

    pytest tests/integration/test_tensor_parallel_8_ranks.py -q
"""

from __future__ import annotations

import pytest
from _tensor_parallel import assert_matches_one_process, run_parity, run_worker, spawn

WORLD, PER_HOST = 8, 4
TOL = 1e-6
CONFIGS = {
    "replicate2-shard2-tp2": {"sharding_degree": 2, "tensor_parallel_degree": 2,
                              "gradient_accumulation_steps": 2},
    "shard2-2d-tp4": {"sharding_degree": 2, "tensor_parallel_degree": 4,
                      "tensor_parallel_mode": "2d"},
}


def _worker(rank: int, port: int, result_dir: str) -> None:
    def body(rt, results: dict) -> None:
        for name, distribution in CONFIGS.items():
            results[name], _ = run_parity(rt, "gpt-neox-tiny", distribution, "sgd")

    run_worker(rank, port, result_dir, world=WORLD, per_host=PER_HOST, body=body)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_worker, world=WORLD, per_host=PER_HOST,
                 result_dir=tmp_path_factory.mktemp("tensor-parallel-8"))


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpt_neox_matches_one_process_within_1e_6(results, name):
    for res in results:
        assert_matches_one_process(res[name], tol=TOL)


def test_the_mesh_is_replicate_by_shard_by_tensor_parallel_with_tp_innermost(results):
    one_d = results[0]["replicate2-shard2-tp2"]["plan"]
    assert one_d["mesh_shape"] == [1, 2, 2, 2] and one_d["strategy"] == "MiCS"
    two_d = results[0]["shard2-2d-tp4"]["plan"]
    assert two_d["mesh_shape"] == [1, 1, 2, 2, 2]
    # the partition group (shard 2, 4 ranks apart) spans the two hosts, each grid stays in one,
    # and MiCS's two-stage all-gather gathers the grid blocks across the hosts
    assert two_d["shard_group_spans_nodes"] is True and two_d["hierarchical_allgather"] is True


def test_replicas_all_reduce_data_parallel_gradients_across_hosts_and_tp_stays_inside(results):
    for res in results:
        stats = res["replicate2-shard2-tp2"]["stats"]
        assert stats["all_reduce"]["inter_bytes"] > 0  # MiCS's replica all-reduce, once a step
        assert stats["tensor_parallel"]["calls"] > 0 and stats["tensor_parallel"]["inter_bytes"] == 0
