"""Side-by-side benchmarks of ``fsdp_custom`` against Lightning's strategies (see ``benchmarks/README.md``)."""
