"""The 4-D layout on 8 real gloo ranks (2 hosts × 4): ``pp 2 × shard 2 × tp 2``, a pipeline
stage per host, each stage MiCS-sharded over 2 ranks and split over 2 tensor-parallel ranks with
sequence parallelism (its activations cross the stages as DTensors), against one process within
1e-6: 1F1B, and interleaved zero-bubble (two stages per rank). Then ``pp 2 × tp 4`` with 2-D
tensor parallelism (a 2 × 2 grid per stage, 1F1B).

Spawned once for the module; eight processes on two cores take a minute or two.

    pytest tests/integration/test_pipeline_parallel_8_ranks.py -q
"""

from __future__ import annotations

import pytest
from _pipeline import run_parity
from _tensor_parallel import assert_matches_one_process, run_worker, spawn

pytestmark = pytest.mark.slow

WORLD, PER_HOST, TOL = 8, 4, 1e-6
LAYOUT = {"pipeline_parallel_degree": 2, "sharding_degree": 2, "tensor_parallel_degree": 2}
SCHEDULES = ["1f1b", "interleaved-zero-bubble"]
GRID = {"pipeline_parallel_degree": 2, "sharding_degree": 1, "tensor_parallel_degree": 4,
        "tensor_parallel_mode": "2d", "pipeline_schedule": "1f1b"}


def _worker(rank: int, port: int, result_dir: str) -> None:
    def body(rt, results: dict) -> None:
        for schedule in SCHEDULES:
            # interleaved: built on the meta device, four stages initialised on their ranks
            results[schedule] = run_parity(rt, {**LAYOUT, "pipeline_schedule": schedule},
                                           meta=schedule.startswith("interleaved"))
        results["2d"] = run_parity(rt, GRID)

    run_worker(rank, port, result_dir, world=WORLD, per_host=PER_HOST, body=body)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_worker, world=WORLD, per_host=PER_HOST,
                 result_dir=tmp_path_factory.mktemp("pipeline-8"))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_by_shard2_by_tp2_matches_one_process(results, schedule):
    for res in results:
        assert_matches_one_process(res[schedule], tol=TOL)


def test_pp2_by_a_2_by_2_grid_matches_one_process(results):
    for res in results:
        assert_matches_one_process(res["2d"], tol=TOL)


def test_the_mesh_is_4d_with_tensor_parallelism_inside_a_host_and_stages_across(results):
    plan = results[0]["1f1b"]["plan"]
    assert plan["mesh_shape"] == [2, 1, 2, 2] and plan["sequence_parallel"] is True
    for res in results:
        stats = res["1f1b"]["stats"]
        assert stats["tensor_parallel"]["calls"] > 0
        assert stats["tensor_parallel"]["inter_bytes"] == 0
        assert stats["pipeline"]["inter_bytes"] > 0  # host 0's stage sends to host 1's
