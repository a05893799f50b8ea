"""A third-party plugin distribution built in a test's tmp_path: a package and its `.dist-info`
(METADATA and entry_points.txt in the router's plugin group), found through PYTHONPATH by a
subprocess exactly as an installed distribution is. Variants break the contract on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PLUGIN = '''
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from router.sdk import ACCEPTED_MEDIA_TYPES, MemoryEstimate, ModelPlugin, decode_image, example_jpeg


class BrightnessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    scale: float = Field(1.0, gt=0)


class BrightnessPlugin(ModelPlugin[BrightnessOptions]):
    Options = BrightnessOptions
    accepts = ACCEPTED_MEDIA_TYPES

    def load(self, device):
        if device != "cpu":
            raise ValueError(f"model {self.context.model_name!r}: brightness runs on the CPU only, got {device!r}")

    def preprocess(self, payload):
        return decode_image(payload).mean(axis=2)

    def predict_batch(self, items: Sequence[np.ndarray]):
        return [float(item.mean()) * self.options.scale for item in items]

    def postprocess(self, output, item):
        return {"brightness": output, "height": int(item.shape[0])}

    def memory_estimate(self):
        return MemoryEstimate(weights_bytes=0, per_item_bytes=1000)

    def example_payload(self):
        return example_jpeg(32, 32)


class ShortPlugin(BrightnessPlugin):
    """Loses the last answer of every batch."""

    def predict_batch(self, items):
        return super().predict_batch(items)[:-1]


class NanPlugin(BrightnessPlugin):
    """Answers what JSON cannot carry."""

    def postprocess(self, output, item):
        return {"brightness": float("nan")}


class ShyPlugin(BrightnessPlugin):
    """Refuses the CPU without saying which model."""

    def load(self, device):
        raise RuntimeError("no device for me")
'''

ENTRY_POINTS = {"brightness": "BrightnessPlugin", "short": "ShortPlugin", "nan": "NanPlugin", "shy": "ShyPlugin"}


def third_party_distribution(root: Path) -> Path:
    """`brightness_plugin` and its distribution `third-party-brightness` under `root`, to put on PYTHONPATH."""
    (root / "brightness_plugin").mkdir(parents=True)
    (root / "brightness_plugin" / "__init__.py").write_text(PLUGIN, encoding="utf-8")
    info = root / "third_party_brightness-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-brightness\nVersion: 1.0\n", encoding="utf-8")
    points = "".join(f"{name} = brightness_plugin:{cls}\n" for name, cls in ENTRY_POINTS.items())
    (info / "entry_points.txt").write_text(f"[model_router.plugins]\n{points}", encoding="utf-8")
    return root


def run_with(extra_path: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with `extra_path` first on PYTHONPATH (the worktree's own path kept after it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
