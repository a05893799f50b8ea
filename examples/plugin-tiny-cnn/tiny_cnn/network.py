"""The network and its checkpoint: three strided convolutions, a global average and a linear layer.

    python -m tiny_cnn model_store/tiny-cnn.pt     # untrained weights and their labels

The checkpoint is a plain dict (`state_dict`, `labels`) that torch.load reads with weights_only=True.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SIDE = 64  # every image is resized to SIDE x SIDE, so any mix of sizes stacks into one batch
LABELS = ("red", "green", "blue", "yellow", "cyan", "magenta", "white", "black", "grey", "orange")


class TinyCnn(torch.nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        )
        self.classifier = torch.nn.Linear(64, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))  # type: ignore[no-any-return]


def save_weights(path: Path, *, seed: int = 0, labels: tuple[str, ...] = LABELS) -> Path:
    """Write an untrained checkpoint (seeded: the same bytes every time) with its labels."""
    torch.manual_seed(seed)
    network = TinyCnn(len(labels))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": network.state_dict(), "labels": list(labels)}, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tiny_cnn", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the checkpoint to write, e.g. model_store/tiny-cnn.pt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(save_weights(args.path, seed=args.seed))


if __name__ == "__main__":
    main()
