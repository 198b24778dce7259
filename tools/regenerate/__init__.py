"""``dflash-regenerate``: a chat dataset with its assistant turns written by the target itself."""
