"""Benchmarks: DFlash against plain decoding on standard prompt suites.

`suites` loads prompts, `runner` measures, `metrics` does the arithmetic,
`report` writes JSON/Markdown/PNG, `cli` is `dflash-mlx bench`.
"""
