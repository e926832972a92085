"""Pure JAX: tasks, optimizers, learned optimizers, truncation schedules, truncated steps, estimators; no Ray, no I/O."""
