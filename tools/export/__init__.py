"""``dflash-export``: a training checkpoint to a HF-style drafter folder."""
