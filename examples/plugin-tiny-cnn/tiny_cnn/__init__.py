"""The second example plugin of docs/plugins.md: `tiny-cnn`, a small torch classifier on cuda:N or the CPU."""

from tiny_cnn.network import TinyCnn, save_weights
from tiny_cnn.plugin import TinyCnnOptions, TinyCnnPlugin

__all__ = ["TinyCnn", "TinyCnnOptions", "TinyCnnPlugin", "save_weights"]
