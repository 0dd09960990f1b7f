"""A dataset row's image field -> PIL images, or the cause it cannot be used.

    row[image_key]   a path (relative to the data file's folder, or absolute), bytes,
                     {"bytes": ..., "path": ...} (a `datasets` Image feature stored raw),
                     a PIL image (a `datasets` Image feature decoded), or a list of these
    -> the same shape (one image, or a list) of loaded PIL images

Every image is read and decoded here, on the rank that loaded its row, so a missing, damaged
or oversized file is found by the loader (a counted skip) instead of by the image processor in
the middle of a rollout. Nothing is read that could block or not end: a path must stat as a
regular file (a FIFO, a device such as /dev/zero or a folder is refused unopened) and its size
must be within max_bytes before a byte is read. The pixel count is checked from the file's
header, before its pixels are decoded: an oversized image never costs its decoded size in memory.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The default of the loader's max_image_bytes: an encoded image file (or inline bytes) larger
# than this is skipped unread. A 4096x4096 PNG of a photo is about 20-30 MiB.
DEFAULT_MAX_IMAGE_BYTES = 32 << 20


class RowImageError(ValueError):
    """An image field that cannot be used; `cause` is the loader's skip cause."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def import_pil() -> Any:
    """PIL.Image, or ImportError saying how to install it."""
    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError(
            "opening a dataset's images (image_key) needs Pillow: pip install 'yatt-core[vision]' "
            "(or pip install pillow)"
        ) from err
    return Image


def open_row_images(
    value: Any,
    *,
    base_dir: Path,
    max_pixels: int | None,
    max_bytes: int | None = DEFAULT_MAX_IMAGE_BYTES,
) -> Any:
    """`value` (one image or a list of them, see the module docstring) as loaded PIL images.

    Raises RowImageError with cause "no_image" (no image, or a file that does not exist),
    "bad_image" (not an image, not one PIL can decode, or a path that is not a regular file)
    or "image_too_large" (more pixels than `max_pixels`, or a file or inline bytes larger than
    `max_bytes`)."""
    limits = {"base_dir": base_dir, "max_pixels": max_pixels, "max_bytes": max_bytes}
    if isinstance(value, list | tuple):
        if not value:
            raise RowImageError("an empty list of images", cause="no_image")
        return [_open_one(item, **limits, where=f"image {i}: ") for i, item in enumerate(value)]
    return _open_one(value, **limits, where="")


def _open_one(
    value: Any, *, base_dir: Path, max_pixels: int | None, max_bytes: int | None, where: str
) -> Any:
    image_module = import_pil()
    if value is None:
        raise RowImageError(f"{where}no image (None)", cause="no_image")
    if isinstance(value, image_module.Image):
        _check_pixels(value, max_pixels, where)
        try:
            value.load()  # a lazily opened image (datasets decodes that way) read now
        except Exception as err:
            raise RowImageError(
                f"{where}the image does not decode ({type(err).__name__}: {err})",
                cause="bad_image",
            ) from None
        return value
    if isinstance(value, Mapping):
        # A datasets Image feature read without decoding: the bytes when stored, else the path.
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise RowImageError(
                f"{where}an image dict with neither bytes nor path", cause="no_image"
            )
    if isinstance(value, bytes | bytearray | memoryview):
        num_bytes = len(value) if not isinstance(value, memoryview) else value.nbytes
        if max_bytes is not None and num_bytes > max_bytes:
            raise RowImageError(
                f"{where}inline image of {num_bytes} bytes, over max_image_bytes={max_bytes}",
                cause="image_too_large",
            )
        data, name = bytes(value), f"{num_bytes} bytes"
    elif isinstance(value, str | Path):
        data, name = _read_file(value, base_dir, max_bytes, where), repr(str(value))
    else:
        raise RowImageError(
            f"{where}a {type(value).__name__} is not an image: give a path, bytes, "
            '{"bytes": ..., "path": ...} or a PIL image',
            cause="bad_image",
        )
    try:
        image = image_module.open(io.BytesIO(data))
    except Exception as err:
        raise RowImageError(
            f"{where}{name} is not an image PIL can open ({type(err).__name__}: {err})",
            cause="bad_image",
        ) from None
    _check_pixels(image, max_pixels, where)
    try:
        image.load()
    except Exception as err:
        raise RowImageError(
            f"{where}{name} does not decode ({type(err).__name__}: {err})", cause="bad_image"
        ) from None
    return image


def _read_file(value: str | Path, base_dir: Path, max_bytes: int | None, where: str) -> bytes:
    text = str(value)
    if "\x00" in text:  # the OS takes no NUL in a path: stat() would raise a bare ValueError
        raise RowImageError(f"{where}image path {text[:80]!r} holds a NUL byte", cause="bad_image")
    if "://" in text:
        raise RowImageError(
            f"{where}{text!r} is a URL; the loader reads local files only (download the images "
            "and give their paths)",
            cause="bad_image",
        )
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    try:
        info = path.stat()  # follows symlinks: a link to /dev/zero is a device
        if not stat.S_ISREG(info.st_mode):
            raise RowImageError(
                f"{where}image path {str(path)!r} is not a regular file (a FIFO, device or "
                "folder?); it is not opened",
                cause="bad_image",
            )
        if max_bytes is not None and info.st_size > max_bytes:
            raise RowImageError(
                f"{where}image file {str(path)!r} has {info.st_size} bytes, over "
                f"max_image_bytes={max_bytes}",
                cause="image_too_large",
            )
        # O_NONBLOCK: should the path turn into a FIFO after the stat, the open cannot block.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise RowImageError(
                    f"{where}image path {str(path)!r} is not a regular file", cause="bad_image"
                )
            # Sized by the file (read(n) allocates n up front), bounded should it have grown.
            size = info.st_size if max_bytes is None else min(info.st_size, max_bytes)
            data = f.read(size + 1)
    except FileNotFoundError:
        raise RowImageError(
            f"{where}image file {str(path)!r} does not exist", cause="no_image"
        ) from None
    except OSError as err:
        raise RowImageError(
            f"{where}image file {str(path)!r} cannot be read ({type(err).__name__}: {err})",
            cause="bad_image",
        ) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise RowImageError(
            f"{where}image file {str(path)!r} has over max_image_bytes={max_bytes} bytes",
            cause="image_too_large",
        )
    return data


def _check_pixels(image: Any, max_pixels: int | None, where: str) -> None:
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise RowImageError(
            f"{where}a {width}x{height} image has {width * height} pixels, over "
            f"max_image_pixels={max_pixels}",
            cause="image_too_large",
        )
