"""Checkpoints: storage backends (a folder or S3), the checkpoint format, saving and loading."""
