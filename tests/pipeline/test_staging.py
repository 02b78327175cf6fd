"""Lock-owned staging folders (``pipeline/core/staging.py``): removed by others only when their owner
is gone (its lock is free), whichever host or PID namespace it ran in, and, with a maximum age, only
once nobody wrote them for that long; lock paths never follow a link."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.core.staging import is_owned, key_lock, lock_path, owned_folder, remove_abandoned, unique_name

REPO = Path(__file__).resolve().parents[2]
FOREIGN_PID = 4_194_305  # above Linux's largest pid_max: never a process of this host

# A process that owns ``argv[1]`` (a staging folder), writes a file in it, says "ready <pid>"
# and holds it until its stdin closes or it is killed.
OWNER = """
import os, sys
from pathlib import Path
from pipeline.core.staging import owned_folder
with owned_folder(Path(sys.argv[1])) as folder:
    (folder / "work.bin").write_bytes(b"half")
    print("ready", os.getpid(), flush=True)
    sys.stdin.read()
"""


def pid_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "true"],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


NEEDS_PID_NAMESPACE = pytest.mark.skipif(
    not pid_namespaces_work(), reason="unshare --pid needs root (CAP_SYS_ADMIN) here"
)


@contextlib.contextmanager
def owner_process(folder: Path, new_pid_namespace: bool = False) -> Iterator[subprocess.Popen[str]]:
    """Run :data:`OWNER` on ``folder`` (in a new PID namespace: another container, as far as PIDs
    go); yields once it holds the folder; ends it (stdin closed) unless the test killed it."""
    prefix = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"] if new_pid_namespace else []
    process = subprocess.Popen(
        [*prefix, sys.executable, "-c", OWNER, str(folder)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("ready"), f"owner did not start: {line!r}"
        if new_pid_namespace:
            assert int(line.split()[1]) <= 2  # its own PID namespace: pid 1 there
        yield process
    finally:
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def kill_owner(process: subprocess.Popen[str], folder: Path) -> None:
    """SIGKILL the owner and wait until the kernel has released its lock (an owner in a PID
    namespace dies a moment after ``unshare``, through its parent-death signal)."""
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while is_owned(folder):
        assert time.monotonic() < deadline, f"{folder}'s owner still holds its lock after SIGKILL"
        time.sleep(0.05)


def test_owned_folder_is_removed_with_its_lock_on_error_and_interrupt(tmp_path: Path) -> None:
    for exc in (RuntimeError("boom"), KeyboardInterrupt(), OSError(28, "No space left on device")):
        folder = tmp_path / unique_name("job")
        with pytest.raises(type(exc)), owned_folder(folder) as made:
            assert made.is_dir() and lock_path(folder).is_file() and is_owned(folder)
            (made / "half.bin").write_bytes(b"x")
            raise exc
        assert not folder.exists() and not lock_path(folder).exists()
    assert list(tmp_path.iterdir()) == []


def test_owned_folder_renamed_away_is_kept(tmp_path: Path) -> None:
    with owned_folder(tmp_path / unique_name("job")) as staging:
        (staging / "data").write_text("done")
        os.rename(staging, tmp_path / "final")
    assert (tmp_path / "final" / "data").read_text() == "done"
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_unique_names_differ_and_carry_the_pid() -> None:
    names = {unique_name("k") for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(rf"k\.{os.getpid()}\.[0-9a-f]{{12}}", n) for n in names)


def test_own_live_folder_is_never_removed(tmp_path: Path) -> None:
    with owned_folder(tmp_path / unique_name("job")) as staging:
        assert remove_abandoned(tmp_path) == []
        assert remove_abandoned(tmp_path, max_age_s=0) == []  # ours, whatever its age
        assert staging.is_dir()


def test_live_owner_with_a_foreign_pid_keeps_its_folder_killed_owner_loses_it(tmp_path: Path) -> None:
    """The folder's name carries a PID that is no process of this host (another host's job): the
    old PID check removed it; the lock says its owner lives. Once SIGKILLed, it is removed."""
    folder = tmp_path / f"key.{FOREIGN_PID}.0123456789ab"
    with owner_process(folder) as owner:
        assert remove_abandoned(tmp_path) == []
        assert (folder / "work.bin").read_bytes() == b"half"
        assert is_owned(folder)
        kill_owner(owner, folder)
        assert folder.is_dir() and lock_path(folder).is_file()  # SIGKILL: nothing ran
        assert not is_owned(folder)
        assert remove_abandoned(tmp_path) == [folder]
    assert list(tmp_path.iterdir()) == []


@NEEDS_PID_NAMESPACE
def test_owner_in_another_pid_namespace_keeps_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "key.1.0123456789ab"  # named by a pid of its own namespace
    with owner_process(folder, new_pid_namespace=True) as owner:
        assert remove_abandoned(tmp_path) == []
        cleanup = "from pathlib import Path; from pipeline.core.staging import remove_abandoned as r; "
        cleanup += f"print(len(r(Path({str(tmp_path)!r}))))"
        # And the cleanup itself run from another namespace than ours and the owner's.
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", cleanup],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "0"
        assert (folder / "work.bin").is_file()
        kill_owner(owner, folder)  # --kill-child: the owner inside dies with it
        assert remove_abandoned(tmp_path) == [folder]
    assert list(tmp_path.iterdir()) == []


def test_folder_without_a_lock_and_stray_locks_are_removed(tmp_path: Path) -> None:
    (tmp_path / "key.123.0123456789ab").mkdir()  # made by a version without locks, or a killed one
    (tmp_path / "key.123.0123456789ab" / "f").write_text("x")
    (tmp_path / "gone.5.0123456789ab.lock").write_text("")  # its folder was removed
    (tmp_path / "file.7.0123456789ab").write_text("a temporary file")
    removed = remove_abandoned(tmp_path)
    assert sorted(p.name for p in removed) == ["file.7.0123456789ab", "key.123.0123456789ab"]
    assert list(tmp_path.iterdir()) == []


def test_prefix_and_pattern_spare_other_files(tmp_path: Path) -> None:
    (tmp_path / ".engine.1.0123456789ab").mkdir()
    (tmp_path / ".engine-mine").mkdir()  # a user's folder with a similar name
    (tmp_path / "notes.txt").write_text("keep")
    pattern = re.compile(r"\.engine\.\d+\.[0-9a-f]{12}")
    assert remove_abandoned(tmp_path, ".", pattern=pattern) == [tmp_path / ".engine.1.0123456789ab"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".engine-mine", "notes.txt"]


def test_max_age_is_a_condition_on_a_free_lock_never_a_reason_on_its_own(tmp_path: Path) -> None:
    """Issue 37, class 10: ``max_age_s`` never removes a folder whose owner still holds its lock,
    however old and however small the age (``staging_max_age_h=0.0002`` deleted a live job's
    staging); once the lock is free, the folder goes only after nothing was written for longer."""
    folder = tmp_path / f"key.{FOREIGN_PID}.0123456789ab"
    old = time.time() - 7200
    with owner_process(folder) as owner:
        for path in (folder / "work.bin", folder):
            os.utime(path, (old, old))
        for max_age_s in (3600, 0.72, 0):
            assert remove_abandoned(tmp_path, max_age_s=max_age_s) == []
        assert (folder / "work.bin").read_bytes() == b"half" and is_owned(folder)
        kill_owner(owner, folder)
    (folder / "fresh.bin").write_bytes(b"new")  # written a moment ago: young, although free
    os.utime(folder, (old, old))
    assert remove_abandoned(tmp_path, max_age_s=3600) == []
    assert folder.is_dir() and not is_owned(folder)  # its lock was released, not kept
    os.utime(folder / "fresh.bin", (old, old))
    assert remove_abandoned(tmp_path, max_age_s=3600) == [folder]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the folder and its lock


CHURN = """
import sys
from pathlib import Path
from pipeline.core.staging import owned_folder, unique_name
root = Path(sys.argv[1])
try:  # like the entry point: the interrupt is caught, then the process exits
    print("ready", flush=True)
    while True:
        with owned_folder(root / unique_name("job")) as folder:
            (folder / "f").write_bytes(b"x")
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.exit(130)
"""


def test_ctrl_c_at_any_moment_leaves_no_folder_or_lock(tmp_path: Path) -> None:
    """Processes take and release staging folders in a tight loop; each gets one Ctrl-C at a
    random moment: whichever instruction it lands on (taking the lock, making the folder,
    writing, removing it), nothing stays."""
    root = tmp_path / "staging"
    root.mkdir()
    rng = random.Random(0)
    for attempt in range(30):
        process = subprocess.Popen(
            [sys.executable, "-c", CHURN, str(root)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.001, 0.03))
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # lost inside shutil.rmtree (it swallows one): again
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=30)
        assert process.returncode == 130 and out == "interrupted\n", err
        assert list(root.iterdir()) == [], f"left by interrupted process #{attempt}"


KEY_HOLDER = """
import sys, time
from pathlib import Path
from pipeline.core.staging import key_lock
with key_lock(Path(sys.argv[1]), "a test key"):
    print("holding", flush=True)
    sys.stdin.read()  # until the test closes stdin or kills us
"""


def test_key_lock_waits_for_its_holder_and_not_for_a_dead_one(tmp_path: Path) -> None:
    """One job computes a key while the others wait: the lock is exclusive across processes, a
    waiter gets it once the holder is done, and a holder killed by SIGKILL frees it at once (no
    PID is trusted: the kernel releases the lock with the process). The holder removes its file."""
    lock = tmp_path / "cache" / ".staging" / "k.compute.lock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for ending in ("done", "killed"):
        holder = subprocess.Popen(
            [sys.executable, "-c", KEY_HOLDER, str(lock)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().startswith("holding")
        releaser = threading.Timer(1.0, holder.stdin.close if ending == "done" else holder.kill)
        releaser.start()
        with key_lock(lock, "a test key", poll_s=0.05) as waited:
            assert waited >= 0.9, f"{ending}: got the lock after {waited:.2f} s while it was held"
            assert lock.exists()
        holder.wait(timeout=30)
        releaser.join()
        assert not lock.exists()  # removed by its holder on release
    with key_lock(lock, "a test key") as waited, pytest.raises(RuntimeError, match="nested key_lock"):
        assert waited < 0.5
        with key_lock(lock, "a test key"):
            pass
