"""Three dimensions at once: data parallelism (FSDP2) × tensor parallelism (with sequence parallelism) × pipeline
parallelism on one device mesh, proved equal to one process (notebook 17, being written)."""
