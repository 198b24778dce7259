"""``dflash-demo``: the whole pipeline on the CPU from an embedded default."""
