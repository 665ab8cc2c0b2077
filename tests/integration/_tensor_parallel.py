"""What the tensor-parallel parity tests share: the loss, one parity run, spawning ranks.

A parity run trains a model split by the runtime and the same model (same seed) in one process
on the same global batch, side by side in each worker, and reports losses, clipped gradient
norms, the largest parameter difference and one step's communication statistics. The split model
is either a copy of the whole one or (``meta``) built on the meta device and initialised by the
runtime after splitting, the path recipes take for large models: it must start as the whole.
"""

from __future__ import annotations

import copy
import os
import pickle
import traceback
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STEPS, MICRO_BATCH, SEQ, VOCAB = 3, 2, 8, 512


def masked(preset: str) -> bool:
    return preset.startswith(("bert", "roberta"))


def lm_loss(model, tokens: torch.Tensor, preset: str) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:].clone()
    if masked(preset):  # a masked LM's loss skips the positions it does not predict
        targets[:, ::3] = -100
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def optimizers(model, ref, kind: str):
    if kind == "adamw":
        return (torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
                torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True))
    return (torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
            torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9))


def build(rt, preset: str, distribution: dict, *, meta: bool = False):
    from dtrain.runtime.models import from_preset

    ctx = rt.init(distribution=distribution)
    torch.manual_seed(0)
    ref = from_preset(preset)  # the default kernel: flash attention, per shard
    # on meta, each rank seeded differently, as a script may: the runtime takes rank 0's seed
    torch.manual_seed(torch.distributed.get_rank())
    model = from_preset(preset, device="meta") if meta else copy.deepcopy(ref)
    rt.shard(model, ctx)
    return ctx, model, ref


def run_parity(rt, preset: str, distribution: dict, optimizer: str, *,
               meta: bool = False) -> tuple[dict, object]:
    from dtrain.runtime.train.optim import clip_and_unscale_

    ctx, model, ref = build(rt, preset, distribution, meta=meta)
    opt, ref_opt = optimizers(model, ref, optimizer)
    data = torch.Generator().manual_seed(1)
    out = {"losses": [], "ref_losses": [], "grad_norms": [], "ref_grad_norms": []}
    steps = ctx.gradient_accumulation_steps  # micro-batches per optimizer step
    for _ in range(STEPS):
        batch = torch.randint(3, VOCAB, (steps, ctx.dp_world_size, MICRO_BATCH, SEQ + 1),
                              generator=data)
        ctx.comm_stats.reset()
        loss = torch.zeros(())
        for micro in ctx.accumulate(model, [batch[m, ctx.dp_rank] for m in range(steps)]):
            scaled = micro.scale(lm_loss(model, micro.batch, preset))
            scaled.backward()
            loss += scaled.item()
        out["stats"] = ctx.comm_stats.snapshot()
        ref_loss = lm_loss(ref, batch.reshape(-1, SEQ + 1), preset)
        ref_loss.backward()
        # clipping: the norm over parameters on several meshes must be the whole model's
        out["grad_norms"].append(clip_and_unscale_(list(model.parameters()), max_norm=1.0)[0])
        out["ref_grad_norms"].append(clip_and_unscale_(list(ref.parameters()), max_norm=1.0)[0])
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    # each rank's loss is its data-parallel share's: the mean over ranks is the global batch's
    losses = torch.tensor(out["losses"], dtype=torch.float64)
    torch.distributed.all_reduce(losses)
    out["losses"] = (losses / torch.distributed.get_world_size()).tolist()
    out["param_error"] = max(float((full(p.detach()) - r.detach()).abs().max())
                             for p, r in zip(model.parameters(), ref.parameters(), strict=True))
    out["names_kept"] = [n for n, _ in model.named_parameters()] == \
        [n for n, _ in ref.named_parameters()]
    out["plan"] = ctx.plan.to_dict()
    return out, (model, ref)


def assert_matches_one_process(run: dict, *, tol: float = 1e-6) -> None:
    """A :func:`run_parity` result: losses and parameters within ``tol`` of one process, and the
    gradient norms alike (relative 1e-5)."""
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(run["ref_losses"]),
                               atol=tol, rtol=0)
    assert run["param_error"] < tol
    torch.testing.assert_close(torch.tensor(run["grad_norms"]),
                               torch.tensor(run["ref_grad_norms"]), atol=0, rtol=1e-5)


def spawn(worker, *, world: int, per_host: int, result_dir) -> list[dict]:
    """Run ``worker(rank, store_port, result_dir)`` on ``world`` spawned ranks (``per_host`` to a
    simulated host) and return what each pickled to ``result_dir/rank<r>.pkl``."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    # The test process hosts the store (as torch elastic's agent does): no port race.
    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    mp.start_processes(worker, args=(store.port, str(result_dir)), nprocs=world,
                       start_method="spawn")
    per_rank = []
    for rank in range(world):
        with open(Path(result_dir) / f"rank{rank}.pkl", "rb") as f:
            per_rank.append(pickle.load(f))
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank} failed:\n{res['error']}"
    return per_rank


def join(rank: int, port: int, *, world: int, per_host: int) -> None:
    """This process is ``rank`` of the spawned world (what torchrun would set)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_host), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(per_host), GROUP_RANK=str(rank // per_host),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # DTensor's full_tensor() warnings in the checks


def run_worker(rank: int, port: int, result_dir: str, *, world: int, per_host: int,
               body) -> None:
    """A spawned rank: join the world, let ``body(rt, results)`` fill ``results`` (``rt`` is
    ``dtrain.runtime``), and write them, or the traceback that stopped it, for :func:`spawn`."""
    join(rank, port, world=world, per_host=per_host)
    results: dict = {}
    try:
        import dtrain.runtime as rt

        body(rt, results)
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the test process, which fails with it
        results["error"] = traceback.format_exc()
    write(results, result_dir, rank)


def write(results: dict, result_dir: str, rank: int) -> None:
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


class AllocationPeak(TorchDispatchMode):
    """The most bytes of new storages alive at once inside the block: outputs of the ops that run
    in it that are not views or in-place results of their inputs, each counted until the tensor
    that created it is collected (views of it are not followed). Exact for a block's own
    temporaries, unlike the resident set."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive]
        self.now = self.peak = 0

    def _release(self, pointer: int) -> None:
        entry = self.live[pointer]
        entry[1] -= 1
        if not entry[1]:
            self.now -= self.live.pop(pointer)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        plain = [t for t in tree_leaves((args, kwargs)) if type(t) is torch.Tensor]
        known = {t.untyped_storage().data_ptr() for t in plain}
        for tensor in tree_leaves(out):
            if type(tensor) is not torch.Tensor:
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in known or not pointer:
                continue
            entry = self.live.setdefault(pointer, [tensor.untyped_storage().nbytes(), 0])
            if not entry[1]:
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(tensor, self._release, pointer)
        return out
