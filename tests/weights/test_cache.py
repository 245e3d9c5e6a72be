"""The content-addressed weight cache and the index of remembered tensor hashes (shardwire/cache.py),
on small byte files written here."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shardwire.weights.cache as cache_module
from shardwire.formats import TensorInfo, TensorReader
from shardwire.weights.cache import HashIndex, WeightCache, default_cache_dir, sha256


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed * 13 + (i >> 3)) % 256 for i in range(n))


def store(cache: WeightCache, data: bytes, chunk: int = 7) -> Path:
    """Put `data` in the cache the way a worker does: chunks in order, then finish()."""
    digest = digest_of(data)
    writer = cache.writer(digest, len(data))
    for offset in range(0, len(data), chunk):
        assert not writer.done
        writer.write(offset, data[offset : offset + chunk])
    assert writer.done
    return writer.finish()


def set_mtime(path: Path, seconds_ago: float) -> None:
    t = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(path, ns=(t, t))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


class CountingReader(TensorReader):
    """A TensorReader that counts the tensors it reads, across every instance."""

    reads: list[str] = []

    def read(self, info):
        CountingReader.reads.append(info.name)
        return super().read(info)


@pytest.fixture
def counting(monkeypatch):
    CountingReader.reads = []
    monkeypatch.setattr(cache_module, "TensorReader", CountingReader)
    return CountingReader.reads


# -- helpers -----------------------------------------------------------------------------------


def test_sha256_of_bytes_and_of_arrays():
    data = blob(1000, 1)
    assert sha256(data) == digest_of(data)
    assert sha256(np.frombuffer(data, dtype=np.uint8)) == digest_of(data)
    assert sha256(np.frombuffer(data, dtype=np.float32)) == digest_of(data)  # the bytes, not the values


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDWIRE_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SHARDWIRE_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "shardwire"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "shardwire"


# -- writing into the cache ----------------------------------------------------------------------


def test_writer_stores_verified_bytes_under_their_hash(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(100, 2)
    digest = digest_of(data)
    path = store(cache, data)
    assert path == tmp_path / "weights" / digest[:2] / digest == cache.path_for(digest)
    assert path.read_bytes() == data
    assert files_under(tmp_path / "weights") == [path]  # no .part file left behind
    assert cache.lookup(digest, len(data)) == path


def test_writer_in_one_chunk_and_empty_tensor(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(64, 3)
    writer = cache.writer(digest_of(data), len(data))
    writer.write(0, data)
    assert writer.finish().read_bytes() == data
    empty = cache.writer(digest_of(b""), 0)
    assert empty.done
    assert empty.finish().read_bytes() == b""


def test_writer_rejects_chunks_out_of_order_or_past_the_end(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(20, 4)
    writer = cache.writer(digest_of(data), len(data))
    with pytest.raises(ValueError, match="out of order or past the end"):
        writer.write(5, data[5:10])  # a gap
    writer.write(0, data[:10])
    with pytest.raises(ValueError, match="out of order"):
        writer.write(0, data[:10])  # a repeat
    with pytest.raises(ValueError, match="past the end"):
        writer.write(10, data[10:] + b"x")
    assert writer.received == 10 and not writer.done
    writer.write(10, data[10:])
    assert writer.finish().read_bytes() == data


def test_a_corrupted_download_never_enters_the_cache(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(50, 5)
    digest = digest_of(data)
    writer = cache.writer(digest, len(data))
    writer.write(0, data[:25])
    writer.write(25, bytes(25))  # wrong bytes of the right length
    assert writer.done
    with pytest.raises(ValueError, match="corrupted"):
        writer.finish()
    assert not cache.path_for(digest).exists()
    assert files_under(tmp_path / "weights") == []
    assert cache.lookup(digest, len(data)) is None


def test_abort_removes_the_partial_file(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(40, 6)
    writer = cache.writer(digest_of(data), len(data))
    writer.write(0, data[:10])
    assert len(files_under(tmp_path / "weights")) == 1  # the .part file
    assert ".part" in files_under(tmp_path / "weights")[0].name
    writer.abort()
    assert files_under(tmp_path / "weights") == []
    assert cache.lookup(digest_of(data), len(data)) is None


class _FullDisk:
    """A file whose buffered bytes cannot be flushed: close() fails as on a full disk."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        return len(data)

    def close(self):
        self.file.close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_finish_or_abort_leaves_no_partial_file(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(40, 8)
    for end in ("finish", "abort"):
        writer = cache.writer(digest_of(data), len(data))
        writer.file = _FullDisk(writer.file)
        writer.write(0, data)
        if end == "finish":
            with pytest.raises(OSError, match="No space"):
                writer.finish()
        else:
            writer.abort()
        assert files_under(tmp_path / "weights") == []
    assert cache.lookup(digest_of(data), len(data)) is None


def test_a_hash_index_that_cannot_be_saved_still_answers_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    _, infos, parts = tensor_file(tmp_path / "m")
    real_write_text = Path.write_text

    def half_written(path, text):
        real_write_text(path, text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_written)
    got, _ = hashes(HashIndex(tmp_path / "cache"), infos)
    assert got[infos[2].name] == digest_of(parts[2])
    assert files_under(tmp_path / "cache" / "hashes") == []


def test_writers_of_the_same_tensor_on_two_threads_use_separate_part_files(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(30, 7)
    a = cache.writer(digest_of(data), len(data))
    other = []
    t = threading.Thread(target=lambda: other.append(cache.writer(digest_of(data), len(data))))
    t.start()
    t.join(5)
    (b,) = other
    assert a.part != b.part
    a.write(0, data[:10])
    b.write(0, data)
    assert b.finish().read_bytes() == data
    a.abort()  # the loser's abort leaves the finished entry alone
    assert cache.lookup(digest_of(data), len(data)) == cache.path_for(digest_of(data))


# -- looking up ------------------------------------------------------------------------------


def test_lookup_of_a_missing_or_wrong_size_entry(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(30, 8)
    assert cache.lookup(digest_of(data), len(data)) is None  # nothing cached yet
    store(cache, data)
    assert cache.lookup(digest_of(data), len(data) + 1) is None
    assert cache.lookup(digest_of(data), len(data)) is not None


def test_a_cached_file_corrupted_on_disk_is_dropped(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(200, 9)
    digest = digest_of(data)
    path = store(cache, data)
    with open(path, "r+b") as f:  # flip one byte, same size
        f.seek(100)
        f.write(bytes([data[100] ^ 0xFF]))
    set_mtime(path, 60)  # a later modification: make sure the timestamp differs from the write's
    assert cache.lookup(digest, len(data)) is None
    assert not path.exists()
    assert cache.lookup(digest, len(data)) is None


def test_a_file_placed_by_hand_is_hashed_before_use(tmp_path):
    cache = WeightCache(tmp_path)
    good, bad = blob(64, 10), blob(64, 11)
    for data, content in ((good, good), (bad, good)):
        path = cache.path_for(digest_of(data))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    assert cache.lookup(digest_of(good), 64) == cache.path_for(digest_of(good))
    assert cache.lookup(digest_of(bad), 64) is None  # its bytes are good's, not bad's
    assert not cache.path_for(digest_of(bad)).exists()


def test_lookup_marks_the_file_most_recently_used(tmp_path):
    cache = WeightCache(tmp_path)
    path = store(cache, blob(10, 12))
    set_mtime(path, 3600)
    before = path.stat()
    assert cache.lookup(digest_of(blob(10, 12)), 10) == path
    assert path.stat().st_atime > before.st_atime + 3000  # the access time says when it was last used
    assert path.stat().st_mtime_ns == before.st_mtime_ns  # the hash index's key is left alone


def test_lookup_right_after_finish_uses_the_remembered_hash(tmp_path, counting):
    cache = WeightCache(tmp_path)
    data = blob(300, 13)
    store(cache, data)
    assert cache.lookup(digest_of(data), len(data)) is not None
    assert counting == []  # finish() hashed it while writing


def test_repeated_lookups_of_an_unchanged_file_do_not_hash_it_again(tmp_path, counting):
    cache = WeightCache(tmp_path)
    data = blob(300, 14)
    store(cache, data)
    for _ in range(3):
        assert cache.lookup(digest_of(data), len(data)) is not None
    assert counting == []


def test_repeated_lookups_do_not_grow_the_hash_index(tmp_path):
    cache = WeightCache(tmp_path)
    data = blob(100, 15)
    store(cache, data)
    for _ in range(5):
        assert cache.lookup(digest_of(data), len(data)) is not None
    assert len(files_under(tmp_path / "hashes")) == 1


# -- eviction --------------------------------------------------------------------------------


def three_files(cache: WeightCache):
    """Three 100-byte entries, a oldest and c newest."""
    datas = [blob(100, 20 + i) for i in range(3)]
    paths = [store(cache, d) for d in datas]
    for path, age in zip(paths, (300, 200, 100)):
        set_mtime(path, age)
    return [digest_of(d) for d in datas], paths


def test_evict_without_a_limit_removes_nothing(tmp_path):
    cache = WeightCache(tmp_path)
    _, paths = three_files(cache)
    assert cache.evict(keep=set()) == 0
    assert all(p.exists() for p in paths)
    assert WeightCache(tmp_path / "empty", max_bytes=0).evict(set()) == 0  # no folder yet


def test_evict_removes_least_recently_used_until_under_the_limit(tmp_path):
    cache = WeightCache(tmp_path, max_bytes=250)
    _, (a, b, c) = three_files(cache)
    assert cache.evict(keep=set()) == 100
    assert [p.exists() for p in (a, b, c)] == [False, True, True]
    assert cache.evict(keep=set()) == 0  # already under the limit

    cache.max_bytes = 100
    assert cache.evict(keep=set()) == 100
    assert [p.exists() for p in (b, c)] == [False, True]


def test_evict_at_exactly_the_limit_removes_nothing(tmp_path):
    cache = WeightCache(tmp_path, max_bytes=300)
    _, paths = three_files(cache)
    assert cache.evict(keep=set()) == 0
    assert all(p.exists() for p in paths)


def test_evict_respects_keep(tmp_path):
    cache = WeightCache(tmp_path, max_bytes=150)
    (da, db, dc), (a, b, c) = three_files(cache)
    assert cache.evict(keep={da}) == 200  # a is the oldest but kept: b and c go
    assert [p.exists() for p in (a, b, c)] == [True, False, False]

    cache = WeightCache(tmp_path / "other", max_bytes=0)
    digests, paths = three_files(cache)
    assert cache.evict(keep=set(digests)) == 0
    assert all(p.exists() for p in paths)


def test_a_lookup_saves_an_entry_from_eviction(tmp_path):
    cache = WeightCache(tmp_path, max_bytes=200)
    (da, db, dc), (a, b, c) = three_files(cache)
    assert cache.lookup(da, 100) == a  # a becomes the most recently used
    assert cache.evict(keep=set()) == 100
    assert [p.exists() for p in (a, b, c)] == [True, False, True]


def test_evict_ignores_files_being_written(tmp_path):
    cache = WeightCache(tmp_path, max_bytes=100)
    _, (a, b, c) = three_files(cache)
    data = blob(500, 30)
    writer = cache.writer(digest_of(data), len(data))
    writer.write(0, data[:50])
    set_mtime(writer.part, 1000)
    assert cache.evict(keep=set()) == 200  # the 500-byte .part neither counts nor goes
    assert writer.part.exists() and c.exists() and not a.exists() and not b.exists()
    writer.write(50, data[50:])
    assert writer.finish().read_bytes() == data


# -- the hash index ---------------------------------------------------------------------------


def tensor_file(folder: Path, sizes=(16, 40, 8), name="model.bin", seed=0):
    """A file of back-to-back tensors after an 8-byte header; their TensorInfos and bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    parts = [blob(n, seed + i) for i, n in enumerate(sizes)]
    path.write_bytes(b"HEADER!!" + b"".join(parts))
    infos, offset = [], 8
    for i, (n, part) in enumerate(zip(sizes, parts)):
        infos.append(TensorInfo(f"blk.{i}.w", "U8", (n,), path, offset, n))
        offset += n
    return path, infos, parts


def hashes(index: HashIndex, infos) -> tuple[dict, int]:
    """(hashes, bytes read to get them)."""
    reader = TensorReader()
    try:
        return index.hashes(infos, reader, threads=2), reader.bytes_read
    finally:
        reader.close()


def test_hash_index_hashes_each_tensor_range(tmp_path):
    _, infos, parts = tensor_file(tmp_path / "m")
    got, read = hashes(HashIndex(tmp_path / "cache"), infos)
    assert got == {info.name: digest_of(part) for info, part in zip(infos, parts)}
    assert read == sum(len(p) for p in parts)
    assert len(files_under(tmp_path / "cache" / "hashes")) == 1
    saved = json.loads(files_under(tmp_path / "cache" / "hashes")[0].read_text())
    assert saved == {f"{i.offset}:{i.nbytes}": digest_of(p) for i, p in zip(infos, parts)}


def test_hash_index_reuses_remembered_hashes_across_instances(tmp_path):
    _, infos, parts = tensor_file(tmp_path / "m")
    first, _ = hashes(HashIndex(tmp_path / "cache"), infos)
    again, read = hashes(HashIndex(tmp_path / "cache"), infos)  # a new process, same cache dir
    assert again == first and read == 0


def test_hash_index_hashes_only_new_ranges(tmp_path):
    _, infos, parts = tensor_file(tmp_path / "m")
    index = HashIndex(tmp_path / "cache")
    hashes(index, infos[:1])
    got, read = hashes(index, infos)
    assert read == infos[1].nbytes + infos[2].nbytes
    assert got[infos[0].name] == digest_of(parts[0])
    # the same range under another tensor name is the same entry
    alias = TensorInfo("alias", "U8", (16,), infos[0].path, infos[0].offset, infos[0].nbytes)
    got, read = hashes(index, [alias])
    assert got == {"alias": digest_of(parts[0])} and read == 0


def test_a_changed_file_is_hashed_again(tmp_path):
    path, infos, parts = tensor_file(tmp_path / "m")
    index = HashIndex(tmp_path / "cache")
    hashes(index, infos)
    # same size, new content and a new timestamp
    new = blob(infos[0].nbytes, 99)
    with open(path, "r+b") as f:
        f.seek(infos[0].offset)
        f.write(new)
    set_mtime(path, -5)
    got, read = hashes(HashIndex(tmp_path / "cache"), infos)
    assert read == sum(i.nbytes for i in infos)
    assert got[infos[0].name] == digest_of(new) != digest_of(parts[0])
    assert got[infos[1].name] == digest_of(parts[1])


def test_the_same_bytes_at_another_path_are_hashed_for_that_path(tmp_path):
    _, infos, parts = tensor_file(tmp_path / "a")
    _, copies, _ = tensor_file(tmp_path / "b")
    index = HashIndex(tmp_path / "cache")
    hashes(index, infos)
    got, read = hashes(index, copies)
    assert read == sum(i.nbytes for i in copies)
    assert list(got.values()) == [digest_of(p) for p in parts]


def test_remember_is_trusted_for_an_unchanged_file(tmp_path):
    path, infos, _ = tensor_file(tmp_path / "m")
    index = HashIndex(tmp_path / "cache")
    index.remember(path, infos[1].offset, infos[1].nbytes, "f" * 64)
    got, read = hashes(HashIndex(tmp_path / "cache"), infos[1:2])
    assert got == {infos[1].name: "f" * 64} and read == 0


def test_an_unreadable_index_file_is_rebuilt(tmp_path):
    _, infos, parts = tensor_file(tmp_path / "m")
    hashes(HashIndex(tmp_path / "cache"), infos)
    (saved,) = files_under(tmp_path / "cache" / "hashes")
    saved.write_text("{not json")
    got, read = hashes(HashIndex(tmp_path / "cache"), infos)
    assert read == sum(i.nbytes for i in infos)
    assert got[infos[2].name] == digest_of(parts[2])
    assert json.loads(saved.read_text())[f"{infos[2].offset}:{infos[2].nbytes}"] == digest_of(parts[2])


def test_a_tensor_past_the_end_of_its_file_is_an_error(tmp_path):
    path, infos, _ = tensor_file(tmp_path / "m")
    beyond = TensorInfo("beyond", "U8", (10,), path, path.stat().st_size - 4, 10)
    with pytest.raises(ValueError, match="past the end"):
        hashes(HashIndex(tmp_path / "cache"), [beyond])
