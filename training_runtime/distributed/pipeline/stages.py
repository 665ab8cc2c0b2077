"""A rank's part of a pipelined model and the schedule that drives it.

:class:`PipelineModel` is what ``dtrain.runtime.shard`` returns under pipeline parallelism: an
``nn.Module`` holding this rank's stages under the whole model's parameter names, so the
optimizer, ``get_state_dict`` and DCP see one model with the usual names (a checkpoint holds every
stage's keys, each written by the ranks that own them). Its :meth:`~PipelineModel.step` runs one
pipeline step of ``torch.distributed.pipelining``: the first stage's ranks feed the micro-batches,
the last stage's compute the loss, and every rank returns the step's mean loss.

Gradients: the schedule keeps each micro-batch's gradient unreduced until the step's last backward
(``perform_reduce_grad``), so the data-parallel reduction runs once per step. Its own averaging
over micro-batches (``scale_grads``) is off: the loss of each micro-batch is scaled instead, so
several steps of gradient accumulation add up to the mean over all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dtrain.core.pipeline import SCHEDULES
from dtrain.runtime.distributed.pipeline.units import StageModule, graft
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TimedStage(PipelineStage):
    """A pipeline stage that adds up the seconds it computes (forward, backward, weight
    gradients): the rest of a step is the bubble and waiting on transfers."""

    busy_s = 0.0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    def _timed(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


class PipelineModel(nn.Module):
    """This rank's stages; see the module docstring. ``forward`` is the schedule's: call
    :meth:`step`."""

    def __init__(self, stage_modules: list[StageModule], *, stage_indices: tuple[int, ...],
                 num_stages: int, schedule: str, microbatches: int, mesh: DeviceMesh,
                 device: torch.device, num_model_parameters: int, hf_config: dict) -> None:
        super().__init__()
        for module in stage_modules:
            for path in module.unit_paths:
                graft(self, path, module.get_submodule(path))
        group = mesh.get_group("pp")
        # a DTensor crossing a cut (sequence parallelism's activations) names its mesh by axes
        self.stages = [TimedStage(module, index, num_stages, device, group=group,
                                  get_mesh=lambda names, _layout: mesh[names])
                       for module, index in zip(stage_modules, stage_indices)]
        self.stage_modules = stage_modules  # a plain list: not registered, names stay the model's
        self.schedule_name, self.microbatches, self.pipeline_group = schedule, microbatches, group
        self.num_model_parameters = num_model_parameters
        self._hf_config = hf_config
        # what a checkpoint records as the parameters' layout: the family's, not this class's
        self.model_type = stage_modules[0].model_type
        self.state_layout = stage_modules[0].state_layout
        self._criterion: Criterion | None = None
        self._loss_scale = 1.0
        self._losses: list[torch.Tensor] = []
        self.step_s = 0.0
        torch_class = getattr(schedules, SCHEDULES[schedule].torch_class)
        stages = self.stages if SCHEDULES[schedule].multi_stage else self.stages[0]
        self.schedule = torch_class(stages, microbatches, loss_fn=self._loss, scale_grads=False)

    @property
    def has_first_stage(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a pipelined model runs through its schedule: call model.step(inputs, "
                        "targets, criterion) (the Trainer does)")

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._criterion(output, target)
        value = loss.detach()
        self._losses.append((value.full_tensor() if hasattr(value, "full_tensor") else value)
                            .float())  # a DTensor under the tensor-parallel loss
        return loss * (self._loss_scale / self.microbatches)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, criterion: Criterion, *,
             loss_scale: float = 1.0) -> torch.Tensor:
        """One pipeline step over ``inputs`` (``microbatches`` equal slices along dim 0) and
        their ``targets``: ``loss_scale`` times the gradient of the micro-batches' mean loss adds
        up in the parameters' ``.grad``. Returns that mean loss, the same on every rank
        (collective over the pipeline's ranks)."""
        if inputs.shape[0] % self.microbatches:
            raise ValueError(f"a pipeline step of {inputs.shape[0]} sequences does not split into "
                             f"{self.microbatches} equal micro-batches")
        self._criterion, self._loss_scale, self._losses = criterion, loss_scale, []
        device = self.stages[0].device
        args = (inputs.to(device),) if self.has_first_stage else ()
        kwargs = {"target": targets.to(device), "losses": []} if self.has_last_stage else {}
        start = time.perf_counter()
        self.schedule.step(*args, **kwargs)
        self.step_s += time.perf_counter() - start
        mean = torch.zeros((), dtype=torch.float64)
        if self.has_last_stage:
            # the first step's shape inference may call the loss once more: keep the real ones
            mean += torch.stack(self._losses[-self.microbatches:]).double().mean().cpu()
        dist.all_reduce(mean, group=self.pipeline_group)  # from the last stage to every rank
        return mean.float()

    def busy_seconds(self) -> float:
        return sum(stage.busy_s for stage in self.stages)

    def reset_timing(self) -> None:
        self.step_s = 0.0
        for stage in self.stages:
            stage.busy_s = 0.0

    def hf_config_dict(self) -> dict:
        return dict(self._hf_config)

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's full tensors on global rank 0 (empty elsewhere): each stage's
        full state, gathered along rank 0's pipeline (collective)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local = {k: v.detach().cpu() for k, v in
                 get_model_state_dict(self, options=options).items()}
        ranks = dist.get_process_group_ranks(self.pipeline_group)
        if 0 not in ranks:
            return {}
        parts: list[Any] = [None] * len(ranks) if dist.get_rank() == 0 else None
        dist.gather_object(local, parts, dst=0, group=self.pipeline_group)
        return {k: v for part in parts or [] for k, v in part.items()}

