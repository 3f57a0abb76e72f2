#!/usr/bin/python3
"""Stdlib-only process supervisor copied to hosts: runs one command detached, restarts it, rotates its log."""

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONFLICT = 0, 1, 2, 3
STATE_FORMAT = 1
LIVE_STATES = ("starting", "running", "backoff")
FINAL_STATES = ("stopped", "failed")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
PR_SET_CHILD_SUBREAPER = 36
KILL_WAIT = 10.0  # after SIGKILL, how long to wait for processes stuck in the kernel before giving up
IDENTIFY_WAIT = 10.0  # how long a lock may be held by a holder that has not written its pid yet


class Fail(Exception):
    """A user-facing error: message for stderr plus the exit code."""

    def __init__(self, message, code=EXIT_FAILED):
        super().__init__(message)
        self.code = code


def warn(message):
    sys.stderr.write(f"supervisor: {message}\n")
    sys.stderr.flush()


def iso(t=None):
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


# ---------------------------------------------------------------- files, locks, processes


class Paths:
    def __init__(self, run_dir, name):
        self.run_dir = run_dir
        self.name = name
        self.state = os.path.join(run_dir, name + ".json")
        self.lock = os.path.join(run_dir, name + ".lock")
        self.stop = os.path.join(run_dir, name + ".stop")


def write_json_atomic(path, doc):
    # Readers must never see a half-written file: write a temp file in the same dir, fsync, rename over.
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def open_lock(paths, create=True):
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        return os.open(paths.lock, flags, 0o644)
    except FileNotFoundError:
        return None


def try_lock(fd, shared=False):
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def is_locked(paths):
    """True while some process (a supervisor, or a launcher about to become one) holds ID.lock."""
    fd = open_lock(paths, create=False)
    if fd is None:
        return False
    try:
        # A shared probe, released at once, so concurrent probes (status) never block each other.
        return not try_lock(fd, shared=True)
    finally:
        os.close(fd)


def lock_owner(paths):
    try:
        with open(paths.lock) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def proc_stat(pid):
    """(state letter, start time in clock ticks since boot) of pid, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def same_process(pid, start_ticks):
    """pid is still the very process recorded (not a reused pid) and not a zombie."""
    if not pid or start_ticks is None:
        return False
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X") and st[1] == start_ticks


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid, sig):
    """Signal a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def children_of(pid):
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def become_subreaper():
    # Orphans of the child (even ones that left its process group) get reparented to us: we reap them
    # and can kill them on stop. Best effort: ctypes is missing from some minimal Python installs.
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def kill_orphan(record, grace):
    """Kill the process group of a child left behind by a dead supervisor (identity checked by start time)."""
    pid = record.get("child_pid")
    if not same_process(pid, record.get("child_start_ticks")):
        return False
    signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and signal_group(pid, 0):
        time.sleep(0.05)
    signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT
    while time.monotonic() < deadline and signal_group(pid, 0):
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------- log file with size-based rotation


class LogWriter:
    """Appends to FILE; past max_bytes renames FILE -> FILE.1 -> ... -> FILE.keep and starts a new FILE."""

    def __init__(self, path, max_bytes, keep):
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.fd = None
        self.size = 0
        self.ident = None
        self.at_line_start = True
        self.error = None
        self._open()

    def _open(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            st = os.fstat(self.fd)
        except OSError as e:
            self._note(e)
            return
        self.size = st.st_size
        self.ident = (st.st_dev, st.st_ino)

    def _note(self, err):
        if self.error is None:
            self.error = f"{self.path}: {err.strerror or err}"

    def _follow(self):
        # Someone moved, deleted or truncated FILE (logrotate, an operator): write to the path again.
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._open()
            return
        except OSError:
            return
        if self.fd is None or (st.st_dev, st.st_ino) != self.ident:
            self._open()
        elif st.st_size < self.size:
            self.size = st.st_size

    def _raw(self, data):
        if self.fd is None:
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except OSError as e:  # disk full and the like: drop output rather than block the child
                self._note(e)
                return
            self.size += n
            view = view[n:]
        self.at_line_start = data.endswith(b"\n")

    def rotate(self):
        if self.fd is None:
            self._open()
            return
        if self.keep <= 0:
            try:
                os.ftruncate(self.fd, 0)
                self.size = 0
            except OSError as e:
                self._note(e)
            return
        i = self.keep + 1
        while os.path.exists(f"{self.path}.{i}"):  # left over from a larger --keep-logs
            with contextlib.suppress(OSError):
                os.unlink(f"{self.path}.{i}")
            i += 1
        try:
            for i in range(self.keep - 1, 0, -1):
                if os.path.exists(f"{self.path}.{i}"):
                    os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        except OSError as e:
            self._note(e)
        self._open()

    def write(self, data):
        self._follow()
        while data:
            if not self.max_bytes:
                self._raw(data)
                return
            room = self.max_bytes - self.size
            if len(data) <= room:
                self._raw(data)
                return
            if room > 0:
                cut = data.rfind(b"\n", 0, room) + 1  # keep lines whole when one fits
                if cut == 0 and self.size == 0:
                    cut = room  # a single line longer than the limit has to be split
                if cut:
                    self._raw(data[:cut])
                    data = data[cut:]
                    continue
            before = self.size
            self.rotate()
            if self.fd is None or self.size >= before:  # rotation failed: keep the output anyway
                self._raw(data)
                return

    def event(self, message):
        line = f"[supervisor {iso()}] {message}\n".encode()
        self.write(line if self.at_line_start else b"\n" + line)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------- the supervisor proper


class Supervisor:
    def __init__(self, cfg, paths, lock_fd, report_fd=None):
        self.cfg = cfg
        self.paths = paths
        self.lock_fd = lock_fd
        self.report_fd = report_fd
        self.log = None
        self.child = None
        self.child_started = 0.0
        self.old_groups = []  # process groups of exited children that may still have members
        self.out_fds = set()
        self.stop_signalled = False
        self.stopping = False
        self.final = "stopped"
        self.deadline = None
        self.killed_at = None
        self.next_start = None
        self.consecutive = 0
        self.restart_times = []
        self.termed = set()  # groups and adopted orphans already sent SIGTERM during a stop
        self.wake_r = self.wake_w = None
        now = time.time()
        self.record = {
            "format": STATE_FORMAT,
            "name": cfg["name"],
            "tag": cfg["tag"],
            "state": "starting",
            "supervisor_pid": os.getpid(),
            "child_pid": None,
            "child_start_ticks": None,
            "started_at": iso(now),
            "child_started_at": None,
            "restarts": 0,
            "last_exit": None,
            "backoff_s": None,
            "next_start_at": None,
            "cmd": cfg["cmd"],
            "cmd_hash": cfg["cmd_hash"],
            "user": cfg["user"]["name"] if cfg["user"] else None,
            "cwd": cfg["cwd"],
            "log": cfg["log"],
            "grace": cfg["grace"],
            "error": None,
            "updated_at": iso(now),
        }

    # -- bookkeeping

    def save(self, **changes):
        self.record.update(changes)
        self.record["updated_at"] = iso()
        try:
            write_json_atomic(self.paths.state, self.record)
        except OSError as e:
            if self.log:
                self.log.event(f"cannot write {self.paths.state}: {e.strerror}")

    def report(self):
        if self.report_fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.report_fd, (json.dumps(self.record, sort_keys=True) + "\n").encode())
        with contextlib.suppress(OSError):
            os.close(self.report_fd)
        self.report_fd = None

    def _on_stop_signal(self, signum, frame):
        self.stop_signalled = True

    def _on_other_signal(self, signum, frame):
        pass  # SIGCHLD only needs to wake select (wakeup fd); SIGHUP is ignored on purpose

    def setup_signals(self):
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        # Python-level handlers rather than SIG_IGN: handled signals are reset to default in the child on
        # exec, ignored ones would be inherited by the engine.
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_other_signal)
        signal.signal(signal.SIGCHLD, self._on_other_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})

    # -- child lifecycle

    def spawn(self):
        """Start the command; returns None or the OSError that prevented exec."""
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                self.cfg["cmd"],
                stdin=subprocess.DEVNULL,
                stdout=w,
                stderr=w,
                cwd=self.cfg["cwd"],
                env=self.cfg["env"],
                start_new_session=True,  # own session and process group: stop kills the whole group
                close_fds=True,
                **self.identity(),
            )
        except OSError as e:
            os.close(r)
            return e
        finally:
            os.close(w)  # only the child keeps the write end, so EOF means all writers are gone
        os.set_blocking(r, False)
        self.out_fds.add(r)
        self.child = proc
        self.child_started = time.monotonic()
        st = proc_stat(proc.pid)
        self.save(
            state="running",
            child_pid=proc.pid,
            child_start_ticks=st[1] if st else None,
            child_started_at=iso(),
            backoff_s=None,
            next_start_at=None,
            error=None,
        )
        self.log.event(f"started pid {proc.pid}: {shlex.join(self.cfg['cmd'])}")
        return None

    def identity(self):
        """Popen's user switch for --user (groups first, then gid, then uid, in the child before exec)."""
        u = self.cfg["user"]
        return {"user": u["uid"], "group": u["gid"], "extra_groups": u["groups"]} if u else {}

    def exec_failed(self, err):
        message = f"cannot execute {self.cfg['cmd'][0]!r}: {err.strerror or err}"
        if err.filename and str(err.filename) != self.cfg["cmd"][0]:
            message += f" ({err.filename})"
        self.log.event(message)
        return message

    def read_output(self, fd):
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                self.out_fds.discard(fd)
                os.close(fd)
                return
            self.log.write(data)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            if self.child is not None and pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)
                self.on_child_exit(self.child.returncode)
            # anything else is an adopted orphan: reaping it is all there is to do

    def on_child_exit(self, code):
        pid = self.child.pid
        uptime = time.monotonic() - self.child_started
        self.child = None
        for fd in list(self.out_fds):  # flush what the child wrote before its exit message
            self.read_output(fd)
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            last = {"signal": -code, "signal_name": name, "at": iso()}
            how = f"killed by {name}"
        else:
            last = {"code": code, "at": iso()}
            how = f"exited with code {code}"
        self.old_groups.append(pid)
        self.save(child_pid=None, child_start_ticks=None, last_exit=last)
        if self.stopping:
            self.log.event(f"pid {pid} {how}")
            return
        self.log.event(f"pid {pid} {how} after {uptime:.1f}s")
        signal_group(pid, signal.SIGTERM)  # its workers go down with it before the restart
        self.schedule_restart(uptime)

    def schedule_restart(self, uptime, error=None):
        now = time.monotonic()
        if uptime >= self.cfg["backoff_reset"]:
            self.consecutive = 0
        limit, window = self.cfg["max_restarts"], self.cfg["restart_window"]
        if limit is not None:
            if window is not None:
                self.restart_times = [t for t in self.restart_times if now - t < window]
            if len(self.restart_times) >= limit:
                span = f" within {window:g}s" if window is not None else ""
                reason = f"gave up: {len(self.restart_times)} restarts{span} (--max-restarts {limit})"
                self.log.event(reason)
                self.save(error=error or reason)
                self.begin_stop(final="failed")
                return
        delay = min(self.cfg["backoff_min"] * 2**self.consecutive, self.cfg["backoff_max"])
        self.consecutive += 1
        self.next_start = now + delay
        self.save(state="backoff", backoff_s=delay, next_start_at=iso(time.time() + delay), error=error)
        self.log.event(f"restarting in {delay:g}s")

    def restart(self):
        self.next_start = None
        self.kill_leftovers(signal.SIGKILL)
        self.restart_times.append(time.monotonic())
        self.record["restarts"] += 1
        err = self.spawn()
        if err is not None:
            message = self.exec_failed(err)
            self.save(last_exit={"error": message, "at": iso()})
            self.schedule_restart(0.0, error=message)

    # -- stopping

    def leftovers(self):
        self.old_groups = [g for g in self.old_groups if signal_group(g, 0)]
        current = self.child.pid if self.child is not None else None
        adopted = [p for p in children_of(os.getpid()) if p != current]
        return self.old_groups, adopted

    def kill_leftovers(self, sig, once=False):
        """Signal old groups and adopted orphans; with once=True, each group or pid gets sig only once
        (a second SIGTERM makes some servers skip their graceful shutdown)."""
        groups, adopted = self.leftovers()
        for g in groups:
            if not (once and ("group", g) in self.termed):
                self.termed.add(("group", g))
                signal_group(g, sig)
        for p in adopted:
            if not (once and p in self.termed):
                self.termed.add(p)
                with contextlib.suppress(OSError):
                    os.kill(p, sig)
        return groups, adopted

    def begin_stop(self, final="stopped"):
        if self.stopping:
            return
        self.stopping = True
        self.final = final
        grace = self.cfg["grace"]
        request = read_json(self.paths.stop)  # `stop --grace` leaves its grace here before signalling us
        if request is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.paths.stop)
            if type(request.get("grace")) in (int, float) and request["grace"] >= 0:
                grace = float(request["grace"])
        self.deadline = time.monotonic() + grace
        self.next_start = None
        if final == "stopped":
            self.save(state="stopping", backoff_s=None, next_start_at=None)
        else:
            self.save(state=final, backoff_s=None, next_start_at=None)
        if self.child is not None:
            self.log.event(f"stopping pid {self.child.pid} (SIGTERM, grace {grace:g}s)")
            signal_group(self.child.pid, signal.SIGTERM)
            self.termed.add(("group", self.child.pid))
        self.kill_leftovers(signal.SIGTERM, once=True)

    # -- main loop

    def run(self):
        try:
            return self._run()
        except Exception:
            # A supervisor bug must not leave an unsupervised engine behind: record, kill, exit.
            text = traceback.format_exc()
            with contextlib.suppress(Exception):
                if self.log:
                    self.log.event("internal error:\n" + text)
                if self.child is not None:
                    signal_group(self.child.pid, signal.SIGKILL)
                self.save(state="failed", child_pid=None, error="internal error: " + text.strip().splitlines()[-1])
            self.report()
            return EXIT_FAILED

    def _run(self):
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no-op when inherited from the launcher
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)
        previous = read_json(self.paths.state)
        with contextlib.suppress(OSError):
            os.unlink(self.paths.stop)  # a stale request must not stop the new supervisor
        self.log = LogWriter(self.cfg["log"], self.cfg["max_log_bytes"], self.cfg["keep_logs"])
        self.save()
        self.setup_signals()
        become_subreaper()
        tag = f" (tag {self.cfg['tag']})" if self.cfg["tag"] is not None else ""
        self.log.event(f"supervisor pid {os.getpid()} for {self.cfg['name']}{tag}")
        if previous and previous.get("state") not in FINAL_STATES and kill_orphan(previous, self.cfg["grace"]):
            self.log.event(f"killed pid {previous['child_pid']} left behind by a dead supervisor")
        if self.stop_signalled:
            self.begin_stop()
        else:
            err = self.spawn()
            if err is not None:
                message = self.exec_failed(err)
                self.save(state="failed", error=message, last_exit={"error": message, "at": iso()})
                self.report()
                return EXIT_FAILED
        self.report()
        return self.loop()

    def loop(self):
        while True:
            if self.stop_signalled and not self.stopping:
                self.begin_stop()
            now = time.monotonic()
            if self.stopping:
                if self.killed_at is None:
                    # Orphans that escaped the group get reparented to us while the group dies: TERM them too.
                    groups, adopted = self.kill_leftovers(signal.SIGTERM, once=True)
                else:  # orphans of SIGKILLed processes keep being reparented to us: SIGKILL them as they come
                    groups, adopted = self.kill_leftovers(signal.SIGKILL)
                if self.child is None and not groups and not adopted:
                    return self.finish()
                if self.killed_at is None and now >= self.deadline:
                    self.log.event("grace period over: SIGKILL")
                    if self.child is not None:
                        signal_group(self.child.pid, signal.SIGKILL)
                    self.kill_leftovers(signal.SIGKILL)
                    self.killed_at = now
                elif self.killed_at is not None and now - self.killed_at > KILL_WAIT:
                    self.log.event("processes still present after SIGKILL; giving up on them")
                    return self.finish()
            elif self.next_start is not None and now >= self.next_start:
                self.restart()
                continue
            timeout = 1.0
            if self.stopping:
                timeout = 0.05  # group members that are not our children do not send SIGCHLD
            elif self.next_start is not None:
                timeout = max(0.0, min(timeout, self.next_start - now))
            try:
                ready, _, _ = select.select([self.wake_r, *self.out_fds], [], [], timeout)
            except InterruptedError:
                ready = []
            for fd in ready:
                if fd == self.wake_r:
                    with contextlib.suppress(OSError):
                        while os.read(self.wake_r, 4096):
                            pass
                else:
                    self.read_output(fd)
            self.reap()
            # Forget emptied groups within a second, long before their number could name someone else's.
            self.old_groups = [g for g in self.old_groups if signal_group(g, 0)]

    def finish(self):
        for fd in list(self.out_fds):
            self.read_output(fd)
            if fd in self.out_fds:  # a straggler still holds the write end: stop listening
                self.out_fds.discard(fd)
                os.close(fd)
        self.reap()
        self.save(state=self.final, child_pid=None, child_start_ticks=None, backoff_s=None, next_start_at=None)
        self.log.event(f"supervisor exiting ({self.final})")
        self.log.close()
        return EXIT_OK if self.final == "stopped" else EXIT_FAILED


# ---------------------------------------------------------------- commands


def read_env_file(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise Fail(f"cannot read env file {path}: {e.strerror}", EXIT_USAGE) from None
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:
        raise Fail(f"env file {path}: {e}", EXIT_USAGE) from None
    env = {}
    for tok in tokens:
        if tok == "export":
            continue
        key, sep, value = tok.partition("=")
        if not sep or not ENV_KEY_RE.match(key):
            raise Fail(f"env file {path}: expected KEY=value, got {tok!r}", EXIT_USAGE)
        env[key] = value
    return env


def run_as(name):
    """--user NAME: the command runs with that user's uid, primary group and groups (the supervisor, root, keeps
    its run dir and log). Refused: a user that does not exist, root, or a supervisor that cannot switch."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise Fail(f"--user {name}: no such user", EXIT_USAGE) from None
    if pw.pw_uid == 0:
        raise Fail(f"--user {name}: is root; name an unprivileged user", EXIT_USAGE)
    if os.geteuid() != 0:
        raise Fail(f"--user {name}: only a supervisor running as root can run the command as another user",
                   EXIT_USAGE)
    return {"name": name, "uid": pw.pw_uid, "gid": pw.pw_gid, "groups": os.getgrouplist(name, pw.pw_gid),
            "home": pw.pw_dir}


def build_config(args, cmd):
    if not cmd:
        raise Fail("missing command: start ... -- CMD [ARGS...]", EXIT_USAGE)
    checks = [
        (args.max_log_bytes >= 0, "--max-log-bytes must be >= 0"),
        (args.keep_logs >= 0, "--keep-logs must be >= 0"),
        (args.grace >= 0, "--grace must be >= 0"),
        (args.backoff_min > 0, "--backoff-min must be > 0"),
        (args.backoff_max >= args.backoff_min, "--backoff-max must be >= --backoff-min"),
        (args.backoff_reset >= 0, "--backoff-reset must be >= 0"),
        (args.max_restarts is None or args.max_restarts >= 0, "--max-restarts must be >= 0"),
        (args.restart_window is None or args.restart_window > 0, "--restart-window must be > 0"),
        (args.restart_window is None or args.max_restarts is not None, "--restart-window needs --max-restarts"),
    ]
    for ok, message in checks:
        if not ok:
            raise Fail(message, EXIT_USAGE)
    user = run_as(args.user) if args.user else None
    # Absolute paths: the daemon chdirs to / before it opens anything.
    cwd = os.path.abspath(args.cwd)
    file_env = read_env_file(os.path.abspath(args.env_file)) if args.env_file else {}
    env = dict(os.environ)
    env.update(file_env)
    # The child may want to know who supervises it and which release (tag) it belongs to.
    env["KIMICTL_SUPERVISED_NAME"] = args.name
    env["KIMICTL_TAG"] = args.tag or ""
    if user:
        env.update(HOME=user["home"], USER=args.user, LOGNAME=args.user)
    # What "the same command" means for idempotent start: argv, working dir, the env file's variables (and the user).
    spec = json.dumps({"cmd": cmd, "cwd": cwd, "env": file_env, **({"user": args.user} if user else {})},
                      sort_keys=True, separators=(",", ":"))
    return {
        "name": args.name,
        "tag": args.tag,
        "user": user,
        "cmd": cmd,
        "cmd_hash": "sha256:" + hashlib.sha256(spec.encode()).hexdigest(),
        "cwd": cwd,
        "env": env,
        "log": os.path.abspath(args.log),
        "grace": args.grace,
        "max_log_bytes": args.max_log_bytes,
        "keep_logs": args.keep_logs,
        "max_restarts": args.max_restarts,
        "restart_window": args.restart_window,
        "backoff_min": args.backoff_min,
        "backoff_max": args.backoff_max,
        "backoff_reset": args.backoff_reset,
    }


def ensure_run_dir(run_dir):
    try:
        os.makedirs(run_dir, mode=0o755, exist_ok=True)
    except OSError as e:
        raise Fail(f"cannot create run dir {run_dir}: {e.strerror}") from None


def check_log(path):
    # Fail here, where the caller sees it, rather than in the daemon whose stderr is /dev/null.
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as e:
        raise Fail(f"cannot open log {path}: {e.strerror}") from None


def identify(paths):
    """The record of the supervisor holding the lock, or None while it cannot be told (starting up)."""
    owner = lock_owner(paths)
    record = read_json(paths.state)
    if owner and record and record.get("supervisor_pid") == owner and pid_alive(owner):
        return record
    return None


def wait_unlocked(paths, timeout):
    deadline = time.monotonic() + timeout
    while is_locked(paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_begin(paths, grace):
    """Ask the supervisor of one ID to stop. Returns ("done", message) or ("wait", (pid, grace))."""
    give_up = time.monotonic() + IDENTIFY_WAIT
    while True:
        record = read_json(paths.state)
        fd = open_lock(paths, create=False)
        if fd is None:
            return "done", "already stopped"
        try:
            if try_lock(fd):
                # Nobody supervises ID; holding the lock keeps a concurrent start out while we tidy up.
                if record and record.get("state") not in FINAL_STATES:
                    g = record.get("grace", 30.0) if grace is None else grace
                    killed = kill_orphan(record, float(g))
                    record.update(state="stopped", child_pid=None, child_start_ticks=None, updated_at=iso())
                    write_json_atomic(paths.state, record)
                    return "done", "stopped (supervisor was dead" + (", killed its child)" if killed else ")")
                return "done", "already stopped"
        finally:
            os.close(fd)
        record = identify(paths)
        if record is not None:
            pid = record["supervisor_pid"]
            if record.get("state") in (*LIVE_STATES, "stopping"):
                if grace is not None and record.get("state") in LIVE_STATES:
                    write_json_atomic(paths.stop, {"grace": grace})
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            g = record.get("grace", 30.0) if grace is None else grace
            return "wait", (pid, float(g))
        if time.monotonic() > give_up:
            raise Fail(f"{paths.name}: {paths.lock} is held by a process that is not a supervisor")
        time.sleep(0.05)


def stop_finish(paths, pid, grace):
    if wait_unlocked(paths, grace + KILL_WAIT + 5):
        record = read_json(paths.state) or {}
        return record.get("state", "stopped"), True
    # The supervisor is hung: do its job, then take its lock over.
    record = read_json(paths.state) or {}
    cpid = record.get("child_pid")
    if same_process(cpid, record.get("child_start_ticks")):
        signal_group(cpid, signal.SIGKILL)
    if lock_owner(paths) == pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not wait_unlocked(paths, KILL_WAIT):
        return f"supervisor pid {pid} did not exit", False
    record.update(
        state="stopped",
        child_pid=None,
        child_start_ticks=None,
        updated_at=iso(),
        error="supervisor did not stop in time and was killed",
    )
    write_json_atomic(paths.state, record)
    return "stopped (supervisor killed)", True


def list_names(run_dir):
    try:
        entries = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        if entry.endswith(".json") and NAME_RE.match(entry[:-5]):
            names.append(entry[:-5])
    return names


def cmd_stop(args):
    run_dir = os.path.abspath(args.run_dir)
    if args.all == bool(args.name):
        raise Fail("stop needs exactly one of --name ID or --all", EXIT_USAGE)
    if args.grace is not None and args.grace < 0:
        raise Fail("--grace must be >= 0", EXIT_USAGE)
    names = list_names(run_dir) if args.all else [args.name]
    pending, results, ok = [], {}, True
    for name in names:  # signal everyone first, then wait: stop --all takes one grace period, not N
        try:
            kind, value = stop_begin(Paths(run_dir, name), args.grace)
        except Fail as e:
            if not args.all:
                raise
            kind, value, ok = "done", f"error: {e}", False
        if kind == "done":
            results[name] = value
        else:
            pending.append((name, value))
    for name, (pid, grace) in pending:
        message, good = stop_finish(Paths(run_dir, name), pid, grace)
        results[name] = message
        ok = ok and good
    for name in names:
        print(f"{name}: {results[name]}" if args.all else results[name])
    if args.all and not names:
        print("already stopped")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_status(args):
    run_dir = os.path.abspath(args.run_dir)
    names = [args.name] if args.name else list_names(run_dir)
    out = []
    for name in names:
        paths = Paths(run_dir, name)
        record = read_json(paths.state)
        if record is None:
            if os.path.exists(paths.state):
                out.append({"name": name, "state": "unreadable"})
            continue
        if record.get("format") != STATE_FORMAT or record.get("name") != name:
            continue  # some other program's JSON in the run dir, not a supervisor's state
        alive = is_locked(paths)
        record["alive"] = alive
        if not alive and record.get("state") not in FINAL_STATES:
            record["recorded_state"] = record.get("state")
            record["state"] = "dead"
        if record.get("child_pid"):
            record["child_alive"] = same_process(record["child_pid"], record.get("child_start_ticks"))
        out.append(record)
    print(json.dumps(out, sort_keys=True))
    return EXIT_OK


def acquire_for_start(cfg, paths, replace):
    """Take ID.lock for a new supervisor; None when the same command already runs ("unchanged")."""
    give_up = None
    while True:
        fd = open_lock(paths)
        if try_lock(fd):
            os.ftruncate(fd, 0)  # the old pid must not be taken for the new holder's
            return fd
        os.close(fd)
        record = identify(paths)
        if record is None:
            give_up = give_up or time.monotonic() + IDENTIFY_WAIT
            if time.monotonic() > give_up:
                raise Fail(f"{paths.name}: {paths.lock} is held by a process that is not a supervisor", EXIT_CONFLICT)
            time.sleep(0.05)
            continue
        give_up = None
        if record.get("state") in LIVE_STATES:
            if record.get("cmd_hash") == cfg["cmd_hash"] and record.get("tag") == cfg["tag"]:
                return None
            if not replace:
                what = "tag" if record.get("cmd_hash") == cfg["cmd_hash"] else "command"
                raise Fail(
                    f"{paths.name} already runs with a different {what} (tag {record.get('tag')!r}, "
                    f"pid {record.get('supervisor_pid')}); pass --replace to replace it",
                    EXIT_CONFLICT,
                )
            warn(f"{paths.name}: replacing supervisor pid {record['supervisor_pid']}")
            kind, value = stop_begin(paths, None)
            if kind == "wait":
                message, good = stop_finish(paths, *value)
                if not good:
                    raise Fail(f"{paths.name}: cannot stop the old supervisor: {message}")
            continue
        # The holder is on its way out (stopping/failed): let it finish.
        if not wait_unlocked(paths, float(record.get("grace", 30.0)) + KILL_WAIT + 5):
            raise Fail(f"{paths.name}: supervisor pid {record['supervisor_pid']} is still stopping")


def read_report(fd, timeout):
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    try:
        return json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None


def daemonize(cfg, paths, lock_fd):
    """Double fork; the grandchild (own session, stdio on /dev/null, cwd /) becomes the supervisor."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    # Blocked until the daemon has its handlers: an early SIGTERM must mean "stop", not "die silently".
    stop_signals = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    pid = os.fork()
    if pid == 0:
        code = EXIT_FAILED
        try:
            os.close(r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.umask(0o022)
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(null, target)
            keep = sorted({0, 1, 2, lock_fd, w})
            max_fd = os.sysconf("SC_OPEN_MAX")
            max_fd = max_fd if max_fd > keep[-1] else 65536
            # Drop every other inherited descriptor (an SSH session's pipes keep Ansible waiting).
            for i, lo in enumerate(keep):  # no zip(strict=): hosts may have Python 3.9
                os.closerange(lo + 1, keep[i + 1] if i + 1 < len(keep) else max_fd)
            code = Supervisor(cfg, paths, lock_fd, w).run()
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    os.close(w)
    os.close(lock_fd)
    os.waitpid(pid, 0)
    try:
        return read_report(r, cfg["start_timeout"])
    finally:
        os.close(r)


def use_systemd(choice):
    """Under systemd (PID 1 is systemd) the supervisor runs as a transient unit: out of the SSH session's scope
    (logind may kill that on logout), visible to systemctl/journalctl, stopped in order with the machine."""
    tool = shutil.which("systemd-run") is not None
    if choice == "yes" and not tool:
        raise Fail("--systemd yes: systemd-run is not on PATH", EXIT_USAGE)
    return choice == "yes" or (choice == "auto" and tool and os.path.isdir("/run/systemd/system"))


def unit_name(run_dir, name):
    # The run dir tells apart two kimictl state dirs (clusters) sharing a host.
    return f"kimi-{name}-{hashlib.sha256(run_dir.encode()).hexdigest()[:8]}"


def launch_unit(args, cmd, cfg, paths):
    """`systemd-run` of this file's foreground `run`; then wait, like daemonize, for the supervisor's report."""
    run_dir = os.path.dirname(paths.state)
    argv = [sys.executable, os.path.abspath(__file__), "run", "--name", args.name, "--run-dir", run_dir,
            "--log", cfg["log"], "--cwd", cfg["cwd"], "--max-log-bytes", str(args.max_log_bytes),
            "--keep-logs", str(args.keep_logs), "--grace", str(args.grace), "--backoff-min", str(args.backoff_min),
            "--backoff-max", str(args.backoff_max), "--backoff-reset", str(args.backoff_reset)]
    for flag, value in (("--env-file", args.env_file and os.path.abspath(args.env_file)), ("--tag", args.tag),
                        ("--max-restarts", args.max_restarts), ("--restart-window", args.restart_window),
                        ("--user", args.user)):
        if value is not None:
            argv += [flag, str(value)]
    unit = unit_name(run_dir, args.name)
    # KillMode=mixed: `systemctl stop` SIGTERMs the supervisor alone (it stops the engine its own way), and
    # SIGKILLs what is left once the supervisor's grace has run out.
    launcher = ["systemd-run", f"--unit={unit}", "--collect", "--quiet", "--property=KillMode=mixed",
                f"--property=TimeoutStopSec={int(args.grace + KILL_WAIT + 5)}",
                f"--setenv=PATH={os.environ.get('PATH', '')}", "--", *argv, "--", *cmd]
    before = read_json(paths.state) or {}
    try:
        res = subprocess.run(launcher, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Fail(f"{args.name}: systemd-run failed: {e}") from None
    if res.returncode != 0:
        raise Fail(f"{args.name}: systemd-run failed ({res.returncode}): {res.stderr.strip()[-500:]}")
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        record = read_json(paths.state)
        if (record and record.get("supervisor_pid") != before.get("supervisor_pid")
                and record.get("state") in ("running", "backoff", "failed", "stopped")):
            record["unit"] = unit
            return record
        time.sleep(0.05)
    return None


def cmd_start(args, cmd):
    cfg = build_config(args, cmd)
    cfg["start_timeout"] = args.start_timeout
    systemd = use_systemd(args.systemd)
    run_dir = os.path.abspath(args.run_dir)
    ensure_run_dir(run_dir)
    paths = Paths(run_dir, args.name)
    check_log(cfg["log"])
    lock_fd = acquire_for_start(cfg, paths, args.replace)
    if lock_fd is None:
        print("unchanged")
        return EXIT_OK
    if systemd:
        os.close(lock_fd)  # the unit's supervisor takes the lock itself
        record = launch_unit(args, cmd, cfg, paths)
    else:
        record = daemonize(cfg, paths, lock_fd)
    if record is None:
        record = read_json(paths.state)
        print(json.dumps(record, sort_keys=True))
        raise Fail(f"{args.name}: the supervisor did not report within {args.start_timeout:g}s (see {cfg['log']})")
    print(json.dumps(record, sort_keys=True))
    if record.get("state") == "running":
        return EXIT_OK
    raise Fail(f"{args.name}: {record.get('error') or 'state ' + str(record.get('state'))}")


def cmd_run(args, cmd):
    cfg = build_config(args, cmd)
    run_dir = os.path.abspath(args.run_dir)
    ensure_run_dir(run_dir)
    paths = Paths(run_dir, args.name)
    check_log(cfg["log"])
    lock_fd = open_lock(paths)
    if not try_lock(lock_fd):
        raise Fail(
            f"{args.name} is already supervised (lock {paths.lock} held by pid {lock_owner(paths)})", EXIT_CONFLICT
        )
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    return Supervisor(cfg, paths, lock_fd).run()


def name_arg(value):
    if not NAME_RE.match(value):
        raise argparse.ArgumentTypeError(f"invalid ID {value!r} (letters, digits, '.', '_', '-')")
    return value


def parser():
    p = argparse.ArgumentParser(prog="supervisor.py", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="{start,run,stop,status}")

    def launch_options(sp):
        sp.add_argument("--name", required=True, type=name_arg, help="supervised ID")
        sp.add_argument("--run-dir", required=True, help="where ID.json (state) and ID.lock live")
        sp.add_argument("--log", required=True, help="log file for the command's stdout+stderr")
        sp.add_argument("--cwd", default="/", help="working directory of the command (default /)")
        sp.add_argument("--env-file", help="KEY='value' lines (shell quoting) added to the environment")
        sp.add_argument("--user", help="run the command as this unprivileged user (its groups, HOME; the supervisor "
                                       "must be root)")
        sp.add_argument("--max-log-bytes", type=int, default=100 * 1024 * 1024, help="rotate past this (0: never)")
        sp.add_argument("--keep-logs", type=int, default=5, help="rotated files kept: FILE.1 .. FILE.K")
        sp.add_argument("--grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL on stop")
        sp.add_argument("--tag", help="opaque string recorded in the state (kimictl: the release id)")
        sp.add_argument("--max-restarts", type=int, help="more restarts than this within the window: failed")
        sp.add_argument("--restart-window", type=float, help="window for --max-restarts (s; default: forever)")
        sp.add_argument("--backoff-min", type=float, default=1.0, help="first restart delay (s)")
        sp.add_argument("--backoff-max", type=float, default=60.0, help="restart delay cap (s)")
        sp.add_argument(
            "--backoff-reset",
            type=float,
            default=60.0,
            help="a child up this long resets the delay to --backoff-min (s)",
        )

    sp = sub.add_parser("start", help="start ID detached (idempotent)", usage="%(prog)s [options] -- CMD [ARGS...]")
    launch_options(sp)
    sp.add_argument("--replace", action="store_true", help="replace a live supervisor running something else")
    sp.add_argument("--start-timeout", type=float, default=60.0, help="wait this long for the spawn report (s)")
    sp.add_argument("--systemd", choices=("auto", "yes", "no"), default="auto",
                    help="run the supervisor as a transient systemd unit (auto: when the host runs systemd)")
    sp = sub.add_parser("run", help="supervise ID in the foreground", usage="%(prog)s [options] -- CMD [ARGS...]")
    launch_options(sp)
    sp = sub.add_parser("stop", help="stop ID (or --all): SIGTERM the group, SIGKILL after the grace")
    sp.add_argument("--name", type=name_arg)
    sp.add_argument("--all", action="store_true")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--grace", type=float, help="default: the --grace given to start")
    sp = sub.add_parser("status", help="JSON list of states with liveness re-checked")
    sp.add_argument("--run-dir", required=True)
    sp.add_argument("--name", type=name_arg)
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = []
    if "--" in argv:  # everything after the first -- is the command, verbatim
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    p = parser()
    args = p.parse_args(argv)
    if cmd and args.command not in ("start", "run"):
        p.error(f"{args.command} takes no command")
    try:
        if args.command == "start":
            return cmd_start(args, cmd)
        if args.command == "run":
            return cmd_run(args, cmd)
        if args.command == "stop":
            return cmd_stop(args)
        return cmd_status(args)
    except Fail as e:
        warn(str(e))
        return e.code
    except OSError as e:  # run dir not writable and the like: a message, not a traceback
        warn(f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e))
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
