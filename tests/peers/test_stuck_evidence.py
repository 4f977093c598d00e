"""A stuck scenario's evidence from P's side: each process's Python stacks, whole.

A P and its TP ranks share one stderr; dumps written at the same moment interleave line by
line and come out unreadable. Real processes here (a leader and a child on its stderr),
no vLLM: the evidence path is the rig's own.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvfail.peers.base import PeerPair
from kvfail.rig.processes import PeerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
# A leader and a child (its "rank") on the same stderr, each with three waiting threads.
LEADER = """
import subprocess, sys, threading, time
from kvfail.rig.stacks import install_stack_dump
install_stack_dump()
code = '''
import threading, time
from kvfail.rig.stacks import install_stack_dump
install_stack_dump()
def rank_waiter():
    time.sleep(60)
for _ in range(3):
    threading.Thread(target=rank_waiter, daemon=True).start()
print("RANK", flush=True)
time.sleep(60)
'''
child = subprocess.Popen([sys.executable, "-c", code], stdout=sys.stdout, stderr=sys.stderr)
def leader_waiter():
    time.sleep(60)
for _ in range(3):
    threading.Thread(target=leader_waiter, daemon=True).start()
print("CHILD", child.pid, flush=True)
time.sleep(60)
"""


def test_each_process_stacks_come_whole_and_led_by_its_pid() -> None:
    peer = PeerProcess(
        [sys.executable, "-c", LEADER], env={"PYTHONPATH": str(REPO_ROOT)}, name="stacks"
    )
    try:
        line = peer.wait_ready(30.0, line=re.compile(r"^CHILD \d+"))
        assert line is not None
        child = int(line.split()[1])
        peer.wait_ready(30.0, line="RANK")
        stacks = PeerPair._p_stacks(peer, [peer.pid, child])
    finally:
        peer.close()
    leader = [s for s in stacks if s.startswith(f"{peer.pid} ")]
    rank = [s for s in stacks if s.startswith(f"{child} ")]
    assert len(leader) == 4 and len(rank) == 4, stacks  # main + three waiters each
    for line in stacks:  # whole lines: a thread header, then frames
        assert re.match(r"^\d+ (Current thread|Thread) 0x[0-9a-f]+: \S", line), line
    assert sum("leader_waiter" in s for s in leader) == 3, leader
    assert sum("rank_waiter" in s for s in rank) == 3, rank
