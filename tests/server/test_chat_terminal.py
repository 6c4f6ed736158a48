"""`quiver chat` on a terminal (a pseudo-terminal here): the line is edited in place (arrow
keys move the cursor instead of reaching the model as `^[[D`), and turns go to the history
file under $QUIVER_HOME. (In the tests/server folder for its pytest run; it starts no server.)"""

import os
import pty
import select
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import model_path, quiver_exe


def read_until(fd, needle, timeout=60):
    buf = b""
    end = time.time() + timeout
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            if needle in buf:
                return buf
    raise AssertionError(f"{needle!r} not seen in {buf[-500:]!r}")


def test_chat_edits_the_line_and_keeps_history():
    home = tempfile.mkdtemp()
    master, slave = pty.openpty()
    env = dict(os.environ, QUIVER_HOME=home)
    p = subprocess.Popen(
        [str(quiver_exe()), "chat", "-m", str(model_path()), "-n", "4", "--temp", "0", "-t", "2"],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
    )
    os.close(slave)
    try:
        read_until(master, b"> ")
        # "Hxllo": two steps left, fix the x, then End and a word more.
        os.write(master, b"Hxllo\x1b[D\x1b[D\x1b[D\x7fe\x1b[F there\r")
        read_until(master, b"> ")
        os.write(master, b"/exit\r")
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    hist = (Path(home) / "chat_history").read_text()
    assert "Hello there" in hist and "\x1b" not in hist and "Hxllo" not in hist, repr(hist)
