"""This machine and the machines a recipe is planned for: one place for every hardware question.

- `current`: which device this process is on, how many processes and machines the launch has, the CPU's name;
- `probes`: every measurement of this machine (matmul rates, the training runtime's memory, attention costs),
  kept in one cache on disk and measured at most once per process;
- `catalogue`: the devices the estimator plans for, their memory and peak FLOP/s.

The package itself imports nothing: its modules are light (torch is imported where a probe runs).
"""
