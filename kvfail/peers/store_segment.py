"""A Mooncake store segment owner in its own OS process.

Why a process: in a Mooncake store the blocks live in the memory segment some client
mounted, and a reader gets them from that client's TransferEngine. Killing the owner is
a real fault only if the owner is a real process (its sockets close, its memory is gone).
This one mounts a segment with the store client vLLM uses, prints ``segment <name>`` (the
name a writer gives as its preferred segment) and serves until it is signalled.

Run: ``python -m kvfail.peers.store_segment --size 32MB``; the store comes from
``$MOONCAKE_CONFIG_PATH`` (vLLM's Mooncake store configuration file), the host from
``$VLLM_HOST_IP``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["main"]


def _size(text: str) -> int:
    units = {"gb": 1024**3, "mb": 1024**2, "kb": 1024, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low.removesuffix(unit)) * factor)
    return int(low)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="32MB", help="segment size (e.g. 32MB)")
    args = parser.parse_args(argv)
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    with open(os.environ["MOONCAKE_CONFIG_PATH"]) as f:
        config = json.load(f)
    host = os.environ.get("VLLM_HOST_IP", "127.0.0.1")
    size = _size(args.size)
    store = MooncakeDistributedStore()
    ret = store.setup(
        host,
        config["metadata_server"],
        size,
        size,
        config.get("protocol", "tcp"),
        config.get("device_name", ""),
        config["master_server_address"],
    )
    if ret != 0:
        print(f"store setup failed: {ret}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"segment {store.get_hostname()}", flush=True)
    try:
        while True:  # serve until signalled
            time.sleep(1.0)
    finally:
        store.close()


if __name__ == "__main__":
    main()
