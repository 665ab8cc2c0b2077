"""The SageMaker target: SageMaker training jobs."""
