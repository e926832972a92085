"""Pinning an actor's threads to its cores while other threads start threads."""

import json
import os
import subprocess
import sys

import pytest

# Each trial unpins every thread, starts a thread that keeps starting short-lived
# threads, pins the process to one core and counts the threads left outside it,
# reading every thread's mask itself rather than through the module's helper.
TRIALS = """
import json, os, threading, time
from popmeta.actors.actor import pin_process_to_cores

def thread_ids():
    return [int(tid) for tid in os.listdir("/proc/self/task")]

def outside(cores):
    count = 0
    for tid in thread_ids():
        try:
            count += not os.sched_getaffinity(tid) <= cores
        except OSError:  # the thread exited meanwhile
            pass
    return count

every_core = sorted(os.sched_getaffinity(0))
left_outside = []
for trial in range(40):
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, every_core)
        except OSError:
            pass
    stop = threading.Event()

    def spawn():
        while not stop.is_set():
            threading.Thread(target=time.sleep, args=(0.02,)).start()

    spawner = threading.Thread(target=spawn)
    spawner.start()
    time.sleep(0.002)
    cores = pin_process_to_cores([trial])
    left_outside.append(outside(set(cores)))
    stop.set()
    spawner.join()
print(json.dumps(left_outside))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_threads_started_while_the_process_is_pinned_end_up_on_its_cores():
    done = subprocess.run(
        [sys.executable, "-c", TRIALS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    left_outside = json.loads(done.stdout)
    assert len(left_outside) == 40 and not any(left_outside), left_outside
