"""Training metrics: throughput, model FLOPs utilisation, memory, communication.

FLOPs per token (``dtrain.planning.costmodel.flops_per_token``, the planner's own formula)::

    6·N + 12·L·h·s        N parameters, L layers, h hidden size, s sequence length

6·N is the weights' forward (2·N) and backward (4·N) multiply-adds; 12·L·h·s is attention's
QKᵀ and AV products, forward and backward (PaLM, appendix B). With activation checkpointing the
forward runs twice, so ×4/3 — this counts the hardware's work, as the planner does (strictly
"MFU" excludes recomputation; ours is then HFU).

``tflops_per_gpu = flops_per_token × tokens_per_s / world_size / 1e12`` (tokens counted once per
data-parallel rank: a tensor-parallel group trains on one batch) and
``mfu = tflops_per_gpu / peak``, where peak is the instance catalog's dense half-precision
TFLOP/s, the first of: ``DTRAIN_PEAK_TFLOPS`` (set it for a GPU the catalog lacks); the figure of
the job's instance type (``DTRAIN_INSTANCE_TYPE``, else ``SM_CURRENT_INSTANCE_TYPE``); on a GPU
with no such figure (``local_gpu``), the figure of the catalog GPU with the device's model name
(SXM figures: a PCIe card's real peak is lower); else ``dtrain.core.instances.LOCAL_CPU_TFLOPS``
(0.1 TFLOP/s per worker process, a nominal value: CPU MFU is only comparable with itself).

Each logged step goes to stdout (rank 0) in ``dtrain.core.metrics_format``'s line, to
``metrics.jsonl`` in the output data folder, and to TensorBoard when it is installed.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch
from dtrain.core import instances
from dtrain.core.flops import flops_per_token
from dtrain.core.metrics_format import format_metrics

INSTANCE_TYPE_ENV = "DTRAIN_INSTANCE_TYPE"
PEAK_TFLOPS_ENV = "DTRAIN_PEAK_TFLOPS"
JSONL_NAME = "metrics.jsonl"


def model_flops_per_token(model: torch.nn.Module, *, seq_len: int,
                          activation_checkpointing: bool = False) -> float:
    """``flops_per_token`` with N, L, h read from a dtrain model's HF config (N of the whole
    model, also when this rank holds some pipeline stages of it)."""
    config = model.hf_config_dict()
    whole = getattr(model, "num_model_parameters", None)
    return flops_per_token(
        num_parameters=whole or sum(p.numel() for p in model.parameters()),
        num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]),
        seq_len=seq_len, activation_checkpointing=activation_checkpointing,
    )


def instance_type_from_env() -> str:
    return (os.environ.get(INSTANCE_TYPE_ENV) or os.environ.get("SM_CURRENT_INSTANCE_TYPE")
            or "local")


def peak_tflops(instance_type: str, *, device: torch.device) -> tuple[float, bool]:
    """(peak TFLOP/s per device, whether it is the nominal CPU figure); order in the module doc."""
    override = os.environ.get(PEAK_TFLOPS_ENV)
    if override:
        try:
            peak = float(override)
        except ValueError:
            peak = 0.0
        if not peak > 0:
            raise ValueError(f"{PEAK_TFLOPS_ENV}={override!r}: expected a positive number of "
                             "TFLOP/s per device, e.g. 989 for an H100 SXM in bf16")
        return peak, False
    try:
        peak = instances.get(instance_type).peak_tflops
    except ValueError:
        peak = 0.0
    if peak <= 0 and device.type == "cuda":
        peak = instances.gpu_peak_tflops(torch.cuda.get_device_name(device))
    if peak > 0:
        return peak, False
    if device.type == "cuda":
        warnings.warn(f"no peak TFLOP/s known for {torch.cuda.get_device_name(device)!r}: MFU "
                      f"is against the nominal CPU figure; set {PEAK_TFLOPS_ENV}", stacklevel=2)
    return instances.LOCAL_CPU_TFLOPS, True


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA's max allocated bytes, or this process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class MetricsLogger:
    """Writes one record per logging interval (rank 0 only writes; every rank may call)."""

    def __init__(self, *, output_dir: str | Path | None, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tensorboard = None
        if enabled and output_dir is not None:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(out / JSONL_NAME, "a", encoding="utf-8")  # noqa: SIM115
            self._tensorboard = _tensorboard_writer(out / "tensorboard")

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        # 7 significant digits on the console; metrics.jsonl keeps the exact values.
        shown = {key: float(f"{value:.7g}") for key, value in values.items()}
        print(format_metrics(step, **shown), file=self.stream, flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(f"train/{key}", value, step)
            self._tensorboard.flush()

    def close(self) -> None:
        for sink in (self._jsonl, self._tensorboard):
            if sink is not None:
                sink.close()
        self._jsonl = self._tensorboard = None


def _tensorboard_writer(folder: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional: metric lines and JSONL still work
        return None
    return SummaryWriter(log_dir=str(folder))


def throughput_metrics(
    *, tokens: int, seconds: float, flops_per_token: float, world_size: int,
    peak_tflops: float, replicas: int | None = None,
) -> dict[str, float]:
    """tokens_per_s (the job's, each token once), tokens_per_s_per_replica (per data-parallel
    rank: a tensor-parallel group counts as one), tflops_per_gpu and mfu over an interval.

    ``tokens`` counts every token once, however many tensor-parallel ranks shared its work, so
    the FLOPs are the model's (``flops_per_token`` from the full parameter count) spread over
    all ``world_size`` devices, not counted again per shard."""
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = flops_per_token * tokens_per_s / world_size / 1e12
    return {"tokens_per_s": tokens_per_s,
            "tokens_per_s_per_replica": tokens_per_s / (replicas or world_size),
            "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else 0.0}


def comm_metrics(snapshot: dict[str, dict[str, float]], *, steps: int) -> dict[str, float]:
    """This rank's collective bytes per optimizer step, from ``ctx.comm_stats.snapshot()``.

    Calls include the Trainer's own: one 4-byte all-reduce per step (the stop flag) and one per
    logged step (loss and token sums); their bytes are negligible.
    """
    total = snapshot.get("total", {})
    tensor_parallel = snapshot.get("tensor_parallel", {})
    pipeline = snapshot.get("pipeline", {})
    steps = max(steps, 1)
    return {"comm_intra_bytes_per_step": total.get("intra_bytes", 0.0) / steps,
            "comm_inter_bytes_per_step": total.get("inter_bytes", 0.0) / steps,
            "comm_calls_per_step": total.get("calls", 0) / steps,
            # of which tensor parallelism's (inside a node)
            "comm_tp_bytes_per_step": (tensor_parallel.get("intra_bytes", 0.0)
                                       + tensor_parallel.get("inter_bytes", 0.0)) / steps,
            # and pipeline stages' transfers, sent by this rank
            "comm_pp_bytes_per_step": (pipeline.get("intra_bytes", 0.0)
                                       + pipeline.get("inter_bytes", 0.0)) / steps}


def gradient_sync_metrics(sync: Any, *, steps: int) -> dict[str, float]:
    """Per optimizer step, the overlapped gradient sync's all-reduce seconds (``sync_busy_s``)
    and the part of them backward's end waited for (``sync_exposed_s``: what the overlap did not
    hide). This rank's figures; resets the sync's clocks."""
    timing = sync.take_timing()
    steps = max(steps, 1)
    return {"sync_busy_s": timing["busy_s"] / steps, "sync_exposed_s": timing["exposed_s"] / steps}


def pipeline_metrics(pipeline: Any, *, steps: int) -> dict[str, float]:
    """Per pipeline rank, the seconds its stages computed per step (``pp_rank<r>_compute_s``),
    and the measured bubble: the mean share of a step a rank did not compute (waiting for the
    next stage, or idle before the pipeline fills and after it drains). Collective over the
    pipeline's ranks; resets their clocks."""
    import torch.distributed as dist

    mine = torch.tensor([pipeline.busy_seconds(), pipeline.step_s], dtype=torch.float64)
    group = pipeline.pipeline_group
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    pipeline.reset_timing()
    steps = max(steps, 1)
    record = {f"pp_rank{r}_compute_s": float(busy) / steps for r, (busy, _) in enumerate(parts)}
    idle = [1.0 - float(busy) / float(wall) for busy, wall in parts if wall > 0]
    record["pipeline_bubble"] = sum(idle) / len(idle) if idle else 0.0
    return record
