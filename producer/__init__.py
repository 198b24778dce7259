"""The producer process: a frozen target over a chat dataset, hidden-state shards into the spool."""
