"""The built-in transforms as the pure functions they are, the payloads that carry decoded pixels,
and the validation of transforms when they register."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import numpy as np
import pytest
from pydantic import BaseModel

from router.errors import InputError, PayloadTooLarge, PluginValidationError
from router.sdk import PIXELS_MEDIA_TYPE, NoOptions, Payload, Transform, Transformed, decode_image, open_image
from router.sdk.crop import CropOptions, CropTransform, WholeTransform, plan_crops
from router.sdk.images import example_jpeg
from router.serving.transforms import TransformRegistry, validate_transform_class


def detection(box: list[float], score: float, **extra: Any) -> dict[str, Any]:
    return {"box": box, "score": score, "label": "thing", **extra}


def image(height: int = 40, width: int = 60) -> np.ndarray:
    """Pixels that say where they are: red = column, green = row."""
    rows, cols = np.mgrid[0:height, 0:width]
    return np.stack([cols, rows, np.full_like(rows, 7)], axis=2).astype(np.uint8)


# -- where crops go ---------------------------------------------------------------------------


def test_a_box_is_rounded_outwards_to_whole_pixels() -> None:
    plan = plan_crops(100, 100, [detection([10.2, 20.7, 30.1, 40.0], 0.9)], CropOptions())
    assert plan.kept == [(0, (10, 20, 31, 40))]


def test_padding_grows_each_side_by_a_share_of_the_box_and_stops_at_the_image() -> None:
    plan = plan_crops(22, 35, [detection([10, 10, 20, 30], 0.9)], CropOptions(padding=0.5))
    assert plan.kept == [(0, (5, 0, 22, 35))]  # 10 +- 5 wide (clipped at 22), 10..30 +- 10 high (clipped)


def test_low_scores_and_small_crops_are_skipped_and_counted() -> None:
    detections = [detection([0, 0, 50, 50], 0.1), detection([0, 0, 3, 50], 0.9), detection([0, 0, 50, 50], 0.8)]
    plan = plan_crops(100, 100, detections, CropOptions(min_score=0.5, min_size=4))
    assert plan.kept == [(2, (0, 0, 50, 50))]
    assert plan.counts() == {"kept": 1, "below_min_score": 1, "below_min_size": 1, "over_max_items": 0}


def test_max_items_keeps_the_top_scoring_highest_first_ties_by_order() -> None:
    scores = [0.3, 0.9, 0.5, 0.9, 0.7]
    detections = [detection([i, i, i + 10, i + 10], s) for i, s in enumerate(scores)]
    plan = plan_crops(100, 100, detections, CropOptions(max_items=3))
    assert [index for index, _ in plan.kept] == [1, 3, 4]
    assert plan.over_max_items == 2


def test_thousands_of_boxes_are_cut_to_max_items() -> None:
    detections = [detection([0, 0, 10, 10], (i % 997) / 997) for i in range(20_000)]
    plan = plan_crops(100, 100, detections, CropOptions(max_items=16))
    assert len(plan.kept) == 16 and plan.over_max_items == 20_000 - 16


@pytest.mark.parametrize("bad", [
    {"box": [0, 0, 10], "score": 0.5}, {"box": [0, 0, 10, float("nan")], "score": 0.5},
    {"box": [0, 0, 10, 10], "score": True}, {"box": "0 0 10 10", "score": 0.5}, ["not", "a", "dict"],
])
def test_a_detection_that_is_not_a_box_and_a_score_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(InputError, match=r"detections\[1\] is not like"):
        plan_crops(100, 100, [detection([0, 0, 5, 5], 0.9), bad], CropOptions())


# -- the transforms -------------------------------------------------------------------------


def test_crop_cuts_views_of_the_decoded_image_and_attaches_nothing_to_its_input() -> None:
    pixels = image()
    answer = {"detections": [detection([5, 10, 15, 30], 0.4), detection([20, 0, 60, 40], 0.9)], "image": {"w": 60}}
    before = copy.deepcopy(answer)
    transformed = CropTransform(CropOptions()).apply(Payload(b"jpeg", "image/jpeg", pixels=pixels), answer)
    items = list(transformed.items)
    assert answer == before  # pure: the detector's answer is not touched
    assert [d["crop_box"] for d in transformed.answer["detections"]] == [[20, 0, 60, 40], [5, 10, 15, 30]]
    assert transformed.answer["crop"]["kept"] == 2 and transformed.answer["image"] == {"w": 60}
    assert [item.into for item in items] == transformed.answer["detections"]  # each answer goes on its detection
    first = items[0].payload
    assert first.media_type == PIXELS_MEDIA_TYPE and first.body == b""
    assert np.shares_memory(first.pixels, pixels)  # cut, not copied, never re-encoded
    assert first.pixels.shape == (40, 40, 3) and first.pixels[0, 0, 0] == 20 and items[1].payload.pixels[0, 0, 1] == 10


def test_crop_makes_its_items_lazily() -> None:
    transformed = CropTransform(CropOptions()).apply(Payload(b"", PIXELS_MEDIA_TYPE, pixels=image()),
                                                     {"detections": [detection([0, 0, 5, 5], 0.5)]})
    assert iter(transformed.items) is transformed.items  # an iterator: each crop goes on as soon as it is cut
    assert len(list(transformed.items)) == 1


def test_crop_refuses_an_answer_without_detections() -> None:
    with pytest.raises(InputError, match="crop needs an answer like"):
        CropTransform(CropOptions()).apply(Payload(b"", PIXELS_MEDIA_TYPE, pixels=image()), {"top_k": []})


def test_whole_passes_the_input_on_and_wraps_an_answer_that_is_not_an_object() -> None:
    payload = Payload(b"jpeg", "image/jpeg", pixels=image())
    carried = WholeTransform(NoOptions()).apply(payload, {"a": 1})
    [item] = list(carried.items)
    assert item.payload is payload and item.into is carried.answer and carried.answer == {"a": 1}
    assert WholeTransform(NoOptions()).apply(payload, [1, 2]).answer == {"result": [1, 2]}


# -- decoded pixels through the SDK's decoder --------------------------------------------------


def test_decode_image_hands_decoded_pixels_over_unchanged() -> None:
    pixels = image()[5:25, 10:40]  # a view, as a crop is
    decoded = decode_image(Payload(b"", PIXELS_MEDIA_TYPE, pixels=pixels))
    assert decoded.flags.c_contiguous and np.array_equal(decoded, pixels)
    opened = open_image(Payload(b"", PIXELS_MEDIA_TYPE, pixels=pixels))
    assert (opened.header.format, opened.header.width, opened.header.height) == ("PIXELS", 30, 20)
    assert np.array_equal(opened.decode(channels="BGR"), pixels[:, :, ::-1])
    assert opened.decode(fit=(8, 8)).shape == (20, 30, 3)  # nothing to reduce: the pixels are what they are


def test_the_same_decode_as_from_the_file() -> None:
    payload = example_jpeg()
    pixels = decode_image(payload)
    assert np.array_equal(decode_image(Payload(payload.body, payload.media_type, pixels=pixels)), pixels)


def test_decoded_pixels_keep_the_decoders_limits() -> None:
    with pytest.raises(PayloadTooLarge, match="the limit is 100 pixels"):
        decode_image(Payload(b"", PIXELS_MEDIA_TYPE, pixels=image(20, 20)), max_pixels=100)
    with pytest.raises(InputError, match="aspect ratio"):
        decode_image(Payload(b"", PIXELS_MEDIA_TYPE, pixels=image(2, 60)))
    with pytest.raises(InputError, match="uint8 \\(height, width, 3\\)"):
        decode_image(Payload(b"", PIXELS_MEDIA_TYPE, pixels=np.zeros((4, 4), np.float32)))
    with pytest.raises(InputError, match="empty"):
        decode_image(Payload(b"", PIXELS_MEDIA_TYPE, pixels=image()[0:0]))


# -- validation when a transform registers ------------------------------------------------------------


class Good(Transform[NoOptions]):
    def apply(self, payload: Payload, answer: Any) -> Transformed:
        return Transformed(answer, [])


class Abstract(Transform[NoOptions]):
    pass


class BadOptions(Good):
    Options: ClassVar[Any] = dict


class BadNeeds(Good):
    needs: ClassVar[Any] = 3


class BadGives(Good):
    gives: ClassVar[Any] = "audio"


@pytest.mark.parametrize(("target", "message"), [
    (len, "must name a Transform subclass"), (BaseModel, "must name a Transform subclass"),
    (Abstract, "does not implement: apply"), (BadOptions, "Options must be a pydantic BaseModel"),
    (BadNeeds, "needs must be a non-empty string or None, got 3"), (BadGives, "gives must be one of image, json, got 'audio'"),
])
def test_an_unfit_transform_is_refused_when_it_registers(target: object, message: str) -> None:
    with pytest.raises(PluginValidationError, match=message):
        validate_transform_class("t", target)
    with pytest.raises(PluginValidationError, match=message):
        TransformRegistry().register("t", target)


def test_the_built_in_names_are_taken_and_entry_points_are_found() -> None:
    registry = TransformRegistry.from_entry_points()
    assert {"crop", "whole", "halves"} <= set(registry.names())  # halves: the test kit's distribution
    assert registry.get("halves") is not None and registry.get("halves").distribution == "vision-model-router-testkit"
    with pytest.raises(PluginValidationError, match="the name of a built-in transform"):
        registry.register("crop", Good)
    registry.register("good", Good)
    assert registry.get("good") is not None
    assert "no transform named 'nope'; transforms: crop, good, halves, whole" == registry.why_missing("nope")
