"""The transform contract: what runs between two models of a pipeline.

A transform reads one step's input and answer and hands the next step its items: `crop` (built
in, `router.sdk.crop`) cuts one item per detected box out of the image, `whole` passes the image
on. Other transforms come from any installed distribution that declares a `Transform` subclass
under the entry-point group `model_router.transforms`; the router validates it when it
registers, as it does model plugins.

A transform is a small pure function of (input, answer): it changes neither, it keeps no state
between calls, and it runs in the router's front on a worker thread, next to the plugins'
`preprocess`. It never sees a model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel

from router.sdk.plugin import NoOptions, Payload

__all__ = ["ITEM_KINDS", "TRANSFORMS_GROUP", "ItemKind", "StepItem", "Transform", "Transformed"]

#: The entry-point group transforms are declared under.
TRANSFORMS_GROUP = "model_router.transforms"
#: What a transform's items are: images (decoded pixels, for a model that accepts `image/*`) or
#: JSON documents (for a model that accepts `application/json`).
ItemKind = Literal["image", "json"]
ITEM_KINDS: tuple[ItemKind, ...] = ("image", "json")

OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass(frozen=True)
class StepItem:
    """One item for the next step: its input, and the object of the answer that the next step's
    answer is attached to (under the next step's name)."""

    payload: Payload
    into: dict[str, Any]


@dataclass(frozen=True)
class Transformed:
    """What a transform returns: the step's answer as the pipeline's answer carries it (a new
    object; the `into` of each item lies inside it), and the items, produced lazily: each one goes
    to the next model's queue as soon as it is made."""

    answer: Any
    items: Iterable[StepItem]


class Transform(ABC, Generic[OptionsT]):
    """One transform. Subclass it, set `Options` to a pydantic model and `needs`/`gives`,
    implement `apply`, and declare the class under the `model_router.transforms` entry point."""

    Options: ClassVar[type[BaseModel]] = NoOptions
    #: The `answers` the model before it must declare (`"detections"` for `crop`); None: any.
    needs: ClassVar[str | None] = None
    #: What its items are; the model after it must accept them.
    gives: ClassVar[ItemKind] = "image"

    def __init__(self, options: OptionsT) -> None:
        self.options = options

    @abstractmethod
    def apply(self, payload: Payload, answer: Any) -> Transformed:
        """The next step's items from the step's input (`payload`, decoded pixels in
        `payload.pixels` for an image) and its answer. Raise `InputError` for an answer it
        cannot read."""
