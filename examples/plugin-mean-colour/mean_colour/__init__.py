"""The example plugin of docs/plugins.md: `mean-colour`, the mean colour of an image."""

from mean_colour.plugin import MeanColourOptions, MeanColourPlugin

__all__ = ["MeanColourOptions", "MeanColourPlugin"]
