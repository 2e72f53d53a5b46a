"""Content checksums of checkpoint files: the CRC-32 of each block of ``BLOCK_BYTES`` of every file.

A checkpoint damaged after its save without a change of size (a few KiB overwritten in place) passes the manifest's
size check and the files' structure checks, and resuming from it trains on garbage. The save therefore records a
checksum of each file's content, and resume recomputes it. CRC-32 (``zlib.crc32``: table-free, several GiB/s on a
current CPU, and it releases the GIL) detects every burst of up to 32 changed bits and any other damage with
probability 1 - 2^-32: it guards against damage, not against someone forging a file. Per block rather than per file,
so one large file (an 8B model's optimizer state) is checksummed by several threads at once, and a mismatch names
the byte range that changed.

The save computes the checksums right after it wrote the files, while they are still in the page cache (on the
writer thread for a background save); ``python -m hf_accel.training.checksums FILE...`` times it on this machine.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

ALGORITHM = "crc32"
BLOCK_BYTES = 64 * 2**20  # the unit of parallel work and of a mismatch's byte range
_READ_BYTES = 4 * 2**20  # one read into a thread's buffer
_local = threading.local()


def workers() -> int:
    """Threads that checksum at once: the usable cores, at most 8 (past that the disk or memory bandwidth decides)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores))


def _buffer() -> memoryview:
    buf = getattr(_local, "buffer", None)
    if buf is None:
        buf = _local.buffer = memoryview(bytearray(_READ_BYTES))
    return buf


def block_crc(path: str, index: int, block_bytes: int = BLOCK_BYTES) -> str:
    """CRC-32 of block ``index`` of ``path`` (its last block may be shorter; an empty file has one empty block)."""
    buf = _buffer()
    crc, offset, end = 0, index * block_bytes, (index + 1) * block_bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        while offset < end:
            n = os.preadv(fd, [buf[:min(_READ_BYTES, end - offset)]], offset)
            if n == 0:
                break
            crc = zlib.crc32(buf[:n], crc)
            offset += n
    finally:
        os.close(fd)
    return f"{crc:08x}"


def _blocks(size: int, block_bytes: int) -> int:
    return max(1, -(-size // block_bytes))


def checksums(folder: str, names: list[str], block_bytes: int = BLOCK_BYTES) -> dict[str, list[str]]:
    """{file name (relative to ``folder``): [CRC-32 of each block, as 8 hex digits]}, computed on ``workers()``
    threads."""
    tasks = [(name, i) for name in names
             for i in range(_blocks(os.path.getsize(os.path.join(folder, name)), block_bytes))]
    with ThreadPoolExecutor(max_workers=min(workers(), max(1, len(tasks))),
                            thread_name_prefix="hf_accel-checksum") as pool:
        crcs = list(pool.map(lambda t: block_crc(os.path.join(folder, t[0]), t[1], block_bytes), tasks))
    out: dict[str, list[str]] = {name: [] for name in names}
    for (name, _), crc in zip(tasks, crcs):
        out[name].append(crc)
    return out


def mismatch(folder: str, expected: dict[str, list[str]], block_bytes: int) -> str | None:
    """None when every file's blocks have the recorded checksums; else one line naming the first file (in name
    order) whose content changed, and the byte range."""
    names = sorted(expected)
    actual = checksums(folder, names, block_bytes)
    for name in names:
        for i, (want, got) in enumerate(zip(expected[name], actual[name])):
            if want != got:
                start = i * block_bytes
                end = min(start + block_bytes, os.path.getsize(os.path.join(folder, name))) - 1
                return (f"{os.path.join(folder, name)}: content changed since the save (CRC-32 of bytes "
                        f"{start}-{end} is {got}, the save recorded {want})")
        if len(expected[name]) != len(actual[name]):
            return f"{os.path.join(folder, name)}: {len(actual[name])} blocks, the save recorded {len(expected[name])}"
    return None


def _main(paths: list[str]) -> int:
    """Time the checksum of each file (a reading from the page cache if the file was read or written just before)."""
    if not paths:
        print("usage: python -m hf_accel.training.checksums FILE [FILE ...]", file=sys.stderr)
        return 2
    total = sum(os.path.getsize(p) for p in paths)
    start = time.perf_counter()
    for path in paths:
        checksums(os.path.dirname(os.path.abspath(path)), [os.path.basename(path)])
    seconds = time.perf_counter() - start
    print(f"{total / 2**30:.2f} GiB in {seconds:.2f} s: {total / 2**30 / max(seconds, 1e-9):.2f} GiB/s on "
          f"{workers()} threads")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
