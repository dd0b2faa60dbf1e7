"""Which malloc the compute processes run on: finding the library, and preloading it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.errors import UserError


def _shipped_mimalloc() -> Path:
    from cpudist.runtime.allocator import find_allocator

    found = find_allocator("mimalloc")
    if found is None:
        pytest.skip("cmeel-mimalloc (a dependency of cpudist) is not installed")
    return Path(found)


def test_mimalloc_comes_with_the_install_and_auto_takes_it() -> None:
    from cpudist.runtime.allocator import choose_allocator

    library = _shipped_mimalloc()
    assert "cmeel.prefix" in str(library)
    assert choose_allocator("auto") == ("mimalloc", str(library))


def test_choose_allocator(tmp_path: Path) -> None:
    import shutil

    from cpudist.runtime.allocator import choose_allocator

    # A real preloadable malloc under other allocators' names: the search order is tested, and
    # every candidate is preloaded into a tiny program before it is chosen.
    real = _shipped_mimalloc()
    shutil.copy(real, tmp_path / "libtcmalloc_minimal.so.4")
    assert choose_allocator("auto", [tmp_path]) == (
        "tcmalloc", str(tmp_path / "libtcmalloc_minimal.so.4"))
    shutil.copy(real, tmp_path / "libjemalloc.so.2")
    assert choose_allocator("auto", [tmp_path])[0] == "jemalloc"
    shutil.copy(real, tmp_path / "libmimalloc.so.3")
    assert choose_allocator("auto", [tmp_path])[0] == "mimalloc"
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




def test_a_library_that_does_not_preload_is_never_chosen(tmp_path: Path) -> None:
    from cpudist.runtime.allocator import choose_allocator

    (tmp_path / "libjemalloc.so.2").write_bytes(b"not an ELF file")  # would break every process
    assert choose_allocator("auto", [tmp_path]) == (None, None)
    with pytest.raises(UserError, match="not found \\(or does not load\\)"):
        choose_allocator("jemalloc", [tmp_path])
