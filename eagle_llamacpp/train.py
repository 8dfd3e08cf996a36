"""`eagle-llamacpp train`: an EAGLE-1/2 head for a GGUF target, on the CPU (or a GPU when torch
has one). Recipe (../shared/reference/eagle_algorithm.md section 8): the head predicts the target's
next feature from (feature, next token); loss = smooth-L1 on features + 0.1 x soft cross-entropy
against the target's own distribution; uniform noise on input features; AdamW, betas (0.9, 0.95),
element-wise gradient clipping at 0.5. The cross-entropy runs over the draft vocabulary (the most
frequent target tokens of the training data), which is also what the draft may restrict its
lm_head to at run time.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .constants import DRAFT_VOCAB_FILE
from .features import FeatureShard


@dataclass
class TrainConfig:
    epochs: int = 4
    batch_size: int = 8
    lr: float = 5e-4          # above the official 3e-5: a small head on little data (section 8.7)
    warmup_steps: int = 50
    weight_decay: float = 0.0
    noise: float = 0.1        # U(-noise, noise) on input features
    p_weight: float = 0.1
    clip_value: float = 0.5
    draft_vocab: int = 16384
    eval_fraction: float = 0.05
    seed: int = 0
    save_every: int = 50      # steps between resumable checkpoints


def target_tensors(target_gguf: Path) -> tuple[np.ndarray, np.ndarray]:
    """The target's token embeddings and lm_head as float32 (lm_head = embeddings when tied)."""
    from .gguf_tensors import dequantize, lm_head

    return dequantize(target_gguf, "token_embd.weight"), lm_head(target_gguf)


def count_draft_vocab(shards: list[FeatureShard], n_vocab: int, size: int) -> np.ndarray:
    """Token ids by how often the target produced them in assistant replies, most frequent first."""
    counts = np.zeros(n_vocab, np.int64)
    for s in shards:
        np.add.at(counts, s.tokens[s.mask.astype(bool)], 1)
    order = np.argsort(-counts, kind="stable")
    return order[:min(size, n_vocab)].astype(np.int32)


class _Batches:
    """Sequences of all shards as (x[j+1], f[j], f[j+1], mask[j+1]) training pairs."""

    def __init__(self, shards: list[FeatureShard]):
        self.seqs = [seq for s in shards for seq in s.sequences() if len(seq[0]) > 2]

    def split(self, fraction: float, seed: int):
        idx = np.random.default_rng(seed).permutation(len(self.seqs))
        n_eval = max(1, int(len(idx) * fraction))
        return idx[n_eval:], idx[:n_eval]

    def batch(self, idx, emb: np.ndarray):
        import torch

        seqs = [self.seqs[i] for i in idx]
        t = max(len(s[0]) for s in seqs) - 1
        b, h = len(seqs), emb.shape[1]
        tok = np.zeros((b, t), np.int64)
        f_in = np.zeros((b, t, h), np.float32)
        f_out = np.zeros((b, t, h), np.float32)
        mask = np.zeros((b, t), np.float32)
        for r, (tokens, feats, m) in enumerate(seqs):
            n = len(tokens) - 1
            tok[r, :n], f_in[r, :n], f_out[r, :n], mask[r, :n] = tokens[1:], feats[:-1], feats[1:], m[1:]
        return (torch.from_numpy(emb[tok]), torch.from_numpy(f_in), torch.from_numpy(f_out),
                torch.from_numpy(mask))


def head_losses(net, batch, lm_head_t, noise: float, p_weight: float):
    """(loss, vloss, ploss, top-1 accuracy), all averaged over masked positions."""
    import torch
    import torch.nn.functional as F

    tok_emb, f_in, f_out, mask = batch
    if noise > 0:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * noise
    pred = net(tok_emb, f_in)
    n = mask.sum().clamp(min=1)
    vloss = (F.smooth_l1_loss(pred, f_out, reduction="none").mean(-1) * mask).sum() / n
    with torch.no_grad():
        target_logits = f_out @ lm_head_t
        target_p = target_logits.softmax(-1)
    pred_logits = pred @ lm_head_t
    ploss = (-(target_p * pred_logits.log_softmax(-1)).sum(-1) * mask).sum() / n
    acc = ((pred_logits.argmax(-1) == target_logits.argmax(-1)).float() * mask).sum() / n
    return vloss + p_weight * ploss, vloss, ploss, acc


def train(target_gguf: Path, shard_paths: list[Path], out_dir: Path, cfg: TrainConfig, *,
          n_threads: int | None = None, progress: bool = True, stop_after: int | None = None,
          card_extra: dict | None = None) -> Path | None:
    """Trains (resuming from out_dir/train_state.pt if there) and writes out_dir/head in HF layout.
    stop_after=N stops after step N as an interruption would (returns None; run again to resume).
    card_extra: more entries for training.json (e.g. how the features were extracted)."""
    import torch
    from tqdm import tqdm

    from .head_model import EagleHeadNet, HeadConfig

    if n_threads:
        torch.set_num_threads(n_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    shards = [FeatureShard.load(p) for p in shard_paths]
    hcfg = HeadConfig.from_target(target_gguf)
    emb, lm_head = target_tensors(target_gguf)
    draft_vocab = count_draft_vocab(shards, hcfg.vocab_size, cfg.draft_vocab)
    lm_head_t = torch.from_numpy(np.ascontiguousarray(lm_head[draft_vocab].T)).to(device)
    del lm_head

    data = _Batches(shards)
    train_idx, eval_idx = data.split(cfg.eval_fraction, cfg.seed)
    steps_per_epoch = math.ceil(len(train_idx) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs

    net = EagleHeadNet(hcfg).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) *
                                              max(0.05, 1 - s / max(1, total_steps)))
    state_path = out_dir / "train_state.pt"
    step, wall = 0, 0.0
    if state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, wall = state["step"], state["wall_s"]
        if "rng" in state:
            torch.set_rng_state(state["rng"])
    out_dir.mkdir(parents=True, exist_ok=True)

    def save_state():
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "step": step, "wall_s": wall, "rng": torch.get_rng_state(), "config": asdict(cfg),
                    "eval_before": eval_before}, tmp)
        tmp.replace(state_path)

    eval_before = state.get("eval_before") if step else evaluate(net, data, eval_idx, emb, lm_head_t, cfg, device)
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not progress)
    history = []
    t_start = time.perf_counter() - wall
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = np.random.default_rng(cfg.seed + epoch).permutation(train_idx)
        idx = order[in_epoch * cfg.batch_size:(in_epoch + 1) * cfg.batch_size]
        batch = [t.to(device) for t in data.batch(idx, emb)]
        net.train()
        loss, vloss, ploss, acc = head_losses(net, batch, lm_head_t, cfg.noise, cfg.p_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), cfg.clip_value)
        opt.step()
        sched.step()
        step += 1
        wall = time.perf_counter() - t_start
        history.append((vloss.item(), ploss.item(), acc.item()))
        recent = np.mean(history[-20:], axis=0)
        bar.set_postfix(vloss=f"{recent[0]:.3f}", ploss=f"{recent[1]:.2f}", acc=f"{recent[2]:.2f}")
        bar.update(1)
        if step % cfg.save_every == 0 or step == total_steps or step == stop_after:
            save_state()
        if step == stop_after:
            bar.close()
            return None
    bar.close()

    metrics = evaluate(net, data, eval_idx, emb, lm_head_t, cfg, device)
    head_dir = net.save_hf(out_dir / "head")
    (head_dir / DRAFT_VOCAB_FILE).write_text(json.dumps([int(t) for t in draft_vocab]))
    n_tokens = int(sum(len(s.tokens) for s in shards))
    epoch_tokens = sum(len(data.seqs[i][0]) for i in train_idx)
    card = {"target": Path(target_gguf).name, "train_tokens": n_tokens,
            "train_sequences": len(train_idx), "eval_sequences": len(eval_idx), "steps": step,
            "wall_s": round(wall, 1), "tokens_per_s": round(epoch_tokens * step / steps_per_epoch / max(wall, 1e-9), 1),
            "device": device, "config": asdict(cfg),
            "final_train": dict(zip(("vloss", "ploss", "top1"), np.mean(history[-50:], axis=0).round(4).tolist()))
            if history else None,
            "eval_before": eval_before, "eval": metrics, **(card_extra or {})}
    (head_dir / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    return head_dir


def evaluate(net, data: _Batches, eval_idx, emb, lm_head_t, cfg: TrainConfig, device) -> dict:
    """Held-out losses and top-1 agreement with the target (next token, teacher-forced features)."""
    import torch

    net.eval()
    sums, n = np.zeros(3), 0
    with torch.no_grad():
        for start in range(0, len(eval_idx), cfg.batch_size):
            batch = [t.to(device) for t in data.batch(eval_idx[start:start + cfg.batch_size], emb)]
            _, vloss, ploss, acc = head_losses(net, batch, lm_head_t, 0.0, cfg.p_weight)
            w = float(batch[3].sum())
            sums += w * np.array([float(vloss), float(ploss), float(acc)])
            n += w
    return dict(zip(("vloss", "ploss", "top1"), (sums / max(n, 1)).round(4).tolist()))
