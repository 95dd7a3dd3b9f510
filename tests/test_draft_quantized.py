"""Quantized drafts: MLX-quantized checkpoints load and run, `--draft-bits` / `bits=` quantize on
load, `export-draft --format mlx --bits` round-trips, and unsupported settings fail in one line."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save_config, save_model

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.cli.main import main
from dflash_mlx.kernels import context_kv
from dflash_mlx.models.draft.checkpoints import random_draft, save_draft
from dflash_mlx.models.draft.config import DraftMismatchError
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import byte_tokenizer, clean_case, tiny_target
from gguf_helpers import write_tiny_gguf

PROMPT_LEN, MAX_TOKENS = 12, 20
TOKENIZER = byte_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)[0]


@pytest.fixture(scope="module")
def float_folder(target, tmp_path_factory):
    """A float DFlash draft (2 layers, block 8) for the tiny target, in our layout."""
    folder = tmp_path_factory.mktemp("qdraft") / "float"
    save_draft(random_draft(target, num_layers=2, block_size=8, intermediate_size=128), folder)
    return folder


def mlx_quantized(float_folder, out, bits, group_size, predicate=None):
    """The draft quantized and written by mlx-lm's own `quantize_model` / `save_model` / `save_config`."""
    model = load_draft(float_folder)
    cfg = json.loads((float_folder / "config.json").read_text())
    model, cfg = quantize_model(model, cfg, group_size, bits, quant_predicate=predicate)
    save_model(out, model)
    save_config(cfg, out / "config.json")
    return out, dict(tree_flatten(model.parameters()))


def linears(draft):
    return {p: m for p, m in draft.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}


def assert_exact(target, draft, widths=(None, 3, "auto")):
    """Greedy DFlash output == the target's own greedy decode, at each width (None: the draft's)."""
    prompt, ref = clean_case(target, PROMPT_LEN, MAX_TOKENS, seed=5)
    for width in widths:
        out = []
        for r in stream_generate(target, draft, TOKENIZER, prompt, max_tokens=MAX_TOKENS,
                                 block_size="draft" if width is None else width):
            out.extend(r.tokens)
        assert out == ref, f"width {width}"


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_mlx_quantized_draft_loads_and_stays_exact(target, float_folder, tmp_path, bits, group_size):
    folder, saved = mlx_quantized(float_folder, tmp_path / "q", bits, group_size)
    assert json.loads((folder / "config.json").read_text())["quantization"] == {
        "group_size": group_size, "bits": bits, "mode": "affine"}
    draft = load_draft(folder, target)
    mods = linears(draft)
    assert mods and all(type(m) is nn.QuantizedLinear and (m.bits, m.group_size) == (bits, group_size)
                        for m in mods.values())
    loaded = dict(tree_flatten(draft.parameters()))
    assert set(loaded) == set(saved)
    packed = [k for k in saved if saved[k].dtype == mx.uint32]
    assert packed and all(mx.array_equal(loaded[k], saved[k]).item() for k in packed)
    assert_exact(target, draft)


def test_per_module_overrides_load_as_written(target, float_folder, tmp_path):
    # mlx-lm's mixed recipes: a dict per module for other settings, False (no .scales) for float.
    def predicate(path, module):
        if path == "fc":
            return False
        if path.endswith("down_proj"):
            return {"group_size": 32, "bits": 8, "mode": "affine"}
        return True

    folder, _ = mlx_quantized(float_folder, tmp_path / "mixed", 4, 64, predicate)
    entry = json.loads((folder / "config.json").read_text())["quantization"]
    assert entry["layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    draft = load_draft(folder, target)
    mods = linears(draft)
    assert type(mods["fc"]) is nn.Linear
    for path, m in mods.items():
        if path != "fc":
            assert (m.bits, m.group_size) == ((8, 32) if path.endswith("down_proj") else (4, 64)), path
    assert_exact(target, draft, widths=(None,))


def test_dflash2_draft_quantized_on_load(target, tmp_path):
    save_draft(random_draft(target, version=2, num_layers=1, block_size=6, intermediate_size=128), tmp_path / "d2")
    draft = load_draft(tmp_path / "d2", target, bits=4, group_size=32)
    mods = linears(draft)
    assert "candidate_selector.hidden_projection" in mods and "layers.0.attention_conv.kernel_projection" in mods
    assert all(type(m) is nn.QuantizedLinear for m in mods.values())
    assert_exact(target, draft, widths=(None, "auto"))


def test_batched_rows_with_a_quantized_draft(target, float_folder):
    # Rows of the batch engine draft together (`propose_logits_rows`) through the quantized layers.
    from dflash_mlx.engine.engine import BatchEngine
    from dflash_mlx.engine.rows import BatchRequest
    from dflash_mlx.options import GenerationOptions

    draft = load_draft(float_folder, target, bits=4, group_size=32)
    cases = [clean_case(target, 6 + 5 * i, 12, seed=i) for i in range(3)]
    engine = BatchEngine(target, draft, TOKENIZER, max_batch=3, prefill_chunk=16, block_size=4)
    rows = {engine.add(BatchRequest(p, GenerationOptions(max_tokens=len(ref)))).uid: i
            for i, (p, ref) in enumerate(cases)}
    out = {i: [] for i in rows.values()}
    while not engine.idle:
        for row, r in engine.step():
            out[rows[row.uid]] += r.tokens
    assert [out[i] for i in range(3)] == [ref for _, ref in cases]


def draft_logits(draft, seed=0):
    mx.random.seed(seed)
    feats = mx.random.normal((1, 9, len(draft.config.target_layer_ids) * draft.config.hidden_size))
    return draft.propose_logits(mx.array([65]), feats, draft.make_cache(), 8)


def rel_err(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def test_quantized_logits_close_to_float(target, float_folder, tmp_path):
    ref = draft_logits(load_draft(float_folder, target))
    err = {bits: rel_err(draft_logits(load_draft(float_folder, target, bits=bits)), ref) for bits in (4, 8)}
    assert err[8] < 0.02 and err[4] < 0.2 and err[8] < err[4]
    # the bound fails a wrong draft: another random draft's weights, quantized the same way
    save_draft(random_draft(target, seed=1, num_layers=2, block_size=8, intermediate_size=128), tmp_path / "other")
    assert rel_err(draft_logits(load_draft(tmp_path / "other", target, bits=4)), ref) > 0.5


def test_stacked_kv_injection_with_quantized_projections(target, float_folder):
    # The opt-in one-matmul injection (kernels.context_kv) stacks packed rows; it must give the
    # draft's own per-layer K/V.
    draft = load_draft(float_folder, target, bits=4, group_size=32)
    assert context_kv.stack_kind(draft) == "quantized"
    feats = mx.random.normal((1, 5, 128))
    ref, stacked = draft.make_cache(), draft.make_cache()
    draft.inject_reference(feats, ref)
    context_kv.draft_inject(draft, feats, stacked)
    for a, b in zip(ref, stacked):
        for x, y in zip(a.fetch(), b.fetch()):
            assert mx.allclose(x, y, atol=1e-5, rtol=1e-5).item()


def test_library_bits_refused_in_one_line(target, float_folder):
    for kwargs in (dict(bits=3), dict(bits=4, group_size=48)):
        with pytest.raises(ValueError, match="bits 4 or 8 and group size 32, 64 or 128") as e:
            load_draft(float_folder, target, **kwargs)
        assert "\n" not in str(e.value)
    q = load_draft(float_folder, target, bits=8)
    assert {m.bits for m in linears(q).values()} == {8}


@pytest.mark.parametrize("entry,needle", [
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, "mode 'affine' with bits 4 or 8"),
    ({"group_size": 64, "bits": 3, "mode": "affine"}, "mode 'affine' with bits 4 or 8"),
    ({"group_size": 64, "bits": 4, "layers.7.mlp": {"bits": 4, "group_size": 64}}, "no module of this draft"),
    (None, "no 'quantization' entry"),
])
def test_unsupported_quantization_refused_in_one_line(target, float_folder, tmp_path, entry, needle):
    folder, _ = mlx_quantized(float_folder, tmp_path / "bad", 4, 64)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    if entry is None:
        cfg.pop("quantization")
    else:
        cfg["quantization"] = entry
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftMismatchError, match=needle) as e:
        load_draft(folder, target)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("qcli")
    model = write_tiny_gguf(d / "tiny.gguf", "llama")
    draft = random_draft(model, num_layers=1, block_size=4)
    draft.set_vocab(mx.arange(0, 258, 2, dtype=mx.int32))  # a reduced draft vocabulary, kept on export
    save_draft(draft, d / "draft")
    return d


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_draft_bits_and_export_round_trip(gguf, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = ["--model", str(gguf / "tiny.gguf"), "--max-tokens", "16", "--json", "the cat sat on"]
    code, out, _ = cli(capsys, *run, "--baseline")
    assert code == 0
    base = json.loads(out)["tokens"]
    code, out, _ = cli(capsys, *run, "--draft", str(gguf / "draft"), "--draft-bits", "4")
    r = json.loads(out)
    assert code == 0 and r["tokens"] == base and r["draft"].endswith("(4-bit)")

    code, out, err = cli(capsys, "export-draft", str(gguf / "draft"), str(tmp_path / "q8"), "--format", "mlx",
                         "--bits", "8", "--group-size", "32")
    assert code == 0, err
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["bits"] == 8
    model = write_tiny_gguf(tmp_path / "t.gguf", "llama")
    exported = load_draft(tmp_path / "q8", model)
    direct = load_draft(gguf / "draft", model, bits=8, group_size=32)
    assert exported.vocab_ids.tolist() == direct.vocab_ids.tolist() == list(range(0, 258, 2))
    a, b = dict(tree_flatten(exported.parameters())), dict(tree_flatten(direct.parameters()))
    assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)
    code, out, _ = cli(capsys, *run, "--draft", str(tmp_path / "q8"))
    assert code == 0 and json.loads(out)["tokens"] == base


def test_cli_bad_bits_refused_in_one_line(gguf, capsys, tmp_path):
    code, _, err = cli(capsys, "--model", str(gguf / "tiny.gguf"), "--draft-bits", "3", "hi")
    assert code == 2 and "--draft-bits" in err and err.count("\n") == 1
    code, _, err = cli(capsys, "export-draft", str(gguf / "draft"), str(tmp_path / "v"), "--format", "vllm",
                       "--bits", "4")
    assert code == 2 and "use --format mlx" in err and err.count("\n") == 1
    # a draft stored quantized is no float draft for other engines either
    target = Target(write_tiny_gguf(tmp_path / "t.gguf", "llama"))
    save_draft(load_draft(gguf / "draft", target, bits=4), tmp_path / "q4")
    code, _, err = cli(capsys, "export-draft", str(tmp_path / "q4"), str(tmp_path / "z"), "--format", "zlab-full")
    assert code == 1 and "export with --format mlx" in err and err.count("\n") == 1
    assert not (tmp_path / "v").exists() and not (tmp_path / "z").exists()
