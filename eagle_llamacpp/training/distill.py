"""Self-distillation: the target writes the replies its head is trained on, so the head learns the
text it will be asked to predict (EAGLE-3 regenerates its training replies the same way).

The target answers one user turn of each conversation (the first by default; a later one after
the conversation's own earlier turns, which gives new replies once the first turns are used up),
many replies at once: every slot is its own sequence, one decode advances all of them by a token
(a slot that has just been refilled prefills its prompt first), and each token's feature is
recorded as it comes out. A batch of 16 tokens costs a few times one token on a CPU, so the replies
come several times faster than one at a time, with their features for free.

Resume: manifest.json records the next conversation to start and the ones in flight at the last
shard; a resumed run starts those again first. Batches then differ from an uninterrupted run's,
so resumed replies are the same conversations but not necessarily bit for bit the same features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import _native as nat
from ..chat import ChatRenderer
from ..draft import TargetModel
from .features import ShardWriter, _progress, read_manifest, stop_requests

MIN_REPLY = 8  # a prompt must leave room for this many reply tokens


@dataclass
class _Slot:
    conv: int
    tokens: list[int]
    n_prompt: int
    rng: np.random.Generator
    feats: list[np.ndarray] = field(default_factory=list)
    n_decoded: int = 0      # tokens whose feature is known (decoded)
    final: bool = False     # the last token is sampled: decode it once more for its feature


def _pick(target: TargetModel, row: int, temperature: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return nat.argmax_ith(target.ctx, row, target.n_vocab)
    logits = target.logits(row).astype(np.float64) / temperature
    p = np.exp(logits - logits.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(target: TargetModel, conversations, out_dir: Path, *, max_tokens: int, token_budget: int,
             temperature: float = 0.0, seed: int = 0, shard_tokens: int = 16384,
             first_conv: int = 0, user_turn: int = 1, progress: bool = True) -> list[Path]:
    """Writes feature shards of the target's own replies (prompt + reply tokens, mask 1 on the
    reply) until token_budget tokens are stored. The context needs n_seq_max slots, n_batch >=
    max_tokens and room for n_seq_max sequences of max_tokens (best not unified: each
    slot then attends to its own cells only). A fresh folder starts at conversation first_conv (a
    resumed one where it stopped), so new data can skip what an earlier head was trained on.
    user_turn n answers each conversation's n-th user message, its turns before as context (ShareGPT's
    words); a conversation with fewer user messages, or whose prompt leaves no room, is skipped."""
    if user_turn < 1:
        raise ValueError(f"user_turn {user_turn}: the first user turn is 1")
    made = read_manifest(out_dir)
    if made and made.get("user_turn", 1) != user_turn:  # folders from before user_turn hold first turns
        raise ValueError(f"{out_dir} holds replies to user turn {made.get('user_turn', 1)}, not {user_turn}: "
                         "give each turn its own folder")
    writer = ShardWriter(out_dir, shard_tokens, {"first_conv": first_conv, "next_conv": first_conv,
                                                     "in_flight": [], "generated": 0, "user_turn": user_turn})
    renderer = ChatRenderer(target)
    vocab = nat.llama_cpp.llama_model_get_vocab(target.model)
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)
    n_slots = max(1, nat.llama_cpp.llama_n_seq_max(target.ctx))
    if max(max_tokens, n_slots) > n_batch:
        raise ValueError(f"max_tokens {max_tokens} or {n_slots} slots exceed the target context's n_batch {n_batch}")
    queue = list(writer.manifest["in_flight"])
    next_conv = writer.manifest["next_conv"]
    slots: dict[int, _Slot] = {}
    nat.clear_memory(target.ctx)
    bar = _progress(progress, token_budget, writer.n_tokens, "self-distill")

    def refill():
        nonlocal next_conv
        for sid in range(n_slots):
            while sid not in slots and (queue or next_conv < len(conversations)):
                if queue:
                    conv = queue.pop(0)
                else:
                    conv, next_conv = next_conv, next_conv + 1
                context = conversations[conv][:2 * user_turn - 1]
                if len(context) < 2 * user_turn - 1:
                    continue
                prompt = renderer.prompt_tokens(context)
                if len(prompt) + MIN_REPLY <= max_tokens:
                    slots[sid] = _Slot(conv, prompt, len(prompt), np.random.default_rng([seed, conv]))

    def decode(sids: list[int]) -> None:
        """Decodes the undecoded tokens of slots sids, records their features and picks each
        running slot's next token."""
        tokens, pos, seq_ids, outputs = [], [], [], []
        for sid in sids:
            s = slots[sid]
            new = s.tokens[s.n_decoded:]
            tokens += new
            pos += range(s.n_decoded, len(s.tokens))
            seq_ids += [sid] * len(new)
            outputs += [0] * (len(new) - 1) + [0 if s.final else 1]
        target.decode(np.asarray(tokens), np.asarray(pos), outputs=np.asarray(outputs, np.int8),
                      seq_ids=np.asarray(seq_ids))
        feats = nat.feature_rows(target.ctx, np.arange(len(tokens)), target.n_embd).astype(np.float16)
        row = 0
        for sid in sids:
            s = slots[sid]
            n_new = len(s.tokens) - s.n_decoded
            s.feats.append(feats[row:row + n_new])
            s.n_decoded += n_new
            row += n_new
            if s.final:
                finish(sid)
            else:
                tok = _pick(target, row - 1, temperature, s.rng)
                s.tokens.append(tok)
                s.final = nat.llama_cpp.llama_vocab_is_eog(vocab, tok) or len(s.tokens) >= max_tokens

    def finish(sid: int) -> None:
        s = slots.pop(sid)
        reply = len(s.tokens) - s.n_prompt
        writer.add(np.asarray(s.tokens), np.concatenate(s.feats),
                   np.r_[np.zeros(s.n_prompt, np.uint8), np.ones(reply, np.uint8)])
        writer.manifest["generated"] += reply
        bar.update(len(s.tokens))
        nat.seq_rm(target.ctx, sid, 0, -1)

    def flush() -> None:
        writer.flush(next_conv=next_conv, in_flight=sorted(queue + [s.conv for s in slots.values()]))

    refill()
    with stop_requests() as stop:
        while slots and writer.n_tokens < token_budget and not stop:
            # a refilled slot's prompt alone (one sequence per decode suits a non-unified cache),
            # then one decode advances every slot by a token
            for sid in [sid for sid, s in slots.items() if s.n_decoded == 0]:
                decode([sid])
            decode(sorted(slots))
            if writer.full() or writer.n_tokens >= token_budget or not slots:
                flush()
            refill()
        stopped = bool(stop) and bool(slots) and writer.n_tokens < token_budget
        if stopped:  # the finished replies are written; the ones in progress start again on the next run
            flush()
    bar.close()
    if stopped:
        raise KeyboardInterrupt
    return writer.shard_paths()
