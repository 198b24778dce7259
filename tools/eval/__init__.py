"""``dflash-eval``: speculative decoding with a drafter against its target, and ``--watch``."""
