"""Training payload: runs on cluster nodes under torchrun (pure PyTorch, fsspec, numpy, pydantic)."""
