"""Job submission: one launcher interface over torchrun on this machine, Slurm and Kubernetes."""
