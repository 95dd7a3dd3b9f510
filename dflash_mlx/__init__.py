# BLAS routing must run before anything imports mlx.core (see dflash_mlx/blas.py).
from dflash_mlx import blas as _blas

_blas.enable()
