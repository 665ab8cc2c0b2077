"""SageMaker's model-parallel v2 (SMP v2) estimator with tensor parallelism, ported to dtrain.

The only change from the SageMaker SDK version is the import of ``PyTorch``
(``from sagemaker.pytorch import PyTorch`` -> ``from dtrain.sagemaker import PyTorch``). SMP's
``tensor_parallel_degree`` becomes dtrain's (1-D, with sequence parallelism, as SMP's is) and
``hybrid_shard_degree`` its MiCS ``sharding_degree`` over the remaining data-parallel ranks;
SMP-only settings dtrain does without are ignored, as the shim ignores the SDK's own. Differences kept small so it runs
outside a notebook: the training script is this repository's ``examples/sagemaker_src/train.py``,
and the bucket name has no underscore. Run it with the SageMaker SDK installed (for
``get_execution_role`` and the image lookup):

    python examples/smp_tensor_parallel_port.py
"""

import os

import sagemaker
from dtrain.sagemaker import PyTorch

HERE = os.path.dirname(os.path.abspath(__file__))

smp_options = {
    "enabled": True,
    "parameters": {
        "tensor_parallel_degree": 8,  # one tensor-parallel group per p4d node
        "hybrid_shard_degree": 2,  # MiCS over the two nodes' data-parallel ranks
        "sm_activation_offloading": False,
        "random_seed": 12345,
    },
}

smp_estimator = PyTorch(
    entry_point="train.py",
    source_dir=os.path.join(HERE, "sagemaker_src"),
    role=sagemaker.get_execution_role(),
    instance_count=2,
    instance_type="ml.p4d.24xlarge",
    framework_version="2.10",
    py_version="py313",
    hyperparameters={"model": "gpt-neox-20b", "seq_len": 2048, "micro_batch_size": 1},
    distribution={
        "torch_distributed": {"enabled": True},
        "smdistributed": {"modelparallel": smp_options},
    },
    base_job_name="tensor-parallel-demo",
)

smp_estimator.fit("s3://my-bucket/my-training-data/")
print(smp_estimator.model_data)
