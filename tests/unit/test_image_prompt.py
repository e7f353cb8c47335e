"""Image markers in the rendered prompt: expansion to each image's prompt text and the placeholder
spans that pair images with feature rows (serving/lowering.py), mismatches rejected."""

from __future__ import annotations

import pytest

from helios.serving.lowering import LoweringError, expand_image_markers, image_spans

IMG = 9


def test_each_marker_becomes_its_image_prompt_text_in_order() -> None:
    text = "<s>user: <image>what is this? <image> and this</s>"
    out = expand_image_markers(text, "<image>", ["[A<image><image>]", "[B<image>]"])
    assert out == "<s>user: [A<image><image>]what is this? [B<image>] and this</s>"


@pytest.mark.parametrize("text", ["no image here", "<image><image>", "look: <image> and the literal <image>"])
def test_markers_that_do_not_pair_up_with_images_are_rejected(text: str) -> None:
    with pytest.raises(LoweringError, match="image markers"):
        expand_image_markers(text, "<image>", ["[A]"] if text.count("<image>") != 1 else ["[A]", "[B]"])


def test_each_image_owns_the_next_placeholders_framing_between_tiles_included() -> None:
    ids = [1, 2, 5, IMG, IMG, 6, IMG, IMG, 7, 3, 5, IMG, IMG, IMG, 7, 4]
    assert image_spans(ids, IMG, [4, 3]) == [(3, 5), (11, 3)]


@pytest.mark.parametrize("tokens", [[4], [4, 4], [2, 2, 1, 1]])
def test_a_placeholder_count_other_than_the_images_cost_is_rejected(tokens: list[int]) -> None:
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]  # 5 placeholders
    with pytest.raises(LoweringError, match="5 image placeholder tokens"):
        image_spans(ids, IMG, tokens, "<image>")


def test_no_images_and_no_placeholders_is_fine() -> None:
    assert image_spans([1, 2, 3], IMG, []) == []
    with pytest.raises(LoweringError):
        image_spans([1, IMG, 3], IMG, [])  # the literal image token in text-only input
