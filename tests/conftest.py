# Import dflash_mlx before anything imports mlx.core, so its BLAS routing applies.
import dflash_mlx  # noqa: F401
