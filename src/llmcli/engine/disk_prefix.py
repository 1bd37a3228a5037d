"""The prefix store's disk tier: prompts' computed state kept in files that outlive the process,
so a second `generate` over the same document, or a restarted server's known conversation,
prefills only what is new.

Where: one safetensors file per entry in the prompt cache folder (config/paths.py), 0700, owned
by this user. safetensors holds tensors and a string table, and reading it executes nothing. The
table's one entry, "llmcli", is a JSON header: the format version, the key (the model's
fingerprint and every load setting that changes the numbers or the tensors' shapes), the token
ids and their SHA-256, the SHA-256 of the tensor bytes, and how the tensors fit together
(native/saved_tensors.py).

Lookup: an index file (index.json) beside them lists every entry's key hash, token ids, resume
points, size and last use, so finding the longest shared prefix reads one small file (re-read
only when another process changed it), never the entries themselves.

Read back, an entry is trusted only when all of these hold; anything else is refused in one line,
removed, and its prompt prefilled as if it were not there:
- the file is a regular file (not a link) owned by this user and writable by no one else;
- its size is what its safetensors header says (not truncated, nothing appended);
- its header's format version and key equal this process's, its token ids equal the index's
  and hash to the header's digest, its tensor bytes hash to the header's digest;
- every tensor has the name, shape and dtype this model's cache holds.

Written off the request's critical path: the state is copied into host memory where a generation
ends (the one step that must hold the cache still), and a writer thread serializes and writes it;
`flush` (at exit) waits for it, so a one-shot call prints its answer first. Bounded in bytes:
after each write the least recently used entries go until the folder fits (`used` in the index,
updated when an entry is read). A write that fails (a full disk, a folder not writable, a file
size limit) stops the writing for this process, said once; answers go on.

Only prefixes of at least MIN_DISK_TOKENS are written, and an entry is read only where it saves
that many tokens of prefill: reading and checking a file costs its whole size (the full state,
however short the prefix used), which a short prefill beats; and a chat's short turns would
otherwise rewrite its files at every reply. A prompt holding an image is not written: its
markers stand for rows of this process's table of images.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import queue
import stat
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.engine.prefix_base import common_prefix_length

if TYPE_CHECKING:
    from llmcli.engine.backend import Saved
    from llmcli.engine.prefix_base import Engine

# Bump when what a file holds or means changes: a file of another version is refused (removed).
FORMAT_VERSION = 1
# Fewer tokens than this are neither written nor read back (module docstring says why).
MIN_DISK_TOKENS = 256
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
SUFFIX = ".safetensors"


class Refused(Exception):
    """An entry that is not what it claims to be: removed, never restored."""


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _packed(ids: Sequence[int]) -> str:
    return base64.b64encode(array("q", ids).tobytes()).decode()


def _unpacked(text: str) -> list[int]:
    values = array("q")
    values.frombytes(base64.b64decode(text, validate=True))
    return values.tolist()


@dataclass(eq=False)
class DiskCopy:
    """A state kept on disk: found by the store's rule as any other entry, read (and checked)
    only when brought."""

    tier: DiskTier
    name: str  # the file's name in the folder
    ids: list[int]
    points: list[int] | None  # where it can be resumed (None: anywhere, keys and values alone)
    nbytes: int

    def reach(self, length: int) -> int:
        length = min(length, len(self.ids))
        if self.points is None:
            return length
        return max((point for point in self.points if point <= length), default=0)

    def bring(self, into: Engine, length: int) -> int:
        saved = self.tier.read(self)  # Refused: the store falls back to what it had
        into.backend.restore(saved)
        into.cached_ids = list(self.ids)
        into.crop_to(length)
        return len(into.cached_ids)


@dataclass
class _Job:
    ids: list[int]
    saved: Saved | None  # None: only the index's `used` time of `touch`
    touch: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class DiskTier:
    """The entries on disk for one model under one set of load settings (`key`), within
    `budget_bytes` for the whole folder. `layout`: a file's tensors and layout → the backend's
    host copy, ValueError where they are not what its cache holds. `warn`: one line to the user."""

    def __init__(
        self,
        folder: Path,
        key: dict[str, Any],
        budget_bytes: int,
        layout: Callable[[dict[str, Any], dict[str, Any]], Saved],
        flatten: Callable[[Saved], tuple[dict[str, Any], dict[str, Any], list[int] | None]],
        warn: Callable[[str], None],
    ) -> None:
        self.folder = folder
        self.key = {**key, "format": FORMAT_VERSION}
        self.key_hash = key_digest(self.key)
        self.budget_bytes = budget_bytes
        self._layout = layout
        self._flatten = flatten
        self._warn = warn
        self.writing = True  # false once a write failed: said once, never tried again
        self.reads = 0  # entries brought back (the tests read them)
        self._ready: bool | None = None  # the folder checked (None: not yet)
        self._index: tuple[Any, dict[str, dict[str, Any]]] = (None, {})  # (file signature, entries)
        self._ids: dict[str, list[int]] = {}  # name → its ids, decoded once
        self._pending: list[_Job] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._writer: threading.Thread | None = None

    # The folder ------------------------------------------------------------------------

    def _folder_ready(self) -> bool:
        """The folder exists, is a directory (not a link) of this user's, closed to others
        (made so where it is ours); once, the first time the tier is used."""
        if self._ready is None:
            self._ready = self._prepare_folder()
        return self._ready

    def _prepare_folder(self) -> bool:
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            found = self.folder.lstat()
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
                self._warn(f"prompt cache: {self.folder} is not a folder of this user's: it is not used")
                return False
            if found.st_mode & 0o077:
                os.chmod(self.folder, 0o700)
        except OSError as error:
            self._warn(f"prompt cache: {self.folder}: {error.strerror}: it is not used")
            return False
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The index read, changed and written by one process at a time."""
        handle = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(handle, "r+b") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            yield

    # The index -------------------------------------------------------------------------

    def _entries(self) -> dict[str, dict[str, Any]]:
        """The index as it is on disk now (re-read only when its file changed)."""
        path = self.folder / INDEX_FILE
        try:
            found = path.stat()
        except OSError:
            return {}
        # Each write replaces the file: a new inode, even within the clock's granularity.
        changed = (found.st_ino, found.st_mtime_ns, found.st_size)
        if changed != self._index[0]:
            try:
                data = json.loads(path.read_bytes())
                entries = data["entries"] if data.get("format") == FORMAT_VERSION else {}
                entries = {name: row for name, row in entries.items() if _well_formed(name, row)}
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                entries = {}  # an unreadable index: rebuilt by the next write
            self._index = (changed, entries)
        return self._index[1]

    def _write_index(self, entries: dict[str, dict[str, Any]]) -> None:
        path = self.folder / INDEX_FILE
        temporary = path.with_name(f".{INDEX_FILE}.{os.getpid()}")
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(handle, "wb") as file:
            file.write(json.dumps({"format": FORMAT_VERSION, "entries": entries}).encode())
        os.replace(temporary, path)

    def _ids_of(self, name: str, row: dict[str, Any]) -> list[int] | None:
        if name not in self._ids:
            try:
                self._ids[name] = _unpacked(row["ids"])
            except (KeyError, TypeError, ValueError):
                return None
        return self._ids[name]

    def longest(self, ids: Sequence[int]) -> tuple[DiskCopy | None, int]:
        """The entry of this key sharing the longest resumable prefix with `ids`, and its length."""
        if not self._folder_ready():
            return None, 0
        best, best_length = None, 0
        for name, row in list(self._entries().items()):
            if row.get("key") != self.key_hash:
                continue
            held = self._ids_of(name, row)
            if held is None:
                continue
            entry = DiskCopy(self, name, held, row.get("points"), row["bytes"])
            length = entry.reach(common_prefix_length(held, ids))
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    # Reading ---------------------------------------------------------------------------

    def read(self, entry: DiskCopy) -> Saved:
        """The host copy the entry holds, every check passed; Refused (the file removed, one
        line said) otherwise."""
        try:
            saved = self._checked(entry)
        except Refused as refusal:
            self._warn(f"prompt cache: {entry.name} refused ({refusal}); removed, the prompt is prefilled")
            self._remove(entry.name)
            raise
        self.reads += 1
        self._submit(_Job([], None, touch=entry.name))
        return saved

    def _checked(self, entry: DiskCopy) -> Saved:
        import safetensors.torch

        path = self.folder / entry.name
        try:
            handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as error:
            raise Refused(error.strerror or "cannot be opened") from None
        with os.fdopen(handle, "rb") as file:
            found = os.fstat(file.fileno())
            if not stat.S_ISREG(found.st_mode):
                raise Refused("not a regular file")
            if found.st_uid != os.geteuid():
                raise Refused(f"owned by user {found.st_uid}, not by this one")
            if found.st_mode & 0o022:
                raise Refused("writable by others")
            data = file.read()
        header, start = _safetensors_header(data)
        try:
            ends = [
                int(tensor["data_offsets"][1]) for name, tensor in header.items() if name != "__metadata__"
            ]
        except (KeyError, TypeError, ValueError, IndexError):
            raise Refused("its header cannot be read") from None
        if len(data) != start + max(ends, default=0) or len(data) != entry.nbytes:
            raise Refused(f"{len(data)} bytes, not the {entry.nbytes} written")
        try:
            meta = json.loads(header["__metadata__"]["llmcli"])
        except (KeyError, TypeError, ValueError):
            raise Refused("no llmcli header") from None
        if meta.get("format") != FORMAT_VERSION:
            raise Refused(f"format {meta.get('format')}, this llmcli's is {FORMAT_VERSION}")
        if meta.get("key") != self.key:
            raise Refused("written for another model or other load settings")
        try:
            ids = _unpacked(meta["ids"])
        except (KeyError, TypeError, ValueError):
            raise Refused("its token ids cannot be read") from None
        if ids != entry.ids or ids_digest(ids) != meta.get("ids_sha256"):
            raise Refused("its token ids do not match their digest")
        if _data_digest(data) != meta.get("data_sha256"):
            raise Refused("its tensors do not match their digest")
        try:
            tensors = safetensors.torch.load(data)
            return self._layout(tensors, meta["layout"])
        except (ValueError, KeyError, TypeError) as error:
            raise Refused(str(error)) from None
        except Exception as error:  # safetensors' own errors: a header it cannot read
            raise Refused(
                f"unreadable: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
            ) from None

    def _remove(self, name: str) -> None:
        with contextlib.suppress(OSError), self._locked():
            (self.folder / name).unlink(missing_ok=True)
            entries = dict(self._entries())
            if entries.pop(name, None) is not None:
                self._write_index(entries)

    # Writing ---------------------------------------------------------------------------

    def offer(self, ids: Sequence[int], take: Callable[[], Saved | None]) -> None:
        """Keep the state of `ids` on disk, unless it is too short, holds an image, or is
        already there (or on its way); `take` copies it into host memory, only when kept."""
        if not self.writing or self.budget_bytes <= 0 or len(ids) < MIN_DISK_TOKENS or min(ids) < 0:
            return
        if not self._folder_ready() or self._covered(ids):
            return
        saved = take()
        if saved is not None:
            self._submit(_Job(list(ids), saved))

    def _covered(self, ids: Sequence[int]) -> bool:
        """Whether an entry of this key (on disk or waiting to be written) starts with `ids`."""
        with self._lock:
            waiting = [job.ids for job in self._pending if job.saved is not None]
        kept = [
            self._ids_of(name, row)
            for name, row in list(self._entries().items())
            if row.get("key") == self.key_hash
        ]
        return any(
            held is not None and len(held) >= len(ids) and held[: len(ids)] == list(ids)
            for held in [*kept, *waiting]
        )

    def _submit(self, job: _Job) -> None:
        with self._lock:
            self._pending.append(job)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_jobs, name="llmcli-prompt-cache", daemon=True
                )
                self._writer.start()
                atexit.register(self.flush)
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until everything offered is written (or given up)."""
        with self._lock:
            waiting = list(self._pending)
        for job in waiting:
            job.done.wait()

    def _write_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job.touch is not None:
                    self._touch(job.touch)
                elif self.writing:
                    self._write(job)
            except OSError as error:
                self._stop_writing(error)
            except Exception as error:  # never the writer thread's traceback on stderr
                self._stop_writing(OSError(errno.EIO, str(error) or type(error).__name__))
            finally:
                with self._lock:
                    self._pending.remove(job)
                job.done.set()

    def _stop_writing(self, error: OSError) -> None:
        if self.writing:
            self.writing = False
            reason = error.strerror or str(error)
            self._warn(
                f"prompt cache: cannot write under {self.folder} ({reason}); it stops writing, answers go on"
            )

    def _touch(self, name: str) -> None:
        with self._locked():
            entries = dict(self._entries())
            if name in entries:
                entries[name] = {**entries[name], "used": time.time()}
                self._write_index(entries)

    def _write(self, job: _Job) -> None:
        import safetensors.torch

        assert job.saved is not None
        tensors, layout, points = self._flatten(job.saved)
        meta = {
            "format": FORMAT_VERSION,
            "key": self.key,
            "ids": _packed(job.ids),
            "ids_sha256": ids_digest(job.ids),
            "layout": layout,
        }
        # The digest is of the tensor bytes as safetensors lays them out, which its header (and so
        # the metadata holding the digest) does not change: checked below all the same.
        body = safetensors.torch.save(tensors)
        meta["data_sha256"] = _data_digest(body)
        data = safetensors.torch.save(tensors, metadata={"llmcli": json.dumps(meta)})
        if _data_digest(data) != meta["data_sha256"]:
            raise OSError(errno.EIO, "safetensors laid the tensors out differently")
        if len(data) > self.budget_bytes:
            return  # larger than the whole cache: not kept
        name = f"{self.key_hash[:16]}-{meta['ids_sha256'][:24]}{SUFFIX}"
        temporary = self.folder / f".{name}.{os.getpid()}.partial"
        try:
            handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(handle, "wb") as file:
                file.write(data)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        row = {
            "key": self.key_hash,
            "ids": meta["ids"],
            "points": points,
            "bytes": len(data),
            "used": time.time(),
        }
        with self._locked():  # in place and indexed at once: a file not in the index is a crash's
            os.replace(temporary, self.folder / name)
            entries = dict(self._entries())
            for other, kept in list(entries.items()):  # made useless: an entry this one starts with
                held = self._ids_of(other, kept)
                if (
                    other != name
                    and kept.get("key") == self.key_hash
                    and held is not None
                    and held == job.ids[: len(held)]
                ):
                    self._drop(entries, other)
            entries[name] = row
            while sum(int(kept.get("bytes", 0)) for kept in entries.values()) > self.budget_bytes:
                self._drop(entries, min(entries, key=lambda other: entries[other].get("used", 0)))
            for stray in self.folder.glob(f"*{SUFFIX}"):  # left by a process that ended mid-write
                if stray.name not in entries:
                    stray.unlink(missing_ok=True)
            self._write_index(entries)

    def _drop(self, entries: dict[str, dict[str, Any]], name: str) -> None:
        entries.pop(name)
        self._ids.pop(name, None)
        (self.folder / name).unlink(missing_ok=True)


def _safetensors_header(data: bytes) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and where its tensor bytes start; Refused where the
    file is too short to hold them."""
    if len(data) < 8:
        raise Refused("truncated")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise Refused("truncated")
    try:
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise ValueError
        return header, 8 + size
    except ValueError:
        raise Refused("its header cannot be read") from None


def _data_digest(data: bytes) -> str:
    """SHA-256 of a safetensors file's tensor bytes (all that follows its header)."""
    _, start = _safetensors_header(data)
    return hashlib.sha256(memoryview(data)[start:]).hexdigest()


def _well_formed(name: Any, row: Any) -> bool:
    """An index row as this llmcli writes it (any other is left out, as if not there; its file,
    no longer named, goes at the next write)."""
    if not isinstance(name, str) or not name.endswith(SUFFIX) or "/" in name or not isinstance(row, dict):
        return False
    points = row.get("points")
    return (
        isinstance(row.get("key"), str)
        and isinstance(row.get("ids"), str)
        and isinstance(row.get("bytes"), int)
        and isinstance(row.get("used"), (int, float))
        and (points is None or (isinstance(points, list) and all(isinstance(at, int) for at in points)))
    )
