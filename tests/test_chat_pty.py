"""`numbat chat` driven through a pseudo-terminal, as a person would use it: real gemma3:270m,
greedy, a few turns, /help /stats /save, Ctrl-C during a reply, Ctrl-D to leave.

The key property: the history stays in the KV cache, so a turn runs only its new tokens. That
is checked against an independent count: the transcript saved with /save is rendered with the
model's own chat template and tokenizer, turn by turn.
"""
import codecs
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from models import catalog

ROOT = Path(__file__).resolve().parent.parent
GEMMA = "gemma3:270m"
PROMPT = ">>> "
FIRST_LOAD_S = 600    # a first run compiles the kernels; on a busy 2-core machine that is slow
TURN_S = 240
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[=>]")

pytestmark = pytest.mark.real


class Terminal:
    """A child process on a pseudo-terminal, with expect-style reads and timeouts."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "TERM": "xterm-256color"}
        env.setdefault("NUMBA_CACHE_DIR", str(catalog.home() / "numba-cache"))
        env.pop("COLUMNS", None)
        env.pop("LINES", None)
        pid, fd = pty.fork()
        if pid == 0:   # child: the pty is its controlling terminal, so ^C and ^D act as typed
            try:
                # as in a terminal: a run started in the background (`cmd &` without job
                # control) ignores SIGINT, the child would inherit that and ^C would do nothing
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.chdir(ROOT)
                os.execve(sys.executable, [sys.executable, "-m", "cli", *args], env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.raw = ""       # everything the terminal showed, \r\n -> \n, escape codes removed
        self.pos = 0        # how much of it the test has consumed
        self.status = None

    def _fill(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        r, _, _ = select.select([self.fd], [], [], min(left, 1.0))
        if not r:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:    # EIO: the child closed the terminal
            data = b""
        if not data:
            raise EOFError(f"the chat exited; it showed:\n{self.raw[self.pos:]}")
        self.raw = ANSI.sub("", (self.raw + self._dec.decode(data)).replace("\r\n", "\n"))
        return True

    def expect(self, pattern: str, timeout: float = TURN_S) -> str:
        """Wait for the regex ``pattern``; return what came before it and consume both."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.raw, self.pos)
            if m:
                before = self.raw[self.pos:m.start()]
                self.pos = m.end()
                return before
            if not self._fill(deadline):
                raise TimeoutError(f"no {pattern!r} within {timeout:.0f} s; the terminal showed:\n"
                                   f"{self.raw[self.pos:]}")

    def wait_for_output(self, timeout: float = TURN_S) -> None:
        """Wait until something not yet consumed appears (e.g. the first words of a reply)."""
        deadline = time.monotonic() + timeout
        while not self.raw[self.pos:].strip():
            if not self._fill(deadline):
                raise TimeoutError("no output")

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def line(self, text: str, timeout: float = TURN_S) -> str:
        """Type a line, wait for the next prompt; return what was printed in between."""
        self.send(text + "\r")
        self.expect(re.escape(text) + "\n", timeout)     # the terminal's echo
        return self.expect("\n?" + re.escape(PROMPT) + "$", timeout)

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
                return os.waitstatus_to_exitcode(status)
            try:   # drain, so the child never blocks on a full terminal buffer
                if select.select([self.fd], [], [], 0.2)[0]:
                    os.read(self.fd, 65536)
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("the chat did not exit")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def chat_factory():
    terms = []

    def start(*args: str) -> Terminal:
        t = Terminal(["chat", *args])
        terms.append(t)
        return t
    yield start
    for t in terms:
        t.close()


@pytest.fixture(scope="module")
def gemma():
    from gguf_io import open_gguf
    from runner.chat_template import ChatTemplate
    from runner.tokenizer import Tokenizer
    meta = open_gguf(catalog.fetch(GEMMA)).metadata
    return Tokenizer.from_metadata(meta), ChatTemplate.from_metadata(meta)


def parse_json(block: str) -> dict:
    """/stats prints one JSON object; a narrow terminal may wrap it, which JSON tolerates."""
    return json.loads(block.strip())


@pytest.mark.parametrize("backend", ["numba", "mlx"])
def test_chat_turns_run_only_their_new_tokens(chat_factory, gemma, tmp_path, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    tok, tmpl = gemma
    t = chat_factory(GEMMA, "--temp", "0", "-n", "16", "--backend", backend)
    banner = t.expect("\n?" + re.escape(PROMPT) + "$", FIRST_LOAD_S)
    assert f"{GEMMA} (gemma3, context 4096). /help for commands." in banner

    shown = t.line("/help")
    for cmd in ("/help", "/reset", "/system", "/stats", "/save", "/exit", "Ctrl-D", "Ctrl-C"):
        assert cmd in shown, shown

    assert "unknown command /frobnicate" in t.line("/frobnicate")

    # Ctrl-C at the prompt: a new prompt, no exit. (Wait first: a SIGINT that lands between
    # input() printing its prompt and blocking in read() is only seen after the next Enter,
    # in CPython itself; no person types that fast.)
    time.sleep(1.0)
    t.send("\x03")
    t.expect(re.escape(PROMPT) + "$")

    users = ["Hello! What is your name?", "What is the capital of France?", "Name three colors."]
    replies = [t.line(u) for u in users]

    stats = parse_json(t.line("/stats"))
    turns = stats["turns"]
    assert len(turns) == 3
    assert stats["context"]["n_ctx"] == 4096 and stats["context"]["dropped"] is False

    # Ctrl-C during a reply stops it; the chat goes on
    t.send("Count from one to fifty, one number per line.\r")
    t.expect(re.escape("Count from one to fifty, one number per line.") + "\n")
    t.wait_for_output()
    t.send("\x03")
    stopped = t.expect("\n?" + re.escape(PROMPT) + "$")
    assert "(stopped)" in stopped, stopped
    replies.append(stopped.replace("^C", "").replace(" (stopped)", "").rstrip("\n"))   # ^C: the tty's echo
    users.append("Count from one to fifty, one number per line.")
    replies.append(t.line("Thank you."))
    users.append("Thank you.")

    save = tmp_path / "chat.json"
    assert f"saved 10 messages to {save}" in t.line(f"/save {save}")
    final = parse_json(t.line("/stats"))
    assert final["turns"][:3] == turns

    t.send("\x04")                                  # Ctrl-D: leave with exit code 0
    assert t.wait() == 0

    saved = json.loads(save.read_text(encoding="utf-8"))
    msgs = saved["messages"]
    assert saved["model"] == GEMMA
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 5
    assert [m["content"] for m in msgs[::2]] == users
    for k, (shown_reply, m) in enumerate(zip(replies, msgs[1::2])):
        if k == 3:   # interrupted: what was shown is what was kept (at most a last token more)
            assert m["content"].startswith(shown_reply.rstrip())
        else:
            assert m["content"].rstrip("\n") == shown_reply.rstrip("\n"), k

    turns = final["turns"]
    assert len(turns) == 5
    assert turns[3].get("interrupted") is True and not turns[4].get("interrupted")
    assert 1 <= turns[3]["completion_tokens"] < 16

    # Independent count: render the saved transcript with the model's template, turn by turn.
    # After turn k the cache holds that turn's prompt and every sampled token but the last (the
    # last is sampled, never run), so turn k+1 must run exactly the rest.
    rendered = [tmpl.encode(tok, msgs[:2 * k + 1]) for k in range(5)]
    assert turns[0]["prompt_tokens"] == len(rendered[0])
    for k in range(1, 5):
        prev, cur = rendered[k - 1], rendered[k]
        assert cur[:len(prev)] == prev                         # the history renders the same
        cached = len(prev) + turns[k - 1]["completion_tokens"] - 1
        assert turns[k]["prompt_tokens"] == len(cur) - cached, (k, turns[k], len(cur), cached)
        assert turns[k]["prompt_tokens"] < len(cur) / 2         # much less than the whole conversation
        # the new user turn's own template tokens are all in it
        user_only = len(tmpl.encode(tok, [msgs[2 * k]])) - int(tok.add_bos)
        assert turns[k]["prompt_tokens"] >= user_only
    assert final["context"]["used"] == len(rendered[4]) + turns[4]["completion_tokens"] - 1


def test_chat_message_longer_than_context_keeps_the_chat(chat_factory):
    t = chat_factory(GEMMA, "--temp", "0", "-n", "4", "-c", "32")
    t.expect("\n?" + re.escape(PROMPT) + "$", FIRST_LOAD_S)
    long = " ".join(["This message is far too long for a context of thirty-two tokens."] * 4)
    shown = t.line(long)
    assert "error" in shown.lower() and "-c/--ctx" in shown, shown
    reply = t.line("Hi")                     # the chat goes on, and the long message is not in it
    assert "error" not in reply.lower()
    t.send("\x04")
    assert t.wait() == 0
