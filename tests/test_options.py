"""dflash_mlx.options: one block-size parser, one options check, one set of flags."""

import argparse

import pytest

from dflash_mlx.options import GenerationOptions, add_generation_args, fixed_width, parse_block_size


@pytest.mark.parametrize("text, want", [
    ("auto", "auto"), ("AUTO", "auto"), (" auto ", "auto"), ("16", 16), (" 4 ", 4), ("1", 1),
    (8, 8), ("", "auto"), ("  ", "auto"), (None, "auto"), ("draft", "draft"), (" Draft ", "draft"),
])
def test_block_size_spellings(text, want):
    assert parse_block_size(text) == want


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "sixteen", "16x", 0, True, 2.0, [4]])
def test_bad_block_size_one_message(text):
    with pytest.raises(ValueError) as e:
        parse_block_size(text)
    assert str(e.value) == ("block size takes 'auto' (default), 'draft' (the draft's own block size) "
                            f"or a whole number >= 1, got {text!r}")


def test_defaults_pass_and_block_size_is_normalised():
    o = GenerationOptions(block_size=" Auto ").check()
    assert o.block_size == "auto"
    assert GenerationOptions(block_size="12").check().block_size == 12
    assert GenerationOptions(block_size="").check().block_size == "auto"
    assert GenerationOptions(block_size="draft").check().block_size == "draft"
    assert GenerationOptions().block_size == "auto"


@pytest.mark.parametrize("spelling, draft_block, want", [
    ("auto", 16, None), ("draft", 16, 16), ("draft", 4, 4), (8, 16, 8), ("3", 16, 3), (None, 16, None),
])
def test_fixed_width_resolves_the_draft_spelling(spelling, draft_block, want):
    assert fixed_width(spelling, draft_block) == want


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", 0, "max tokens must be"), ("max_tokens", 2.5, "max tokens must be"),
    ("temperature", -0.1, "temperature must be >= 0"), ("temperature", float("nan"), "temperature"),
    ("top_p", 0.0, "top-p must be in (0, 1]"), ("top_p", 1.5, "top-p must be in (0, 1]"),
    ("top_k", -1, "top-k must be"), ("min_p", 1.1, "min-p must be in [0, 1]"),
    ("seed", "x", "seed must be"), ("draft_sampling", "beam", "draft sampling must be one of argmax, sample"),
    ("block_size", "0", "block size takes"), ("repetition_penalty", -1.0, "repetition penalty must be >= 0"),
    ("presence_penalty", "x", "presence penalty must be a number"),
    ("frequency_context_size", 0, "frequency context size must be a whole number >= 1"),
])
def test_check_names_the_bad_value(field, value, words):
    with pytest.raises(ValueError) as e:
        GenerationOptions(**{field: value}).check()
    assert words in str(e.value) and repr(value) in str(e.value)
    assert "\n" not in str(e.value)


def test_logit_bias_names_the_bad_entry():
    for bias, entry in (({-3: 1.0}, "-3: 1.0"), ({5: float("inf")}, "5: inf"), ({"7": 1.0}, "'7': 1.0")):
        with pytest.raises(ValueError, match="logit bias must map token ids") as e:
            GenerationOptions(logit_bias=bias).check()
        assert entry in str(e.value)


def test_flags_round_trip_into_options():
    p = add_generation_args(argparse.ArgumentParser())
    args = p.parse_args(["--max-tokens", "7", "--block-size", "auto", "--temperature", "0.5",
                         "--top-p", "0.9", "--top-k", "3", "--min-p", "0.1", "--seed", "4",
                         "--draft-sampling", "sample", "--repetition-penalty", "1.1",
                         "--repetition-context-size", "32", "--presence-penalty", "0.5", "--frequency-penalty",
                         "-0.25", "--presence-context-size", "8", "--frequency-context-size", "9",
                         "--xtc-probability", "0.25", "--xtc-threshold", "0.2"])
    o = GenerationOptions.from_args(args).check()
    penalties = dict(repetition_penalty=1.1, repetition_context_size=32, presence_penalty=0.5,
                     presence_context_size=8, frequency_penalty=-0.25, frequency_context_size=9)
    xtc = dict(xtc_probability=0.25, xtc_threshold=0.2)
    assert o == GenerationOptions(7, "auto", 0.5, 0.9, 3, 0.1, 4, "sample", **penalties, **xtc)
    assert o.generate_kwargs() == dict(max_tokens=7, block_size="auto", temperature=0.5, top_p=0.9,
                                       top_k=3, min_p=0.1, seed=4, draft_sampling="sample", logit_bias=None,
                                       xtc_special_tokens=None, min_tokens_to_keep=1, **penalties, **xtc)
    assert len(o.processors()) == 3 and GenerationOptions().processors() == []


def test_front_end_defaults_and_skipped_flags():
    p = add_generation_args(argparse.ArgumentParser(), GenerationOptions(max_tokens=512),
                            skip=("block_size",))
    args = p.parse_args([])
    assert args.max_tokens == 512 and not hasattr(args, "block_size")
    assert GenerationOptions.from_args(args).block_size == "auto"  # the dataclass default


def test_bad_block_size_flag_is_a_usage_error(capsys):
    p = add_generation_args(argparse.ArgumentParser(prog="x"))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--block-size", "0"])
    assert e.value.code == 2
    assert "block size takes 'auto'" in capsys.readouterr().err


def _front_end_parsers():
    from dflash_mlx.cli import run
    from dflash_mlx.serve import cli as serve_cli
    from dflash_mlx.bench import cli as bench_cli
    from dflash_mlx.tui import cli as app

    return {
        "run": lambda text: run.build_parser().parse_args(["--block-size", text, "hi"]).block_size,
        "chat": lambda text: app.build_parser().parse_args(["--block-size", text]).block_size,
        "bench": lambda text: bench_cli.build_parser().parse_args(["--block-size", text]).block_size,
        "bench sweep": lambda text: bench_cli.build_parser().parse_args(["--block-sizes", f"4,{text}"]).block_sizes[1],
        "serve": lambda text: serve_cli.build_parser().parse_args(["--block-size", text]).block_size,
    }


def test_every_front_end_defaults_to_auto():
    parsers = {"run": ["hi"], "chat": [], "bench": [], "serve": []}
    from dflash_mlx.cli import run
    from dflash_mlx.serve import cli as serve_cli
    from dflash_mlx.bench import cli as bench_cli
    from dflash_mlx.tui import cli as app

    builders = {"run": run.build_parser, "chat": app.build_parser, "bench": bench_cli.build_parser,
                "serve": serve_cli.build_parser}
    for name, argv in parsers.items():
        assert builders[name]().parse_args(argv).block_size == "auto", name


@pytest.mark.parametrize("front_end", ["run", "chat", "bench", "bench sweep", "serve"])
def test_every_front_end_takes_the_same_block_sizes(front_end):
    from dflash_mlx.cli.common import CLIError

    parse = _front_end_parsers()[front_end]
    for text, want in (("auto", "auto"), ("AUTO", "auto"), (" Auto ", "auto"), ("16", 16), ("1", 1),
                       ("draft", "draft"), ("DRAFT", "draft")):
        assert parse(text) == want, (front_end, text)
    for text in ("0", "-2", "x", "2.5"):
        with pytest.raises(CLIError, match=r"block size takes 'auto' \(default\), 'draft' \(the draft's own"):
            parse(text)
