"""Sandboxed tools for multi-turn environments: a calculator and a Python executor.

Every tool returns text for the policy to read and never raises: a failure is an error
observation that names what went wrong (`error: <kind>: <detail>`, kinds in `ERROR_KINDS`),
so a tool that hangs, crashes, prints megabytes or gets malformed arguments costs its turn,
not the rollout or the run.

* `calculate(expression)`: arithmetic over integers and decimals (`+ - * / // % **`,
  parentheses, unary signs) by a whitelisting AST evaluator, in this process: no names, no
  calls, no attributes, bounded exponents, operand sizes and result size.
* `run_python(code)`: a fresh interpreter per call, the grader pool's kind of worker
  (`python -I`, no fork of the training process, killed with its parent), under
  `resource.setrlimit` limits (address space, CPU seconds, output file size), a wall-clock
  timeout that kills its whole process group, no network and no new processes (a seccomp filter:
  socket, fork / clone / exec, kill and ptrace fail in the kernel, for root too, while a clone that
  makes a thread of the same process is allowed; proxy variables unset and the Python functions
  blocked on top), an empty temporary working folder removed
  afterwards, and stdout + stderr cut to `max_output` characters. Nothing survives a call, so
  nothing leaks between rollouts. Where the kernel has no seccomp filter for the machine (not
  Linux, not x86-64 / arm64), only the Python-level blocks remain, which a determined program can
  get around (`_socket`, `ctypes`); `kernel_isolation()` says which holds on this machine.

>>> calculate("12 * (3 + 4)")
'84'
>>> calculate("2 ** 100000")
'error: bad_arguments: exponent 100000 is above 64'
>>> calculate("__import__('os')")
'error: bad_arguments: unsupported expression: Call'
"""

from __future__ import annotations

import ast
import dataclasses
import decimal
import functools
import operator
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: The error observations a tool can return (`error: <kind>: ...`).
ERROR_KINDS = ("bad_arguments", "timeout", "crash", "output_too_large", "memory", "error")

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 60


def error(kind: str, detail: str) -> str:
  """The error observation of a tool (`kind` one of `ERROR_KINDS`).

  >>> error("timeout", "no output within 1.0 s")
  'error: timeout: no output within 1.0 s'
  """
  assert kind in ERROR_KINDS, kind
  return f"error: {kind}: {detail}"


def is_error(observation: str) -> bool:
  """Whether a tool's observation is an error observation."""
  return observation.startswith("error: ")


# ------------------------------------------------------------------------------------------------
# Calculator
# ------------------------------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Bad(ValueError):
  pass


def _check_size(x):
  if isinstance(x, int) and len(str(abs(x))) > MAX_DIGITS:
    raise _Bad(f"a value has more than {MAX_DIGITS} digits")
  if isinstance(x, decimal.Decimal) and not x.is_finite():
    raise _Bad("the result is not finite")
  return x


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _check_size(node.value if isinstance(node.value, int) else decimal.Decimal(repr(node.value)))
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
    return _UNOPS[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    a, b = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow):
      if abs(b) > MAX_EXPONENT:
        raise _Bad(f"exponent {b} is above {MAX_EXPONENT}")
      if b != int(b):
        raise _Bad("only whole exponents are supported")
      b = int(b)
      if b < 0 and isinstance(a, int):
        a = decimal.Decimal(a)
    if isinstance(node.op, ast.Div):
      a, b = decimal.Decimal(a), decimal.Decimal(b)
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
      raise _Bad("division by zero")
    if isinstance(a, decimal.Decimal) != isinstance(b, decimal.Decimal):
      a, b = decimal.Decimal(a), decimal.Decimal(b)
    return _check_size(_BINOPS[type(node.op)](a, b))
  raise _Bad(f"unsupported expression: {type(node).__name__}")


def _format(x) -> str:
  if isinstance(x, decimal.Decimal):
    if x == x.to_integral_value():
      return str(int(x))
    return format(x.normalize(), "f")
  return str(x)


# "x" / "×" written for multiplication: only between two operands (a number or a parenthesis).
_TIMES = re.compile(r"(?<=[\d.)])\s*[x×]\s*(?=[\d.(])")


def calculate(expression: str) -> str:
  """The value of an arithmetic expression as text, or an error observation (never raises).

  `^` is read as `**`, and `x` or `×` between two operands as `*`.

  >>> calculate("7 / 2"), calculate("-3 + 10 // 4"), calculate("1/0")
  ('3.5', '-1', 'error: bad_arguments: division by zero')
  >>> calculate("12 x 7"), calculate("(2)×3"), calculate("exp(2)")
  ('84', '6', 'error: bad_arguments: unsupported expression: Call')
  """
  text = str(expression).strip()
  if not text:
    return error("bad_arguments", "empty expression")
  if len(text) > MAX_EXPRESSION_CHARS:
    return error("bad_arguments", f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  try:
    tree = ast.parse(_TIMES.sub("*", text.replace("^", "**")), mode="eval")
  except (SyntaxError, ValueError) as e:
    return error("bad_arguments", f"not an expression ({type(e).__name__})")
  try:
    with decimal.localcontext() as ctx:
      ctx.prec = MAX_DIGITS
      ctx.traps[decimal.Overflow] = True
      return _format(_eval(tree))
  except _Bad as e:
    return error("bad_arguments", str(e))
  except (ArithmeticError, ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:
    return error("bad_arguments", f"{type(e).__name__}")


# ------------------------------------------------------------------------------------------------
# Python executor
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one `run_python` call.

  Attributes:
    timeout_s: wall-clock seconds before the process group is killed.
    cpu_s: CPU seconds (RLIMIT_CPU).
    memory_mb: address space in MiB (RLIMIT_AS).
    max_output: characters of stdout + stderr returned (the file the child writes is capped
      at a few times this by RLIMIT_FSIZE, so a flood of output stops the child).
  """
  timeout_s: float = 5.0
  cpu_s: int = 5
  memory_mb: int = 512
  max_output: int = 2000


# Runs in the child before the user's code: its limits (argv: address-space MiB, CPU seconds, output
# bytes), killed with its parent, bounded recursion, and no network and no new processes, enforced by
# the kernel where it can be (Linux on x86-64 or arm64): a seccomp filter makes socket, fork / clone /
# exec, kill and ptrace fail with EPERM (other system-call ABIs get nothing), under no_new_privs;
# threads still start. It binds root too (RLIMIT_NPROC does not: the kernel exempts uid 0) and leaves
# files alone, so an interpreter installed under /root still imports its modules. Python-level blocks
# come on top (and are all there is where the kernel refuses). Set here, in the fresh interpreter,
# rather than in a `preexec_fn` (which would fork the multithreaded training process).
_BOOTSTRAP = r"""
import os, platform, resource, sys
_mem, _cpu, _out = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (_mem * 2**20, _mem * 2**20))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_out, _out))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# (audit arch, clone, clone3, system calls refused: socket, fork, vfork, execve, execveat, kill, tkill, tgkill,
# ptrace, process_vm_readv / writev). clone is allowed only for a thread (CLONE_THREAD set: the same
# process, its limits and its process group); clone3 passes its flags in memory a filter cannot read,
# so it gets ENOSYS and the C library falls back to clone for threads.
_SECCOMP = {"x86_64": (0xC000003E, 56, 435, (41, 57, 58, 59, 322, 62, 200, 234, 101, 310, 311)),
            "aarch64": (0xC00000B7, 220, 435, (198, 221, 281, 129, 130, 131, 117, 270, 271))}
def _isolate():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL: die with the parent
    arch, clone, clone3, refused = _SECCOMP[platform.machine()]
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, DENY, NOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38   # SECCOMP_RET_ALLOW, _ERRNO | EPERM, ENOSYS
    # (code, k, jump if true, jump if false), a label first where a jump lands: another ABI or an x32
    # number gets nothing, clone3 ENOSYS, clone only with CLONE_THREAD in args[0] (low word, offset 16).
    prog = [(LD, 4), (JEQ, arch, "nr", "deny"), ("nr", LD, 0), (JGE, 0x40000000, "deny"), (JEQ, clone3, "nosys"),
            (JEQ, clone, "clone")] + [(JEQ, nr, "deny") for nr in refused] + [
            (RET, ALLOW), ("clone", LD, 16), (JSET, 0x00010000, "allow", "deny"), ("allow", RET, ALLOW),
            ("nosys", RET, NOSYS), ("deny", RET, DENY)]   # (classic BPF jumps only forward)
    labels = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}
    prog = [ins[1:] if isinstance(ins[0], str) else ins for ins in prog]
    jump = lambda i, to: labels[to] - i - 1 if to else 0
    insn = lambda i, op, k, jt=None, jf=None: Insn(op, jump(i, jt), jump(i, jf), k)
    table = (Insn * len(prog))(*(insn(i, *ins) for i, ins in enumerate(prog)))
    if libc.prctl(38, 1, 0, 0, 0) == 0:   # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        libc.prctl(22, 2, ctypes.byref(Prog(len(prog), table)), 0, 0)
try:
    _isolate()
except Exception:
    pass
del _isolate, _SECCOMP
import socket
def _no_network(*a, **k):
    raise OSError("network access is disabled in the sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
socket.getaddrinfo = _no_network
import os, subprocess
def _no_processes(*a, **k):
    raise OSError("starting processes is disabled in the sandbox")
for _name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp", "execvp",
              "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "posix_spawn", "posix_spawnp", "kill", "killpg"):
    if hasattr(os, _name):
        setattr(os, _name, _no_processes)
subprocess.Popen = _no_processes
sys.setrecursionlimit(2000)
code = sys.stdin.read()
del socket, subprocess, resource, os, platform
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""

_SANDBOX_ENV_DROP = ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy", "no_proxy", "HTTP_PROXY",
                     "HTTPS_PROXY", "FTP_PROXY", "ALL_PROXY", "NO_PROXY", "PYTHONPATH", "PYTHONSTARTUP")


def _file_cap(limits: SandboxLimits) -> int:
  return max(4 * int(limits.max_output), 65536)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
  """Runs `code` in a fresh sandboxed interpreter; returns its output (cut) or an error observation.

  Never raises. The observation is the program's stdout and stderr (cut to
  `limits.max_output` characters with a note); `error: timeout: ...` when it ran past
  `timeout_s` or its CPU seconds, `error: crash: ...` when it died by a signal or exited
  non-zero (the last lines of its traceback follow), `error: memory: ...` for a MemoryError,
  `error: output_too_large: ...` when it wrote past the output file's cap.

  >>> run_python("print(6 * 7)")
  '42\\n'
  """
  if not isinstance(code, str):
    return error("bad_arguments", f"code must be text, got {type(code).__name__}")
  if len(code) > 20000:
    return error("bad_arguments", "code longer than 20000 characters")
  try:
    compile(code, "<tool>", "exec")   # compiled, never run, here: a syntax error costs no process
  except (SyntaxError, ValueError) as e:
    return error("bad_arguments", f"not valid Python ({type(e).__name__}: {getattr(e, 'msg', e)})")
  work = tempfile.mkdtemp(prefix="rollouts_tool_")
  out_path = os.path.join(work, "out.txt")
  env = {k: v for k, v in os.environ.items() if k not in _SANDBOX_ENV_DROP}
  env.update(HOME=work, TMPDIR=work, PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
  try:
    with open(out_path, "wb") as out:
      argv = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(int(limits.memory_mb)), str(int(limits.cpu_s)),
              str(_file_cap(limits))]
      proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env,
                              start_new_session=True, close_fds=True)
      timed_out = False
      t0 = time.monotonic()
      try:
        proc.stdin.write(code.encode("utf-8", "replace"))
        proc.stdin.close()
      except (BrokenPipeError, OSError):
        pass
      try:
        proc.wait(timeout=max(limits.timeout_s - (time.monotonic() - t0), 0.01))
      except subprocess.TimeoutExpired:
        timed_out = True
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          proc.kill()
        proc.wait()
    size = os.path.getsize(out_path)
    with open(out_path, "rb") as f:
      text = f.read(limits.max_output * 4 + 4).decode("utf-8", "replace")
    code_ = proc.returncode
    if timed_out or code_ in (-signal.SIGXCPU, -signal.SIGKILL) and not size >= _file_cap(limits):
      return error("timeout", f"no result within {limits.timeout_s:g} s")
    if code_ == -signal.SIGXFSZ or size >= _file_cap(limits):
      return error("output_too_large", f"the program wrote more than {_file_cap(limits)} bytes; "
                   f"first lines: {_cut(text, 200)}")
    if code_ != 0:
      if "MemoryError" in text:
        return error("memory", f"the program ran out of its {limits.memory_mb} MiB")
      if code_ < 0:
        return error("crash", f"killed by signal {-code_}")
      return error("crash", f"exit status {code_}: {_cut(text.strip().splitlines()[-1] if text.strip() else '', 300)}")
    return _cut(text, limits.max_output)
  except OSError as e:   # could not start the interpreter (no memory, no processes left)
    return error("error", f"the sandbox could not run the code ({type(e).__name__})")
  finally:
    shutil.rmtree(work, ignore_errors=True)


_PROBE = """
import ctypes, _socket
libc = ctypes.CDLL(None)
pid = libc.fork()
if pid == 0:
    libc._exit(0)
try:
    _socket.socket().close()
    net = False
except OSError:
    net = True
print(net, pid < 0)
"""


@functools.lru_cache(maxsize=None)
def kernel_isolation() -> dict[str, bool]:
  """What the kernel enforces for `run_python` on this machine (probed once, by a sandboxed call that
  opens a socket through `_socket` and forks through `ctypes`, around the Python-level blocks).

  Returns:
    {"network": a raw socket is refused, "processes": a raw fork is refused}. Where either is False,
    only the Python-level block stands for it.
  """
  out = run_python(_PROBE, SandboxLimits(timeout_s=10.0, cpu_s=5)).split()
  if len(out) != 2:
    return {"network": False, "processes": False}
  return {"network": out[0] == "True", "processes": out[1] == "True"}


def _cut(text: str, limit: int) -> str:
  """`text` cut to `limit` characters with a note of how much was dropped."""
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n... [{len(text) - limit} more characters cut]"
