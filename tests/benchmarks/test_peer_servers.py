"""Tests for `benchmarks/peer_servers.py`: the memory a watched process and its children hold,
counted apart, on real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.peer_servers import RssPeaks, free_port, high_water_mark_mb

# Holds ~200 MB itself and starts a child holding ~100 MB; both sleep until killed.
PARENT = """
import subprocess, sys, time
block = bytearray(200 * 2**20)
child = subprocess.Popen([sys.executable, "-c",
    "import time; b = bytearray(100 * 2**20); print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.server
def test_a_process_and_its_children_are_measured_apart() -> None:
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        peaks = RssPeaks(interval_s=0.05)
        peaks.watch("parent", proc.pid)
        peaks.start()
        time.sleep(0.3)
        peaks.stop()
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    peak = peaks.peaks["parent"]
    assert peak.samples >= 3
    assert 200 <= peak.rss_mb < 290  # the parent's own block, not its child's
    assert 100 <= peak.children_rss_mb < 190
    assert len(peak.children) == 1 and "python" in next(iter(peak.children))
    assert peak.hwm_mb >= peak.rss_mb - 1


def test_the_high_water_mark_is_at_least_the_rss_now_and_zero_for_no_process() -> None:
    now = psutil.Process().memory_info().rss / 2**20
    assert high_water_mark_mb(os.getpid()) >= now - 1
    assert high_water_mark_mb(2**22 + 12345) == 0.0  # above Linux's pid_max


def test_a_free_port_can_be_listened_on() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
