"""DeepSpeed's ZeRO-3 and MiCS as the side-by-side peer in ``mics_emulated_cluster.py``.

Installed by dtrain's optional ``bench`` extra (``pip install -c constraints.txt
--no-build-isolation -e ".[bench]"``), pinned to DeepSpeed 0.19.2. MiCS was removed from DeepSpeed
in 0.19.7, and 0.19.3–0.19.6 deadlock on a 2 × 2 layout (gradients reduced over all ranks
instead of the shard group), so 0.19.2 is MiCS's last working release; its ZeRO-3 trains with
exact parity here too, so both rows use it. What it takes on gloo (named in the table's header):

* MiCS's parameter gather issues a coalesced all-gather, which gloo does not implement
  (``Backend gloo does not implement startCoalescing``): :func:`packed_all_gather_coalesced`
  replaces it with one all-gather of the same bytes, packed and unpacked around the call;
* MiCS reads processes per host from ``LOCAL_SIZE`` (or ``NDEV_PER_NODE``), not torch elastic's
  ``LOCAL_WORLD_SIZE``;
* the model is built as for every other row and handed to ``MiCS_Init(module=...)``: built
  inside the ``MiCS_Init`` context, the model's own weight initialisation runs on parameters
  already partitioned away and the model trains from other weights;
* ``destroy_process_group()`` at exit, or the workers hang there.

The C++ op DeepSpeed compiles on its first launch (3–4 minutes here) is kept under
``TORCH_EXTENSIONS_DIR`` (``~/.cache/dtrain-bench/torch_extensions`` by default). Before timing,
each row checks parity: one full window's loss and the gradients of the first and last blocks
and the final norm against one process on the global batch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

from _cluster_workers import adamw, build_model, lm_loss, make_batches, timed_steps

DEEPSPEED_VERSION = "0.19.2"
ADAPTATIONS = ("DeepSpeed 0.19.2 (gloo: one packed all-gather for MiCS's coalesced one; "
               "LOCAL_SIZE set; MiCS_Init(module=model))")
PARITY_TOLERANCE = 1e-5


def packed_all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """``deepspeed.comm.all_gather_coalesced`` as one all-gather: the inputs are packed, gathered
    once, and each output gets ``[rank 0's input, rank 1's, ...]`` as the coalesced call gives."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    packed = torch.cat([t.reshape(-1) for t in input_tensors])
    gathered = torch.empty(ranks * packed.numel(), dtype=packed.dtype, device=packed.device)
    dist.all_gather_into_tensor(gathered, packed, group=group)
    per_rank, offset = gathered.view(ranks, -1), 0
    for out, inp in zip(output_tensors, input_tensors):
        out.view(ranks, inp.numel()).copy_(per_rank[:, offset:offset + inp.numel()])
        offset += inp.numel()
    return _Done()


class _Done:
    """The handle of a collective that has already completed."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def deepspeed_config(args: argparse.Namespace, world: int) -> dict:
    zero = {"stage": 3}
    if args.degree < world:
        zero.update(mics_shard_size=args.degree,
                    mics_hierarchical_params_gather=bool(args.hierarchical))
    return {"train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.accum, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def worker_deepspeed(args: argparse.Namespace) -> None:
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    import deepspeed
    import deepspeed.comm
    import torch
    import torch.distributed as dist

    if deepspeed.__version__ != DEEPSPEED_VERSION:
        raise RuntimeError(f"these rows were measured with DeepSpeed {DEEPSPEED_VERSION}; this is "
                           f"{deepspeed.__version__}: pip install -c constraints.txt -e .[bench]")
    torch.set_num_threads(1)
    deepspeed.comm.all_gather_coalesced = packed_all_gather_coalesced
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = deepspeed_config(args, dist.get_world_size())
    torch.manual_seed(0)
    model = build_model(args.model)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    if args.degree < dist.get_world_size():
        deepspeed.zero.MiCS_Init(module=model, config_dict_or_path=config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model), config=config)

    def one_step(batches: list) -> list[float]:
        losses = []
        for batch in batches:
            loss = lm_loss(engine, batch)
            engine.backward(loss)
            losses.append(float(loss))
            if len(losses) < len(batches):
                engine.step()
        return losses

    # parity, in place of a warm-up step: a full window, gradients before the update
    losses = one_step(make_batches(args, model.config.vocab_size, rank=dist.get_rank(), step=0))
    parity = check_parity(args, engine, reference, losses)
    engine.step()
    args.warmup, args.steps = 0, args.steps  # the parity window was the warm-up

    def timed(batches: list) -> None:
        one_step(batches)
        engine.step()

    result = timed_steps(args, model.config.vocab_size, timed, warmup_window=args.accum)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({**result, **parity}))
    dist.destroy_process_group()


def check_parity(args: argparse.Namespace, engine, reference, losses: list[float]) -> dict:
    """Rank 0: this window's mean loss and chosen full gradients against one process on the
    global batch; raises when they differ by more than :data:`PARITY_TOLERANCE`."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    layers = engine.module.config.num_layers
    checked = [n for n, _ in engine.module.named_parameters()
               if ".layers.0." in n or f".layers.{layers - 1}." in n or "final_layer_norm" in n]
    params = dict(engine.module.named_parameters())
    grads = {n: safe_get_full_grad(params[n]) for n in checked}  # collective: every rank
    loss = torch.tensor([sum(losses)], dtype=torch.float64)
    dist.all_reduce(loss)
    if reference is None:
        return {}
    world, vocab = dist.get_world_size(), reference.config.vocab_size
    total = 0.0
    for rank in range(world):
        for batch in make_batches(args, vocab, rank=rank, step=0):
            part = lm_loss(reference, batch) / (world * args.accum)
            part.backward()
            total += float(part)
    ref = dict(reference.named_parameters())
    worst = max(float((grads[n] - ref[n].grad).norm() / ref[n].grad.norm()) for n in checked)
    loss_error = abs(float(loss[0]) / (world * args.accum) - total) / abs(total)
    if worst > PARITY_TOLERANCE or loss_error > PARITY_TOLERANCE:
        raise RuntimeError(f"DeepSpeed parity failed: gradient error {worst:.2e}, loss error "
                           f"{loss_error:.2e} (tolerance {PARITY_TOLERANCE:g})")
    return {"parity_grad_error": worst, "parity_loss_error": loss_error}
