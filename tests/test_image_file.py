"""image_file.py: an image's bytes to the RGB picture transformers' image processors see, or one
line naming the image. Every odd image here is written by Pillow in the test; the reference is
transformers' own path (`load_image`'s EXIF step, then `convert_to_rgb` as every image processor
applies it to a PIL image)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import random
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from llmcli.errors import EXIT_USAGE, UsageError
from llmcli.models.vision.encoder import ImageInput
from llmcli.models.vision.image_file import (
    ALLOW_IMAGE_URLS_FLAG,
    IMAGE_BYTES,
    MAX_PIXELS,
    CheckedImage,
    ImageError,
    decode_base64_image,
    decode_data_url,
    is_remote_url,
    open_image,
    read_image_file,
)

EXIF_ORIENTATION = 0x0112


def noise(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A picture whose every pixel differs from its neighbours, so that a rotation, a dropped
    alpha or a wrong palette entry shows in the pixels."""
    bands = len(Image.new(mode, (1, 1)).getbands())
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, (size[1], size[0], bands), dtype=np.uint8)
    return Image.fromarray(values[..., 0] if bands == 1 else values, mode)


def encoded(picture: Image.Image, file_format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, file_format, **options)
    return buffer.getvalue()


def rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6  # stored sideways: shown turned 90° clockwise
    return encoded(noise("RGB", (40, 24)), "JPEG", exif=exif)


def partly_transparent_png() -> bytes:
    picture = noise("RGBA", (17, 9))
    alpha = np.array(picture)[..., 3]
    alpha[:, :4] = 0  # fully transparent columns, partial elsewhere
    values = np.array(picture)
    values[..., 3] = alpha
    return encoded(Image.fromarray(values, "RGBA"), "PNG")


def palette(file_format: str) -> bytes:
    picture = noise("L", (13, 7)).quantize(16)
    return encoded(picture, file_format, transparency=3)


def deep_gray_png() -> bytes:
    values = np.random.default_rng(1).integers(0, 65536, (6, 11), dtype=np.uint16)
    return encoded(Image.fromarray(values), "PNG")  # 16-bit grey: mode I;16


def stereo_mpo() -> bytes:
    """A camera's JPEG holding two pictures (MPO): the first is the photo."""
    return encoded(noise("RGB", (16, 12)), "MPO", save_all=True, append_images=[noise("RGB", (16, 12), 1)])


READ: dict[str, Callable[[], bytes]] = {
    "one_pixel.png": lambda: encoded(noise("RGB", (1, 1)), "PNG"),
    "wide.jpg": lambda: encoded(noise("RGB", (3000, 20)), "JPEG"),
    "wide.png": lambda: encoded(noise("RGB", (3000, 20)), "PNG"),
    "rotated.jpg": rotated_jpeg,
    "transparent.png": partly_transparent_png,
    "gray_alpha.png": lambda: encoded(noise("LA", (9, 5)), "PNG"),
    "palette.gif": lambda: palette("GIF"),
    "palette.png": lambda: palette("PNG"),
    "gray.png": lambda: encoded(noise("L", (7, 3)), "PNG"),
    "deep_gray.png": deep_gray_png,
    "cmyk.jpg": lambda: encoded(noise("CMYK", (10, 6)), "JPEG"),
    "one_bit.bmp": lambda: encoded(noise("L", (12, 4)).convert("1"), "BMP"),
    "photo.bmp": lambda: encoded(noise("RGB", (5, 8)), "BMP"),
    "lossless.webp": lambda: encoded(noise("RGBA", (8, 8)), "WEBP", lossless=True),
    "stereo.mpo": stereo_mpo,
}
OPAQUE = ("one_pixel.png", "wide.jpg", "rotated.jpg", "gray.png", "cmyk.jpg", "photo.bmp", "stereo.mpo")


def written(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def processor_pixels(path: Path) -> np.ndarray:
    """What transformers' image processors see of the file: upright (load_image's
    exif_transpose), then their `convert_to_rgb`."""
    from transformers.image_transforms import convert_to_rgb

    with Image.open(path) as opened:
        return convert_to_rgb(ImageOps.exif_transpose(opened), return_numpy=True)


def refusal(data: bytes, label: str = "photo.png", **options: int) -> str:
    with pytest.raises(ImageError) as caught:
        open_image(ImageInput(data, label), **options)
    line = caught.value.one_line()
    assert line.startswith(f"image {label}: "), line
    return line


@pytest.mark.parametrize("name", READ)
def test_each_image_reads_as_the_pixels_transformers_image_processors_see(tmp_path: Path, name: str) -> None:
    data = READ[name]()
    checked = open_image(ImageInput(data, name))
    expected = processor_pixels(written(tmp_path, name, data))
    assert checked.image.mode == "RGB"
    assert (checked.height, checked.width, 3) == expected.shape
    assert checked.image.size == (checked.width, checked.height)
    np.testing.assert_array_equal(np.array(checked.image), expected)
    assert checked.digest == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", OPAQUE)
def test_an_opaque_image_is_what_transformers_load_image_gives(tmp_path: Path, name: str) -> None:
    from transformers.image_utils import load_image

    data = READ[name]()
    expected = np.array(load_image(str(written(tmp_path, name, data))))
    np.testing.assert_array_equal(np.array(open_image(ImageInput(data, name)).image), expected)


def test_transparency_is_composited_on_white_as_the_processors_do_not_dropped_as_load_image_does(
    tmp_path: Path,
) -> None:
    """transformers has two answers for a transparent picture: `load_image` drops the alpha band
    (the hidden colours show), `convert_to_rgb` composites on white. A processor handed a PIL
    image does the second; so does this module, and the difference is real for this image."""
    from transformers.image_utils import load_image

    path = written(tmp_path, "transparent.png", partly_transparent_png())
    ours = np.array(open_image(ImageInput(path.read_bytes(), "transparent.png")).image)
    assert (ours[:, :4] == 255).all()  # the transparent columns are white
    assert not np.array_equal(ours, np.array(load_image(str(path))))


def test_the_exif_orientation_turns_the_picture_upright() -> None:
    checked = open_image(ImageInput(rotated_jpeg(), "rotated.jpg"))
    assert (checked.width, checked.height, checked.format) == (24, 40, "JPEG")


def test_a_camera_file_with_two_pictures_reads_its_first_not_refused_as_animated() -> None:
    checked = open_image(ImageInput(stereo_mpo(), "stereo.jpg"))
    assert (checked.format, checked.width, checked.height) == ("MPO", 16, 12)


def with_declared_size(png: bytes, width: int, height: int) -> bytes:
    """The PNG with its IHDR saying another size (and a CRC that matches, so that only the size
    is wrong): a few hundred bytes that would decode to width × height pixels."""
    header = struct.pack(">II", width, height) + png[24:29]
    return png[:16] + header + struct.pack(">I", zlib.crc32(b"IHDR" + header)) + png[33:]


def test_a_decompression_bomb_is_refused_by_its_declared_size_before_decoding() -> None:
    bomb = with_declared_size(encoded(noise("RGB", (4, 4)), "PNG"), 100_000, 100_000)
    assert len(bomb) < 200
    line = refusal(bomb, "bomb.png")
    # Decoding first would have failed on the missing pixel data ("damaged or truncated"), or
    # tried to allocate 30 GB: the size in the line is the header's, read before any decode.
    assert "100000×100000 is 10000 megapixels, over the 67.1 megapixel limit" in line


def test_the_pixel_cap_is_the_callers_to_lower_and_holds_at_its_edge() -> None:
    wide = READ["wide.png"]()
    assert "3000×20 is 0.1 megapixels" in refusal(wide, max_pixels=59_999)
    assert open_image(ImageInput(wide, "wide.png"), max_pixels=60_000).width == 3000
    assert MAX_PIXELS == 8192 * 8192 and IMAGE_BYTES == 4 * MAX_PIXELS


def animated(file_format: str) -> bytes:
    frames = [noise("RGB", (6, 6), seed) for seed in range(3)]
    return encoded(frames[0], file_format, save_all=True, append_images=frames[1:], duration=100)


@pytest.mark.parametrize("file_format", ["GIF", "PNG", "WEBP"])
def test_an_animated_image_is_refused_rather_than_read_as_one_frame(file_format: str) -> None:
    line = refusal(animated(file_format), "dance.gif")
    assert f"an animated {file_format}: animated images are not read: give one frame" in line


@pytest.mark.parametrize("name", ["transparent.png", "wide.jpg", "palette.gif", "lossless.webp"])
def test_a_truncated_file_is_refused_whole_not_read_in_part(name: str) -> None:
    data = READ[name]()
    line = refusal(data[: len(data) * 2 // 3], name)
    assert "damaged or truncated" in line


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"", "empty (0 bytes)"),
        (b"just some notes\nabout a photo\n", "text, not an image (PNG, JPEG, GIF, WebP, BMP are read)"),
        (bytes(random.Random(0).randrange(256) for _ in range(4096)), "not an image (PNG, JPEG"),
        (encoded(noise("RGB", (4, 4)), "TIFF"), "a TIFF image, which is not read"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "text, not an image"),
    ],
    ids=["empty", "text", "random", "tiff", "svg"],
)
def test_what_is_not_a_readable_image_is_named_in_one_line(data: bytes, said: str) -> None:
    assert said in refusal(data, "notes.txt")


def test_no_damaged_file_escapes_as_anything_but_one_line() -> None:
    """Cuts and flipped bytes through every format's reader: a picture or an ImageError, never
    Pillow's own exception (whose traceback the user would see)."""
    rng = random.Random(46)
    originals = [READ[name]() for name in READ if name != "wide.jpg"]
    for _ in range(300):
        data = bytearray(rng.choice(originals))
        if rng.random() < 0.5:
            del data[rng.randrange(1, len(data)) :]
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            # A small cap: a flipped header may declare a large picture, and this stays fast.
            checked = open_image(ImageInput(bytes(data), "fuzzed"), max_pixels=100_000)
        except ImageError as error:
            assert error.one_line().startswith("image fuzzed: ")
        else:
            assert isinstance(checked, CheckedImage) and checked.image.mode == "RGB"


def test_an_image_error_is_a_usage_error_the_cli_and_server_answer_in_one_line() -> None:
    assert issubclass(ImageError, UsageError) and ImageError.exit_code == EXIT_USAGE


def test_reading_an_image_imports_pillow_but_neither_transformers_nor_torch(tmp_path: Path) -> None:
    path = written(tmp_path, "photo.png", READ["transparent.png"]())
    script = (
        "import sys\n"
        "from llmcli.models.vision import image_file\n"
        "assert 'PIL' not in sys.modules, 'Pillow imported before an image'\n"
        f"image_file.open_image(image_file.read_image_file({str(path)!r}))\n"
        "assert 'PIL' in sys.modules\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"


def test_a_file_is_read_with_its_path_as_the_label(tmp_path: Path) -> None:
    path = written(tmp_path, "photo.png", READ["gray.png"]())
    image = read_image_file(path)
    assert image == ImageInput(path.read_bytes(), str(path))


def file_refusal(path: Path) -> str:
    with pytest.raises(ImageError) as caught:
        read_image_file(path)
    line = caught.value.one_line()
    assert line.startswith(f"image {path}: "), line
    return line


def test_a_missing_path_or_a_folder_is_refused_naming_the_path(tmp_path: Path) -> None:
    assert "no such file" in file_refusal(tmp_path / "nowhere.png")
    assert "a folder, not a file" in file_refusal(tmp_path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_refused_naming_the_path(tmp_path: Path) -> None:
    path = written(tmp_path, "secret.png", READ["gray.png"]())
    path.chmod(0)
    assert "cannot read it" in file_refusal(path)


def test_a_file_over_the_byte_limit_is_refused_by_its_size_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.bmp"
    with path.open("wb") as handle:
        handle.truncate(IMAGE_BYTES + 1)  # sparse: no disk, and reading it would take 256 MiB
    line = file_refusal(path)
    # read_file's own bound would say "for this input" after reading; this is the stat's.
    assert "over the 256 MiB limit for an image" in line


PNG = encoded(noise("RGB", (3, 2)), "PNG")
PNG_BASE64 = base64.b64encode(PNG).decode()


@pytest.mark.parametrize(
    "url", [f"data:image/png;base64,{PNG_BASE64}", f"DATA:Image/PNG;BASE64,{PNG_BASE64}"]
)
def test_a_base64_data_url_carries_the_image(url: str) -> None:
    assert decode_data_url(url, "messages[0].content[1]") == ImageInput(PNG, "messages[0].content[1]")
    assert not is_remote_url(url)


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "HTTPS://example.com/cat.png"])
def test_a_remote_url_is_refused_saying_why_and_which_flag_allows_it(url: str) -> None:
    assert is_remote_url(url)
    with pytest.raises(ImageError) as caught:
        decode_data_url(url, "messages[1].content[0]")
    line = caught.value.one_line()
    assert line.startswith("image messages[1].content[0]: this server does not fetch the image URLs")
    assert f"llmcli serve {ALLOW_IMAGE_URLS_FLAG}" in line and ALLOW_IMAGE_URLS_FLAG == "--allow-image-urls"


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("file:///etc/passwd", "a file: URL"),
        ("ftp://example.com/cat.png", "a ftp: URL"),
        (PNG_BASE64, "not a URL"),
        (f"data:image/png,{PNG_BASE64}", "a data URL that is not base64"),
        (f"data:text/plain;base64,{PNG_BASE64}", "a data URL of text/plain, not of an image"),
        (f"data:;base64,{PNG_BASE64}", "a data URL of no media type"),
        (f"data:image/png;base64,{PNG_BASE64[:8]}\n{PNG_BASE64[8:]}", "not valid base64"),
        (f"data:image/png;base64,{PNG_BASE64}!", "not valid base64"),
    ],
    ids=["file", "ftp", "bare", "percent", "text", "untyped", "newline", "stray"],
)
def test_any_other_url_is_refused_naming_the_image(url: str, said: str) -> None:
    assert not is_remote_url(url)
    with pytest.raises(ImageError) as caught:
        decode_data_url(url, "input[2]")
    line = caught.value.one_line()
    assert line.startswith("image input[2]: ") and said in line, line


def test_base64_over_the_byte_limit_is_refused_before_it_is_decoded() -> None:
    over = "A" * ((IMAGE_BYTES // 3 + 2) * 4)
    with pytest.raises(ImageError, match=r"^image images\[0\]: over the 256 MiB limit"):
        decode_base64_image(over, "images[0]")
