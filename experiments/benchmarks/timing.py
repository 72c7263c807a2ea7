"""The benchmarks' one timing helper: sides alternated in one process, medians, a load check.

A timing counts the cores other processes used meanwhile (from /proc), so a number taken on a
busy machine is marked BUSY instead of being reported as ours.

>>> t = alternate({"a": lambda: 1, "b": lambda: 2}, 2, warmup=1)
>>> sorted(t.times), len(t.times["a"]), t.last["b"]
(['a', 'b'], 2, 2)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from typing import Any, Callable


def proc_times() -> tuple[int, int]:
  """(jiffies all CPUs spent busy, jiffies this process spent) from /proc."""
  with open("/proc/stat") as f:
    cpu = [int(x) for x in f.readline().split()[1:]]
  busy = sum(cpu) - cpu[3] - (cpu[4] if len(cpu) > 4 else 0)  # minus idle and iowait
  with open("/proc/self/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return busy, int(fields[11]) + int(fields[12])  # utime + stime, all threads


def other_cores(before: tuple[int, int], after: tuple[int, int], wall: float) -> float:
  """Cores other processes used on average between two `proc_times()` readings `wall` seconds apart."""
  others = max((after[0] - before[0]) - (after[1] - before[1]), 0)
  return others / os.sysconf("SC_CLK_TCK") / max(wall, 1e-9)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
  """Runs fn(); returns (wall seconds, cores other processes used on average meanwhile)."""
  before = proc_times()
  t0 = time.perf_counter()
  fn()
  wall = time.perf_counter() - t0
  return wall, other_cores(before, proc_times(), wall)


def first_call(fn: Callable[..., Any], *args, block: Callable[[Any], Any] = lambda x: x) -> tuple[Any, float]:
  """(output, seconds) of one call (the first: compilation + one run), `block` applied to the output."""
  t0 = time.perf_counter()
  out = block(fn(*args))
  return out, time.perf_counter() - t0


@dataclasses.dataclass
class Timings:
  """Per side: the timed seconds, the last result and BUSY notes (timings during others' CPU use)."""
  times: dict[str, list[float]]
  last: dict[str, Any]
  busy: dict[str, list[str]]

  def median(self, name: str) -> float:
    return statistics.median(self.times[name])

  @property
  def notes(self) -> list[str]:
    """Every BUSY note, side by side."""
    return [n for name in self.busy for n in self.busy[name]]


def alternate(sides: dict[str, Callable[[], Any]], repeats: int, *, warmup: int = 0,
              max_other_cores: float = float("inf"), label: str = "",
              block: Callable[[Any], Any] = lambda x: x, abba: bool = False) -> Timings:
  """Times the zero-argument callables in turn (a, b, a, b, ...), `repeats` rounds, in this process.

  Args:
    sides: {name: fn}; fn's result (after `block`, e.g. `jax.block_until_ready`) is kept as `last`.
    repeats: timed calls per side.
    warmup: untimed calls per side first (compilation), in the same order.
    max_other_cores: a timing during which other processes used more cores is noted as BUSY.
    label: prefix of the BUSY notes (e.g. the shape).
    block: applied to each result inside the timing.
    abba: reverse the order every other round (a, b, b, a, ...).

  Returns:
    `Timings` (use `.median(name)`).
  """
  last = {}
  for _ in range(warmup):
    for name, fn in sides.items():
      last[name] = block(fn())
  times = {name: [] for name in sides}
  busy = {name: [] for name in sides}
  for i in range(repeats):
    order = list(sides.items())
    for name, fn in (order[::-1] if abba and i % 2 else order):
      box = {}
      wall, others = timed(lambda fn=fn, box=box: box.setdefault("r", block(fn())))
      times[name].append(wall)
      last[name] = box["r"]
      if others > max_other_cores:
        busy[name].append(f"{label}{name}: {wall:.2f} s with {others:.2f} other cores")
  return Timings(times, last, busy)


def check_load(max_load: float, allow_busy: bool = False) -> float:
  """The 1-minute load average; exits when it is above `max_load` (unless `allow_busy`)."""
  load1 = os.getloadavg()[0]
  if load1 > max_load and not allow_busy:
    raise SystemExit(f"1-minute load average {load1:.2f} > {max_load}: other processes are using the CPU "
                     "and would skew the comparison. Wait, or pass --allow_busy.")
  return load1


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
  """float32 FLOP/s of a jitted square `jnp.dot` (median of `repeats` after a warm-up): this machine's
  speed, recorded beside a benchmark's seconds so that runs on different days can be put side by side
  (the project's 2-core CPU machine has measured from 151 to 453 GFLOP/s on different days)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
  mm = jax.jit(jnp.dot)
  jax.block_until_ready(mm(a, b))
  secs = statistics.median(timed(lambda: jax.block_until_ready(mm(a, b)))[0] for _ in range(repeats))
  return 2 * size ** 3 / secs


def rss_bytes() -> int:
  """This process's resident set now."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(fn: Callable[[], Any]) -> int:
  """Peak resident-set growth (bytes) over a call of fn(), sampled every 2 ms."""
  base, peak, stop = rss_bytes(), [0], threading.Event()

  def watch():
    while not stop.is_set():
      peak[0] = max(peak[0], rss_bytes())
      time.sleep(0.002)

  t = threading.Thread(target=watch, daemon=True)
  t.start()
  try:
    fn()
  finally:
    stop.set()
    t.join()
  return max(peak[0], rss_bytes()) - base


_FLAGS = {
    "repeats": ("DEFINE_integer", 3, "Timed calls per side (medians are reported)."),
    "quick": ("DEFINE_bool", False, "Fewer shapes, one repetition: a smoke run."),
    "allow_busy": ("DEFINE_bool", False, "Run and report even when other processes use the CPU."),
    "max_load": ("DEFINE_float", 1.0, "Refuse to start above this 1-minute load average."),
    "max_other_cores": ("DEFINE_float", 0.3, "Mark a timing BUSY when others used more cores than this."),
}


def define_flags(json_default: str, names=tuple(_FLAGS)) -> None:
  """The absl flags the side-by-side benchmarks share, plus --json; each defined once per process.

  A benchmark that imports another (bench_rollout_reuse runs bench_april) gets no duplicate.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  for name in names:
    if name not in flags.FLAGS:
      define, default, help_text = _FLAGS[name]
      getattr(flags, define)(name, default, help_text)
  if "json" not in flags.FLAGS:
    flags.DEFINE_string("json", json_default, "Where to write the results ('' for none).")
