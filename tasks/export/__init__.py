"""The export step: checkpoints as Hugging Face model folders (hf.py: the format; task.py: the step)."""
