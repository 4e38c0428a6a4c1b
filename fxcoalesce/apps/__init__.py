"""Applications built on the fxcoalesce core: the CLI, tracing, benchmarks, the demo."""
