"""mlx-lm's fine-tuned adapters (`load(adapter_path=)`, `--adapter-path` on every front end): the adapted
model is the one decoded, greedy DFlash equals mlx-lm's own greedy decode of it token for token (a draft made
for the base model still fits), and a wrong folder is one line naming what is missing or does not fit."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import load
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.loading import ModelLoadError
from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, decoded, greedy_reference, tiny_target


def _folders(tmp_path):
    """(a tiny Qwen3's mlx-lm folder, LoRA adapters for it that change its answers, the config)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import save_config, save_model

    model, tok = tiny_target("qwen3", head_dim=32, tie_word_embeddings=False)
    config = dict(model.args.__dict__, model_type="qwen3")
    base = tmp_path / "base"
    save_model(base, model)
    save_config(config, base / "config.json")
    tok._tokenizer.save_pretrained(base)
    lora = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(7)
    weights = {k: mx.random.normal(v.shape) * 0.5 for k, v in tree_flatten(model.trainable_parameters())
               if k.endswith(("lora_a", "lora_b"))}
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    mx.save_safetensors(str(adapters / "adapters.safetensors"), weights)
    (adapters / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    return base, adapters


def test_the_adapted_model_decodes_exactly(tmp_path):
    from mlx_lm.utils import load as mlx_lm_load

    base, adapters = _folders(tmp_path)
    model, tok = load(str(base), adapter_path=str(adapters))
    plain, _ = load(str(base))
    theirs, _ = mlx_lm_load(str(base), adapter_path=str(adapters))
    prompt = list(range(40, 60))
    ref = greedy_reference(model, prompt, 32)
    assert ref == greedy_reference(theirs, prompt, 32)  # (mlx-lm's own load of the same adapters)
    assert ref != greedy_reference(plain, prompt, 32)  # (the adapters change this answer)
    ref = ref[: ref.index(EOS_ID) + 1] if EOS_ID in ref else ref
    draft = random_draft(plain, block_size=8, num_layers=1)  # made for the base model
    assert decoded(model, draft, tok, prompt, 32)[0] == ref
    from dflash_mlx.models.target.adapter import Target

    scripted = ScriptedDraft(Target(model), prompt + ref, lambda c: c % 6, block_size=8)
    assert decoded(model, scripted, tok, prompt, 32, 8)[0] == ref


def test_a_wrong_adapter_folder_is_one_line(tmp_path, capsys):
    from dflash_mlx.cli.main import main

    base, adapters = _folders(tmp_path)
    with pytest.raises(ModelLoadError, match="no such folder"):
        load(str(base), adapter_path=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no adapter_config.json or adapters.safetensors in it"):
        load(str(base), adapter_path=str(tmp_path / "empty"))
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((adapters / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(other / "adapters.safetensors"),
                        {"model.layers.1.self_attn.q_proj.lora_a": mx.zeros((3, 3))})  # (another model's shapes)
    with pytest.raises(ModelLoadError, match="do not fit model"):
        load(str(base), adapter_path=str(other))
    code = main(["--model", str(base), "--adapter-path", str(tmp_path / "nowhere"), "--max-tokens", "2", "hi"])
    out, err = capsys.readouterr()
    assert code != 0 and out == "" and err.count("\n") == 1 and "no such folder" in err, err
    code = main(["--model", str(base), "--adapter-path", str(adapters), "--max-tokens", "4", "--json",
                 "--no-chat-template", "hi"])
    out, err = capsys.readouterr()
    assert code == 0, err
    from dflash_mlx.engine.responses import wrap_tokenizer
    from dflash_mlx.generate import encode_prompt

    model, tok = load(str(base), adapter_path=str(adapters))
    ref = greedy_reference(model, encode_prompt(wrap_tokenizer(tok), "hi"), 4)
    assert json.loads(out)["tokens"] == ref[: len(json.loads(out)["tokens"])] and json.loads(out)["tokens"]
