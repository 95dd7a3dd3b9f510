"""Terminal chat app (installed as dflash_mlx.tui)."""
