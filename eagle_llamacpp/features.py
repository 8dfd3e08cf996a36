"""Training features for an EAGLE head, taken from the patched llama.cpp itself so that they match
the (quantized) target exactly: each conversation is rendered with the target's chat template, and
one target decode yields the final hidden state of every token.

Shards are written as they fill up, so an interrupted extraction resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _native as nat
from .draft import TargetModel


class ChatRenderer:
    """Renders messages with the GGUF's Jinja chat template and tokenizes them turn by turn, so the
    assistant's tokens (the ones a head is trained on) are known exactly."""

    def __init__(self, target: TargetModel):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = nat.meta_str(target.model, "tokenizer.chat_template", 1 << 17)
        if not template:
            raise nat.EagleError(f"{target.path.name} has no chat template (tokenizer.chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)
        self.target = target
        vocab = nat.llama_cpp.llama_model_get_vocab(target.model)
        self.bos = nat.llama_cpp.llama_vocab_bos(vocab)
        self.special = {"bos_token": target.piece(self.bos) if self.bos >= 0 else "",
                        "eos_token": target.piece(nat.llama_cpp.llama_vocab_eos(vocab))}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            return ""

        def raise_exception(msg):
            raise ValueError(msg)

        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    raise_exception=raise_exception, **self.special)

    def tokens_and_mask(self, messages: list[dict], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the whole conversation, and 1 where a token belongs to an assistant reply.

        Each turn boundary is found by tokenizing the conversation up to it, so the tokens are
        exactly the whole conversation's tokens (tokenizers such as SentencePiece do not split at
        turn boundaries)."""
        tokens: list[int] = []
        mask: list[int] = []
        for i, m in enumerate(messages):
            full = self._tokenize(self.render(messages[:i + 1], add_generation_prompt=False))
            keep = _common_prefix(tokens, full)
            mask = mask[:keep] + [0] * (len(full) - keep)
            if m["role"] == "assistant":
                head = self._tokenize(self.render(messages[:i], add_generation_prompt=True))
                start = _common_prefix(head, full)
                mask[start:] = [1] * (len(full) - start)
            tokens = full
            if len(tokens) >= max_tokens:
                break
        return np.asarray(tokens[:max_tokens], np.int32), np.asarray(mask[:max_tokens], np.uint8)

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """The prompt for the assistant's next reply, tokenized as the training data is."""
        return self._tokenize(self.render(messages, add_generation_prompt=True))

    def _tokenize(self, text: str) -> list[int]:
        tokens = self.target.tokenize(text, add_special=True)
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self.bos:
            tokens = tokens[1:]  # the template wrote the BOS text itself
        return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclass
class FeatureShard:
    tokens: np.ndarray    # int32 [n], all sequences concatenated
    feats: np.ndarray     # float16 [n, n_embd], the target's final hidden state of each token
    mask: np.ndarray      # uint8 [n], 1 on assistant tokens
    offsets: np.ndarray   # int64 [n_seq + 1], sequence boundaries

    def sequences(self):
        for a, b in zip(self.offsets[:-1], self.offsets[1:]):
            yield self.tokens[a:b], self.feats[a:b], self.mask[a:b]

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=self.tokens, feats=self.feats, mask=self.mask, offsets=self.offsets)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> FeatureShard:
        with np.load(path) as z:
            return cls(z["tokens"], z["feats"], z["mask"], z["offsets"])


def packed_features(target: TargetModel, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """The final hidden state of every token of several sequences in one target decode, each its own
    sequence id from position 0, so that short conversations fill the batch as the target's prompt
    processing wants it (needs len(seqs) <= n_seq_max and their tokens <= n_batch)."""
    nat.clear_memory(target.ctx)
    lengths = [len(s) for s in seqs]
    target.decode(np.concatenate(seqs), np.concatenate([np.arange(n) for n in lengths]),
                  outputs=np.zeros(sum(lengths), np.int8), seq_ids=np.repeat(np.arange(len(seqs)), lengths))
    feats = nat.feature_rows(target.ctx, np.arange(sum(lengths)), target.n_embd).astype(np.float16)
    return np.split(feats, np.cumsum(lengths)[:-1])


def extract(target: TargetModel, conversations, out_dir: Path, *, max_tokens: int, token_budget: int,
            shard_tokens: int = 16384, progress: bool = True) -> list[Path]:
    """Writes feature shards for conversations until token_budget tokens are stored; resumes from
    the shards already in out_dir (manifest.json records how far each run got). Conversations are
    packed into the target's batches (n_batch tokens, n_seq_max sequences: see packed_features);
    a batch depends only on where it starts, so a resumed run decodes the same batches."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"shards": [], "n_conv": 0,
                                                                                      "n_tokens": 0}
    manifest.setdefault("seconds", 0.0)  # extraction wall time, over all runs
    renderer = ChatRenderer(target)
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)
    n_seq = max(1, nat.llama_cpp.llama_n_seq_max(target.ctx))
    if max_tokens > n_batch:
        raise ValueError(f"max_tokens {max_tokens} exceeds the target context's n_batch {n_batch}")
    bar = _progress(progress, token_budget, manifest["n_tokens"], "features")
    pending: list[tuple] = []
    i = manifest["n_conv"]
    rendered: dict[int, tuple] = {}  # the conversation that did not fit the last batch
    t_last = time.perf_counter()
    while manifest["n_tokens"] < token_budget and i < len(conversations):
        batch, used = [], 0
        while i < len(conversations) and len(batch) < n_seq:
            tokens, mask = rendered.pop(i, None) or renderer.tokens_and_mask(conversations[i], max_tokens)
            if mask.sum() < 8:
                i += 1
                continue  # nothing to learn from
            if used + len(tokens) > n_batch:
                rendered[i] = (tokens, mask)
                break  # it starts the next batch
            batch.append((tokens, mask))
            used += len(tokens)
            i += 1
        if batch:
            feats = packed_features(target, [b[0] for b in batch])
            pending += [(tokens, f, mask) for (tokens, mask), f in zip(batch, feats)]
            bar.update(used)
        n_pending = sum(len(p[0]) for p in pending)
        if pending and (n_pending >= shard_tokens or manifest["n_tokens"] + n_pending >= token_budget
                        or i == len(conversations)):
            name = f"shard-{len(manifest['shards']):04d}.npz"
            lengths = [len(p[0]) for p in pending]
            FeatureShard(np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending]),
                         np.concatenate([p[2] for p in pending]),
                         np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)).save(out_dir / name)
            manifest["shards"].append(name)
            manifest["n_conv"] = i
            manifest["n_tokens"] += n_pending
            manifest["seconds"] += time.perf_counter() - t_last
            t_last = time.perf_counter()
            manifest_path.write_text(json.dumps(manifest))
            pending = []
    bar.close()
    return [out_dir / s for s in manifest["shards"]]


def _progress(enabled: bool, total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="tok", disable=not enabled, smoothing=0.1)
