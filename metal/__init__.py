"""Metal kernel sources (installed as dflash_mlx.metal); see dflash_mlx/kernels/selection.py."""
