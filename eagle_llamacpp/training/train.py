"""`eagle-llamacpp train`: an EAGLE-1/2 head for a GGUF target, on the CPU (or a GPU when torch
has one). Recipe (../shared/reference/eagle_algorithm.md section 8): the head predicts the target's
next feature from (feature, next token); loss = smooth-L1 on features + 0.1 x soft cross-entropy
against the target's own distribution; uniform noise on input features; AdamW, betas (0.9, 0.95),
element-wise gradient clipping at 0.5. The cross-entropy runs over the draft vocabulary (the most
frequent target tokens of the training data), which is also what the draft may restrict its
lm_head to at run time.

Multi-step training (`steps` > 1, EAGLE-3's training-time test / HASS): the head also predicts
steps 2..k from its own predicted features (head_model.EagleHeadNet.forward_steps), as tree levels
2 and deeper draft at run time; step s's loss weighs step_decay^(s-1). Held-out top-1 is reported
per step whatever `steps` trained.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..constants import DRAFT_VOCAB_FILE
from .shards import ShardStream

EVAL_STEPS = 3  # held-out top-1 is reported for steps 1..EVAL_STEPS (at least)


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
    steps: int = 1            # chained prediction steps trained (1: EAGLE-1/2's teacher-forced loss)
    step_decay: float = 0.8   # loss weight of step s is step_decay ** (s - 1)
    init_from_target: bool = False  # the head's layer starts as a copy of the target's last layer
    intermediate_size: int = 0  # the head's MLP width (0: the target's); narrower heads ship smaller
    int8: bool = False        # store the head's 2-D weights as int8 blocks (half the size of float16)
    init_from_head: str = ""  # a trained head's folder to go on training (new data for a shipped head)
    bf16: bool = False        # forward and backward under bfloat16 autocast (weights and optimizer stay float32):
                              # ~4x the tokens/s on a CPU with AMX, whose matrix units take bfloat16


def keep_freed_memory() -> None:
    """glibc hands every freed block of 32 MiB and more back to the kernel, and torch's activations are
    such blocks: each training step faulted its fresh pages in, zeroed, ~5x10^5 faults a step for a
    1.5B-sized head. Served from the heap and kept there, a step ran 1.13x faster (AMD EPYC, 2 threads;
    torch's own transparent-huge-page option, THP_MEM_ALLOC_ENABLE, ran 1.07x slower), for a larger
    peak (5.4 GB against 3.4 GB over the first 15 steps). Linux with glibc only; the process keeps
    its peak heap until it exits."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)  # the process's own C library, as llama_server.py finds prctl
    if not hasattr(libc, "mallopt"):  # not glibc
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def target_tensors(target_gguf: Path) -> tuple[np.ndarray, np.ndarray]:
    """The target's token embeddings and lm_head as float32 (lm_head = embeddings when tied)."""
    from ..gguf_tensors import dequantize, lm_head

    return dequantize(target_gguf, "token_embd.weight"), lm_head(target_gguf)


def target_last_layer(target_gguf: Path) -> dict[str, np.ndarray]:
    """The target's last decoder layer as float32, by GGUF name without its blk.N. prefix."""
    import gguf

    from ..gguf_tensors import dequantize_tensor

    reader = gguf.GGUFReader(target_gguf)
    arch = reader.fields["general.architecture"].contents()
    prefix = f"blk.{int(reader.fields[f'{arch}.block_count'].contents()) - 1}."
    layer = {t.name[len(prefix):]: dequantize_tensor(t) for t in reader.tensors if t.name.startswith(prefix)}
    if arch == "llama":
        # llama GGUFs store q/k rows interleaved for ggml's normal rope; the head (as HF) rotates halves
        n_head = int(reader.fields[f"{arch}.attention.head_count"].contents())
        n_head_kv = int(reader.fields.get(f"{arch}.attention.head_count_kv", reader.fields[f"{arch}.attention.head_count"]).contents())
        layer["attn_q.weight"] = _unpermute_rope_rows(layer["attn_q.weight"], n_head)
        layer["attn_k.weight"] = _unpermute_rope_rows(layer["attn_k.weight"], n_head_kv)
    return layer


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf's q/k row permutation for llama (pairs back to halves per head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def count_draft_vocab(stream: ShardStream, n_vocab: int, size: int) -> np.ndarray:
    """Token ids by how often the target produced them in assistant replies, most frequent first."""
    counts = np.zeros(n_vocab, np.int64)
    for tokens, mask in stream.tokens_and_masks():
        np.add.at(counts, tokens[mask.astype(bool)], 1)
    order = np.argsort(-counts, kind="stable")
    return order[:min(size, n_vocab)].astype(np.int32)


def _shift(x, s: int):
    """x moved s positions left along time (dim 1), zero-filled at the end."""
    import torch.nn.functional as F

    if s == 0:
        return x
    pad = (0, 0) * (x.dim() - 2) + (0, s)
    return F.pad(x[:, s:], pad)


def head_losses(net, batch, lm_head_t, noise: float, p_weight: float, n_steps: int = 1, step_decay: float = 1.0):
    """(loss, per-step [vloss, ploss, top-1 accuracy] averaged over masked positions). Step s predicts
    f[j+s] from the step before's prediction; loss = sum over steps of step_decay^(s-1) x (vloss +
    p_weight x ploss)."""
    import torch
    import torch.nn.functional as F

    tok_emb, f_in, f_out, mask = batch
    if noise > 0:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * noise
    preds = net.forward_steps(tok_emb, f_in, n_steps)
    loss, per_step = 0.0, []
    for s, pred in enumerate(preds):
        target, m = _shift(f_out, s), _shift(mask, s)
        n = m.sum().clamp(min=1)
        vloss = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * m).sum() / n
        with torch.no_grad():
            target_logits = target @ lm_head_t
            target_p = target_logits.softmax(-1)
        pred_logits = pred @ lm_head_t
        ploss = (-(target_p * pred_logits.log_softmax(-1)).sum(-1) * m).sum() / n
        acc = ((pred_logits.argmax(-1) == target_logits.argmax(-1)).float() * m).sum() / n
        loss = loss + step_decay ** s * (vloss + p_weight * ploss)
        per_step.append((vloss, ploss, acc, m.sum()))
    return loss, per_step


def train(target_gguf: Path, shard_paths: list[Path], out_dir: Path, cfg: TrainConfig, *,
          n_threads: int | None = None, progress: bool = True, stop_after: int | None = None,
          card_extra: dict | None = None) -> Path | None:
    """Trains (resuming from out_dir/train_state.pt if there) and writes out_dir/head in HF layout.
    Shards are streamed from disk (shards.ShardStream). stop_after=N stops after step N as an
    interruption would (returns None; run again to resume). card_extra: more entries for
    training.json (e.g. how the features were made)."""
    import torch
    from tqdm import tqdm

    from .head_model import EagleHeadNet, HeadConfig

    if n_threads:
        torch.set_num_threads(n_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        keep_freed_memory()
    torch.manual_seed(cfg.seed)
    data = ShardStream(shard_paths)
    hcfg = HeadConfig.from_target(target_gguf)
    start_head = None
    if cfg.init_from_head:
        from ..checkpoint import load_head

        if cfg.init_from_target:
            raise ValueError("init_from_head and init_from_target exclude each other")
        start_head = load_head(cfg.init_from_head)
        hcfg = replace(hcfg, intermediate_size=start_head.intermediate_size)
    elif cfg.intermediate_size:
        hcfg = replace(hcfg, intermediate_size=cfg.intermediate_size)
    emb, lm_head = target_tensors(target_gguf)
    draft_vocab = count_draft_vocab(data, hcfg.vocab_size, cfg.draft_vocab)
    lm_head_t = torch.from_numpy(np.ascontiguousarray(lm_head[draft_vocab].T)).to(device)
    del lm_head

    train_idx, eval_idx = data.split(cfg.eval_fraction, cfg.seed)
    steps_per_epoch = math.ceil(len(train_idx) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs

    state_path = out_dir / "train_state.pt"
    net = EagleHeadNet(hcfg)
    if not state_path.exists():  # a resumed run loads its weights below
        if cfg.init_from_target:
            net.init_from_target_layer(target_last_layer(target_gguf))
        elif start_head is not None:
            net.load_head(start_head.tensors)
    net = net.to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) *
                                              max(0.05, 1 - s / max(1, total_steps)))
    step, wall = 0, 0.0
    state = {}
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
    order, order_epoch = None, -1
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = data.epoch_order(train_idx, epoch, cfg.seed), epoch
        idx = order[in_epoch * cfg.batch_size:(in_epoch + 1) * cfg.batch_size]
        batch = [t.to(device) for t in data.batch(idx, emb)]
        net.train()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, per_step = head_losses(net, batch, lm_head_t, cfg.noise, cfg.p_weight, cfg.steps, cfg.step_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(net.parameters(), cfg.clip_value)
        opt.step()
        sched.step()
        step += 1
        wall = time.perf_counter() - t_start
        history.append([v.item() for v in per_step[0][:3]])
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
    head_dir = net.save_hf(out_dir / "head", int8=cfg.int8)
    (head_dir / DRAFT_VOCAB_FILE).write_text(json.dumps([int(t) for t in draft_vocab]))
    epoch_tokens = int(data.lengths[train_idx].sum())
    card = {"target": Path(target_gguf).name, "train_tokens": int(data.lengths.sum()),
            "train_sequences": len(train_idx), "eval_sequences": len(eval_idx), "steps": step,
            "wall_s": round(wall, 1), "tokens_per_s": round(epoch_tokens * step / steps_per_epoch / max(wall, 1e-9), 1),
            "device": device, "config": asdict(cfg),
            "final_train": dict(zip(("vloss", "ploss", "top1"), np.mean(history[-50:], axis=0).round(4).tolist()))
            if history else None,
            "eval_before": eval_before, "eval": metrics, **(card_extra or {})}
    if cfg.init_from_head and (Path(cfg.init_from_head) / "training.json").exists():
        # the run this one goes on from, so the card can state the head's whole training
        card["started_from"] = json.loads((Path(cfg.init_from_head) / "training.json").read_text())
    (head_dir / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    return head_dir


def evaluate(net, data: ShardStream, eval_idx, emb, lm_head_t, cfg: TrainConfig, device) -> dict:
    """Held-out losses and top-1 agreement with the target at step 1 (next token, the target's
    features), and top-1 at each chained step (the head's own features, as deeper tree levels)."""
    import torch

    net.eval()
    n_steps = max(cfg.steps, EVAL_STEPS)
    sums, n = np.zeros((n_steps, 3)), np.zeros(n_steps)
    with torch.no_grad():
        for start in range(0, len(eval_idx), cfg.batch_size):
            batch = [t.to(device) for t in data.batch(eval_idx[start:start + cfg.batch_size], emb)]
            _, per_step = head_losses(net, batch, lm_head_t, 0.0, cfg.p_weight, n_steps)
            for s, (vloss, ploss, acc, w) in enumerate(per_step):
                sums[s] += float(w) * np.array([float(vloss), float(ploss), float(acc)])
                n[s] += float(w)
    mean = sums / np.maximum(n, 1)[:, None]
    out = dict(zip(("vloss", "ploss", "top1"), mean[0].round(4).tolist()))
    out["top1_per_step"] = mean[:, 2].round(4).tolist()
    out["vloss_per_step"] = mean[:, 0].round(4).tolist()
    return out
