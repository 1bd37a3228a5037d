"""The Responses API's `encrypted_content`: a reasoning item a client keeps and sends back on the
next turn (`include: ["reasoning.encrypted_content"]` with `store: false`, as Codex CLI asks).

What the server hands out is the thinking it generated, signed, not encrypted: the same text is
the item's summary, so there is nothing to hide from the client, only something to trust when
it comes back. It comes back from the network, so it is taken only with this server's signature
(HMAC-SHA256); one tampered with, or signed by another llmcli's key, is refused by name.

The key is made once and kept under the state directory (readable by its owner only), not drawn
per process: an agent's conversation outlives a server restart (`llmcli serve` with
--idle-exit, a new version installed), and its next turn re-sends every reasoning item it was
given; a per-process key would refuse them all. Where the state directory cannot hold the key
(a file in its place, a full disk), the server signs with a key of its own process and says so
once: it serves all the same, as with every other state it cannot write."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import sys
from pathlib import Path

from llmcli.errors import LlmcliError

KEY_FILE = "responses-reasoning.key"
KEY_BYTES = 32
VERSION = 1


class SealError(LlmcliError):
    """An encrypted_content this server did not sign, or signed for something else."""


class ReasoningSeal:
    """Signs a reasoning item's text into an opaque string, and opens one it signed."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    @classmethod
    def kept_under(cls, folder: Path) -> ReasoningSeal:
        try:
            return cls(_kept_key(folder))
        except OSError as error:
            reason = error.strerror or type(error).__name__
            print(
                f"llmcli serve: {folder} cannot keep the key reasoning items are signed with ({reason}): "
                "this server's own is used, and a server started later refuses the items it handed out",
                file=sys.stderr,
                flush=True,
            )
            return cls(secrets.token_bytes(KEY_BYTES))

    def seal(self, text: str) -> str:
        payload = _b64(bytes([VERSION]) + text.encode())  # the version, then the text's UTF-8
        return f"llmcli.{payload}.{_b64(self._mac(payload))}"

    def open(self, sealed: object, label: str) -> str:
        """The text `sealed` holds, or a SealError naming `label` when this server did not sign it."""
        parts = sealed.split(".") if isinstance(sealed, str) else []
        if len(parts) != 3 or parts[0] != "llmcli":
            raise SealError(f"{label}: encrypted_content was not made by an llmcli server")
        payload, mac = parts[1], parts[2]
        if not hmac.compare_digest(_b64(self._mac(payload)), mac):
            signed = "this server's signature (changed, or from another server)"
            raise SealError(f"{label}: encrypted_content does not carry {signed}")
        content = _unb64(payload)
        if content[:1] != bytes([VERSION]):
            raise SealError(f"{label}: encrypted_content is from another llmcli version")
        return content[1:].decode()

    def _mac(self, payload: str) -> bytes:
        return hmac.new(self.key, b"llmcli reasoning\0" + payload.encode(), hashlib.sha256).digest()


def _kept_key(folder: Path) -> bytes:
    """The key under `folder`, made on first use: written whole to a file of its own, owner-only
    (whoever reads it can sign), then linked into place, so that two servers starting at once
    agree on one key and none ever reads half of one."""
    path = folder / KEY_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        folder.mkdir(parents=True, exist_ok=True)
        draft = folder / f"{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as written:
            written.write(secrets.token_bytes(KEY_BYTES))
        try:
            os.link(draft, path)
        except FileExistsError:  # another server made one meanwhile: theirs it is
            pass
        finally:
            draft.unlink()
        key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise LlmcliError(f"{path} is not a key llmcli made ({len(key)} bytes): remove it to make a new one")
    return key


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
