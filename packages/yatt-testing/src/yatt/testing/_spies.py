"""Spies for tests that count work: wrap the real object, count its calls, pass everything on."""

from __future__ import annotations

from collections import Counter
from typing import Any


class CountingImageProcessor:
    """An image processor that counts the images it is given (a spy around the real one), for
    tests that an image is processed once."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor
        self.num_images = 0

    def __call__(self, *, images: Any, **kwargs: Any) -> Any:
        self.num_images += len(images)
        return self.image_processor(images=images, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.image_processor, name)


class CountingTokenizer:
    """A tokenizer that counts the texts it tokenizes (a spy around the real one), for tests
    that a prompt is tokenized once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: Counter[str] = Counter()

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        self.texts[text] += 1
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)
