"""`dflash-mlx doctor`: what this machine will run with."""

import argparse
import json
import platform
import sys


def report() -> dict:
    from dflash_mlx import blas  # importing dflash_mlx already ran blas.enable()

    import mlx.core as mx

    from dflash_mlx.loading import DTYPE_ENV, default_dtype
    from dflash_mlx.packaged import PACKAGED, packaged_draft_dir, packaged_status

    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        backend = "metal" if mx.metal.is_available() else "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "gpu"
    else:
        backend = "cpu"
    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:
        mlx_lm_version = "not installed"
    state = blas.active_blas()
    models = {}
    for name in PACKAGED:
        draft = packaged_draft_dir(name)
        models[name] = {
            "model": packaged_status(name),
            "draft": str(draft) if draft else "none shipped yet (an untrained draft is used)",
        }
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "backend": backend,
        "device": str(device),
        "blas": str(state),
        "blas_fast": state.name != "reference",
        "default_dtype": str(default_dtype()).replace("mlx.core.", ""),
        "dtype_override": f"set {DTYPE_ENV}=float32|float16|bfloat16 or pass --dtype",
        "packaged": models,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dflash-mlx doctor", description="report MLX backend, BLAS, packaged models, default dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    r = report()
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    width = 20
    for key in ("python", "platform", "mlx", "mlx_lm", "backend", "device", "blas", "default_dtype"):
        print(f"{key:<{width}} {r[key]}")
    if not r["blas_fast"] and r["backend"] == "cpu":
        print(f"{'':<{width}} (reference BLAS: CPU matmuls 10-30x slower; pip install cmeel-openblas)")
    print(f"{'dtype':<{width}} {r['dtype_override']}")
    for name, info in r["packaged"].items():
        print(f"{'model ' + name:<{width}} {info['model']}")
        print(f"{'':<{width}} draft: {info['draft']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
