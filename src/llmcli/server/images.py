"""Images in a request, whichever protocol named them, made one protocol-neutral form.

Each adapter reads its own shape (OpenAI's `image_url` part, the Responses API's `input_image`,
Anthropic's `image` block, Ollama's `images`) into an `ImageRef`: the image's bytes (a data URL
or plain base64, decoded strictly) or the http(s) URL it names, with its label as the request
names it (`messages[0].content[1]`, `input[0].content[2]`, `images[0]`) for every error about
it. A bad image is refused here, as it is read. `resolve` then turns a conversation's ImageRefs
into `ImageInput`s (models/vision/encoder.py), once the server has said what it allows: a remote
URL is fetched only under `llmcli serve --allow-image-urls` (a server that fetches what a request
names is an SSRF), and a model that reads no images has each refused, by its label.

In the neutral form a message with images has `content` as a list of parts, `{"type": "text",
"text": …}` and `{"type": "image", "image": ImageInput}`; a message without any keeps its text.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmcli.errors import UsageError
from llmcli.models.vision.encoder import ImageInput
from llmcli.models.vision.image_file import decode_base64_image, decode_data_url, is_remote_url, refuse_remote

MAX_FETCHED_BYTES = 20 << 20  # OpenAI's own limit on one image
FETCH_TIMEOUT_S = 10.0
REMOTE_SCHEMES = ("http://", "https://")


class ImageRefused(UsageError):
    """An image a request names that this server will not take: a 400 in the protocol's shape."""


@dataclass(frozen=True)
class ImageRef:
    """An image as a request names it, read but not yet fetched: its bytes, or its remote URL.
    `kind` is the protocol's name for such a part ("image_url parts", "image blocks", …), for
    the refusal a text-only model gives."""

    label: str
    kind: str
    data: bytes | None = field(default=None, repr=False)  # never megabytes in an error's text
    url: str | None = None


def image_part(ref: ImageRef) -> dict[str, Any]:
    """A neutral image part, as adapters put it in a message's content."""
    return {"type": "image", "image": ref}


def from_url(url: str, label: str, kind: str) -> ImageRef:
    """A data URL's image (image_file.py reads it), or an http(s) URL kept for `resolve` to
    refuse or fetch."""
    if is_remote_url(url):
        return ImageRef(label, kind, url=url)
    return ImageRef(label, kind, data=decode_data_url(url, label).data)


def refuse_detail(detail: str | None, label: str) -> None:
    """OpenAI's `detail` (chat and Responses): "auto" or none. An image's resolution is its
    model's image processor's to set, so "low" or "high" would be taken and not honoured."""
    if detail not in (None, "auto"):
        raise ImageRefused(
            f"{label}: detail {detail!r} is not honoured here: the model's image processor sets "
            "an image's resolution (send auto, or leave detail out)"
        )


def from_base64(text: str, label: str, kind: str, media_type: str | None = None) -> ImageRef:
    """Plain base64 (Ollama's `images`, Anthropic's `data`), strictly (image_file.py).
    `media_type`, where the request gives one, is an image's."""
    if media_type is not None and not media_type.lower().startswith("image/"):
        raise ImageRefused(f"{label}: media type {media_type!r} is not an image's (image/png, image/jpeg, …)")
    data = decode_base64_image(text, label).data
    if not data:
        raise ImageRefused(f"{label}: the image is empty")
    return ImageRef(label, kind, data=data)


def refs_in(messages: list[dict[str, Any]]) -> Iterator[ImageRef]:
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if part.get("type") == "image" and isinstance(part.get("image"), ImageRef):
                yield part["image"]


def resolve(messages: list[dict[str, Any]], reads_images: bool, allow_urls: bool) -> list[dict[str, Any]]:
    """`messages` with each ImageRef an ImageInput, in the order a request is refused: a remote
    URL without --allow-image-urls, then any image for a model that reads none (nothing is
    fetched for it), then a fetch that fails. Blocking (it may fetch): run it off the event loop."""
    refs = list(refs_in(messages))
    if not refs:
        return messages
    for ref in refs:
        if ref.url is not None and not allow_urls:
            refuse_remote(ref.label)
    if not reads_images:
        first = refs[0]
        said = "this server's model reads text only"
        raise ImageRefused(f"{first.label}: {said}: {first.kind} are not supported")
    return [_with_inputs(message) for message in messages]


def _with_inputs(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return message | {"content": [_input_of(part) for part in content]}


def _input_of(part: dict[str, Any]) -> dict[str, Any]:
    ref = part.get("image")
    if not isinstance(ref, ImageRef):
        return part
    data = ref.data if ref.data is not None else fetch(str(ref.url), ref.label)
    return {"type": "image", "image": ImageInput(data, ref.label)}


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed to http(s) only (urllib's own also follows ftp)."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if not newurl.startswith(REMOTE_SCHEMES):
            raise urllib.error.URLError(f"redirected to {newurl.split(':', 1)[0]}:, which is not http(s)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, label: str, cap: int = MAX_FETCHED_BYTES, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """The image at an http(s) URL, at most `cap` bytes: a larger Content-Length is refused
    before the body is read, and a body that runs past it as it is read. `timeout_s` bounds the
    whole fetch, not each read alone (a server sending a byte at a time would hold it for ever)."""
    if not url.startswith(REMOTE_SCHEMES):
        raise ImageRefused(f"{label}: only http(s) URLs are fetched")
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    too_large = ImageRefused(f"{label}: the image at its URL is over {cap} bytes")
    too_slow = ImageRefused(f"{label}: fetching its URL took over {timeout_s:g} s")
    deadline = time.monotonic() + timeout_s
    try:
        with opener.open(url, timeout=timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > cap:
                raise too_large
            data = bytearray()
            while len(data) <= cap and (chunk := response.read1(64 << 10)):
                data += chunk
                if time.monotonic() > deadline:
                    raise too_slow
    except urllib.error.HTTPError as error:
        raise ImageRefused(f"{label}: fetching its URL answered {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        if isinstance(reason, TimeoutError):
            raise too_slow from None
        raise ImageRefused(f"{label}: its URL could not be fetched ({reason})") from None
    if len(data) > cap:
        raise too_large
    if not data:
        raise ImageRefused(f"{label}: its URL gave no bytes")
    return bytes(data)
