"""The one place an image's bytes become a decoded, checked RGB picture: a file from the command
line, a data URL or base64 from a request, each refused in one line that names the image.

What is checked, and when: the format from the bytes (five, read by Pillow's own openers and no
other plugin), the size from the header before a pixel is decoded (a 100-byte PNG may declare a
gigapixel), one frame only, then the whole decode inside the check (Pillow decodes lazily: a
truncated file fails on `load`, not on `open`). The RGB picture is the one transformers' image
processors see: EXIF orientation applied as `load_image` applies it, transparency composited on
white as `convert_to_rgb` composites it.

Pillow is imported on the first image, not with this module: the CLI and the server read their
arguments through here, and a call without an image starts no faster for an image library.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.errors import UsageError
from llmcli.models.vision.encoder import ImageInput
from llmcli.reading import MiB, peer_text, read_file

if TYPE_CHECKING:
    from PIL import Image

# 8192 × 8192 (67 megapixels): above what any camera saves by default (phones 12–50 MP, a 48 MP
# photo is 8064 × 6048) and an 8K frame (33 MP). No vision model looks at more than a few
# megapixels (each processor scales down first), so a larger picture only costs memory: decoded
# RGB at the cap is 192 MiB, and a transparent one composited on white peaks near 1 GiB.
MAX_PIXELS = 8192 * 8192
# The bytes of one image: 4 bytes a pixel at the pixel cap, what an uncompressed RGBA picture at
# the cap takes (256 MiB). A compressed file of a picture under the cap is smaller; one larger is
# refused by its size before a byte of it is read.
IMAGE_BYTES = 4 * MAX_PIXELS
# The `serve` flag that lets a server fetch the http(s) image URLs a request names (the server
# implements it; this module only says it exists when it refuses such a URL).
ALLOW_IMAGE_URLS_FLAG = "--allow-image-urls"

# Pillow's format names, in the order their openers are tried. Only these: Pillow's other plugins
# read formats no chat client sends, and some do more than read (EPS runs Ghostscript).
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
_READ = "PNG, JPEG, GIF, WebP, BMP are read"
# Formats that may hold an animation. A JPEG with several pictures (MPO, as many cameras save
# one) holds a primary picture and its depth map or stereo twin: its first frame is the picture,
# and it is what transformers reads too.
_ANIMATABLE = frozenset({"GIF", "PNG", "WEBP"})
# Pillow's errors while it decodes a file it opened: each means the file is damaged or cut.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)
# Well-known formats that are not read, by their first bytes: named, so that the user knows what
# to convert rather than hearing "not an image" about a photo.
_OTHER_FORMATS = {
    b"II*\x00": "a TIFF image",
    b"MM\x00*": "a TIFF image",
    b"ftypheic": "a HEIC photo",
    b"ftypheix": "a HEIC photo",
    b"ftypmif1": "a HEIF image",
    b"ftypavif": "an AVIF image",
    b"%PDF": "a PDF document",
}


class ImageError(UsageError):
    """An image that cannot be read as given: the CLI prints its one line and exits 2, the server
    answers 400 in the protocol's error shape (every LlmcliError is one there)."""


@dataclass(frozen=True)
class CheckedImage:
    """An image decoded whole, upright and RGB; `digest` (sha256 of its bytes) keys its place in
    a cached prefix, and `format` is the file's own (PNG, JPEG, MPO, GIF, WEBP, BMP)."""

    image: Image.Image
    width: int
    height: int
    digest: str
    format: str


def open_image(image: ImageInput, max_pixels: int = MAX_PIXELS) -> CheckedImage:
    """The image's picture, decoded and checked; any image that cannot be read is an ImageError
    naming `image.label`, raised before more than the header was decoded where the header tells."""
    from PIL import Image, ImageOps

    where = _where(image.label)
    if not image.data:
        raise ImageError(f"{where}: empty (0 bytes)")
    try:
        picture = _open_header(image.data, where)
        _check_size(picture.size, max_pixels, where)
        if picture.format in _ANIMATABLE and getattr(picture, "is_animated", False):
            # Refused rather than read as its first frame (what transformers does): a model shown
            # one still of an animation answers about something the user did not mean, silently.
            # Video is a different input (frames sampled over time), not read here.
            raise ImageError(
                f"{where}: an animated {picture.format}: animated images are not read: give one frame"
            )
        picture.load()
        upright = ImageOps.exif_transpose(picture)
        rgb = _to_rgb(upright)
    except Image.DecompressionBombError as error:
        # Pillow's own limit, met inside a format's reader (a GIF frame reaching past the screen).
        raise ImageError(f"{where}: declares more pixels than are decoded ({error})", _SCALE_DOWN) from None
    except _DECODE_ERRORS as error:
        raise ImageError(f"{where}: a damaged or truncated {picture.format} file ({error})") from None
    return CheckedImage(
        rgb, rgb.width, rgb.height, hashlib.sha256(image.data).hexdigest(), str(picture.format)
    )


_SCALE_DOWN = "scale it down first: the model sees a few megapixels at most"


def _where(label: str) -> str:
    return f"image {label}"


def _open_header(data: bytes, where: str) -> Image.ImageFile.ImageFile:
    """The file opened by the opener of its format (its header read, no pixel decoded), as
    `Image.open` opens it but without Pillow's process-wide pixel limit, which would warn on
    stderr or refuse without saying the size; `open_image` compares the size itself."""
    from PIL import Image

    _register_openers()

    prefix = data[:16]
    for name in FORMATS:
        factory, accepts = Image.OPEN[name]
        accepted = accepts(prefix) if accepts is not None else True
        if not accepted or isinstance(accepted, str):  # a str: "looks like it, cannot read it"
            continue
        try:
            return factory(io.BytesIO(data), "")
        except (*_DECODE_ERRORS, TypeError) as error:
            # Its first bytes say this format and its header breaks off or contradicts itself.
            raise ImageError(f"{where}: a damaged or truncated {name} file ({error})") from None
    raise ImageError(f"{where}: {_what_else(data)} ({_READ})")


def _register_openers() -> None:
    """Importing a format's plugin registers its opener in `Image.OPEN` (Pillow imports the
    plugins only inside `Image.open`). Pillow's own warnings (a photo's corrupt EXIF, a frame
    past its screen) are silenced: stderr carries llmcli's lines only, and what matters in
    them is refused here in one line. Once, by a filter on Pillow's modules alone."""
    import warnings

    from PIL import BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

    del BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin
    if not _quiet_pillow:
        warnings.filterwarnings("ignore", module=r"PIL(\.|$)")
        _quiet_pillow.append(True)


_quiet_pillow: list[bool] = []  # whether Pillow's warnings are filtered yet


def _what_else(data: bytes) -> str:
    """What a file that no reader accepts seems to be, for the refusal."""
    for magic, name in _OTHER_FORMATS.items():
        if magic in data[:12]:
            return f"{name}, which is not read"
    try:
        data[:4096].decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < 4093:  # not merely a character cut at the 4096th byte
            return "not an image"
    return "text, not an image"


def _check_size(size: tuple[int, int], max_pixels: int, where: str) -> None:
    width, height = size
    if width * height > max_pixels:
        raise ImageError(
            f"{where}: {width}×{height} is {_megapixels(width * height)} megapixels,"
            f" over the {_megapixels(max_pixels)} megapixel limit",
            _SCALE_DOWN,
        )


def _megapixels(pixels: int) -> str:
    return f"{pixels / 1e6:.1f}".removesuffix(".0")


def _to_rgb(picture: Image.Image) -> Image.Image:
    """RGB exactly as transformers' `convert_to_rgb` makes it for an image processor: whatever
    has an alpha band or a transparent colour composited on opaque white, the rest converted."""
    from PIL import Image

    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        rgba = picture.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return picture.convert("RGB")


def read_image_file(path: str | Path) -> ImageInput:
    """A file's bytes, named by its path, for `--image` and `/image`. Its size is checked before
    it is read (a file over IMAGE_BYTES is not read at all); "-" (stdin) is the caller's."""
    label = str(path)
    where = _where(label)
    try:
        size = Path(path).expanduser().stat().st_size
    except OSError:
        size = 0  # read_file names what is wrong with it
    if size > IMAGE_BYTES:
        raise ImageError(
            f"{where}: {size // MiB} MiB, over the {IMAGE_BYTES // MiB} MiB limit for an image", _SCALE_DOWN
        )
    try:
        return ImageInput(read_file(path, IMAGE_BYTES, where), label)
    except ImageError:
        raise
    except UsageError as error:  # missing, a folder, unreadable, a pipe that ran over
        raise ImageError(error.message, error.hint) from None


def is_remote_url(url: str) -> bool:
    """Whether `url` names an image on the network (http or https) rather than carrying it."""
    return _scheme(url) in ("http", "https")


def refuse_remote(label: str) -> None:
    """The one refusal of an image a request names by its http(s) URL (serve fetches none
    unless started with ALLOW_IMAGE_URLS_FLAG)."""
    raise ImageError(
        f"{_where(label)}: this server does not fetch the image URLs a request names (a server that"
        " fetches what a request points it at can be made to reach its own network: an SSRF); send"
        f" the image inline as a data: URL (base64), or start `llmcli serve {ALLOW_IMAGE_URLS_FLAG}`"
    )


def decode_data_url(url: str, label: str) -> ImageInput:
    """The image a `data:image/…;base64,…` URL carries. Any other URL is refused: an http(s) one
    with why (the server fetches none unless started with ALLOW_IMAGE_URLS_FLAG, which the
    server checks before calling this), any other scheme (file:, ftp:) always."""
    where = _where(label)
    scheme = _scheme(url)
    if is_remote_url(url):
        refuse_remote(label)
    if scheme != "data":
        named = f"a {peer_text(scheme, 20)}: URL" if scheme else "not a URL"
        raise ImageError(f"{where}: {named}; an image is sent inline, as data:image/png;base64,…")
    header, comma, payload = url.partition(",")
    media_type, *parameters = header.partition(":")[2].split(";")
    if not comma or not parameters or parameters[-1].strip().lower() != "base64":
        raise ImageError(f"{where}: a data URL that is not base64; send data:image/png;base64,…")
    if not media_type.strip().lower().startswith("image/"):
        shown = peer_text(media_type.strip(), 60) or "no media type"
        raise ImageError(f"{where}: a data URL of {shown}, not of an image (image/png, image/jpeg, …)")
    return decode_base64_image(payload, label)


def decode_base64_image(text: str, label: str) -> ImageInput:
    """The bytes that base64 `text` carries (a data URL's payload, Anthropic's `data`, Ollama's
    `images`), strictly: any character outside the alphabet, or bad padding, is refused."""
    where = _where(label)
    if len(text) > (IMAGE_BYTES // 3 + 1) * 4:
        raise ImageError(f"{where}: over the {IMAGE_BYTES // MiB} MiB limit for an image", _SCALE_DOWN)
    try:
        return ImageInput(base64.b64decode(text, validate=True), label)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"{where}: not valid base64 ({error})") from None


def _scheme(url: str) -> str:
    """The URL's scheme in lower case ('https'), or '' where it has none."""
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*):")
