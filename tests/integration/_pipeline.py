"""What the pipeline parity tests share: one parity run of a pipelined model against one process.

Each worker trains the model split by the runtime (pipeline stages, with MiCS and tensor
parallelism when the distribution asks) and, beside it, the same model (same seed) whole in one
process on the same global batch, with SGD. It reports the losses, the clipped gradient norms,
the largest parameter difference, whether the parameter names are the whole model's, the export
gathered from every stage, and one step's communication statistics. With ``meta`` the split model
is built on the meta device and each stage initialised by the runtime: it must start as the
whole model does.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

STEPS, MICRO, SEQ, VOCAB, LAYERS = 3, 2, 8, 512, 4
PRESET = "gpt-neox-tiny"


def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_parity(rt, distribution: dict, *, accumulation: int = 1, meta: bool = False,
               **shard_options) -> dict:
    from dtrain.runtime import torch_private
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.train.optim import clip_and_unscale_
    from torch.distributed.fsdp import FSDPModule

    ctx = rt.init(distribution=distribution)
    torch.manual_seed(0)
    ref = from_preset(PRESET, attention="sdpa", num_hidden_layers=LAYERS)
    # on meta, each rank seeded differently, as a script may: the runtime takes rank 0's seed
    torch.manual_seed(torch.distributed.get_rank())
    model = (from_preset(PRESET, attention="sdpa", num_hidden_layers=LAYERS, device="meta")
             if meta else copy.deepcopy(ref))
    piped = rt.shard(model, ctx, **shard_options)
    opt = torch.optim.SGD(piped.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    m = ctx.plan.microbatches
    out = {"losses": [], "ref_losses": [], "grad_norms": [], "ref_grad_norms": []}
    for _ in range(STEPS):
        step_loss, ref_loss = 0.0, 0.0
        for index in range(accumulation):
            batch = torch.randint(3, VOCAB, (ctx.dp_world_size, m * MICRO, SEQ + 1),
                                  generator=data)
            ctx.comm_stats.reset()
            mine = batch[ctx.dp_rank]
            with ctx.micro_step(piped, boundary=index == accumulation - 1):
                step_loss += piped.step(mine[:, :-1], mine[:, 1:], criterion,
                                        loss_scale=1 / accumulation).item() / accumulation
            out["stats"] = ctx.comm_stats.snapshot()
            whole = batch.reshape(-1, SEQ + 1)
            loss = criterion(ref(whole[:, :-1]), whole[:, 1:]) / accumulation
            loss.backward()
            ref_loss += loss.item()
        # clipping by the whole model's norm: every stage's gradients, summed over the pipeline
        out["grad_norms"].append(clip_and_unscale_(list(piped.parameters()), max_norm=1.0,
                                                   across=piped.pipeline_group)[0])
        out["ref_grad_norms"].append(clip_and_unscale_(list(ref.parameters()), max_norm=1.0)[0])
        out["losses"].append(step_loss)
        out["ref_losses"].append(ref_loss)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    # each rank's loss is its data-parallel share's: the mean over ranks is the global batch's
    losses = torch.tensor(out["losses"], dtype=torch.float64)
    torch.distributed.all_reduce(losses)
    out["losses"] = (losses / torch.distributed.get_world_size()).tolist()
    reference = dict(ref.named_parameters())
    out["names"] = [name for name, _ in piped.named_parameters()]
    out["param_error"] = max(float((full(p.detach()) - reference[name].detach()).abs().max())
                             for name, p in piped.named_parameters())
    exported = piped.gather_full_state_dict()
    if exported:
        ref_state = ref.state_dict()
        out["export_keys_match"] = exported.keys() == ref_state.keys()
        out["export_error"] = max(float((exported[k] - ref_state[k]).abs().max())
                                  for k in ref_state)
    out["reshard_after_forward"] = sorted({
        reshards for module in piped.modules() if isinstance(module, FSDPModule)
        for reshards in torch_private.fsdp_reshards_after_forward(module)})
    out["plan"] = ctx.plan.to_dict()
    out["partition"] = [piped.partition.describe(k) for k in range(piped.partition.num_stages)]
    out["bubble_measured"] = piped.busy_seconds() < piped.step_s
    return out

