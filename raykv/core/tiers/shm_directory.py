"""A shared host tier's directory: which committed block sits in which slot, readable one-sided.

A same-node peer that maps the owner's shared host tier (``/dev/shm``, :mod:`raykv.core.tiers.host`)
can copy pages out of it without asking the owner anything, if it can find the slots and tell
whether they changed while it read. The owner keeps, next to the tier file, a directory file
(``<tier file>.dir``) that it alone writes:

- per slot: a generation counter (a seqlock: odd while the owner edits the slot's record, bumped
  by two on every bind and unbind), the key of the committed block bound to it (zeros: none), its
  parent key, its token count and whether its parent is a scope root;
- a hash table from the key's first 8 bytes to a slot (open addressing, linear probing; 0 marks
  an empty cell, 1 a deleted one; a key whose first 8 bytes read 0 or 1 is simply not indexed).

Binding: :func:`install` makes a manager bind a slot when a committed block lands on the shared
tier (stored there, or moved there and its copy settled) and the tier unbinds a slot when it is
released, before it can be reused. The bytes of a bound slot never change (committed blocks are
immutable), so a reader that sees the same even generation before and after its copy, with the
slot bound to its key, has read that block's page. A reader that sees anything else (no entry,
an odd or changed generation) gives up and asks the owner (the RPC paths).

Ordering: the owner writes with plain stores and the reader reads with plain loads, each
separate numpy calls; this relies on x86-64's total store order (stores seen in program order,
loads not reordered with older loads). :func:`supported` is False on other machines and the
one-sided path is then never used.
"""

from __future__ import annotations

import itertools
import mmap
import os
import platform
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from raykv.core.errors import StateError
from raykv.core.events import BlockStored, BlockTierChanged, CacheEvent, EventQueue
from raykv.core.radix import Block, BlockRadixTree, Root
from raykv.core.tiers.base import PagePool
from raykv.core.tiers.cuda_util import SlotEvents

MAGIC = b"RAYKVDIR"
VERSION = 1
SUFFIX = ".dir"
EMPTY, DELETED = 0, 1
_HEAD = struct.Struct("<8sIIQQQ")  # magic, version, pad, num_slots, table cells, page bytes
_ALIGN = 64
VECTOR_MIN = 32
"""From this many keys a reader locates and checks them with numpy passes, not one at a time."""


def supported() -> bool:
    """Whether one-sided reads are safe on this machine (x86-64 memory ordering)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _cells(num_slots: int) -> int:
    return 1 << max(4, (2 * num_slots - 1).bit_length())


def _layout(num_slots: int) -> tuple[int, dict[str, tuple[int, Any, tuple[int, ...]]]]:
    """File size and (offset, dtype, shape) of every array."""
    cells = _cells(num_slots)
    arrays = {
        "gen": (np.uint64, (num_slots,)),
        "key": (np.uint8, (num_slots, 32)),
        "parent": (np.uint8, (num_slots, 32)),
        "meta": (np.uint32, (num_slots, 2)),  # num_tokens, flags (bit 0: parent is a root)
        "tags": (np.uint64, (cells,)),
        "cells": (np.int64, (cells,)),
    }
    offset, out = _ALIGN, {}
    for name, (dtype, shape) in arrays.items():
        out[name] = (offset, dtype, shape)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return offset, out


def offsets(num_slots: int) -> tuple[tuple[int, ...], int]:
    """The byte offsets of the gen, key, parent, meta, tags and cells arrays, and the table's
    cell count (for the compiled reader, :func:`raykv.transfer.paths.shm_read.compiled_reader`)."""
    _, arrays = _layout(num_slots)
    names = ("gen", "key", "parent", "meta", "tags", "cells")
    return tuple(arrays[name][0] for name in names), _cells(num_slots)


def _views(buf: Any, num_slots: int) -> dict[str, npt.NDArray[Any]]:
    _, arrays = _layout(num_slots)
    return {
        name: np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=off).reshape(shape)
        for name, (off, dtype, shape) in arrays.items()
    }


def _tag(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


_odd = (1).__and__
"""``_odd(gen)``: non-zero while the slot's record is being edited (a C call: no Python frame)."""


def _any_odd(gens: list[int]) -> bool:
    """Whether any generation is odd (a record being edited): one OR over them all."""
    if len(gens) < 16:
        return any(map(_odd, gens))
    return bool(int(np.bitwise_or.reduce(np.array(gens, dtype=np.uint64))) & 1)


def _split_parents(parents: bytes, keys: Sequence[bytes], joined: bytes) -> list[bytes]:
    """The 32-byte parent keys in ``parents`` (a run's records, read in one slice). In a chain
    (each block the parent of the next, the usual run) they are the first parent and the keys
    before the last, so the list is built from those after one comparison."""
    n = len(keys)
    if n == 1:
        return [parents]
    if parents[32:] == joined[: 32 * (n - 1)]:
        return [parents[:32], *keys[: n - 1]]
    return [parents[i : i + 32] for i in range(0, 32 * n, 32)]


def _root_flags(flags: list[int]) -> list[bool]:
    """Whether each record's parent is a scope root (flag bit 0); in a chain only the first's can
    be, so the usual answer is built without a pass per record."""
    if not any(flags[1:]):
        return [flags[0] & 1 == 1, *itertools.repeat(False, len(flags) - 1)]
    return [f & 1 == 1 for f in flags]


class ShmDirectory:
    """The owner's writable directory of one shared host tier (created with the tier file)."""

    def __init__(self, tier_path: str, num_slots: int, page_bytes: int) -> None:
        self.path = tier_path + SUFFIX
        size, _ = _layout(num_slots)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._mmap[: _HEAD.size] = _HEAD.pack(MAGIC, VERSION, 0, num_slots, _cells(num_slots), page_bytes)
        self.num_slots = num_slots
        v = _views(self._mmap, num_slots)
        self._gen, self._key, self._parent, self._meta = v["gen"], v["key"], v["parent"], v["meta"]
        self._tags, self._cells = v["tags"], v["cells"]
        self._mask = len(self._tags) - 1
        self._bound: dict[int, bytes] = {}  # slot -> key (the owner's own copy, for unbinding)
        self._deleted = 0

    def bind(self, slot: int, key: bytes, parent: bytes, parent_is_root: bool, num_tokens: int) -> None:
        """Record that committed block ``key`` now sits in ``slot`` (its bytes are in place)."""
        if slot in self._bound:
            self.unbind([slot])
        gen = self._gen
        gen[slot] += 1  # odd: editing
        self._key[slot] = np.frombuffer(key, dtype=np.uint8)
        self._parent[slot] = np.frombuffer(parent, dtype=np.uint8)
        self._meta[slot] = (num_tokens, 1 if parent_is_root else 0)
        gen[slot] += 1
        self._bound[slot] = key
        tag = _tag(key)
        if tag > DELETED:
            i = tag & self._mask
            while self._tags[i] > DELETED:
                i = (i + 1) & self._mask
            if self._tags[i] == DELETED:
                self._deleted -= 1
            self._cells[i] = slot  # before the tag: a reader that sees the tag sees the slot
            self._tags[i] = tag

    def bind_block(self, block: Block) -> None:
        """:meth:`bind` a committed block at its page's slot (its bytes must be in place)."""
        parent = block.parent
        self.bind(block.page.slot, block.key, parent.key, isinstance(parent, Root), block.num_tokens)

    def unbind(self, slots: Sequence[int]) -> None:
        """Forget the blocks in ``slots`` (before the slots are reused); unbound slots are skipped."""
        for slot in slots:
            key = self._bound.pop(int(slot), None)
            if key is None:
                continue
            self._gen[slot] += 1
            self._key[slot] = 0
            self._gen[slot] += 1
            self._drop_cell(_tag(key), int(slot))
        if self._deleted > len(self._tags) // 4:
            self._rebuild()

    def _drop_cell(self, tag: int, slot: int) -> None:
        if tag <= DELETED:
            return
        i = tag & self._mask
        while self._tags[i] != EMPTY:
            if self._tags[i] == tag and self._cells[i] == slot:
                self._tags[i] = DELETED
                self._deleted += 1
                return
            i = (i + 1) & self._mask

    def _rebuild(self) -> None:
        """Drop deleted cells (a reader meanwhile may miss a key and ask the owner instead)."""
        self._tags[:] = EMPTY
        self._deleted = 0
        for slot, key in self._bound.items():
            tag = _tag(key)
            if tag > DELETED:
                i = tag & self._mask
                while self._tags[i] != EMPTY:
                    i = (i + 1) & self._mask
                self._cells[i] = slot
                self._tags[i] = tag

    def bound(self) -> dict[int, bytes]:
        """Slot -> key of every bound slot (a copy; for checks)."""
        return dict(self._bound)

    def check(self, expected: dict[int, bytes]) -> None:
        """AssertionError unless the file says exactly ``expected`` (slot -> key) and every bound
        key is found through the table."""
        assert self._bound == expected, "directory bindings differ from the committed blocks"
        assert not (self._gen % 2).any(), "a slot record is left mid-edit"
        reader = DirectoryView(self._mmap, self.num_slots)
        try:
            for slot, key in expected.items():
                assert bytes(self._key[slot]) == key
                if _tag(key) > DELETED:
                    assert reader.find(key) == slot, "a bound key is missing from the table"
        finally:
            reader.release()

    def close(self) -> None:
        """Remove the file (readers keep their mapping; every lookup then misses). Idempotent."""
        if self._mmap is None:
            return
        try:
            self._gen[:] += 2  # readers mid-copy see a change
            self._key[:] = 0
            os.unlink(self.path)
        except (FileNotFoundError, ValueError):
            pass
        self._gen = self._key = self._parent = self._meta = self._tags = self._cells = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass
        self._mmap = None  # type: ignore[assignment]


class Located(NamedTuple):
    """Where a reader found blocks: slots, the generations seen, and the blocks' positions.

    ``first``: the first slot when ``slots`` is the run ``first, first + 1, ...`` (its records
    were read, and are re-checked, with one slice per array), else -1."""

    slots: list[int]
    gens: list[int]
    parents: list[bytes]
    roots: list[bool]
    tokens: list[int]
    first: int = -1

    def part(self, lo: int, hi: int) -> Located:
        """The entries ``lo`` up to (not including) ``hi``, for re-checking a chunk alone."""
        return Located(
            self.slots[lo:hi],
            self.gens[lo:hi],
            self.parents[lo:hi],
            self.roots[lo:hi],
            self.tokens[lo:hi],
            self.first + lo if self.first >= 0 else -1,
        )


class DirectoryView:
    """Read-only lookups in a directory mapping (the reader's side).

    A few keys are looked up with plain memoryview reads (a Python int or bytes per access: no
    numpy call overhead); :data:`VECTOR_MIN` keys or more with numpy passes over all of them."""

    def __init__(self, buf: Any, num_slots: int) -> None:
        _, arrays = _layout(num_slots)
        mem = memoryview(buf)
        self._mem = mem
        self.num_slots = num_slots

        def part(name: str, fmt: Any) -> memoryview:
            off, dtype, shape = arrays[name]
            return mem[off : off + int(np.prod(shape)) * np.dtype(dtype).itemsize].cast(fmt)

        self._gen, self._meta = part("gen", "Q"), part("meta", "I")
        self._tags, self._cells = part("tags", "Q"), part("cells", "q")
        self._key_off, self._parent_off = arrays["key"][0], arrays["parent"][0]
        self._mask = len(self._tags) - 1

    def _key_at(self, slot: int) -> bytes:
        at = self._key_off + 32 * slot
        return self._mem[at : at + 32].tobytes()

    def find(self, key: bytes) -> int | None:
        """The slot the table lists for ``key`` with a matching slot record, else None."""
        tag = _tag(key)
        if tag <= DELETED:
            return None
        tags, cells, mask, n = self._tags, self._cells, self._mask, self.num_slots
        i = tag & mask
        for _ in range(len(tags)):
            t = tags[i]
            if t == EMPTY:
                return None
            if t == tag:
                slot = cells[i]
                if 0 <= slot < n and self._key_at(slot) == key:
                    return slot
            i = (i + 1) & mask
        return None

    def locate(self, keys: Sequence[bytes]) -> Located | None:
        """Every key's slot, generation and position, or None if any key is not bound.

        The positions are read after the generations: a caller that finds :meth:`unchanged`
        true after using them (its copy) knows they, and the pages, were stable throughout."""
        if not keys:
            return Located([], [], [], [], [])
        first = self.find(keys[0])
        if first is None:
            return None
        run = self._locate_run(first, keys)
        if run is not None:
            return run
        if len(keys) >= VECTOR_MIN:
            return self._locate_many(keys)
        slots = self._find_each(first, keys)
        if slots is None:
            return None
        gen, meta, mem, off = self._gen, self._meta, self._mem, self._parent_off
        gens = [gen[s] for s in slots]
        if any(g & 1 for g in gens):
            return None
        return Located(
            slots,
            gens,
            [mem[off + 32 * s : off + 32 * s + 32].tobytes() for s in slots],
            [bool(meta[2 * s + 1] & 1) for s in slots],
            [meta[2 * s] for s in slots],
        )

    def _locate_run(self, first: int, keys: Sequence[bytes]) -> Located | None:
        """:meth:`locate` when ``keys`` are bound to the consecutive slots ``first, first + 1,
        ...`` (the usual case: a chain committed together), reading each array with one slice:
        generations (all even), then keys, then positions. None when they are not (or a slot is
        being edited): the caller then locates them key by key."""
        n = len(keys)
        end = first + n
        if end > self.num_slots:
            return None
        gens = self._gen[first:end].tolist()
        if _any_odd(gens):
            return None
        at = self._key_off + 32 * first
        joined = keys[0] if n == 1 else b"".join(keys)
        if self._mem[at : at + 32 * n].tobytes() != joined:
            return None
        at = self._parent_off + 32 * first
        parents = self._mem[at : at + 32 * n].tobytes()
        meta = self._meta[2 * first : 2 * end].tolist()  # num_tokens, flags per slot
        return Located(
            list(range(first, end)),
            gens,
            _split_parents(parents, keys, joined),
            _root_flags(meta[1::2]),
            meta[0::2],
            first,
        )

    def _find_each(self, first: int, keys: Sequence[bytes]) -> list[int] | None:
        """The slot of every key (``first``: the first key's), or None if one is not bound. A
        key is looked for in the slot after the previous key's first (runs are common), then
        through the table."""
        slots = [first]
        n, key_at = self.num_slots, self._key_at
        for key in keys[1:]:
            guess = slots[-1] + 1
            slot = guess if guess < n and key_at(guess) == key else self.find(key)
            if slot is None:
                return None
            slots.append(slot)
        return slots

    def _arrays(self) -> tuple[npt.NDArray[Any], ...]:
        """numpy views of tags, cells, gens, keys, parents and meta (dropped by the caller)."""
        n, mem = self.num_slots, self._mem
        return (
            np.frombuffer(self._tags, dtype=np.uint64),
            np.frombuffer(self._cells, dtype=np.int64),
            np.frombuffer(self._gen, dtype=np.uint64),
            np.frombuffer(mem, dtype=np.uint8, count=32 * n, offset=self._key_off).reshape(n, 32),
            np.frombuffer(mem, dtype=np.uint8, count=32 * n, offset=self._parent_off).reshape(n, 32),
            np.frombuffer(self._meta, dtype=np.uint32).reshape(n, 2),
        )

    def _locate_many(self, keys: Sequence[bytes]) -> Located | None:
        want = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
        table, cells, gen, key_arr, parent_arr, meta = self._arrays()
        slots = self._probe(want, table, cells, key_arr)
        if slots is None:
            return None
        index = np.asarray(slots, dtype=np.intp)
        gens = gen[index].tolist()
        if any(g & 1 for g in gens):
            return None
        rows = meta[index]
        return Located(
            slots,
            gens,
            [row.tobytes() for row in parent_arr[index]],
            [bool(f & 1) for f in rows[:, 1].tolist()],
            rows[:, 0].tolist(),
        )

    def _probe(
        self,
        want: npt.NDArray[np.uint8],
        table: npt.NDArray[np.uint64],
        cells: npt.NDArray[np.int64],
        key_arr: npt.NDArray[np.uint8],
    ) -> list[int] | None:
        """The slot bound to each row's key: linear probing, every key per numpy pass."""
        tags = want[:, :8].copy().view("<u8").ravel()
        if (tags <= DELETED).any():
            return None
        pos = (tags & np.uint64(self._mask)).astype(np.intp)
        slots = np.full(len(tags), -1, dtype=np.intp)
        todo = np.arange(len(tags))
        for _ in range(len(table)):
            at = pos[todo]
            seen = table[at]
            cand = np.where(seen == tags[todo], cells[at], -1)
            valid = (cand >= 0) & (cand < self.num_slots)
            cand = np.where(valid, cand, 0)
            found = valid & (key_arr[cand] == want[todo]).all(axis=1)
            slots[todo[found]] = cand[found]
            if (~found & (seen == EMPTY)).any():
                return None  # a key is not in the table
            todo = todo[~found]
            if not len(todo):
                return [int(x) for x in slots.tolist()]
            pos[todo] = (pos[todo] + 1) & self._mask
        return None

    def unchanged(self, located: Located, keys: Sequence[bytes]) -> bool:
        """True when every located slot still holds its key at the generation seen."""
        first = located.first
        if first >= 0:  # one run: one slice of generations, one of keys
            n = len(keys)
            if n != len(located.gens) or self._gen[first : first + n].tolist() != located.gens:
                return False
            at = self._key_off + 32 * first
            return self._mem[at : at + 32 * n].tobytes() == b"".join(keys)
        if len(keys) >= VECTOR_MIN:
            _, _, gens, key_arr, _, _ = self._arrays()
            index = np.asarray(located.slots, dtype=np.intp)
            if gens[index].tolist() != located.gens:
                return False
            return bool(key_arr[index].tobytes() == b"".join(keys))
        gen = self._gen
        if [gen[s] for s in located.slots] != located.gens:
            return False
        return b"".join(map(self._key_at, located.slots)) == b"".join(keys)

    def release(self) -> None:
        """Drop the views of the mapping (lookups fail afterwards). Idempotent."""
        for view in (self._gen, self._meta, self._tags, self._cells, self._mem):
            view.release()


class DirectoryReader(DirectoryView):
    """A peer's directory file mapped read-only. Raises StateError when it is not one."""

    def __init__(self, tier_path: str, num_slots: int, page_bytes: int) -> None:
        path = tier_path + SUFFIX
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            size, _ = _layout(num_slots)
            if os.fstat(fd).st_size != size:
                raise StateError("the peer's tier directory has an unexpected size")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, _pad, slots, _cells_n, page = _HEAD.unpack(self._mmap[: _HEAD.size])
        if (magic, version, slots, page) != (MAGIC, VERSION, num_slots, page_bytes):
            self._mmap.close()
            raise StateError("the peer's tier directory does not match its tier")
        super().__init__(self._mmap, num_slots)

    @property
    def buffer(self) -> mmap.mmap:
        """The read-only mapping of the owner's directory (what a compiled reader scans); valid
        until :meth:`close`."""
        return self._mmap

    def close(self) -> None:
        self.release()
        try:
            self._mmap.close()
        except BufferError:
            pass


# ---- the owner's manager ------------------------------------------------------------------------
def install(
    pools: Sequence[PagePool],
    tree: BlockRadixTree,
    events: EventQueue,
    host_events: Mapping[int, SlotEvents],
) -> None:
    """Bind the committed blocks of ``tree`` that sit on a shared host tier among ``pools`` (if
    one has a directory) as ``events`` reports them; the tier unbinds slots itself when it
    releases them. ``host_events``: the pending copies of host slots per level (the copy engine's),
    whose blocks are bound only once their bytes are in place."""
    levels: dict[int, ShmDirectory] = {}
    for level, pool in enumerate(pools):
        directory = pool.slot_directory
        if isinstance(directory, ShmDirectory):
            levels[level] = directory
    if not levels:
        return

    def on_event(event: CacheEvent) -> None:
        if not isinstance(event, (BlockStored, BlockTierChanged)):
            return
        block = tree.get(event.key)
        if block is None:
            return
        page = block.page
        directory = levels.get(page.level)
        if directory is None or _copy_pending(host_events, page.level, page.slot):
            return  # bytes still arriving: the RPC paths settle and serve it
        directory.bind_block(block)

    events.listeners.append(on_event)


def _copy_pending(host_events: Mapping[int, SlotEvents], level: int, slot: int) -> bool:
    events = host_events.get(level)
    return events is not None and len(events) > 0 and bool(events.pending([slot]))


def expected_bindings(
    tree: BlockRadixTree, host_events: Mapping[int, SlotEvents], level: int
) -> dict[int, bytes]:
    """Slot -> key of the committed blocks of ``tree`` on ``level`` whose bytes are in place
    (for checks)."""
    return {
        int(b.page.slot): b.key
        for b in tree.blocks.values()
        if b.page.level == level and not _copy_pending(host_events, level, b.page.slot)
    }
