"""The Trainer: accumulation with MiCS 2-hop sync, clipping, AdamW, LR schedule, checkpoints, metrics.

    ctx = rt.init()
    model = rt.shard(model, ctx)
    trainer = Trainer(model, ctx, loss_fn, config=TrainerConfig(steps=100, lr=3e-4))
    result = trainer.fit(loader)        # resumes from the newest complete checkpoint

``loss_fn(model, batch) -> (loss, tokens)``: the mean loss of one micro-batch and how many
tokens it trained on (for throughput). One optimizer step takes ``gradient_accumulation_steps``
micro-batches; hop 2 of the gradient sync runs only on the last one (see
:mod:`dtrain.runtime.distributed.accumulation`).

Pipeline stages (``shard`` returned a ``PipelineModel``): each accumulation step is one pipeline
step of ``microbatches`` data-loader micro-batches, stacked and run through the schedule; the loss
must be a :class:`SplitLoss` (inputs and targets apart, the criterion on the last stage's output);
the loss is reported on every rank and gradients are clipped by the whole model's norm, summed
over the stages. Each logged step also carries the measured bubble and each pipeline rank's
compute seconds.

Stopping: SIGTERM (a spot interruption, ``dtrain stop``) sets a flag; at the next step boundary
every rank agrees on it (one all-reduce of a flag), a checkpoint is written and ``fit`` returns
with ``preempted=True``; recipes then exit with ``PREEMPTED_EXIT_CODE`` (the node agent reports
that as an interruption, not a crash).

The end: after the last step a checkpoint is written, so it holds everything; then the ranks
vote once more. A stop requested by then skips the model save (``preempted=True``: a resubmitted
job resumes at the last step and only writes the model). A SIGTERM during the model save lets it
finish within the agent's grace period, and ``fit`` returns normally: the job is complete.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dtrain.core import checkpoint_layout
from dtrain.core.contract import (
    PREEMPTED_EXIT_CODE,  # noqa: F401 - recipes' exit code, shared
    STOPPED_EARLY_FILE,
)
from dtrain.runtime.distributed import gradient_sync
from dtrain.runtime.distributed.pipeline import PipelineModel
from dtrain.runtime.train import metrics as m
from dtrain.runtime.train.checkpoint import CheckpointManager, save_hf_model
from dtrain.runtime.train.model_export import (
    MODEL_FORMATS,
    resolve_model_format,
    save_safetensors_model,
)
from dtrain.runtime.train.optim import DynamicLossScaler, build_optimizer, clip_and_unscale_
from dtrain.runtime.train.schedule import WarmupCosine
from torch import nn
from torch.distributed.tensor import DTensor

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, int]]
# Optimizer steps skipped in a row for a non-finite gradient norm before training stops: fp16's
# loss scale halves on each (16 take the default 2**16 to 1), so more means the model or data.
MAX_NONFINITE_STEPS = 20
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitLoss:
    """A loss in the two parts a pipeline needs: ``split(batch) -> (inputs, targets, tokens)``
    on a data-loader batch, ``criterion(outputs, targets) -> mean loss`` on the last stage.
    Called as ``loss_fn(model, batch)`` it runs the whole model, so one loss serves both."""

    split: Callable[[Any], tuple[torch.Tensor, torch.Tensor, int]]
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        inputs, targets, tokens = self.split(batch)
        device = next(model.parameters()).device
        return self.criterion(model(inputs.to(device)), targets.to(device)), tokens


@dataclass(frozen=True)
class TrainerConfig:
    steps: int
    lr: float = 3e-4  # the peak of the Trainer's own AdamW (an optimizer passed in keeps its own)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    log_interval: int = 10
    # None: the job spec's checkpoint.interval_steps and keep_last (the one knob); a value here
    # overrides it, and says so. Interval 0 = only at the end and on SIGTERM.
    checkpoint_interval: int | None = None
    keep_last: int | None = None
    gradient_accumulation_steps: int | None = None  # None: the context's distribution setting
    model_format: str = "auto"  # auto | huggingface | safetensors | none (model_export.py)

    def __post_init__(self) -> None:
        for name in ("steps", "log_interval", "keep_last"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0 (0 = off), got "
                             f"{self.checkpoint_interval}")
        if self.model_format not in MODEL_FORMATS:
            raise ValueError(f"model_format {self.model_format!r} is not one of {MODEL_FORMATS}")


@dataclass
class FitResult:
    step: int
    preempted: bool = False  # stopped by SIGTERM; no model saved (step may be the last one)
    resumed_from: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)  # the logged records


class StopFlag:
    """Set by SIGTERM; read at step boundaries."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


class Trainer:
    def __init__(
        self, model: nn.Module, ctx: Any, loss_fn: LossFn, *, config: TrainerConfig,
        optimizer: torch.optim.Optimizer | None = None, flops_per_token: float = 0.0,
        checkpoint_dir: str | Path | None = None, model_dir: str | Path | None = None,
        output_dir: str | Path | None = None, stop: StopFlag | None = None,
        loss_scaling: bool | None = None,
    ) -> None:
        """``loss_scaling`` defaults to on when the context's mixed precision is fp16."""
        self.model, self.ctx, self.loss_fn, self.config = model, ctx, loss_fn, config
        self.optimizer = optimizer or build_optimizer(
            model, lr=config.lr, weight_decay=config.weight_decay)
        # an optimizer of the user's keeps its groups' learning rates, as the schedule's peaks
        self._peaks = None if optimizer is None else \
            [float(g["lr"]) for g in optimizer.param_groups]
        if self._peaks and any(peak != config.lr for peak in self._peaks):
            logger.warning("Trainer: the optimizer passed in keeps its learning rates %s as the "
                           "schedule's peaks; TrainerConfig.lr=%g applies to the Trainer's own "
                           "optimizer only", self._peaks, config.lr)
        self.schedule = WarmupCosine(config.lr, config.steps, warmup_steps=config.warmup_steps,
                                     min_lr_ratio=config.min_lr_ratio)
        if loss_scaling is None:
            loss_scaling = ctx.config.mixed_precision == "fp16"
        self.scaler = DynamicLossScaler(enabled=loss_scaling)
        self.accumulation = config.gradient_accumulation_steps or ctx.gradient_accumulation_steps
        self.checkpoint_interval = _setting(config.checkpoint_interval, "checkpoint_interval",
                                            ctx.checkpoint_interval_steps,
                                            "checkpoint.interval_steps")
        self.keep_last = _setting(config.keep_last, "keep_last", ctx.checkpoint_keep_last,
                                  "checkpoint.keep_last")
        _setting(config.gradient_accumulation_steps, "gradient_accumulation_steps",
                 ctx.gradient_accumulation_steps, "distribution.gradient_accumulation_steps")
        self.model_format = resolve_model_format(model, config.model_format)
        self.flops_per_token = flops_per_token
        self.checkpoint_dir = Path(checkpoint_dir or ctx.checkpoint_dir)
        self.model_dir = Path(model_dir or ctx.model_dir)
        self.output_dir = Path(output_dir or ctx.output_data_dir)
        self.stop = stop or StopFlag()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.pipeline = model if isinstance(model, PipelineModel) else None
        if self.pipeline is not None and not isinstance(loss_fn, SplitLoss):
            raise ValueError("loss_fn: a model in pipeline stages needs a SplitLoss (its inputs "
                             "go to the first stage, its targets and criterion to the last)")
        self.peak, self.peak_is_nominal = m.peak_tflops(m.instance_type_from_env(),
                                                        device=ctx.device)
        self.step = 0
        self._saved_step: int | None = None  # the step of the last checkpoint saved or loaded
        self._nonfinite = 0  # optimizer steps skipped in a row (non-finite gradient norm)

    def fit(self, loader: Any) -> FitResult:
        """Train to ``config.steps`` optimizer steps, resuming from the newest checkpoint."""
        self.stop.install()
        checkpoints = CheckpointManager(self.checkpoint_dir, keep_last=self.keep_last)
        try:
            result = FitResult(step=0, resumed_from=self._resume(checkpoints, loader))
        except BaseException:  # a checkpoint refused: the caller's SIGTERM is its own again
            self.stop.uninstall()
            raise
        logger = m.MetricsLogger(output_dir=self.output_dir, enabled=self.ctx.is_main)
        window = _Window()
        batches = _epochs(loader)
        self.ctx.comm_stats.reset()  # count training traffic only, not setup and resume
        try:
            while self.step < self.config.steps:
                if self._stop_requested():
                    self._save(checkpoints, loader)
                    result.preempted = True
                    break
                loss, tokens, grad_norm, lr = self.train_step(batches)
                self.step += 1
                window.add(loss, tokens, grad_norm, lr)
                if self.step % self.config.log_interval == 0 or self.step == self.config.steps:
                    record = self._log_record(window)
                    logger.log(self.step, record)
                    result.history.append({"step": self.step, **record})
                    window = _Window()
                interval = self.checkpoint_interval
                if interval and self.step % interval == 0 and self.step < self.config.steps:
                    saving = time.perf_counter()
                    with self.ctx.comm_stats.paused():  # keep saving out of the step metrics
                        self._save(checkpoints, loader)
                    window.start += time.perf_counter() - saving
            if not result.preempted:
                saved = self._finish(checkpoints, loader)
                result.preempted = not saved
        finally:
            logger.close()
            self.stop.uninstall()
        result.step = self.step
        if result.preempted:
            self._note_stopped_early()
        return result

    def _note_stopped_early(self) -> None:
        """Tell this host's node agent that training stopped on a signal (one file per host,
        in ``SM_OUTPUT_DIR``): it reports a stop even if the script then exits 0."""
        output = os.environ.get("SM_OUTPUT_DIR")
        if not output or self.ctx.local_rank != 0:
            return  # not under a node agent, or another rank of this host writes it
        try:
            (Path(output) / STOPPED_EARLY_FILE).write_text(json.dumps({"step": self.step}))
        except OSError as exc:  # the script's exit code can still tell
            logger.warning("could not note the stop in %s: %s", output, exc)

    def train_step(self, batches: Iterator[Any]) -> tuple[torch.Tensor, int, float, float]:
        """One optimizer step; returns (local mean loss, local tokens, grad norm, lr)."""
        steps = self.accumulation
        loss_sum, tokens = torch.zeros(()), 0
        for index in range(steps):
            with self.ctx.micro_step(self.model, boundary=index == steps - 1):
                loss, batch_tokens = self._forward_backward(batches, scale=self.scaler.scale / steps)
            loss_sum += _local_value(loss.detach()).float().cpu()
            tokens += batch_tokens
        grad_norm, scaled_norm = clip_and_unscale_(
            self.params, max_norm=self.config.max_grad_norm, loss_scale=self.scaler.scale,
            across=self.pipeline.pipeline_group if self.pipeline else None)
        lr = self.schedule.apply(self.optimizer, self.step, self._peaks)
        scale = self.scaler.scale
        if self.scaler.update(scaled_norm):
            self.optimizer.step()
            self._nonfinite = 0
        else:
            self._skip_nonfinite(loss_sum / steps, scaled_norm, scale=scale)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / steps, tokens, grad_norm, lr

    def _skip_nonfinite(self, loss: torch.Tensor, scaled_norm: float, *, scale: float) -> None:
        """An optimizer step skipped (every rank alike: the norm is global); say so, and stop
        training after :data:`MAX_NONFINITE_STEPS` in a row rather than run on unchanged."""
        self._nonfinite += 1
        step = self.step + 1
        if self.scaler.enabled:
            logger.info("step %d: gradients overflowed at loss scale %g; optimizer step "
                        "skipped, scale now %g", step, scale, self.scaler.scale)
        else:
            logger.warning("step %d: gradient norm %s (this rank's loss %s); optimizer step "
                           "skipped", step, scaled_norm, float(loss))
        if self._nonfinite >= MAX_NONFINITE_STEPS:
            raise FloatingPointError(
                f"training stopped at step {step}: the gradient norm was not finite for "
                f"{self._nonfinite} steps in a row, so the model stopped changing (this rank's "
                f"loss {float(loss)}); the last checkpoint holds the model before them. Lower "
                "lr, check the data for bad values, or use bf16 or fp32 instead of fp16")

    def _forward_backward(self, batches: Iterator[Any], *, scale: float
                          ) -> tuple[torch.Tensor, int]:
        """One micro-step (a pipeline step of ``microbatches`` batches under pipelining)."""
        if self.pipeline is None:
            result = self.loss_fn(self.model, next(batches))
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TypeError(
                    f"Trainer: loss_fn returned {type(result).__name__}; it must return "
                    "(loss, tokens): the mean loss of the batch and how many tokens (or "
                    "samples) it averaged over, which weigh the ranks' losses and count "
                    "throughput")
            loss, tokens = result
            (loss * scale).backward()
            return loss, tokens
        parts = [self.loss_fn.split(next(batches)) for _ in range(self.pipeline.microbatches)]
        inputs, targets = (torch.cat([part[i] for part in parts]) for i in (0, 1))
        loss = self.pipeline.step(inputs, targets, self.loss_fn.criterion, loss_scale=scale)
        return loss, sum(part[2] for part in parts)

    def _stop_requested(self) -> bool:
        flag = torch.tensor([1.0 if self.stop.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks stop at the same step
        return bool(flag.item())

    def _finish(self, checkpoints: CheckpointManager, loader: Any) -> bool:
        """The last checkpoint, then the model; False when a stop came before the model save."""
        self._save(checkpoints, loader)
        if self._stop_requested():
            return False
        # Still under the stop flag: a SIGTERM now lets the save finish (within the agent's
        # grace period) instead of killing this rank half-way through the model.
        if self.model_format == "huggingface":
            save_hf_model(self.model, self.model_dir)
        elif self.model_format == "safetensors":
            save_safetensors_model(self.model, self.model_dir)
        return True

    def _trainer_state(self, loader: Any) -> dict[str, Any]:
        data = loader.state_dict() if hasattr(loader, "state_dict") else None
        # total_steps lets the node agent tell a stop after the last step from one before it.
        return {"data": data, "loss_scaler": self.scaler.state_dict(),
                "total_steps": self.config.steps}

    def _save(self, checkpoints: CheckpointManager, loader: Any) -> None:
        """A checkpoint of this step, unless it has one already (saved at an interval, or
        resumed from, just before a stop or the end): rewriting it only spends the grace
        period."""
        if self._saved_step == self.step or self.step == 0:
            # step 0: nothing trained, and an optimizer without state would be saved with a
            # made-up one (torch initialises it with a zero-gradient step)
            return
        checkpoints.save(self.step, self.model, self.optimizer, self._trainer_state(loader))
        self._saved_step = self.step

    def _resume(self, checkpoints: CheckpointManager, loader: Any) -> int | None:
        path = checkpoints.latest()
        if path is None:
            return None
        saved_step = checkpoint_layout.step_of(path)
        if saved_step > self.config.steps:  # it would train nothing, and end Completed
            raise ValueError(
                f"checkpoint {path} is at step {saved_step}, past the {self.config.steps} steps "
                f"this run trains to; give steps above {saved_step} to train on from it (the "
                "learning-rate schedule then spans the new steps), or start afresh with a new "
                "checkpoint location (checkpoint.uri)")
        state = checkpoints.load(path, self.model, self.optimizer)
        self.step = self._saved_step = int(state["step"])
        self.scaler.load_state_dict(state["loss_scaler"])
        if state.get("data") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state["data"])
        elif hasattr(loader, "load_state_dict"):
            logger.warning("resumed at step %d, but the checkpoint holds no data position (the "
                           "run that saved it had a loader without state_dict): the data "
                           "starts from the beginning again", self.step)
        else:
            logger.warning("resumed at step %d, but the loader (%s) has no load_state_dict: it "
                           "starts its data from the beginning again (DistributedTokenLoader "
                           "resumes where the checkpoint left it)", self.step,
                           type(loader).__name__)
        if self.ctx.is_main:
            left = ("" if self.step < self.config.steps else
                    f"; that is the last of its {self.config.steps} steps: nothing left to train")
            print(f"dtrain: resumed from {path} at step {self.step}{left}", flush=True)
        return self.step

    def _log_record(self, window: _Window) -> dict[str, float]:
        # One all-reduce for the loss and token sums of the whole interval.
        sums = torch.tensor([float(window.loss_sum), float(window.tokens)], dtype=torch.float64)
        dist.all_reduce(sums)
        world = dist.get_world_size()
        seconds = time.perf_counter() - window.start
        record = {"loss": sums[0].item() / (world * window.steps), "lr": window.lr,
                  "grad_norm": window.grad_norm}
        # A tensor-parallel group, a pipeline, train on one batch: their tokens count once.
        plan = getattr(self.ctx, "plan", None)
        record.update(m.throughput_metrics(
            tokens=round(sums[1].item() / (plan.tp * plan.pp if plan else 1)), seconds=seconds,
            flops_per_token=self.flops_per_token, world_size=world, peak_tflops=self.peak,
            replicas=plan.dp_degree if plan else world))
        record["peak_memory_bytes"] = float(m.peak_memory_bytes(self.ctx.device))
        record.update(m.comm_metrics(self.ctx.comm_stats.snapshot(), steps=window.steps))
        if self.pipeline is not None:
            record.update(m.pipeline_metrics(self.pipeline, steps=window.steps))
        elif (sync := gradient_sync.attached(self.model)) is not None:
            record.update(m.gradient_sync_metrics(sync, steps=window.steps))
        self.ctx.comm_stats.reset()
        if self.scaler.enabled:
            record["loss_scale"] = self.scaler.scale
        return record


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: tensor parallelism's loss is a replicated DTensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _epochs(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch: training runs for ``steps`` optimizer steps,
    whatever the loader's length (a ``DistributedSampler``'s ``set_epoch`` reshuffles each)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty and not epoch:
            raise ValueError(f"the loader ({type(loader).__name__}) yields no batches")
        if empty:
            raise ValueError(
                f"the loader ({type(loader).__name__}) has no more batches after {epoch} "
                "epoch(s): an iterator runs only once; pass something that can be iterated "
                "again (a DataLoader, a list) or lower steps")
        epoch += 1
        logger.info("the loader's epoch %d has ended: starting epoch %d", epoch, epoch + 1)


def _setting(value: int | None, name: str, job_value: int, job_field: str) -> int:
    """``value`` when given (logged when it overrides the job's), else the job's."""
    if value is None:
        return job_value
    if value != job_value:
        logging.getLogger(__name__).warning("TrainerConfig.%s=%d overrides the job's %s=%d",
                                            name, value, job_field, job_value)
    return value


class _Window:
    """What one logging interval accumulates."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.loss_sum, self.tokens, self.steps = torch.zeros((), dtype=torch.float64), 0, 0
        self.grad_norm = self.lr = 0.0

    def add(self, loss: torch.Tensor, tokens: int, grad_norm: float, lr: float) -> None:
        self.loss_sum += loss.double()
        self.tokens += tokens
        self.steps += 1
        self.grad_norm, self.lr = grad_norm, lr
