"""Past one process: the Accelerator built from the recipe, the launch command, cluster environments,
stop signals and experiment trackers."""
