"""The ground floor: errors, terminal output, metrics, units, charts, the heap and the builtin models' cache.
Imports nothing of the project's above it."""
