"""Things that run on a schedule during training; each keeps its state in the checkpoint."""
