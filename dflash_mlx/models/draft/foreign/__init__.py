"""Draft checkpoints in other engines' layouts: speculators (vLLM's trainer), vLLM's
reduced-vocabulary form; `export-draft` writes them, `load_draft` reads them.

Nothing here imports the draft model: readers turn a foreign checkpoint into z-lab's
layout (config dict + weights + reduced vocabulary) and the loader goes on as usual.
"""
