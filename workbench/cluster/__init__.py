"""Engines past one machine: what SLURM and Kubernetes tell a process through its environment, and the
job files the workbench writes for them. torchrun (through `workbench launch`) stays the layer that starts ranks."""
