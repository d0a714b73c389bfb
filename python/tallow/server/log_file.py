"""`tallow serve --log` / `--log-file PATH`: everything the server writes to stderr also goes to a file, as
candle-vllm's --log does. The engine core and extra API servers are processes of their own that log to the
stderr they inherit, so the copy is made at the file-descriptor level: fd 2 becomes a pipe (inherited by
every process started afterwards) and a thread copies what arrives to the terminal and to the file."""
from __future__ import annotations

import os
import sys
import threading


class StderrTee:
    def __init__(self, path: str):
        self.file = open(path, "wb")  # replaced at each start; OSError for the caller's one line
        sys.stderr.flush()
        self.saved = os.dup(2)  # the real stderr
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self.thread = threading.Thread(target=self._copy, name="tallow-log-file", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                break
            if not chunk:  # every writer (this process's fd 2 and its children's) is gone
                break
            rest = chunk
            try:
                while rest:
                    rest = rest[os.write(self.saved, rest):]
            except OSError:  # the terminal went away: keep writing the file
                pass
            self.file.write(chunk)
            self.file.flush()
        os.close(self._read)

    def close(self, timeout: float = 5.0) -> None:
        """Give fd 2 back and wait for the copy to drain (a child still alive keeps its end open: then the
        thread goes on copying until that child ends)."""
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            os.close(self.saved)
            self.file.close()
