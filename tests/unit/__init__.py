"""One-process tests: configuration, topology, data, schedules, kernels, monitor, layering and lint rules."""
