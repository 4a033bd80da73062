"""`python -m tests.support.forked_child MODE [ARG]`: what tests/test_forkserver.py starts through the fork server.

It prints, as one JSON line, what a process started with `python -m` would see, then ends as MODE says."""
from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    mode = sys.argv[1]
    seen = {"argv": sys.argv, "cwd": os.getcwd(), "setting": os.environ.get("GLMIMAGE_FORKED"), "pid": os.getpid(),
            "name": __name__, "torch": "torch" in sys.modules, "runtime": "runtime" in sys.modules,
            "stdin": sys.stdin.read()}
    print(json.dumps(seen), flush=True)
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "message":
        sys.exit("a message for stderr")
    if mode == "raise":
        raise RuntimeError("an error nobody caught")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "read":  # what the fd numbered ARG (passed to it, as subprocess's pass_fds would) holds
        print(json.dumps({"read": os.read(int(sys.argv[2]), 1024).decode()}), flush=True)
    if mode == "wait":  # until a signal ends it; SIGTERM by its default action unless ARG is "handle"
        if sys.argv[2:] == ["handle"]:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
        while True:
            signal.pause()


if __name__ == "__main__":
    main()
