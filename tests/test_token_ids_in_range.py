"""Token ids outside the target's vocabulary never reach its embedding.

MLX's gather does not check bounds: an id past the table reads whatever lies beyond it. A
verify row holding such an id puts garbage (often NaN) in the target's caches, and a NaN in a
masked row still spoils the rows before it (0 * NaN in attention's weighted sum), so every
later argmax is token 0: wrong tokens, no error. It happened in this suite, now and then, with a
reduced draft vocabulary that named ids past its tiny target's 259 (the draft proposed them).
So a draft vocabulary and a prompt are checked against the target's vocabulary, in one line.
"""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.models.draft.checkpoints import DRAFT_VOCAB_FILE, load_draft, random_draft, save_draft
from dflash_mlx.models.draft.config import DraftMismatchError
from dflash_mlx.testing.targets import VOCAB, greedy_reference, tiny_target


@pytest.fixture(scope="module")
def target():
    model, tok = tiny_target("llama", seed=3, layer_types=None, sliding_window=None)
    return model, tok


@pytest.mark.parametrize("ids, needle", [
    (list(range(0, VOCAB + 10, 2)), f"token id {VOCAB + 8}"),
    ([-1, 4, 5], "token id -1"),
    ([], "non-empty"),
])
def test_a_draft_vocabulary_past_the_target_is_refused_in_one_line(target, tmp_path, ids, needle):
    model, _ = target
    save_draft(random_draft(model, num_layers=1, block_size=4), tmp_path / "draft")
    np.save(tmp_path / "draft" / DRAFT_VOCAB_FILE, np.array(ids, dtype=np.int32))
    with pytest.raises(DraftMismatchError, match=needle) as e:
        load_draft(tmp_path / "draft", model)
    assert "\n" not in str(e.value)


def test_a_draft_vocabulary_inside_the_target_loads_and_stays_exact(target, tmp_path):
    model, tok = target
    draft = random_draft(model, num_layers=1, block_size=4)
    draft.set_vocab(mx.arange(VOCAB - 40, VOCAB, dtype=mx.int32))  # the vocabulary's last ids: in range
    save_draft(draft, tmp_path / "draft")
    loaded = load_draft(tmp_path / "draft", model)
    assert loaded.vocab_ids.tolist() == list(range(VOCAB - 40, VOCAB))
    prompt = [5, 9, 44, 120, 7]
    tokens = [t for r in stream_generate(model, loaded, tok, prompt, max_tokens=24, block_size=4,
                                         stop_token_ids=[]) for t in r.tokens]
    assert tokens == greedy_reference(model, prompt, 24)


def test_set_vocab_refuses_ids_past_the_target(target):
    model, _ = target
    draft = random_draft(model, num_layers=1, block_size=4)
    with pytest.raises(DraftMismatchError, match=f"token id {VOCAB}, outside the target's vocabulary of {VOCAB}"):
        draft.set_vocab(mx.arange(VOCAB - 3, VOCAB + 1, dtype=mx.int32))
    assert draft.vocab_ids is None


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
@pytest.mark.parametrize("with_draft", [True, False])
def test_a_prompt_id_outside_the_vocabulary_is_refused_in_one_line(target, bad, with_draft):
    model, tok = target
    draft = random_draft(model, num_layers=1, block_size=4) if with_draft else None
    with pytest.raises(ValueError, match=f"token id {bad}, outside .* vocabulary of {VOCAB} tokens") as e:
        next(iter(stream_generate(model, draft, tok, [5, bad, 9], max_tokens=4, baseline=not with_draft)))
    assert "\n" not in str(e.value)
