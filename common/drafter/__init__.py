"""The DFlash drafter: its config, model, attention, batches, loss, decoding and HF format."""
