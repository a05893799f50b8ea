"""Comparing an engine's raw outputs with a reference's on the same inputs.

Used by the exporters before they give a file its final name: the ONNX export against eager
PyTorch, the TensorRT engine against onnxruntime running the ONNX file it was built from. Detect
outputs are (n, 4 + classes, anchors) with boxes in network-input pixels; classify outputs are
logits (n, classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FP16", "FP32", "ParityReport", "Tolerance", "compare", "top_k_agree"]


@dataclass(frozen=True)
class Tolerance:
    box_px: float  # detect: largest box coordinate difference, in network-input pixels
    score: float  # detect: class score; classify: softmax probability


FP32 = Tolerance(box_px=1.0, score=1e-3)
FP16 = Tolerance(box_px=2.0, score=2e-2)


@dataclass(frozen=True)
class ParityReport:
    engine: str
    reference: str
    batch: int
    max_box_px: float | None  # None for classify
    max_score: float
    top_k_equal: bool | None  # None for detect
    ok: bool

    def line(self) -> str:
        boxes = "" if self.max_box_px is None else f"boxes within {self.max_box_px:.3g} px, "
        top_k = "" if self.top_k_equal is None else f", top-k {'identical' if self.top_k_equal else 'DIFFERENT'}"
        verdict = "ok" if self.ok else "FAILED"
        return (f"{self.engine} vs {self.reference} at batch {self.batch}: {boxes}scores within {self.max_score:.3g}"
                f"{top_k}: {verdict}")


def compare(
    task: str,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    tolerance: Tolerance,
    *,
    engine: str,
    against: str = "PyTorch",
    top_k: int = 5,
) -> ParityReport:
    """One batch's raw outputs side by side: `candidate` from `engine`, `reference` from `against`."""
    reference, candidate = reference.detach().float().cpu(), candidate.detach().float().cpu()
    if reference.shape != candidate.shape:
        raise ValueError(f"{engine} output has shape {tuple(candidate.shape)}, {against}'s {tuple(reference.shape)}")
    batch = int(reference.shape[0])
    if task == "detect":
        box = float((reference[:, :4] - candidate[:, :4]).abs().max())
        score = float((reference[:, 4:] - candidate[:, 4:]).abs().max()) if reference.shape[1] > 4 else 0.0
        ok = box <= tolerance.box_px and score <= tolerance.score
        return ParityReport(engine, against, batch, box, score, None, ok)
    ref_probs, cand_probs = reference.softmax(dim=1), candidate.softmax(dim=1)
    score = float((ref_probs - cand_probs).abs().max())
    same = top_k_agree(ref_probs, cand_probs, min(top_k, ref_probs.shape[1]), tolerance.score)
    return ParityReport(engine, against, batch, None, score, same, same and score <= tolerance.score)


def top_k_agree(reference: torch.Tensor, candidate: torch.Tensor, k: int, tie: float = 0.0) -> bool:
    """Same top-k class ids in the same order; a swap counts only between classes whose reference
    probabilities are within `tie` of each other (0: identical ids required)."""
    ref_ids = reference.topk(k, dim=1).indices
    cand_ids = candidate.topk(k, dim=1).indices
    if torch.equal(ref_ids, cand_ids):
        return True
    gap = (reference.gather(1, ref_ids) - reference.gather(1, cand_ids)).abs()
    return bool(tie > 0 and float(gap.max()) <= tie)
