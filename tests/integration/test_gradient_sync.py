"""The overlapped gradient sync on real gloo groups: FSDP2's own gradients, computed otherwise.

Four CPU processes pose as 2 hosts × 2 workers, spawned once for the module. Each worker trains
the same model three times per configuration from the same start — ``gradient_sync: fsdp``
(FSDP2's HSDP all-reduce per block) and ``overlapped`` (fusion buffers all-reduced by the
background communicator), both with dtrain's all-to-all reduce-scatter in the partition groups,
and ``stock``: ``fsdp`` with gloo's own reduce-scatter, the reference — and records gradients,
parameters, buffer traffic and the byte counters, which the tests below judge.

    pytest tests/integration/test_gradient_sync.py -q
"""

from __future__ import annotations

import pytest
import torch
from _tensor_parallel import run_worker, spawn
from test_mics_sharding import SEQ, VOCAB, TinyLM, lm_loss
from torch.distributed.fsdp import FSDPModule

WORLD, PER_HOST, STEPS, MICRO_BATCH = 4, 2, 3, 2
BUFFER_BYTES = 4096  # 1024 fp32 elements: several buffers per step, shards split across them
# (sharding_degree, gradient_accumulation_steps)
CONFIGS = [(1, 1), (1, 4), (2, 1), (2, 4)]
TOLERANCE = 1e-6


class HeadLM(TinyLM):
    """TinyLM whose output layer is ``lm_head``: ``shard`` makes it an FSDP unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = self._modules.pop("head")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


_ALL_TO_ALL_CALLS = [0]  # dtrain's reduce-scatter calls in this process since the last pop


def _count_all_to_all_reduce_scatters() -> None:
    """Patch dtrain's reduce-scatter in this (spawned) process to count its calls."""
    from dtrain.runtime.distributed.collectives import AllToAllReduceScatter

    original = AllToAllReduceScatter.__call__

    def counted(comm, *args, **kwargs):
        _ALL_TO_ALL_CALLS[0] += 1
        return original(comm, *args, **kwargs)

    AllToAllReduceScatter.__call__ = counted


def _pop_all_to_all_calls() -> int:
    calls, _ALL_TO_ALL_CALLS[0] = _ALL_TO_ALL_CALLS[0], 0
    return calls


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(rt, degree: int, accum: int, sync: str) -> dict:
    from dtrain.runtime.distributed import collectives, gradient_sync, sharding

    ctx = rt.init(distribution={"sharding_degree": degree, "gradient_accumulation_steps": accum,
                                "gradient_sync": "fsdp" if sync == "stock" else sync})
    torch.manual_seed(0)
    chosen = sharding.gloo_reduce_scatter
    if sync == "stock":  # FSDP2 with gloo's own reduce-scatter: nothing of dtrain's collectives
        sharding.gloo_reduce_scatter = lambda plan: None
    try:
        model = rt.shard(HeadLM(), ctx, fusion_buffer_bytes=BUFFER_BYTES)
    finally:
        sharding.gloo_reduce_scatter = chosen
    assert chosen is collectives.gloo_reduce_scatter
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    attached = gradient_sync.attached(model)
    _pop_all_to_all_calls()
    out = {"plan_sync": ctx.plan.gradient_sync, "attached": attached is not None,
           "head_unit": isinstance(model.lm_head, FSDPModule),
           "fsdp_mesh": ctx.data_parallel_mesh.mesh_dim_names, "grads": [], "stats": [],
           "history": [], "sent_before_last_shard": [], "per_micro": []}
    if attached is not None:
        # runs after the sync's own hook: how many buffers the communicator had been handed
        # when each shard arrived (the root's shards arrive last, at the end of backward)
        seen: list[int] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _p: seen.append(len(attached.communicator.history)))
    data = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (accum, WORLD, MICRO_BATCH, SEQ + 1), generator=data)
        ctx.comm_stats.reset()
        if attached is not None:
            seen.clear()
            before = len(attached.communicator.history)
        for micro in ctx.accumulate(model, [batch[m, ctx.dp_rank] for m in range(accum)]):
            micro.scale(lm_loss(model, micro.batch)).backward()
            if attached is not None:
                out["per_micro"].append(len(attached.communicator.history) - before)
        out["stats"].append(ctx.comm_stats.snapshot())
        out.setdefault("all_to_all_reduce_scatters", []).append(_pop_all_to_all_calls())
        out["grads"].append([_full(p.grad).clone() for p in model.parameters()])
        if attached is not None:
            out["history"].append(attached.communicator.history[before:])
            out["sent_before_last_shard"].append(seen[-1] - before)
        opt.step()
        opt.zero_grad()
    out["params"] = [_full(p.detach()).clone() for p in model.parameters()]
    return out


def _joint(rt, sync: str) -> list[list[torch.Tensor]]:
    """Two models sharded on one context, one backward through both (a joint loss): each
    overlapped sync must all-reduce on a group of its own."""
    ctx = rt.init(distribution={"sharding_degree": 2, "gradient_sync": sync})
    torch.manual_seed(0)
    models = [rt.shard(HeadLM(), ctx, fusion_buffer_bytes=BUFFER_BYTES),
              rt.shard(TinyLM(hidden=48), ctx, fusion_buffer_bytes=BUFFER_BYTES)]
    data, grads = torch.Generator().manual_seed(99), []
    for _ in range(2):
        batch = torch.randint(0, VOCAB, (WORLD, MICRO_BATCH, SEQ + 1), generator=data)
        sum(lm_loss(m, batch[ctx.dp_rank]) for m in models).backward()
        grads.append([_full(p.grad).clone() for m in models for p in m.parameters()])
        for m in models:
            m.zero_grad()
    return grads


class GatedLM(HeadLM):
    """HeadLM with a layer only the first micro-step of a window uses."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(32, 32)
        self.use_extra = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.extra(x) if self.use_extra else x
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _unused_on_the_boundary(rt) -> str:
    """The overlapped sync's error when a parameter's gradient would miss the replicas."""
    ctx = rt.init(distribution={"sharding_degree": 2, "gradient_accumulation_steps": 2,
                                "gradient_sync": "overlapped"})
    model = rt.shard(GatedLM(), ctx, fusion_buffer_bytes=BUFFER_BYTES)
    batch = torch.randint(0, VOCAB, (2, MICRO_BATCH, SEQ + 1),
                          generator=torch.Generator().manual_seed(ctx.rank))
    try:
        for micro in ctx.accumulate(model, list(batch)):
            model.use_extra = micro.index == 0
            micro.scale(lm_loss(model, micro.batch)).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _reduce_scatters(rt) -> dict:
    """dtrain's all-to-all reduce-scatter against gloo's own, on the 4 ranks (2 hosts) and on
    this rank's host (2 ranks), in chunks of an odd number of elements."""
    import torch.distributed as dist
    from dtrain.runtime.distributed.collectives import AllToAllReduceScatter

    rt.init()
    rank, comm, out = dist.get_rank(), AllToAllReduceScatter(), {}
    host = None
    for members in ([0, 1], [2, 3]):  # new_group is collective: every rank makes every group
        group = dist.new_group(members)
        host = group if rank in members else host
    for name, group in (("world", dist.group.WORLD), ("host", host)):
        ranks = group.size()
        data = torch.randn(ranks * 1001, generator=torch.Generator().manual_seed(rank))
        ours, gloos = torch.empty(1001), torch.empty(1001)
        comm(ours, data, group, dist.ReduceOp.SUM)
        dist.reduce_scatter_tensor(gloos, data.clone(), group=group)
        out[name] = (ours, gloos)
    return out


def _worker(rank: int, port: int, result_dir: str) -> None:
    def body(rt, results: dict) -> None:
        results["reduce_scatters"] = _reduce_scatters(rt)
        _count_all_to_all_reduce_scatters()
        for degree, accum in CONFIGS:
            for sync in ("stock", "fsdp", "overlapped"):
                results[(degree, accum, sync)] = _train(rt, degree, accum, sync)
        results["joint"] = {sync: _joint(rt, sync) for sync in ("fsdp", "overlapped")}
        results["unused_on_the_boundary"] = _unused_on_the_boundary(rt)  # last: it raises

    run_worker(rank, port, result_dir, world=WORLD, per_host=PER_HOST, body=body)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_worker, world=WORLD, per_host=PER_HOST,
                 result_dir=tmp_path_factory.mktemp("gradient_sync"))


pytestmark = pytest.mark.slow
IDS = [f"degree{d}-accum{a}" for d, a in CONFIGS]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("sync", ["fsdp", "overlapped"])
def test_gradients_and_parameters_equal_fsdp2_s_own_sync_within_1e_6(results, config, sync):
    for res in results:
        stock, ours = res[(*config, "stock")], res[(*config, sync)]
        for step_stock, step_ours in zip(stock["grads"], ours["grads"], strict=True):
            for a, b in zip(step_ours, step_stock, strict=True):
                torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)
        for a, b in zip(ours["params"], stock["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_fsdp2_shards_over_the_partition_group_only_when_overlapped(results, config):
    fsdp, overlapped = results[0][(*config, "fsdp")], results[0][(*config, "overlapped")]
    assert (fsdp["plan_sync"], fsdp["attached"]) == ("fsdp", False)
    assert (overlapped["plan_sync"], overlapped["attached"]) == ("overlapped", True)
    assert fsdp["fsdp_mesh"] == ("dp_replicate", "dp_shard")
    assert overlapped["fsdp_mesh"] == ("dp_shard",)
    assert fsdp["head_unit"] and overlapped["head_unit"]  # the untied lm_head is its own unit


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_buffers_have_one_size_and_go_out_while_backward_continues(results, config):
    elements = BUFFER_BYTES // 4
    histories = [res[(*config, "overlapped")]["history"] for res in results]
    for history in histories[0]:
        assert len(history) > 2 and set(history[:-1]) == {elements}
        assert 0 < history[-1] <= elements  # the last one is sent partly filled
    # every rank fills the same buffers: equal sizes everywhere (replica peers must match)
    assert all(h == histories[0] for h in histories)
    for res in results:
        # buffers were handed to the communicator before the last shard arrived
        assert min(res[(*config, "overlapped")]["sent_before_last_shard"]) > 0


@pytest.mark.parametrize("degree", [1, 2])
def test_with_accumulation_the_buffers_fill_on_the_boundary_micro_step_only(results, degree):
    per_micro = results[0][(degree, 4, "overlapped")]["per_micro"]
    assert len(per_micro) == 4 * STEPS
    for step in range(STEPS):
        window = per_micro[4 * step:4 * step + 4]
        assert window[:3] == [0, 0, 0] and window[3] > 0


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_same_bytes_cross_hosts_as_fsdp2_s_all_reduce(results, config):
    for res in results:
        fsdp = res[(*config, "fsdp")]["stats"]
        overlapped = res[(*config, "overlapped")]["stats"]
        for a, b in zip(overlapped, fsdp):
            assert a["all_reduce"]["inter_bytes"] == pytest.approx(b["all_reduce"]["inter_bytes"])
            assert a["all_reduce"]["inter_bytes"] > 0
            assert a["reduce_scatter"] == b["reduce_scatter"]


def test_dtrain_s_reduce_scatter_on_gloo_sums_as_gloo_s_own(results):
    for res in results:
        ours, gloos = res["reduce_scatters"]["host"]
        assert torch.equal(ours, gloos)  # two ranks: the same additions
        ours, gloos = res["reduce_scatters"]["world"]
        torch.testing.assert_close(ours, gloos, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_partition_groups_on_one_host_reduce_scatter_with_dtrain_s_all_to_all(results, config):
    degree, accum = config
    for sync in ("fsdp", "overlapped"):
        counts = results[0][(*config, sync)]["all_to_all_reduce_scatters"]
        # one per FSDP unit (2 blocks, the head, the root) and micro-step; none without a group
        assert counts == [4 * accum if degree == 2 else 0] * STEPS
    assert results[0][(*config, "stock")]["all_to_all_reduce_scatters"] == [0] * STEPS


def test_two_models_in_one_backward_each_sync_on_a_group_of_their_own(results):
    for res in results:
        fsdp, overlapped = res["joint"]["fsdp"], res["joint"]["overlapped"]
        for step_fsdp, step_overlapped in zip(fsdp, overlapped, strict=True):
            for a, b in zip(step_fsdp, step_overlapped, strict=True):
                torch.testing.assert_close(b, a, atol=TOLERANCE, rtol=0)


def test_a_gradient_that_would_miss_the_replicas_is_an_error_naming_the_parameter(results):
    for res in results:  # every rank: the accumulated gradient of extra.* was never averaged
        assert res["unused_on_the_boundary"].startswith(
            "overlapped gradient sync: extra.bias, extra.weight took a gradient on an earlier "
            "micro-step of this accumulation window but none on its last")
