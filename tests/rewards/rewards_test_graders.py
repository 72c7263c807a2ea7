"""Misbehaving graders for the process-pool tests (importable by the worker processes)."""
import os
import time


def length_or_hang(completion, reference):
    """len(completion), but sleeps forever on "hang", spins in C on "spin", exits on "crash"."""
    if completion == "hang":
        time.sleep(10**6)
    if completion == "spin":
        return float(sum(range(10**13)))  # one long C call: a SIGALRM handler cannot run
    if completion == "crash":
        os._exit(3)
    if completion == "raise":
        raise RuntimeError("grader bug")
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "not a number"
    return float(len(completion))
