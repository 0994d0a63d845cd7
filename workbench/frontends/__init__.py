"""The front doors: the command line, the Python API's helpers, and the Ray and SLURM launchers."""
