"""The pipeline rows of ``mics_emulated_cluster.py``: pipeline parallelism across the two emulated
hosts (a stage per host, MiCS-sharded over the host's two workers), on the same model and global
batch as the other rows, and the planner's prediction for them.

The other rows run ``accum`` micro-batches per rank on 4 data-parallel ranks; the pipeline has 2
data-parallel ranks (each stage's pair), so one optimizer step is one pipeline step of
``2 · accum`` micro-batches through 1F1B: the same sequences per optimizer step. Each
data-parallel rank ``r`` reads the tokens the other rows' ranks ``r`` and ``r + 2`` read, and both
stages of a pipeline read the same ones (inputs on the first, targets on the last).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PIPELINE_DEGREE, SCHEDULE = 2, "1f1b"


def distribution(accum: int) -> dict:
    return {"pipeline_parallel_degree": PIPELINE_DEGREE, "sharding_degree": 2,
            "pipeline_schedule": SCHEDULE, "microbatches": PIPELINE_DEGREE * accum,
            "mixed_precision": "fp32", "attention": "sdpa"}


def worker_pipeline(args: argparse.Namespace) -> None:
    """The worker: ``rt.shard`` returns this rank's stage; one optimizer step is one pipeline
    step of ``2 · accum`` micro-batches."""
    import dtrain.runtime as rt
    import torch
    import torch.nn.functional as F
    from _cluster_workers import adamw, build_model, make_batches, timed_steps

    torch.set_num_threads(1)
    ctx = rt.init(distribution=distribution(args.accum))
    torch.manual_seed(0)
    model = build_model(args.model)
    vocab = model.config.vocab_size
    piped = rt.shard(model, ctx, pipeline_sample=(args.micro_batch, args.seq_len))
    opt = adamw(piped)

    def criterion(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    steps = iter(range(10**6))

    def one_step(_rank_batches: list) -> None:
        step = next(steps)
        tokens = torch.cat([batch for rank in (ctx.dp_rank, ctx.dp_rank + PIPELINE_DEGREE)
                            for batch in make_batches(args, vocab, rank=rank, step=step)])
        piped.step(tokens[:, :-1], tokens[:, 1:], criterion)
        opt.step()
        opt.zero_grad()

    result = timed_steps(args, vocab, one_step, stats=ctx.comm_stats)
    if ctx.is_main:
        Path(args.out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def predicted_step(args: argparse.Namespace, work, cluster, *, accum: int) -> float:
    """The planner's step for the row (``dtrain.planning.pipeline.estimate``)."""
    from dtrain.core.parallelism import build_parallelism_plan
    from dtrain.planning import pipeline as pipelining
    from dtrain.planning.model_shape import ModelShape
    from dtrain.runtime.models import from_preset

    config = from_preset(args.model, device="meta").config
    plan = build_parallelism_plan(distribution(accum), world_size=cluster.world_size,
                                  devices_per_node=cluster.gpus_per_node,
                                  num_blocks=config.num_layers)
    shape = ModelShape(source=args.model, num_parameters=work.num_parameters,
                       hidden_size=config.hidden_size, num_layers=config.num_layers,
                       vocab_size=config.vocab_size, seq_len=work.seq_len,
                       micro_batch_size=work.micro_batch_size, num_heads=config.num_heads,
                       intermediate_size=config.intermediate_size)
    return pipelining.estimate(plan, shape, work, cluster, accumulation=1,
                               device_gib=0.0).step.step_s
