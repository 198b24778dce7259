"""The consumer process: shards from the spool, DFlash drafter training steps, checkpoints."""
