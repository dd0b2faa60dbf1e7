"""Which malloc the compute processes run on: finding the library, and preloading it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.errors import UserError


def test_choose_allocator(tmp_path: Path) -> None:
    (tmp_path / "libtcmalloc_minimal.so.4").write_text("")
    from cpudist.runtime.allocator import choose_allocator

    assert choose_allocator("auto", [tmp_path]) == (
        "tcmalloc", str(tmp_path / "libtcmalloc_minimal.so.4"))
    (tmp_path / "libjemalloc.so.2").write_text("")
    assert choose_allocator("auto", [tmp_path])[0] == "jemalloc"
    assert choose_allocator("none", [tmp_path]) == (None, None)
    assert choose_allocator("auto", []) == (None, None)
    with pytest.raises(UserError, match="apt-get install libjemalloc2"):
        choose_allocator("jemalloc", [])
    with pytest.raises(UserError, match="CPUDIST_ALLOCATOR=jemaloc: choose one of auto"):
        choose_allocator("jemaloc", [])


def test_preload_env_swaps_allocators_and_keeps_other_preloads(tmp_path: Path) -> None:
    from cpudist.runtime.allocator import in_use, preload_env

    env = preload_env("jemalloc", "/lib/libjemalloc.so.2", "/opt/a.so:/usr/lib/libtcmalloc.so.4")
    assert env == {"CPUDIST_ALLOCATOR": "jemalloc", "LD_PRELOAD": "/lib/libjemalloc.so.2:/opt/a.so",
                   "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    assert preload_env(None, None, "/lib/libjemalloc.so.2:/opt/a.so") == {
        "CPUDIST_ALLOCATOR": "none", "LD_PRELOAD": "/opt/a.so"}
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert in_use(maps) == "glibc malloc"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert in_use(maps) == "tcmalloc"


