"""``Estimator``: the SageMaker-SDK-shaped way to run a dtrain job from Python.

    est = Estimator(entry_point="train.py", source_dir="src", instance_type="local",
                    instance_count=2, hyperparameters={"epochs": 1})
    est.fit({"train": "data/"})

It builds the same ``JobSpec`` a YAML file would and calls ``dtrain.jobs.api.submit``; SMP-style
``distribution`` dicts are translated by the spec, so SageMaker code ports by changing an import.
"""

from __future__ import annotations

from typing import Any

from dtrain.jobs.store import JobRecord

LOCAL_INSTANCE_TYPES = ("local", "local_gpu")
DEFAULT_CHANNEL = "training"  # the SageMaker SDK's channel name for a single input


def _copy(section: Any, extra: dict[str, Any] | None = None) -> Any:
    """A copy of a mapping argument with ``extra`` added (None: an empty one); anything else as
    given, for the spec's validation to name."""
    if section is None:
        return dict(extra or {})
    return {**section, **(extra or {})} if isinstance(section, dict) else section


class Estimator:
    def __init__(self, *, entry_point: str, source_dir: str | None = None,
                 instance_type: str = "local", instance_count: int = 1,
                 processes_per_instance: int | None = None,
                 hyperparameters: dict[str, Any] | None = None,
                 distribution: dict[str, Any] | None = None, target: str | None = None,
                 name: str | None = None, base_job_name: str | None = None,
                 output_path: str | None = None, environment: dict[str, str] | None = None,
                 max_run: int | str | None = None, max_restarts: int | None = None,
                 use_spot_instances: bool = False, checkpoint_s3_uri: str | None = None,
                 max_wait: int | str | None = None, volume_size: int | None = None,
                 price_per_hour: float | None = None, oversubscribe: bool | None = None,
                 role: str | None = None,
                 tags: dict[str, str] | list[dict[str, str]] | None = None,
                 checkpoint: dict[str, Any] | None = None,
                 sagemaker: dict[str, Any] | None = None, ec2: dict[str, Any] | None = None,
                 slurm: dict[str, Any] | None = None, clients: dict[str, Any] | None = None):
        """The job spec's fields as keyword arguments (SageMaker SDK names where it has one:
        ``use_spot_instances``, ``volume_size``, ``checkpoint_s3_uri``, ``role``); ``checkpoint``,
        ``sagemaker``, ``ec2`` and ``slurm`` are the spec's sections of those names (``role``
        goes into ``sagemaker``, ``checkpoint_s3_uri`` into ``checkpoint``); the inputs are
        ``fit``'s. ``base_job_name`` is made a valid name (``my_job`` -> ``my-job``), as the
        SageMaker SDK does; ``name`` is taken as given."""
        from dtrain.core import names

        compute: dict[str, Any] = {
            "target": target or ("local" if instance_type in LOCAL_INSTANCE_TYPES
                                 else "sagemaker"),
            "instance_type": instance_type, "instance_count": instance_count,
            "use_spot": use_spot_instances,
        }
        mpi = distribution.get("mpi") if isinstance(distribution, dict) else None
        if processes_per_instance is None and isinstance(mpi, dict):  # an SMP estimator's
            processes_per_instance = mpi.get("processes_per_host")  # distribution says it there
        optional = {"processes_per_instance": processes_per_instance, "max_run": max_run,
                    "max_restarts": max_restarts, "max_wait": max_wait,
                    "volume_size_gb": volume_size, "price_per_hour": price_per_hour,
                    "oversubscribe": oversubscribe}
        compute.update({k: v for k, v in optional.items() if v is not None})
        self.spec_data: dict[str, Any] = {
            "name": name or (names.sanitize(base_job_name) if base_job_name else None),
            "entry_point": entry_point, "source_dir": source_dir,
            # copies, so a caller's later change does not reach the job; what is not a mapping
            # goes as given, and the spec's validation names its field
            "hyperparameters": _copy(hyperparameters), "compute": compute,
            "distribution": _copy(distribution), "output_path": output_path,
            "environment": _copy(environment), "tags": tags or {},
        }
        sections = {"sagemaker": _copy(sagemaker, {"role": role} if role else {}),
                    "checkpoint": _copy(checkpoint,
                                        {"uri": checkpoint_s3_uri} if checkpoint_s3_uri else {}),
                    "ec2": _copy(ec2), "slurm": _copy(slurm)}
        self.spec_data.update({key: value for key, value in sections.items() if value})
        self.clients = clients
        self.latest_job: JobRecord | None = None

    def spec(self, inputs: str | dict[str, str] | None = None):
        """The validated JobSpec ``fit`` would submit (raises SpecError with every problem)."""
        from dtrain.spec.model import JobSpec

        data = {k: v for k, v in self.spec_data.items() if v is not None}
        if inputs:
            data["inputs"] = {DEFAULT_CHANNEL: inputs} if isinstance(inputs, str) else dict(inputs)
        return JobSpec.from_dict(data)

    @classmethod
    def attach(cls, job: str, *, clients: dict[str, Any] | None = None) -> Estimator:
        """An Estimator for a job already submitted (id, id prefix or name), from the store."""
        from dtrain.jobs import api as jobs

        record = jobs.get(job, clients=clients)
        spec = record.spec or {}
        estimator = cls(entry_point=spec.get("entry_point", "unknown"), clients=clients)
        estimator.spec_data = {**estimator.spec_data, **spec}
        estimator.latest_job = record
        return estimator

    @property
    def model_data(self) -> str | None:
        """Where the finished job's model artifacts are (S3 URI or local folder)."""
        from dtrain.core.errors import DtrainError
        from dtrain.jobs import api as jobs

        if self.latest_job is None:
            raise DtrainError("model_data: this estimator has no job yet; call fit() or attach()")
        record = jobs.get(self.latest_job.id, clients=self.clients)
        self.latest_job = record
        return (record.target_data or {}).get("model_data") or record.output_location

    def fit(self, inputs: str | dict[str, str] | None = None, *, wait: bool = True,
            follow: bool = False) -> JobRecord:
        """Submit the job; with ``wait`` return once it completed and its target removed what
        it created for it (EC2: its groups, at most 5 min more), or raise DtrainError with why
        it failed or stopped, as ``dtrain submit`` does (the record is in ``latest_job``).
        ``follow`` prints its log lines as they come."""
        from dtrain.core.errors import DtrainError
        from dtrain.jobs import api as jobs

        self.latest_job = jobs.submit(self.spec(inputs), wait=wait, follow=follow,
                                      clients=self.clients,
                                      on_line=print if follow else None)
        problem = jobs.not_completed(self.latest_job, clients=self.clients) if wait else None
        if problem:
            raise DtrainError(problem)
        return self.latest_job
