"""A kernel interrupt (Kernel > Interrupt in JupyterLab) during `run.wait()` stops the run and
leaves no rank behind, in a real Jupyter kernel driven by jupyter_client."""

import ast
import os
import shutil
import tempfile
import time

from jupyter_client.manager import KernelManager

from test_process_safety import TINY, assert_all_gone

LAUNCH = f"""
import time
from distlab import RunConfig, launch
run = launch(RunConfig.from_dict({TINY.replace(steps=100_000, step_delay_s=0.01).to_dict()!r}))
while run.steps_done() < 1 and not run.done:
    time.sleep(0.05)
print(run.pids)
"""


def _execute(kc, code, timeout=120, **kwargs):
    """Run code in the kernel; return (reply content, stdout text)."""
    msg_id = kc.execute(code, **kwargs)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return _reply_to(kc, msg_id, timeout), "".join(out)


def _reply_to(kc, msg_id, timeout):
    """The shell reply to msg_id, skipping any other: under load start_new_kernel can send
    kernel_info more than once, and its extra replies wait in the shell queue (seen in CI,
    where the interrupt's check read the launch cell's reply instead of its own)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def _start_kernel(folder):
    """jupyter_client's start_new_kernel, on Unix sockets in `folder`: not TCP ports, which a
    rank's gloo socket can take between jupyter_client finding them free and the kernel
    binding them (conftest.py says the same for nbval's kernels)."""
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, "k"))
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def test_kernel_interrupt_during_wait_stops_the_run():
    folder = tempfile.mkdtemp(prefix="distlab-kernel-")  # short: a socket path has 107 bytes
    km, kc = _start_kernel(folder)
    try:
        reply, out = _execute(kc, LAUNCH)
        assert reply["status"] == "ok", reply
        pids = ast.literal_eval(out.strip())
        assert len(pids) == 2
        wait_id = kc.execute("run.wait()")
        time.sleep(1.0)
        km.interrupt_kernel()
        reply = _reply_to(kc, wait_id, timeout=60)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        assert_all_gone(pids)
        # read back as a user expression, in the reply itself: a print's stream message can
        # reach iopub after the kernel reports idle when the machine is loaded (seen in CI)
        # ipykernel sends the error reply first and only then opens its abort window (its
        # "stop aborting" marker goes through a callback), so a request sent at once can come
        # back "aborted", with no user_expressions: ask again until it runs
        for _ in range(20):
            reply, _ = _execute(kc, "", user_expressions={"status": "run.status"})
            if reply["status"] != "aborted":
                break
            time.sleep(0.5)
        status = reply.get("user_expressions", {}).get("status", {})
        assert status.get("data", {}).get("text/plain") == "'stopped'", reply
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        shutil.rmtree(folder, ignore_errors=True)
