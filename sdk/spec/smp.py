"""Translate SageMaker model-parallel (SMP) distribution dicts into dtrain's distribution.

So that estimator code written for SMP v1 (``sharded_data_parallel_degree``,
``ddp_dist_backend``, ``tensor_parallel_degree``, ``pipeline_parallel_degree``/``partitions``,
``microbatches``, ``pipeline``, ``auto_partition``, ``active_microbatches``) or SMP v2
(``hybrid_shard_degree``, ``tensor_parallel_degree``) ports by changing an import. SMP's tensor
parallelism is 1-D (Megatron-style) with the sequence split over the group, which is what dtrain's
``1d`` mode with ``sequence_parallel: auto`` runs. SMP v1's pipeline ``interleaved`` alternates
one forward and one backward per micro-batch (dtrain's ``1f1b``; dtrain's ``interleaved-1f1b``
is the virtual-stage schedule, which SMP does not have), ``simple`` runs all forwards first
(``gpipe``).
"""

from __future__ import annotations

from typing import Any

# SMP parameters that mean the same as a dtrain setting.
_DEGREE_KEYS = ("sharded_data_parallel_degree", "hybrid_shard_degree")
# Parallelism dtrain does not implement: a degree above 1 is an error, 1 is fine.
_UNSUPPORTED_DEGREES = ("expert_parallel_degree", "context_parallel_degree")
_PIPELINE_KEYS = ("pipeline_parallel_degree", "partitions", "microbatches", "pipeline",
                  "auto_partition", "active_microbatches")
_SMP_SCHEDULES = {"interleaved": "1f1b", "simple": "gpipe"}
WRAPPER_KEYS = ("smdistributed", "torch_distributed", "pytorchddp", "mpi")


def translate_distribution(data: Any) -> tuple[Any, list[str]]:
    """Return ``(dtrain distribution dict, notes)``; non-SMP input is returned unchanged."""
    if not isinstance(data, dict) or not any(k in data for k in WRAPPER_KEYS):
        return data, []
    notes: list[str] = []
    out: dict[str, Any] = {}  # what the SMP settings translate to
    if _enabled(data.get("pytorchddp")):
        out.setdefault("sharding_degree", 1)
    if "mpi" in data:
        notes.append("distribution.mpi is not used: dtrain starts workers with torch elastic; "
                     "processes per host are compute.processes_per_instance "
                     "(dtrain.Estimator and dtrain.sagemaker.PyTorch read "
                     "mpi.processes_per_host into it)")
    smp = data.get("smdistributed")
    if isinstance(smp, dict):
        if _enabled(smp.get("dataparallel")):  # SageMaker's data-parallel library: DDP
            out["sharding_degree"] = 1
            notes.append("distribution.smdistributed.dataparallel: plain data parallel "
                         "(sharding_degree 1), with dtrain's gradient all-reduce for SMDDP's")
        for key in smp:
            if key not in ("modelparallel", "dataparallel"):
                notes.append(f"distribution.smdistributed.{key} is ignored by dtrain")
        mp = smp.get("modelparallel")
        if isinstance(mp, dict) and mp.get("enabled", True):
            params = mp.get("parameters", {})
            if not isinstance(params, dict):
                raise ValueError(
                    "smdistributed.modelparallel.parameters: expected a mapping, got "
                    f"{type(params).__name__}"
                )
            _translate_parameters(params, out, notes)
    # dtrain's own fields given beside the SMP dict (or by --set) win over the translation
    given = {k: v for k, v in data.items() if k not in WRAPPER_KEYS}
    for key, value in given.items():
        if key in out and out[key] != value:
            notes.append(f"distribution.{key} {value!r} is used over the {out[key]!r} the SMP "
                         "settings translate to")
    return {**out, **given}, notes


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", True))


def _translate_parameters(params: dict, out: dict, notes: list[str]) -> None:
    for key, value in params.items():
        where = f"smdistributed.modelparallel.parameters.{key}"
        if key in _PIPELINE_KEYS:
            continue  # below, together
        if key in _DEGREE_KEYS:
            # SMP v2 uses 0 for "shard over every GPU".
            out["sharding_degree"] = "full" if value == 0 else value
        elif key == "tensor_parallel_degree":
            out["tensor_parallel_degree"] = value
        elif key == "ddp_dist_backend":
            out["backend"] = "auto" if value == "smddp" else value
            if value == "smddp":
                notes.append(f"distribution.{where} smddp: dtrain's backend auto (NCCL on GPUs, "
                             "with dtrain's topology-aware collectives)")
        elif key in ("bf16", "fp16") and value is True:
            out["mixed_precision"] = key
        elif key in ("activation_checkpointing", "gradient_accumulation_steps"):
            out[key] = value
        elif key in _UNSUPPORTED_DEGREES:
            if value not in (0, 1):
                raise ValueError(
                    f"{where} = {value!r}: dtrain runs sharded data parallel (MiCS), tensor and "
                    "pipeline parallelism, not this; remove it and use "
                    "sharded_data_parallel_degree / tensor_parallel_degree / "
                    "pipeline_parallel_degree"
                )
        else:
            notes.append(f"distribution.{where} is not used by dtrain and was ignored")
    _translate_pipeline(params, out, notes)


def _translate_pipeline(params: dict, out: dict, notes: list[str]) -> None:
    """SMP v1's pipeline settings: ``partitions`` is the older name of the degree."""
    where = "smdistributed.modelparallel.parameters"
    degrees = {params[k] for k in ("pipeline_parallel_degree", "partitions") if k in params}
    if len(degrees) > 1:
        raise ValueError(f"{where}: pipeline_parallel_degree and partitions are the same setting "
                         f"but differ ({sorted(degrees, key=str)}); keep one")
    degree = degrees.pop() if degrees else 1
    if degree not in (0, 1):
        out["pipeline_parallel_degree"] = degree
    elif any(k in params for k in _PIPELINE_KEYS[2:]):
        notes.append(f"distribution.{where}: microbatches, pipeline, auto_partition and "
                     "active_microbatches apply to pipeline_parallel_degree above 1; ignored")
        return
    if degree not in (0, 1) and ("microbatches" not in params or "pipeline" not in params):
        notes.append(f"distribution.{where}: SMP's pipeline defaults (pipeline interleaved, 1 "
                     "micro-batch) are not copied; dtrain plans the schedule and micro-batches "
                     "(pipeline_schedule, microbatches: auto); give both to keep SMP's")
    if "microbatches" in params:
        out["microbatches"] = params["microbatches"]
    if "pipeline" in params:
        kind = params["pipeline"]
        if kind not in _SMP_SCHEDULES:
            raise ValueError(f"{where}.pipeline = {kind!r}: SMP's pipelines are interleaved or "
                             "simple")
        out["pipeline_schedule"] = _SMP_SCHEDULES[kind]
    if "auto_partition" in params:
        out["partition"] = "auto" if params["auto_partition"] else "uniform"
        if not params["auto_partition"]:
            notes.append(f"distribution.{where}.auto_partition false: dtrain does not read "
                         "smp.partition() in the script; the blocks are split uniformly (set "
                         "distribution.partition to a list of block indices to choose the cuts)")
    active = params.get("active_microbatches")
    if active is not None and active < params.get("microbatches", 1):
        # GPipe keeps every micro-batch in flight; 1F1B at most pipeline_parallel_degree.
        out["pipeline_schedule"] = "1f1b"
        notes.append(f"distribution.{where}.active_microbatches {active}: pipeline_schedule 1f1b, "
                     f"which keeps at most pipeline_parallel_degree ({degree}) micro-batches in "
                     "flight on a rank")
