"""A tiny real torch model over JSON vectors: `{"x": [16 floats]}` -> 4 logits."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from router.sdk import InputError, MemoryEstimate, ModelPlugin, Payload, loads_bounded

IN_FEATURES = 16


class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    seed: int = 0
    hidden: int = Field(32, ge=1)


def build_model(seed: int, hidden: int) -> torch.nn.Module:
    """The same network for the same seed: tests build it directly to compare answers."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model.eval()


class ToyPlugin(ModelPlugin[ToyOptions]):
    Options = ToyOptions
    accepts = ("application/json",)

    def load(self, device: str) -> None:
        self.device = torch.device(device)
        self.model = build_model(self.options.seed, self.options.hidden).to(self.device)

    def preprocess(self, payload: Payload) -> torch.Tensor:
        expected = f'JSON like {{"x": [{IN_FEATURES} numbers]}}'
        data = loads_bounded(payload.body, "the input", expected=expected)
        try:
            values = data["x"]
        except (TypeError, KeyError) as exc:
            raise InputError(f"expected {expected}: {exc!r}") from None
        if not isinstance(values, list) or len(values) != IN_FEATURES:
            raise InputError(f"'x' must be a list of {IN_FEATURES} numbers, got {str(values)[:80]}")
        try:
            return torch.tensor(values, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise InputError(f"'x' must hold numbers only: {exc}") from None

    def predict_batch(self, items: Sequence[torch.Tensor]) -> list[list[float]]:
        with torch.inference_mode():
            logits = self.model(torch.stack(list(items)).to(self.device))
        return logits.cpu().tolist()

    def postprocess(self, output: Any, item: Any) -> dict[str, Any]:
        return {"logits": output}

    def memory_estimate(self) -> MemoryEstimate:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return MemoryEstimate(weights_bytes=weights, per_item_bytes=4 * (IN_FEATURES + self.options.hidden + 4))

    def example_payload(self) -> Payload:
        return Payload(json.dumps({"x": [0.0] * IN_FEATURES}).encode(), "application/json")
