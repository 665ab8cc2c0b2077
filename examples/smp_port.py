"""SageMaker's sharded-data-parallel (SMP) estimator example, ported to dtrain.

The only change from the SageMaker SDK version is the import of ``PyTorch``
(``from sagemaker.pytorch import PyTorch`` -> ``from dtrain.sagemaker import PyTorch``).
Differences kept deliberately small so it runs outside a notebook: the training script is this
repository's ``examples/sagemaker_src/train.py``, and the bucket name has no underscore (S3 rejects
those). Run it with the SageMaker SDK installed (for ``get_execution_role`` and the image lookup):

    python examples/smp_port.py
"""

import os

import sagemaker
from dtrain.sagemaker import PyTorch

HERE = os.path.dirname(os.path.abspath(__file__))

smp_options = {
    "enabled": True,
    "parameters": {
        "ddp": True,
        "sharded_data_parallel_degree": 8,  # one MiCS partition group per p4d node
        "ddp_dist_backend": "auto",
        "partitions": 1,
        "bf16": True,
    },
}

mpi_options = {
    "enabled": True,
    "processes_per_host": 8,
}

smp_estimator = PyTorch(
    entry_point="train.py",
    source_dir=os.path.join(HERE, "sagemaker_src"),
    role=sagemaker.get_execution_role(),
    instance_count=2,
    instance_type="ml.p4d.24xlarge",
    framework_version="2.10",
    py_version="py313",
    distribution={
        "smdistributed": {"modelparallel": smp_options},
        "mpi": mpi_options,
    },
    base_job_name="sharded-data-parallel-demo",
)

smp_estimator.fit("s3://my-bucket/my-training-data/")
print(smp_estimator.model_data)
