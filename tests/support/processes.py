"""Processes as /proc shows them: which of some pids still run, and what runs under a pid."""

from __future__ import annotations

from pathlib import Path


def _stat(entry: Path) -> list[str] | None:
    """The fields of `entry`/stat after the command's name (None: gone)."""
    try:
        text = (entry / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that run (not gone, not zombies)."""
    out = set()
    for pid in pids:
        fields = _stat(Path(f"/proc/{pid}"))
        if fields is not None and fields[0] != "Z":
            out.add(pid)
    return out


def children(pid: int) -> set[int]:
    """The running processes whose parent is `pid`."""
    out = set()
    for entry in Path("/proc").iterdir():
        fields = _stat(entry) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def descendants(pid: int) -> set[int]:
    """The running processes under `pid`, at any depth."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found
