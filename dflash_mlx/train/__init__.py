"""Training recipe for DFlash drafts (`dflash-mlx train`)."""
