"""Hugging Face-compatible transformer models. Nothing here imports torch.distributed."""
