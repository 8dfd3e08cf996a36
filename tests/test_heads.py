"""The heads shipped in heads/: each loads as an EAGLE head, and its card states its training run."""

import json

import pytest

from eagle_llamacpp.checkpoint import load_head
from eagle_llamacpp.constants import DRAFT_VOCAB_FILE
from eagle_llamacpp.heads import HEADS_DIR, SHIPPED

FOLDERS = sorted(p for p in HEADS_DIR.iterdir() if p.is_dir())


def test_every_shipped_head_is_registered_for_its_target():
    assert sorted(SHIPPED.values()) == [p.name for p in FOLDERS]
    for target, folder in SHIPPED.items():
        card = json.loads((HEADS_DIR / folder / "training.json").read_text())
        assert card["target"] == target


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_head_loads_and_its_card_matches_training_json(folder):
    head = load_head(folder)
    card = json.loads((folder / "training.json").read_text())
    readme = (folder / "README.md").read_text()
    assert head.tensors["fc.weight"].shape == (head.hidden_size, 2 * head.hidden_size)
    vocab = json.loads((folder / DRAFT_VOCAB_FILE).read_text())
    assert len(vocab) == len(set(vocab)) == card["config"]["draft_vocab"]
    # the card quotes the run as training.json records it
    assert card["target"] in readme
    assert f"{card['train_tokens']:,} tokens" in readme
    assert f"{card['steps']} steps" in readme
    assert f"top-1 {card['eval']['top1']:.3f}" in readme
