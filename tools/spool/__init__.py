"""``dflash-spool``: look at a spool or a shard, and clean up after runs. ``cli.py`` the command line,
``view.py`` the read-only commands (stats, inspect), ``upkeep.py`` the writing ones (prepare, free, gc),
``audit.py`` the exactly-once audit of a run's sample ledgers."""
