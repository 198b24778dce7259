"""The library below both processes: the producer/consumer contract, checkpoints, the target side, the
drafter, CLI helpers, metrics and redaction (docs/architecture.md, "The rooms of the code")."""
