"""Where kiln keeps what it builds or converts once per machine.

One function, so every cache (kernel builds, converted tokenizers, GGUF exports, engine --help
probes, inductor's graphs, model folders) moves together when the user points kiln elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "KILN_CACHE_DIR"


def xdg_cache_home() -> Path:
    """The user's cache root (XDG): `$XDG_CACHE_HOME`, else `~/.cache`. Hugging Face's hub cache
    lives under it too (resolve/hf_cache.py)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


def cache_dir(*parts: str) -> Path:
    """kiln's cache folder, or a path inside it: `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`,
    else `~/.cache/kiln`. Read from the environment at each call (tests and users set the
    variables at run time); nothing is created here."""
    base = os.environ.get(CACHE_DIR_ENV)
    root = Path(base).expanduser() if base else xdg_cache_home() / "kiln"
    return root.joinpath(*parts)


def check_cache_dir_writable() -> None:
    """Startup's check that kiln's cache folder can be created and written, so an unwritable one
    is one line naming it and the fix, not an error from whichever cache writes first."""
    from kiln.errors import ConfigError
    from kiln.i18n import msg

    root = cache_dir()
    probe = root / f".write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(msg("paths.cache_unwritable", path=root, error=e.strerror or e),
                          hint=msg("paths.cache_unwritable.hint", env=CACHE_DIR_ENV)) from None


def runtime_dir() -> Path:
    """Where running servers leave their pid files: `$XDG_RUNTIME_DIR/kiln` (per user, cleared
    at logout), else `run/` under kiln's cache dir. Nothing is created here."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg).expanduser() / "kiln" if xdg else cache_dir("run")
