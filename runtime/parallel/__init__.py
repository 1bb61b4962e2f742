"""One file per parallelism technique, applied to the runtime's modules by runtime.models.parallelize."""
