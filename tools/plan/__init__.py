"""``dflash-plan``: how many of a node's GPUs should produce and how many should train. ``cli.py`` the
model and the command, ``rates.py`` the measured rates it plans from."""
