"""How often a head drafts the token the target emits, measured on stored features.

Training's held-out top-1 compares the head's argmax with the target's argmax over the same draft
vocabulary (the cross-entropy's). Inference is stricter: a drafted token is accepted only if it is
the token the target emits, which may lie outside the draft vocabulary, and the draft GGUF usually
keeps fewer rows than training did (`--draft-vocab`, default 2048). On greedy replies (self-distilled
at temperature 0) the emitted token is the sequence's next token, so this measures exactly that.

A chain draft is accepted to depth d when steps 1..d are all right; step s runs on the head's own
features after s-1 right tokens, as the draft does. Over thousands of reply positions this estimates
a fixed chain's acceptance far more tightly than a few hundred decoding rounds do.
"""

from __future__ import annotations

import numpy as np

POSITION_BIN = 32  # reply tokens per bin of the per-position figures


def chain_hits(drafted: np.ndarray, emitted: np.ndarray) -> np.ndarray:
    """(n_pos, n_steps) bool: steps 1..s all drafted the emitted token. emitted is -1 past a
    reply's end, which no draft matches."""
    return np.logical_and.accumulate((drafted == emitted) & (emitted >= 0), axis=1)


def emitted_ahead(tokens: np.ndarray, n_steps: int) -> np.ndarray:
    """For the positions of shards.ShardStream.batch (position j feeds f[j] and x[j+1]), the
    tokens emitted 1..n_steps drafts ahead: x[j+2], x[j+3], ... (-1 past the end)."""
    n = len(tokens) - 1
    out = np.full((n, n_steps), -1, np.int64)
    for s in range(n_steps):
        ahead = tokens[2 + s:]
        out[:len(ahead), s] = ahead
    return out


def measure(net, stream, emb: np.ndarray, lm_head: np.ndarray, draft_vocab: np.ndarray,
            sizes: tuple[int, ...], n_steps: int = 3, batch_size: int = 8) -> dict:
    """Step-1 top-1 as training counts it and as inference does, and chain acceptance to depths
    1..n_steps, for draft vocabularies of the first `sizes` tokens of draft_vocab, over every
    reply position of stream (a shards.ShardStream). The first size also gets top-1 per reply
    position (bins of POSITION_BIN tokens)."""
    import torch

    sizes = tuple(min(k, len(draft_vocab)) for k in sizes)
    # one product with the largest vocabulary: a smaller one is its first columns (draft_vocab's prefix)
    widest = max(sizes)
    head_t = torch.from_numpy(np.ascontiguousarray(lm_head[draft_vocab[:widest]].T))
    n_pos = 0
    in_vocab = dict.fromkeys(sizes, 0)
    as_trained = dict.fromkeys(sizes, 0)
    chain = {k: np.zeros(n_steps, np.int64) for k in sizes}
    n_bins = int(stream.lengths.max(initial=0)) // POSITION_BIN + 1
    bin_hits, bin_counts = np.zeros(n_bins, np.int64), np.zeros(n_bins, np.int64)
    net.eval()
    with torch.no_grad():
        for start in range(0, len(stream), batch_size):
            idx = range(start, min(len(stream), start + batch_size))
            tok_emb, f_in, f_out, mask = stream.batch(idx, emb)
            preds = net.forward_steps(tok_emb, f_in, n_steps)
            for r, i in enumerate(idx):
                tokens, _, reply_mask = stream.sequence(i)
                # drafts made from a reply token on that have a next token to match
                emitted = emitted_ahead(tokens, n_steps)
                m = reply_mask[1:].astype(bool) & (emitted[:, 0] >= 0)
                emitted, sel = emitted[m], torch.from_numpy(m)
                n_pos += len(emitted)
                draft_logits = [p[r, :len(m)][sel] @ head_t for p in preds]
                target_logits = f_out[r, :len(m)][sel] @ head_t
                for k in sizes:
                    ids = draft_vocab[:k]
                    drafted = np.stack([ids[lg[:, :k].argmax(-1).numpy()] for lg in draft_logits], 1)
                    target_in_k = ids[target_logits[:, :k].argmax(-1).numpy()]
                    as_trained[k] += int((drafted[:, 0] == target_in_k).sum())
                    in_vocab[k] += int(np.isin(emitted[:, 0], ids).sum())
                    hits = chain_hits(drafted, emitted)
                    chain[k] += hits.sum(0)
                    if k == sizes[0]:
                        bins = np.arange(len(hits)) // POSITION_BIN
                        np.add.at(bin_hits, bins, hits[:, 0])
                        np.add.at(bin_counts, bins, 1)
    n = max(n_pos, 1)
    return {
        "positions": n_pos,
        "sizes": {str(k): {"emitted_in_vocab": round(in_vocab[k] / n, 4),
                           "top1_as_trained": round(as_trained[k] / n, 4),
                           "top1": round(float(chain[k][0]) / n, 4),
                           "chain_acceptance_length": [round(1 + float(chain[k][:d].sum()) / n, 4)
                                                       for d in range(1, n_steps + 1)]}
                  for k in sizes},
        "top1_by_reply_position": {str(b * POSITION_BIN): round(float(bin_hits[b] / bin_counts[b]), 4)
                                   for b in np.flatnonzero(bin_counts)},
    }
