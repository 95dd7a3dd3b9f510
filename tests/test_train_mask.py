"""The block-sparse training mask: each block sees exactly its allowed context."""

import dflash_mlx  # noqa: F401
import mlx.core as mx
import numpy as np

from dflash_mlx.train.mask import block_mask


def _expected(anchors, S, B, window=None, causal=False):
    K = len(anchors)
    m = np.zeros((K * B, S + K * B), dtype=bool)
    for j, a in enumerate(anchors):
        for i in range(B):
            q = j * B + i
            for p in range(S):
                m[q, p] = p < a and (window is None or a + i - p < window)
            for i2 in range(B):
                m[q, S + j * B + i2] = (not causal) or i2 <= i
    return m


def test_each_block_sees_context_strictly_before_its_anchor_and_its_own_block():
    anchors = [[3, 7, 7, 12], [0, 1, 5, 9]]
    S, B = 14, 4
    m = np.array(block_mask(mx.array(anchors), S, B))
    assert m.shape == (2, 1, 4 * B, S + 4 * B)
    for n in range(2):
        np.testing.assert_array_equal(m[n, 0], _expected(anchors[n], S, B))
    # spot checks stated plainly: block 1 of sequence 0 (anchor 7) ...
    q = 1 * B + 2
    assert m[0, 0, q, :7].all() and not m[0, 0, q, 7:S].any()  # context 0..6 only
    assert m[0, 0, q, S + B : S + 2 * B].all()  # its whole block, both directions
    assert not m[0, 0, q, S : S + B].any() and not m[0, 0, q, S + 2 * B :].any()  # no other block
    # an anchor at position 0 has no context at all
    assert not m[1, 0, :B, :S].any()


def test_sliding_window_and_causal_variants():
    anchors = [[6, 11]]
    S, B = 16, 5
    m = np.array(block_mask(mx.array(anchors), S, B, window=4, causal=True))
    np.testing.assert_array_equal(m[0, 0], _expected(anchors[0], S, B, window=4, causal=True))
    # query at position 11+2=13 sees context 10 only (13-p < 4 and p < 11)
    row = m[0, 0, B + 2, :S]
    assert np.flatnonzero(row).tolist() == [10]
