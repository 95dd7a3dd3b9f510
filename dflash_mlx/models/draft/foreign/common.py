"""What the foreign-layout readers share: their error, the verifier-weight check."""

from typing import Optional

import mlx.core as mx


class ForeignDraftError(ValueError):
    """A checkpoint in another engine's layout that cannot be read as a DFlash draft."""


# Rows of a stored verifier tensor compared with the target's (spread over the vocabulary).
CHECK_ROWS = 256
# Mean cosine similarity of those rows below which the tensor is another model's. The same
# model in another precision (bf16 checkpoint, GGUF Q4/Q8 target) stays above 0.95.
MIN_COSINE = 0.5


def sample_rows(n: int, k: int = CHECK_ROWS) -> mx.array:
    return mx.array(sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(min(k, n))}), dtype=mx.int32)


def mean_cosine(a: mx.array, b: mx.array) -> float:
    """Mean cosine similarity of matching rows of a and b ([n, H] each)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    num = (a * b).sum(-1)
    den = mx.sqrt((a * a).sum(-1) * (b * b).sum(-1)) + 1e-12
    return float((num / den).mean())


def head_rows(target, token_ids: mx.array) -> mx.array:
    """The target's LM-head rows for `token_ids`, [n, H], through `Target.head` (dense,
    tied or quantized heads alike)."""
    eye = mx.eye(target.hidden_size, dtype=mx.float32)
    return target.head(eye, token_ids).T


def check_verifier_tensor(name: str, stored: mx.array, ours: mx.array, what: str, source: str,
                          verifier: Optional[str] = None):
    """Fail when a verifier tensor stored with the draft is not the target's (another model)."""
    sim = mean_cosine(stored, ours)
    if sim < MIN_COSINE:
        made_for = f" (made for {verifier!r})" if verifier else ""
        raise ForeignDraftError(
            f"{source}: '{name}' holds another model's {what} (cosine similarity {sim:.2f} with this "
            f"target's){made_for}: this draft was made for another target model"
        )


def ids_from_offsets(d2t: mx.array, vocab_size: int, source: str) -> mx.array:
    """Draft index -> target token id from EAGLE-3's offsets (target id = index + d2t[index])."""
    if d2t.ndim != 1:
        raise ForeignDraftError(f"{source}: 'd2t' has shape {tuple(d2t.shape)}, expected [draft_vocab_size]")
    ids = mx.arange(d2t.shape[0], dtype=mx.int64) + d2t.astype(mx.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ForeignDraftError(
            f"{source}: 'd2t' maps draft tokens to ids {lo}..{hi}, outside the vocabulary of {vocab_size}"
        )
    if len(set(ids.tolist())) != ids.shape[0]:
        raise ForeignDraftError(f"{source}: 'd2t' maps two draft tokens to the same target token")
    return ids.astype(mx.int32)


def reduced_vocab_ids(draft_vocab, vocab_size: int, d2t: Optional[mx.array], source: str) -> Optional[mx.array]:
    """The target ids of an EAGLE-3-style reduced vocabulary (`draft_vocab_size` + `d2t`
    offsets), or None when the draft scores the whole vocabulary (equal sizes: no mapping)."""
    if draft_vocab == vocab_size:
        return None
    if not isinstance(draft_vocab, int) or not isinstance(vocab_size, int) or not 0 < draft_vocab < vocab_size:
        raise ForeignDraftError(f"{source}: draft_vocab_size {draft_vocab!r} is not between 1 and the "
                                f"verifier's vocabulary of {vocab_size!r}")
    if d2t is None:
        raise ForeignDraftError(f"{source}: draft_vocab_size is {draft_vocab} (reduced) but the weights "
                                "have no 'd2t' (draft -> target token offsets)")
    if d2t.shape != (draft_vocab,):
        raise ForeignDraftError(f"{source}: 'd2t' has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    return ids_from_offsets(d2t, vocab_size, source)
