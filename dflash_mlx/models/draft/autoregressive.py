"""A small autoregressive model as the draft: mlx-lm's `--draft-model`, in the DFlash engine.

mlx-lm's speculative decoding drafts with a smaller model of the same tokenizer, one token a
forward. `AutoregressiveDraft` gives such a model the draft interface the cycles use, so its
chains go through the same verify, acceptance, rollback, policies (widths sized from measured
cost, copies, token trees from its top-k) and batched engine as a DFlash draft's; the output is
the target's own, as with any draft.

Where a DFlash draft reads the target's hidden states, this one reads the tokens themselves:
its `target_layer_ids` ask the target's forwards for their input tokens (`INPUT_TOKENS`), which
the cycles keep and hand back as they keep features, so its own KV cache holds exactly the
tokens the target's caches hold. A proposal runs the kept tokens and the last one, then one
token a forward along its own argmax chain, all queued without a host sync, and trims its cache
back to the kept tokens.

Its sliding-window layers keep every entry, so a rejected token can be trimmed from them too; a
model that asks its cache for its window's mask (Llama's, Gemma 3's) attends as its own caches would
let it, one that does not sees past its window (other guesses, never another token). Refused in one line: a model with
recurrent state (a rejected token could not be taken back from it), and a tokenizer other than the
target's.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from dflash_mlx.identity import IdentityMap
from dflash_mlx.models.draft.config import DraftMismatchError
from dflash_mlx.models.draft.foreign.speculators import is_speculators
from dflash_mlx.models.target.adapter import INPUT_TOKENS, Target, target_for

DEFAULT_DRAFT_TOKENS = 3  # mlx-lm's --num-draft-tokens default
# The caches a draft model may make: each becomes a `DraftKVCache` (a sliding layer's keeps every entry, and
# its window is the mask mlx-lm's models ask of a cache for it)
ATTENTION_CACHES = {"KVCache", "RotatingKVCache"}
MAX_PADDING = 1024  # ids one tokenizer's models may pad their vocabularies by (Qwen2.5: 151,936 to 152,064)
MAX_TOKENS_APART = 0.01  # the share of the target's token texts a draft model's tokenizer may map elsewhere


class DraftKVCache(KVCache):
    """mlx-lm's KVCache with the calls the engine makes of a draft's context cache (`ContextCache`'s):
    every entry can be trimmed, `fetch` the entries held, `append` entries (a prompt cache file's)."""

    window = None

    def trimmable(self, n: int) -> bool:
        return n <= self.offset

    def fetch(self):
        if self.keys is None:
            return None, None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def append(self, keys: mx.array, values: mx.array):
        return self.update_and_fetch(keys, values)


@dataclass
class AutoregressiveDraftConfig:
    """What the engine reads of a draft's config."""

    block_size: int  # widest verify: the draft tokens + the last committed token
    target_layer_ids: List = field(default_factory=lambda: [INPUT_TOKENS])


class AutoregressiveDraft(nn.Module):
    """`model` (an mlx-lm model of the target's tokenizer) drafting up to `num_draft_tokens` tokens a cycle,
    one forward each. `tokenizer`, when given, is checked against the target's by `stream_generate`
    (`check_tokenizer`)."""

    vocab_ids = None

    def __init__(self, model: nn.Module, tokenizer=None, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        super().__init__()
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a whole number >= 1, got {num_draft_tokens!r}")
        caches = make_prompt_cache(model)
        kinds = {type(c).__name__ for c in caches}
        if not kinds <= ATTENTION_CACHES:
            raise DraftMismatchError(
                f"this draft model keeps {', '.join(sorted(kinds - ATTENTION_CACHES))} caches: an autoregressive "
                "draft must be an attention model, whose rejected tokens can be trimmed from its caches")
        self.model = model
        self.lm = Target(model, name="draft model")  # its text model and exact logits, every architecture
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "_same", IdentityMap())  # tokenizers found to be the draft's
        self.config = AutoregressiveDraftConfig(block_size=num_draft_tokens + 1)
        self._num_caches = len(caches)  # (a layer each)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def check_target(self, target):
        """A draft whose vocabulary is not about the target's is another tokenizer's: refused in one line
        (padded vocabularies of one tokenizer differ by a few hundred ids; `check_tokenizer` compares texts)."""
        if abs(self.lm.vocab_size - target.vocab_size) > MAX_PADDING:
            raise DraftMismatchError(
                f"the draft model scores {self.lm.vocab_size} tokens and the target {target.vocab_size}: another "
                "tokenizer's ids; use a draft model of the target's family (the same tokenizer)")

    def check_tokenizer(self, tokenizer):
        """The target's tokenizer against the draft model's (given at construction): the same ids for the
        target's token texts (all but a few special ones, which a family's models may name apart), or a
        one-line refusal."""
        if self.tokenizer is None or self._same.get((tokenizer,)) is not None:
            return
        theirs, ours = _vocab(tokenizer), _vocab(self.tokenizer)
        apart = sum(ours.get(text) != i for text, i in theirs.items())
        if apart > MAX_TOKENS_APART * len(theirs):
            raise DraftMismatchError(f"the draft model's tokenizer is not the target's: {apart} of the target's "
                                     f"{len(theirs)} tokens have other ids there; use a draft model of the target's "
                                     "family (the same tokenizer)")
        self._same.put((tokenizer,), True)

    def bind(self, target) -> "AutoregressiveDraft":
        object.__setattr__(self, "target", target)
        # (ids the draft scores past the target's vocabulary would be embedded from outside its table)
        object.__setattr__(self, "_scored", min(self.lm.vocab_size, target.vocab_size))
        return self

    def fused_taps(self):
        return None

    def make_cache(self) -> List[DraftKVCache]:
        return [DraftKVCache() for _ in range(self._num_caches)]

    def batches_rows(self, caches: Sequence) -> bool:
        return False

    def inject(self, tokens: Optional[mx.array], cache: List[DraftKVCache]):
        """tokens [B, S, 1] (the target's input tokens, kept as its features): into the draft's cache, lazy."""
        if tokens is not None:
            self.lm.run_text_model(tokens[..., 0], cache)

    def _logits(self, tokens: mx.array, cache) -> mx.array:
        """tokens [B, S] -> the draft's logits after the last of them [B, V_scored]."""
        h = self.lm.run_text_model(tokens, cache)
        return self.lm.logits(h[:, -1:])[:, 0, : self._scored]

    def propose_logits(self, last_token: mx.array, tokens: Optional[mx.array], cache: List[DraftKVCache],
                       block_size: int) -> mx.array:
        """last_token [B], tokens [B, S, 1] kept since the last call (or None) -> logits [B, block_size - 1, V]
        along the draft's argmax chain after `last_token` (a token tree's top-k are read from them); its cache
        holds the kept tokens after."""
        rows = []
        self.propose_chain(last_token, tokens, cache, block_size,
                           lambda logits: rows.append(logits) or mx.argmax(logits, axis=-1))
        return mx.stack(rows, axis=1)

    def propose_chain(self, last_token: mx.array, tokens: Optional[mx.array], cache: List[DraftKVCache],
                      block_size: int, choose: Callable[[mx.array], mx.array]):
        """Run the kept `tokens` and `last_token`, then each token `choose(logits [B, V]) -> [B]` picks from the
        draft's logits after the ones picked before it (the acceptor's proposal: an argmax, or a draw at
        temperature > 0 with `draft_sampling="sample"`), until `block_size` - 1 are picked; then trim the
        cache back to the kept tokens."""
        fed = last_token[:, None] if tokens is None else mx.concatenate([tokens[..., 0], last_token[:, None]], axis=1)
        for _ in range(block_size - 1):
            fed = choose(self._logits(fed, cache))[:, None]
        for c in cache:  # the last token and the drafts: the verify's rows bring them back as they are kept
            c.trim(block_size - 1)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        return draft_ids


def load_draft_model(name_or_path, model=None, tokenizer=None, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                     dtype=None, quiet: bool = False, trust_remote_code: bool = False) -> AutoregressiveDraft:
    """mlx-lm's `--draft-model`: a small model (packaged name, .gguf, folder or hub id) as the draft of the target
    `model` with `tokenizer`, each checked where given (`DraftMismatchError`, one line, where it does not fit)."""
    from dflash_mlx.models.loading import load  # (looked up at the call, as the other loaders do)

    _not_a_dflash_draft(name_or_path)
    draft_model, draft_tokenizer = load(name_or_path, dtype=dtype, quiet=quiet, trust_remote_code=trust_remote_code)
    draft = AutoregressiveDraft(draft_model, draft_tokenizer, num_draft_tokens=num_draft_tokens)
    if tokenizer is not None:
        draft.check_tokenizer(tokenizer)
    if model is not None:
        target_for(model, draft)
    return draft


def _not_a_dflash_draft(name_or_path):
    """A DFlash draft's folder given as a draft model: refused in one line (mlx-lm's loader would fail on
    its config in its own words)."""
    config = Path(str(name_or_path)) / "config.json"
    if config.is_file():
        try:
            cfg = json.loads(config.read_text())
        except (OSError, ValueError):
            return
        if isinstance(cfg, dict) and ("dflash_config" in cfg or is_speculators(cfg)):
            raise DraftMismatchError(f"{name_or_path} is a DFlash draft, not a language model: load it as one "
                                     "(--draft, `load_draft`)")


def _vocab(tokenizer) -> dict:
    return getattr(tokenizer, "_tokenizer", tokenizer).get_vocab()  # (mlx-lm's wrapper holds the tokenizer)
