"""Ctrl-C that stops a run cleanly, never in the middle of JAX, XLA or orbax.

Python runs a SIGINT handler only between bytecodes of the main thread, but those may be
inside JAX's own Python code, or inside a Python callback that XLA's C++ compiler called:
a `KeyboardInterrupt` raised there unwinds through C++ frames, and the interpreter may
then exit while compiler threads still run, which is how Ctrl-C during compilation could
crash the process. :func:`install` replaces the default handler:

* first Ctrl-C: one line on stderr; if the main thread is in our own code (the loop, the
  grader pool's wait, data loading) `KeyboardInterrupt` is raised there at once; if it is
  inside `jax`, `jaxlib`, `orbax`, `tensorstore`, `flax`, `optax` or TFDS code, the interrupt
  is deferred and re-checked every 0.2 s until the main thread is back in our code (a
  compilation finishes, a checkpoint save completes);
* second Ctrl-C: one line, then the process exits with status 130 at once (`os._exit`, from a
  watcher thread, so it works even while the main thread is busy in C++; it skips
  interpreter teardown, which is what crashed).

>>> import signal
>>> previous = install()
>>> signal.getsignal(signal.SIGINT) is _handler
True
>>> uninstall(previous)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

#: Module prefixes of code that must not be unwound by KeyboardInterrupt.
UNSAFE_MODULES = ("jax", "jaxlib", "orbax", "tensorstore", "flax", "optax", "chex", "tensorflow_datasets",
                  "array_record", "etils", "ml_dtypes")

_lock = threading.Lock()
_state = {"presses": 0, "pokes": 0, "pending": False, "wake_r": None, "wake_w": None, "watcher": None,
          "poker": None, "message": "Interrupted (Ctrl-C): stopping at the next safe point; press Ctrl-C "
                                    "again to exit at once."}


def _in_unsafe_code(frame) -> bool:
  while frame is not None:
    name = frame.f_globals.get("__name__", "") or ""
    if name.split(".", 1)[0] in UNSAFE_MODULES:
      return True
    frame = frame.f_back
  return False


def _say(text: str) -> None:
  try:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
  except Exception:  # pylint: disable=broad-except
    pass


def _watch(fd: int) -> None:
  """Counts real SIGINTs as the C-level handler reports them (works while the main thread is in C++)."""
  while True:
    try:
      data = os.read(fd, 64)
    except OSError:
      return
    if not data:
      return
    for b in data:
      if b != signal.SIGINT:
        continue
      with _lock:
        if _state["pokes"] > 0:
          _state["pokes"] -= 1
          continue
        _state["presses"] += 1
        presses = _state["presses"]
      if presses == 1:
        _say(_state["message"])
      elif presses >= 2:
        _say("Interrupted again (Ctrl-C): exiting now; the run resumes from its latest checkpoint.")
        os._exit(130)


def _poke_until_handled() -> None:
  """Re-delivers SIGINT while an interrupt is deferred, so the handler re-checks where we are."""
  while True:
    time.sleep(0.2)
    with _lock:
      if not _state["pending"]:
        _state["poker"] = None
        return
      _state["pokes"] += 1
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _handler(signum, frame):
  with _lock:
    if _state["presses"] == 0 and _state["wake_r"] is None:
      _state["presses"] = 1  # no watcher (install without a wakeup fd): count here
      _say(_state["message"])
  if not _in_unsafe_code(frame):
    with _lock:
      _state["pending"] = False
    raise KeyboardInterrupt
  with _lock:
    _state["pending"] = True
    if _state["poker"] is None:
      _state["poker"] = threading.Thread(target=_poke_until_handled, name="sigint-poker", daemon=True)
      _state["poker"].start()


def install(message: str | None = None):
  """Installs the handler (main thread only). Returns the previous handler for :func:`uninstall`.

  Args:
    message: the line printed on the first Ctrl-C.
  """
  if message:
    _state["message"] = message
  previous = signal.getsignal(signal.SIGINT)
  signal.signal(signal.SIGINT, _handler)
  if _state["wake_r"] is None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
      signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
      os.close(r)
      os.close(w)
    else:
      _state["wake_r"], _state["wake_w"] = r, w
      _state["watcher"] = threading.Thread(target=_watch, args=(r,), name="sigint-watcher", daemon=True)
      _state["watcher"].start()
  with _lock:
    _state["presses"] = 0
    _state["pending"] = False
  return previous


def uninstall(previous=signal.default_int_handler) -> None:
  """Restores `previous` as the SIGINT handler and stops counting presses."""
  signal.signal(signal.SIGINT, previous)
  if _state["wake_w"] is not None:
    signal.set_wakeup_fd(-1)
    os.close(_state["wake_w"])  # the watcher's read returns EOF
    _state["wake_w"] = _state["wake_r"] = None
  with _lock:
    _state["presses"] = 0
    _state["pending"] = False


def requested() -> bool:
  """True once Ctrl-C was pressed (for loops that prefer to poll at their own safe points)."""
  return _state["presses"] > 0 or _state["pending"]
