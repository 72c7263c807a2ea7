"""The sandboxed tools: a named error observation for every fault, nothing leaked, no lost rollout."""

import os
import time

import pytest

from rollouts_jax.envs import tools

FAST = tools.SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, max_output=500)


@pytest.mark.parametrize("expr,want", [("12 * (3 + 4)", "84"), ("7 / 2", "3.5"), ("-3 + 10 // 4", "-1"),
                                       ("2 ** 10", "1024"), ("47x28", "1316"), ("0.1 + 0.2", "0.3")])
def test_calculator_values(expr, want):
  assert tools.calculate(expr) == want


@pytest.mark.parametrize("expr,kind", [("", "bad_arguments"), ("1 +", "bad_arguments"), ("1/0", "bad_arguments"),
                                       ("2 ** 100000", "bad_arguments"), ("9" * 70 + " * 2", "bad_arguments"),
                                       ("__import__('os').system('ls')", "bad_arguments"), ("a + 1", "bad_arguments"),
                                       ("(1).__class__", "bad_arguments"), ("1" * 300, "bad_arguments"),
                                       ("[1, 2]", "bad_arguments"), ("'a' * 3", "bad_arguments")])
def test_calculator_rejects_malformed_or_unsafe_arguments_with_a_named_error(expr, kind):
  out = tools.calculate(expr)
  assert out.startswith(f"error: {kind}: "), out


def test_python_tool_returns_the_output():
  assert tools.run_python("print(sum(range(10)))", FAST) == "45\n"


def test_a_hanging_tool_is_killed_at_its_timeout():
  t0 = time.monotonic()
  out = tools.run_python("while True: pass", tools.SandboxLimits(timeout_s=1.0, cpu_s=5))
  assert out == "error: timeout: no result within 1 s"
  assert time.monotonic() - t0 < 5
  assert tools.run_python("import time; time.sleep(60)", tools.SandboxLimits(timeout_s=0.5)).startswith("error: timeout")


def test_a_crashing_tool_is_a_crash_observation():
  assert tools.run_python("import ctypes; ctypes.string_at(0)", FAST) == "error: crash: killed by signal 11"
  assert tools.run_python("raise ValueError('boom')", FAST) == "error: crash: exit status 1: ValueError: boom"
  assert tools.run_python("import sys; sys.exit(3)", FAST).startswith("error: crash: exit status 3")


def test_huge_output_is_stopped_and_cut():
  out = tools.run_python("print('x' * 10**7)", FAST)
  assert out.startswith("error: output_too_large: ") and len(out) < 500
  cut = tools.run_python("print('y' * 3000)", FAST)        # under the file cap, over max_output: cut with a note
  assert cut.startswith("y" * 500) and "more characters cut" in cut and len(cut) < 600


def test_memory_network_and_processes_are_refused():
  assert tools.run_python("x = bytearray(2**30)", FAST) == "error: memory: the program ran out of its 256 MiB"
  net = tools.run_python("import socket; socket.create_connection(('10.0.0.1', 80), timeout=1)", FAST)
  assert net.startswith("error: crash") and "network access is disabled" in net
  sub = tools.run_python("import subprocess; subprocess.run(['true'])", FAST)
  assert "starting processes is disabled" in sub


def test_the_kernel_blocks_network_and_processes_that_get_around_the_python_blocks():
  """`_socket` and a `fork` through `ctypes` skip the Python-level blocks; on Linux x86-64 / arm64 the
  sandbox's seccomp filter refuses them in the kernel (root included), and ordinary programs still run."""
  import platform
  import socket
  import sys
  iso = tools.kernel_isolation()
  kernel = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
  assert iso == {"network": kernel, "processes": kernel}
  if not kernel:
    return   # only the Python-level blocks stand here (checked by the test above)
  with socket.socket() as listener:   # a server on this machine's loopback, which the sandbox must not reach
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    out = tools.run_python(f"import _socket\ns = _socket.socket()\ns.settimeout(2)\n"
                           f"s.connect(('127.0.0.1', {port}))\nprint('connected')", FAST)
    assert out.startswith("error: crash") and "PermissionError" in out, out
  out = tools.run_python("import ctypes\nlibc = ctypes.CDLL(None)\npid = libc.fork()\n"
                         "if pid == 0:\n    libc._exit(0)\nprint(pid)", FAST)
  assert out == "-1\n", out
  out = tools.run_python("import ctypes, os\nprint(ctypes.CDLL(None).kill(os.getppid(), 0))", FAST)
  assert out == "-1\n", out   # not even a signal to the training process
  # A raw clone of a new process (SIGCHLD, no CLONE_THREAD) and clone3 through syscall(): refused
  # (EPERM; ENOSYS for clone3, whose flags the filter cannot read), so no child process starts.
  clone, clone3 = {"x86_64": (56, 435), "aarch64": (220, 435)}[platform.machine()]
  out = tools.run_python(f"import ctypes, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                         f"pid = libc.syscall({clone}, int(signal.SIGCHLD), 0, 0, 0, 0)\n"
                         f"if pid == 0:\n    libc._exit(0)\nprint(pid, os.strerror(ctypes.get_errno()))\n"
                         f"print(libc.syscall({clone3}, 0, 0), os.strerror(ctypes.get_errno()))", FAST)
  assert out == "-1 Operation not permitted\n-1 Function not implemented\n", out
  # Threads of the tool's own process run (the C library's thread clone carries CLONE_THREAD).
  out = tools.run_python("import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
                         "with ThreadPoolExecutor(3) as ex:\n    print(sum(ex.map(lambda x: x * x, range(10))))\n"
                         "t = threading.Thread(target=print, args=('thread',))\nt.start(); t.join()", FAST)
  assert out == "285\nthread\n", out
  # Ordinary programs are unaffected: stdlib extension modules import, files in the working folder work.
  assert tools.run_python("import math, json\nopen('f', 'w').write('7')\nprint(math.isqrt(int(open('f').read()) ** 2))",
                          FAST) == "7\n"


def test_bad_arguments_and_no_leaks_between_calls(tmp_path):
  assert tools.run_python(None, FAST).startswith("error: bad_arguments")   # type: ignore[arg-type]
  # A call's files and environment die with it: the next call starts clean.
  tools.run_python("open('left_behind.txt', 'w').write('secret'); import os; os.environ['LEAK'] = '1'", FAST)
  assert tools.run_python("import os; print(os.listdir('.'), os.environ.get('LEAK'))", FAST) == "['out.txt'] None\n"
  assert not any(n.startswith("rollouts_tool_") for n in os.listdir(os.environ.get("TMPDIR", "/tmp"))
                 if os.path.exists(os.path.join(os.environ.get("TMPDIR", "/tmp"), n, "left_behind.txt")))


def test_syntax_errors_are_bad_arguments_without_a_process():
  assert tools.run_python("def (:", FAST).startswith("error: bad_arguments: not valid Python (SyntaxError")


def test_faulty_tool_calls_in_episodes_give_named_error_observations_and_lose_no_rollout():
  """Rows whose tool hangs, crashes, floods its output or gets malformed code: each row reads its named
  error as an observation, its episode goes on to a final turn, and every row is in the batch."""
  import jax
  import numpy as np
  from rollouts_jax import data, envs, models, sampling
  from rollouts_jax.envs import calculator
  from rollouts_jax.rollout import multiturn

  class FaultEnv(calculator.CalculatorEnv):
    def reset(self, example):
      return dict(super().reset(example), program=example["program"])

    def step(self, state, completion_text):   # the first turn calls the example's program
      if state["calls"] == 0:
        completion_text = f"<tool_call>{state['program']}</tool_call>"
      return super().step(state, completion_text)

  programs = {"timeout": "while True: pass", "crash": "import ctypes; ctypes.string_at(0)",
              "output_too_large": "print('x' * 10**7)", "bad_arguments": "def (:", "ok": "print(6 * 7)"}
  examples = [{"program": p, "answer": "42", "a": 6, "b": 7} for p in programs.values()]
  env = FaultEnv(tool="python", timeout_s=1.0, max_calls=1)
  tok = data.CharTokenizer.default()
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, eos_token_ids=(tok.eos_id,), pad_token_id=tok.pad_id)
  params = models.init_params(cfg, jax.random.key(0))
  conf = sampling.SamplingConfig(num_samples=2, max_new_tokens=512, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                 prompt_buckets=(32,))
  ids, mask = data.pad_left([tok.encode(env.prompt(ex)) for ex in examples], (32,), pad_id=tok.pad_id)
  t0 = time.monotonic()
  ep = multiturn.run_episodes(cfg, params, np.asarray(ids), np.asarray(mask), examples, env, tok, conf,
                              jax.random.key(0), envs.EnvSettings(name="calculator", max_turns=2, turn_tokens=4))
  assert time.monotonic() - t0 < 60
  batch = multiturn.to_batch(ep, len(examples), 2, prompt_index=np.arange(len(examples)), version=0)
  assert batch.completion_ids.shape[:2] == (5, 2) and np.asarray(batch.sample_mask).all()
  for r in range(10):
    kind = list(programs)[r // 2]
    obs = tok.decode(ep.obs_ids[r][0])
    assert obs.startswith("<tool_result>") and obs.endswith("</tool_result>")
    if kind == "ok":
      assert obs == "<tool_result>42\n</tool_result>"
    else:
      assert obs.startswith(f"<tool_result>error: {kind}: "), obs
    assert ep.turn_mask[r].tolist() == [True, True] and not env.used_tool(ep.states[r]) is False
