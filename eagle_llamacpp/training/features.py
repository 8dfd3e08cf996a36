"""Training features for an EAGLE head, taken from the patched llama.cpp itself so that they match
the (quantized) target exactly: each conversation is rendered with the target's chat template, and
one target decode yields the final hidden state of every token.

Shards are written as they fill up, so an interrupted extraction resumes where it stopped; Ctrl-C
(or SIGTERM) first lets the decode under way finish and writes what is done (see stop_requests).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _native as nat
from ..chat import ChatRenderer
from ..draft import TargetModel


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


def read_arrays(path: Path, *keys: str) -> list[np.ndarray]:
    """Some arrays of a shard without the features (an .npz member is read on its own)."""
    with np.load(path) as z:
        return [z[k] for k in keys]


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


MANIFEST = "manifest.json"


def read_manifest(folder: Path) -> dict:
    """A feature folder's manifest (see ShardWriter); {} for a folder not started yet."""
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


class ShardWriter:
    """Appends sequences to numbered shards in a folder; manifest.json records the shards, the
    tokens stored, the wall time spent and whatever the producer needs to resume (`state`)."""

    def __init__(self, out_dir: Path, shard_tokens: int, state: dict):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / MANIFEST
        self.manifest = {"shards": [], "n_tokens": 0, "seconds": 0.0, **state, **read_manifest(self.out_dir)}
        self.shard_tokens = shard_tokens
        self.pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.t_last = time.perf_counter()

    @property
    def n_pending(self) -> int:
        return sum(len(p[0]) for p in self.pending)

    @property
    def n_tokens(self) -> int:
        """Tokens stored and pending."""
        return self.manifest["n_tokens"] + self.n_pending

    def add(self, tokens: np.ndarray, feats: np.ndarray, mask: np.ndarray) -> None:
        self.pending.append((np.asarray(tokens, np.int32), np.asarray(feats, np.float16), np.asarray(mask, np.uint8)))

    def full(self) -> bool:
        return self.n_pending >= self.shard_tokens

    def flush(self, **state) -> None:
        """Writes the pending sequences as the next shard and records `state` with it."""
        if self.pending:
            name = f"shard-{len(self.manifest['shards']):04d}.npz"
            lengths = [len(p[0]) for p in self.pending]
            FeatureShard(*(np.concatenate([p[k] for p in self.pending]) for k in range(3)),
                         np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)).save(self.out_dir / name)
            self.manifest["shards"].append(name)
            self.manifest["n_tokens"] += sum(lengths)
            self.pending = []
        self.manifest.update(state)
        self.manifest["seconds"] += time.perf_counter() - self.t_last
        self.t_last = time.perf_counter()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.manifest))
        tmp.replace(self.path)  # a reader (or a crash) never sees half a manifest

    def shard_paths(self) -> list[Path]:
        return [self.out_dir / s for s in self.manifest["shards"]]


class StopRequest:
    """Set by the first SIGINT or SIGTERM inside stop_requests(): the producer finishes the decode
    under way, flushes what is done, and raises KeyboardInterrupt."""

    def __init__(self):
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None


@contextmanager
def stop_requests():
    """Turns Ctrl-C and SIGTERM into a StopRequest while features are made, so that stopping keeps
    every finished sequence (up to a shard of them otherwise) and a rerun starts where the
    manifest says. A second signal stops at once, as before. Outside the main thread (where
    Python cannot set handlers) the request simply never comes."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.signum = signum
        print("\nstopping after the decode under way (again to stop at once)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def extract(target: TargetModel, conversations, out_dir: Path, *, max_tokens: int, token_budget: int,
            shard_tokens: int = 16384, first_conv: int = 0, progress: bool = True) -> list[Path]:
    """Writes feature shards for conversations until token_budget tokens are stored; resumes from
    the shards already in out_dir (manifest.json records how far each run got). Conversations are
    packed into the target's batches (see _extract_batches). A fresh folder starts at conversation
    first_conv."""
    writer = ShardWriter(out_dir, shard_tokens, {"first_conv": first_conv, "n_conv": first_conv})
    renderer = ChatRenderer(target)
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)
    if max_tokens > n_batch:
        raise ValueError(f"max_tokens {max_tokens} exceeds the target context's n_batch {n_batch}")

    def rendered():
        for i in range(writer.manifest["n_conv"], len(conversations)):
            tokens, mask = renderer.tokens_and_mask(conversations[i], max_tokens)
            if mask.sum() >= 8:  # else nothing to learn from
                yield i, tokens, mask

    _extract_batches(target, rendered(), writer, token_budget, "n_conv", progress)
    return writer.shard_paths()


def source_sequences(folders: list[Path]):
    """(tokens, mask) of every sequence of some feature folders, in order, read without features."""
    for folder in folders:
        for name in read_manifest(folder).get("shards", []):
            tokens, mask, offsets = read_arrays(Path(folder) / name, "tokens", "mask", "offsets")
            for a, b in zip(offsets[:-1], offsets[1:]):
                yield tokens[a:b], mask[a:b]


def reencode(target: TargetModel, sources: list[Path], out_dir: Path, *, token_budget: int,
             shard_tokens: int = 16384, progress: bool = True) -> list[Path]:
    """This target's features for the sequences (tokens and reply masks) of other feature folders:
    replies that a smaller model with the same tokenizer self-distilled cost a bigger target one
    prompt-processing decode here instead of its own generation. The head's labels are this
    target's predictions either way (see train.head_losses). Resumes like extract."""
    sources = [Path(s) for s in sources]
    for folder in sources:
        if not read_manifest(folder).get("shards"):
            raise ValueError(f"{folder}: not a feature folder (no shards in {MANIFEST})")
    writer = ShardWriter(out_dir, shard_tokens, {"tokens_from": [str(s) for s in sources], "n_seq": 0})
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)

    def sequences():
        for i, (tokens, mask) in enumerate(source_sequences(sources)):
            if i < writer.manifest["n_seq"]:
                continue
            if len(tokens) > n_batch:
                raise ValueError(f"a sequence of {len(tokens)} tokens exceeds the target context's n_batch {n_batch}")
            if tokens.min() < 0 or tokens.max() >= target.n_vocab:
                raise ValueError(f"token id {int(tokens.max())} is outside the target's vocabulary of "
                                 f"{target.n_vocab}: the folders were made with another tokenizer")
            yield i, tokens, mask

    _extract_batches(target, sequences(), writer, token_budget, "n_seq", progress)
    return writer.shard_paths()


def _extract_batches(target: TargetModel, items, writer: ShardWriter, token_budget: int, resume_key: str,
                     progress: bool) -> None:
    """Stores the features of (index, tokens, mask) items until token_budget tokens are stored.
    Items are packed into the target's batches (n_batch tokens, n_seq_max sequences: see
    packed_features); an item that does not fit starts the next batch, so a batch depends only on
    where it starts and a resumed run decodes the same batches. The manifest's resume_key holds
    the index to go on from."""
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)
    n_seq = max(1, nat.llama_cpp.llama_n_seq_max(target.ctx))
    bar = _progress(progress, token_budget, writer.n_tokens, "features")
    batch, used, resume_at = [], 0, writer.manifest[resume_key]

    def decode_batch(next_index: int) -> None:
        for (tokens, mask), f in zip(batch, packed_features(target, [b[0] for b in batch])):
            writer.add(tokens, f, mask)
        bar.update(used)
        if writer.full() or writer.n_tokens >= token_budget:
            writer.flush(**{resume_key: next_index})

    stopped = False
    if writer.n_tokens < token_budget:
        with stop_requests() as stop:
            for index, tokens, mask in items:
                if batch and (used + len(tokens) > n_batch or len(batch) == n_seq):
                    decode_batch(index)
                    batch, used = [], 0
                    if stop:  # at a batch boundary: a rerun decodes the batches this run would have
                        writer.flush(**{resume_key: index})
                        stopped = True
                        break
                    if writer.n_tokens >= token_budget:
                        break
                batch.append((tokens, mask))
                used += len(tokens)
                resume_at = index + 1
            else:
                if batch:
                    decode_batch(resume_at)
                writer.flush(**{resume_key: resume_at})
    bar.close()
    if stopped:
        raise KeyboardInterrupt


def _progress(enabled: bool, total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="tok", disable=not enabled, smoothing=0.1)
