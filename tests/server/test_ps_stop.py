"""Pid files, `kiln ps` and `kiln stop`: two real servers on two ports are listed and stopped;
stale pid files (dead processes) are ignored and removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_server import _serve

from kiln import pidfile
from kiln.i18n import msg


def _kiln(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *argv], capture_output=True, text=True,
                          timeout=timeout, check=False, env=dict(os.environ))


def _wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_stale_pid_files_are_ignored_and_removed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = pidfile.write(pidfile.ServerRecord(pid=dead.pid, port=1234, host="127.0.0.1",
                                               model="gone"))
    (stale.parent / "9999.pid").write_text("not json")
    assert stale == tmp_path / "kiln" / "1234.pid" and stale.exists()
    assert pidfile.running() == []
    assert not stale.exists() and not (stale.parent / "9999.pid").exists()


def test_runtime_dir_falls_back_to_the_cache_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert pidfile.path_for(8000) == tmp_path / "run" / "8000.pid"


@pytest.mark.slow
def test_ps_lists_two_servers_and_stop_all_stops_both(
    tmp_path: Path, gguf_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    gens = [_serve(tmp_path, gguf_path) for _ in range(2)]
    try:
        servers = [next(g) for g in gens]
        ports = sorted(int(s.base_url.rsplit(":", 1)[1]) for s in servers)
        files = [tmp_path / "run" / "kiln" / f"{p}.pid" for p in ports]
        _wait_for(lambda: all(f.exists() for f in files))
        rec = json.loads(files[0].read_text())
        assert {"pid", "port", "host", "model", "started_at"} <= set(rec)
        assert rec["pid"] in {s.proc.pid for s in servers} and rec["model"] == "smol"

        r = _kiln("ps", "--json")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [row["port"] for row in rows] == ports
        assert all(row["responding"] and row["requests_running"] == 0 for row in rows)
        assert all(row["model"] == "smol" and row["uptime_s"] >= 0 for row in rows)
        assert all(row["memory_bytes"] > 50 << 20 for row in rows)  # each one's RSS
        table = _kiln("ps").stdout
        assert table.splitlines()[0].split()[:5] == ["PORT", "PID", "MODEL", "MEMORY", "UPTIME"]
        assert all(str(p) in table for p in ports)

        r = _kiln("stop", "all", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        for s in servers:
            assert s.proc.wait(30) == 0  # drained: exits 0
        assert "stopped" in r.stderr
        assert not any(f.exists() for f in files)
        assert json.loads(_kiln("ps", "--json").stdout) == []
    finally:
        for g in gens:
            g.close()


def test_stop_says_what_is_left_when_a_server_outlives_the_timeout(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from kiln.cli.main import main

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    # A "kiln" process (by its command line) that ignores SIGTERM and answers no /metrics.
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print(1, flush=True); time.sleep(60)")
    stubborn = subprocess.Popen([sys.executable, "-c", code, "kiln"], stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline()  # handler installed
        pidfile.write(pidfile.ServerRecord(pid=stubborn.pid, port=1, host="127.0.0.1",
                                           model="stuck"))
        assert main(["stop", "--timeout", "0.5"]) == 1  # the only one running: it is the target
        err = capsys.readouterr().err
        # what the catalogue says for that key and these fields (its /metrics: none, so "?")
        assert msg("stop.still_running", port=1, pid=stubborn.pid, timeout=0.5, running="?") \
            in err
        assert pidfile.path_for(1).exists()  # still its server's
        assert main(["stop", "2"]) == 1
        assert msg("stop.no_server", port=2) in capsys.readouterr().err
    finally:
        stubborn.kill()
        stubborn.wait()
