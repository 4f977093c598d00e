"""Where a rig process that does not answer is stuck: its Python stacks (on a signal)
and its native stacks (through gdb), each summarized one line per thread.

Evidence only: nothing here changes what a scenario judges; a P or a TP rank that hangs
is described in the failure message instead of timing out with nothing said.
"""

from __future__ import annotations

import faulthandler
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "STACK_SIGNAL",
    "install_stack_dump",
    "native_stacks",
    "summarize_native",
    "summarize_stacks",
]


#: The signal on which a rig process (a P, a TP rank) writes every thread's Python stack
#: to its stderr (:func:`install_stack_dump`): evidence for one that does not answer.
STACK_SIGNAL = signal.SIGUSR1


def install_stack_dump() -> None:
    """Have :data:`STACK_SIGNAL` write all threads' Python stacks to stderr."""
    faulthandler.register(STACK_SIGNAL, file=sys.__stderr__, all_threads=True, chain=False)


def summarize_stacks(lines: Iterable[str], frames: int = 5) -> list[str]:
    """faulthandler's dump, one line per thread: its innermost ``frames`` frames."""
    out: list[str] = []
    current: list[str] = []
    head = ""

    def flush() -> None:
        if head:
            out.append(f"{head}: " + " < ".join(current[:frames]))

    for line in lines:
        text = line.strip()
        if text.startswith(("Thread 0x", "Current thread 0x")):
            flush()
            head, current = text.split(" (most recent")[0], []
        elif text.startswith("File ") and head:
            path, _, rest = text.removeprefix("File ").partition(", line ")
            lineno, _, func = rest.partition(" in ")
            where = Path(path.strip('"')).name
            current.append(f"{func} ({where}:{lineno})")
    flush()
    return out


#: Interpreter frames left out of a native stack: they say "Python called C", which the
#: Python stack already shows; what matters is the library the thread waits in.
_INTERPRETER_FRAME = re.compile(
    r"^(__|_?Py(?!Thread)|cfunction_|method_vectorcall|vectorcall_|slot_tp_|call_function|builtin_|"
    r"object_vacall|_TAIL_CALL|pymain_|Py_RunMain|main$|_start$|"
    r"start_thread|clone3?$|thread_run|pythread_wrapper)"
)
_GDB_THREAD = re.compile(r'^Thread \d+ \(Thread 0x[0-9a-f]+ \(LWP (\d+)\) "([^"]*)"\)')
_GDB_FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(.+?) \(.*?\)(?: (?:at|from) (\S+))?$")


def native_stacks(pid: int, timeout_s: float = 20.0, frames: int = 8) -> list[str]:
    """Every thread's native stack of ``pid`` through gdb (when installed), one line per
    distinct stack: which library call a process that does not answer waits in (a
    lock, a socket, a transport's progress), which a Python stack cannot show. Evidence
    only: empty when gdb is absent, cannot attach, or does not finish in ``timeout_s``."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return []
    argv = [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off"]
    argv += ["-ex", "thread apply all bt 40"]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"{pid}: no native stacks ({type(exc).__name__})"]
    return summarize_native(done.stdout.splitlines(), pid, frames)


def summarize_native(lines: Iterable[str], pid: int, frames: int = 8) -> list[str]:
    """gdb's ``thread apply all bt``, one line per distinct stack (threads with the same
    stack counted together), interpreter and libc-internal (``__``) frames left out."""
    stacks: dict[str, list[str]] = {}  # "name/LWP" -> its frames, in gdb's order
    current: list[str] | None = None
    for line in lines:
        if head := _GDB_THREAD.match(line):
            current = stacks[f"{head.group(2)}/{head.group(1)}"] = []
        elif current is not None and (frame := _GDB_FRAME.match(line.strip())):
            # A C++ frame carries its signature: the name says enough.
            func, where = frame.group(1).split("(")[0], frame.group(2) or ""
            if func == "??" or _INTERPRETER_FRAME.match(func):
                continue
            lib = Path(where).name.split(".so")[0] if ".so" in where else ""
            current.append(f"{func}[{lib}]" if lib else func)
    grouped: dict[str, list[str]] = {}
    for name, frames_of in stacks.items():
        shown = " < ".join(frames_of[:frames])
        grouped.setdefault(shown or "(no native frames)", []).append(name)
    return [
        f"{pid} {threads[0]}"
        + (f" (+{len(threads) - 1} alike)" if len(threads) > 1 else "")
        + f": {shown}"
        for shown, threads in grouped.items()
    ]
