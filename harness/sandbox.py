"""The sandbox: every run of untrusted code (a repository's tests, an agent's solution, the oracle's child)
goes through here. Inside bubblewrap (github.com/containers/bubblewrap, the sandbox Flatpak is built on) a run
is an unprivileged user (nobody, when the host runs as root) that sees the system folders, the few files of
/etc an interpreter needs and its interpreter read-only, and nothing else of the host: no network, not the
task's files, not the source repository, not the other tasks. Its work folder is a tmpfs of bounded size that
a trusted launcher fills from a read-only view of the host's copy before the run starts (the tests and their
configuration stay read-only mounts); /tmp and /dev/shm are bounded tmpfs too, and the rest of the file system
is read-only, so nothing it writes reaches the host's disk but the descriptors it is handed, whose files
RLIMIT_FSIZE bounds. A pids cgroup (RLIMIT_NPROC when not root) caps its processes, RLIMIT_AS its memory, and
a timeout kills all of it. Temporary folders and cgroups are named after the process that made them, and the
next start removes those whose process is gone (a verify killed with SIGKILL cleans up nothing itself).
Without bubblewrap (--no-sandbox) a run gets only a scrubbed environment, its own folder and the same limits
on time and memory.

A test's outcome is never read from what the tests print: Sandbox.pytest loads the verifier's own reporter
plugin (Reporter, sent as source) before collection imports any of the repository's code, and it writes each
outcome to a descriptor the host opened.

Imported by tasks.py and the rest of the harness; tested in test_all.py
(`python -m pytest test_all.py -k sandbox`).
"""

import concurrent.futures
import contextlib
import functools
import inspect
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

from harness import TaskError

# pytest's cache in the run's own fresh home, never in the tree (it names tests, and a planted one would steer
# --lf); its options stay, as a configuration's addopts may name them (--cache-clear); a test file that fails
# to collect costs its own tests, not the run's; node ids from the repository's root, however the run names
# its files (a pyproject.toml in doit's tests/ made that folder the root of a run naming files in it)
PYTEST = ["-m", "pytest", "-q", "-o", "cache_dir=~/.pytest_cache", "--continue-on-collection-errors",
          "--rootdir=."]
# what a sandboxed run sees of the host; with the network (installs), all of /etc
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
ETC = ("passwd", "group", "hosts", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime",
       "mime.types", "alternatives", "ssl", "ca-certificates")
NOBODY = 65534  # the uid and gid a run has when the host is root
READ_AT_MOST = 64 << 20  # bytes the host reads of what a run wrote to a descriptor it was handed
CASES_AT_MOST = 50  # the cases of one parametrized test a run of whole files keeps
# sys.pycache_prefix: a folder that is not there, on a read-only mount
NO_BYTECODE = "/usr/.featdel-no-bytecode"
# Before the sandbox: join the run's pids cgroup, cap the address space, file size and processes, turn address
# randomization off, then become the command (bubblewrap, or the interpreter unisolated). Arguments: cgroup or
# "", bytes, bytes, count or 0.
LIMITS = """import os, resource, sys
cg, memory, disk, nproc = sys.argv[1:5]
if cg:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
resource.setrlimit(resource.RLIMIT_FSIZE, (int(disk), int(disk)))
if int(nproc):
    resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
try:  # the same addresses in every run: Python 3.11 hashes None by address, so a set of tuples holding it
    import ctypes  # iterates in an order address randomization changes, and with it a suite's test ids
    ctypes.CDLL(None).personality(0x0040000)  # (isodate's parametrize over a set): ADDR_NO_RANDOMIZE
except (OSError, AttributeError):
    pass
os.execvp(sys.argv[5], sys.argv[5:])
"""
# The launcher, run with -I -S before anything of the repository: fills the tmpfs work folder from the
# read-only view (skipping the read-only mounts already in place), then becomes the real command.
FILL = f"""import os, shutil, sys
src, dst = sys.argv[1:3]
for d, dirs, files in os.walk(src):
    to = os.path.normpath(os.path.join(dst, os.path.relpath(d, src)))
    if d != src and os.path.ismount(to):
        dirs[:] = []
        continue
    os.makedirs(to, exist_ok=True)
    for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
        if not os.path.lexists(os.path.join(to, f)):
            shutil.copy2(os.path.join(d, f), os.path.join(to, f), follow_symlinks=False)
if os.getuid() == 0:  # the host is root: hand the work folder to nobody, then become nobody for good
    for d, dirs, files in os.walk(dst):
        dirs[:] = [x for x in dirs if not os.path.ismount(os.path.join(d, x))]
        for x in [d, *(os.path.join(d, f) for f in files)]:
            try:
                os.chown(x, {NOBODY}, {NOBODY}, follow_symlinks=False)
            except OSError:  # a read-only mount
                pass
    os.setgroups([])
    os.setgid({NOBODY})
    os.setuid({NOBODY})
os.execv(sys.argv[3], sys.argv[3:])
"""


def clean_env(root, home, extra=()):
    # Nothing inherited but PATH: no PYTHON* variables, no user site, HOME in a throwaway folder. With the
    # current interpreter the host's pytest plugins stay out (the verifier, not the environment, decides what
    # runs); a venv made by `tasks.py env` holds only the repository's own, and they load.
    paths = os.pathsep.join([str(root), *([str(Path(root, "src"))] if Path(root, "src").is_dir() else []),
                             *extra])
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "PYTHONPATH": paths,
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def scratch():
    """A temporary folder named after this process (the next start removes it if this process dies first),
    readable by the sandbox's unprivileged user."""
    sweep()
    # a SIGTERM between the folder's creation and its finalizer would leave it behind: it waits until then
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        d = tempfile.TemporaryDirectory(prefix=f"featdel-{os.getpid()}-")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    os.chmod(d.name, 0o755)
    return d


@functools.cache
def sweep():
    """Remove the temporary folders and cgroups of earlier runs whose process is gone."""
    def gone(name):
        pid = name.split("-")[1]
        return pid.isdigit() and int(pid) != os.getpid() and not Path("/proc", pid).exists()
    for p in Path(tempfile.gettempdir()).glob("featdel-*-*"):
        if gone(p.name):
            shutil.rmtree(p, ignore_errors=True)
    for cg in Path(pids_cgroup() or "/nonexistent").glob("featdel-*-*"):
        if gone(cg.name):
            remove_cgroup(cg)


def remove_cgroup(cg):
    while cg.exists():  # whatever is left of it (a fork bomb's children) goes too
        for pid in Path(cg, "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            cg.rmdir()


@functools.cache
def pids_cgroup():
    """A cgroup folder this process may make children in, with a pids controller; None if there is none."""
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        probe = Path(base, f"featdel-probe-{os.getpid()}-{secrets.token_hex(4)}")  # pids are reused
        try:
            probe.mkdir()
            ok = Path(probe, "pids.max").exists()
            probe.rmdir()
            if ok:
                return base
        except OSError:
            pass
    return None


@functools.cache
def sandbox_problem():
    """None when runs can be isolated here, else why not."""
    if not shutil.which("bwrap"):
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    ns = (["--unshare-pid", "--unshare-net", "--cap-add", "CAP_SETUID"] if os.getuid() == 0
          else ["--unshare-all"])
    p = subprocess.run(["bwrap", *ns, "--ro-bind", "/", "/", "true"], capture_output=True, text=True)
    if p.returncode:
        return ("bubblewrap cannot run here: "
                f"{(p.stderr.strip().splitlines() or ['exit ' + str(p.returncode)])[-1]}")
    if os.getuid() == 0 and not pids_cgroup():
        return "running as root with no writable pids cgroup, so the number of processes cannot be limited"
    return None


@functools.cache
def prefixes(python):
    """(sys.prefix, sys.base_prefix) of an interpreter: a venv's folder and the Python it was made from."""
    probe = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix]))"
    try:
        p = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
        return tuple(json.loads(p.stdout))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        raise TaskError(f"--python {python} is not a Python interpreter")


@dataclass
class Sandbox:
    """How untrusted code runs: which interpreter, isolated or not, for how long, with how much."""
    # runs the repository's tests: a venv from `tasks.py env`, or this interpreter
    python: str = sys.executable
    isolate: bool = True  # bubblewrap; False is --no-sandbox
    timeout: int = 300  # seconds per run
    processes: int = 512  # processes and threads at once
    memory: int = 8 << 30  # bytes of address space per process
    disk: int = 512 << 20  # bytes in each of the work folder, /tmp and /dev/shm, and in any one file written
    executed: int = 0  # tests run so far, setup to teardown: what make's cost is counted in

    def __post_init__(self):
        # a relative path means the caller's folder, and runs start elsewhere (a venv's link stays a link)
        self.python = os.path.abspath(self.python) if os.sep in self.python else self.python
        self.prefix, self.base = prefixes(self.python)
        if self.isolate and sandbox_problem():
            raise TaskError(f"cannot sandbox the tests: {sandbox_problem()}; "
                            "pass --no-sandbox to run them unisolated")

    def sees(self, path):
        """Whether an isolated run can read path: it lies inside what the sandbox mounts from the host."""
        if not self.isolate:
            return False
        exe = os.path.dirname(os.path.realpath(self.python))
        mounts = {os.path.realpath(m) for m in (*SYSTEM, "/etc", self.prefix, self.base, exe)}
        path = os.path.realpath(path)
        return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)

    def bwrap(self, root, home, path, writable, readonly, network):
        """The bubblewrap command that runs the launcher. As root it runs without a user namespace and the
        launcher becomes nobody itself: inside a namespace, nobody could not reach an interpreter under
        /root."""
        if os.getuid() == 0:
            args = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                    *([] if network else ["--unshare-net"]),
                    *(a for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN") for a in ("--cap-add", cap))]
        else:
            args = ["bwrap", "--unshare-all", *(["--share-net"] if network else [])]
        size, made, binds = ["--size", str(self.disk)], {Path("/proc"), Path("/dev"), Path("/tmp")}, []
        args += ["--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", *size, "--tmpfs", "/dev/shm", "--perms", "1777", *size, "--tmpfs", "/tmp",
                 "--perms", "1777", "--dir", str(home)]

        def mount(op, src, dst, *extra):  # its missing parents made traversable, whatever their host modes
            nonlocal args
            for d in reversed(Path(dst).parents[:-1]):
                if d not in made and not any(b == d or b in d.parents for b in binds):
                    args += ["--perms", "0755", "--dir", str(d)]
                    made.add(d)
            args += [*extra, op, *([src] if src else []), str(dst)]
            made.add(Path(dst))
            binds.extend([Path(dst)] if "bind" in op else [])

        for d in [*SYSTEM, "/etc"] if network else [*SYSTEM, *(f"/etc/{x}" for x in ETC)]:
            if os.path.islink(d) and d in SYSTEM:
                mount("--symlink", os.readlink(d), d)
            elif os.path.exists(d):
                mount("--ro-bind", d, d)
        exe = os.path.dirname(os.path.realpath(self.python))
        for d in sorted({self.prefix, self.base, os.path.realpath(self.base), exe, *map(str, path)}):
            mount("--ro-bind", d, d)
        if self.prefix != self.base:  # a venv: the base interpreter's own packages stay hidden
            args += ["--tmpfs", str(next(Path(self.base).glob("lib/python3*/site-packages"), "/nonexistent"))]
        mount("--ro-bind", str(root), f"{root}.view")
        mount("--tmpfs", None, root, *size)
        for r in readonly:
            mount("--ro-bind", str(r), r)
        for w in writable:
            mount("--bind", str(w), w)
        return [*args, "--remount-ro", "/", "--chdir", str(root), "--", os.path.realpath(self.python), "-I",
                "-S", "-c", FILL, f"{root}.view", str(root)]

    def run(self, args, root, path=(), writable=(), readonly=(), extra_env=None, pass_fds=(), network=False,
            timeout=None):
        """(exit code, the last MiB of its output) of `python *args` run in a copy of root; 124 on timeout,
        all of its processes killed. path: folders put on PYTHONPATH (read-only); writable: host folders it
        may change (an install's venv: handed to the sandbox's user for the run); readonly: paths inside root
        it may read but not change; pass_fds: descriptors it may write results to."""
        root, timeout = Path(root).resolve(), timeout or self.timeout
        cg = (Path(pids_cgroup(), f"featdel-{os.getpid()}-{secrets.token_hex(4)}")
              if self.isolate and pids_cgroup() else None)
        nproc = None if self.isolate and cg or os.getuid() == 0 else self.processes + len(os.listdir("/proc"))

        with scratch() as home, tempfile.TemporaryFile() as log:  # a file: output beyond RAM stays bounded
            env = clean_env(root, home, [str(v) for v in path]) | (extra_env or {})
            if self.prefix != self.base:
                del env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
            cmd = [self.python, *args]
            if self.isolate:
                cmd = self.bwrap(root, home, path, writable, readonly, network) + cmd
                os.chmod(root, os.stat(root).st_mode | 0o555)  # the sandbox's user reads its view of root
                owner(writable, NOBODY) if os.getuid() == 0 else None
                readable(readonly) if os.getuid() == 0 else None
            if cg:
                cg.mkdir()
                Path(cg, "pids.max").write_text(str(self.processes))
            # the limits are set by a launcher of their own, not a preexec_fn: Python code between fork and
            # exec is not safe beside threads (make --jobs, survey), as subprocess's documentation warns
            cmd = [sys.executable, "-I", "-S", "-c", LIMITS, str(cg or ""), str(self.memory), str(self.disk),
                   str(nproc or 0), *cmd]
            try:
                with RUNS:
                    if STOPPING.is_set():
                        raise TaskError("stopped by a signal")
                    p = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
                    LIVE.add(p)
                try:
                    rc = p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    rc = 124
                finally:
                    LIVE.discard(p)
            finally:
                if cg:
                    remove_cgroup(cg)
                if self.isolate and os.getuid() == 0:
                    owner(writable, 0)
            out = tail(log, 1 << 20)
        return rc, out

    def pytest(self, root, args=(), path=(), extra_env=None, pass_fds=(), select=None, **kw):
        """Run pytest with the reporter plugin below; select: run only these node ids (their files are
        collected, the rest of each file deselected: far faster than naming thousands of ids). Outcomes come
        from the plugin's descriptor, never from what the tests print (their code can print anything)."""
        with scratch() as plugin, tempfile.TemporaryFile() as fd:
            Path(plugin, "_featdel_report.py").write_text(REPORTER)
            # a test may take a fifth of the run's time
            env = {"FEATDEL_REPORT_FD": str(fd.fileno()), "FEATDEL_TEST_S": str((kw.get("timeout")
                                                                                 or self.timeout) / 5)}
            if select is not None:
                Path(plugin, "select.json").write_text(json.dumps(sorted(select)))
                env["FEATDEL_SELECT"] = str(Path(plugin, "select.json"))
                args = [*args, *sorted({t.split("::")[0] for t in select})]
            rc, out = self.run([*PYTEST, "-p", "_featdel_report", *args], root, path=[plugin, *path],
                               pass_fds=[fd.fileno(), *pass_fds], extra_env=env | (extra_env or {}), **kw)
            lines = tail(fd, READ_AT_MOST).splitlines()
        try:
            records = [parsed(line) for line in lines]
            end = records[-1][2] if records and records[-1][0] == "<end>" else None
            outcomes = {}  # node id -> the outcomes of its setup, call and teardown
            for nodeid, when, outcome in records[:-1] if end is not None else records:
                outcomes.setdefault(nodeid, {})[when] = outcome
        except (ValueError, TypeError, IndexError):
            return Report(rc, out, None, None)
        with RUNS:
            self.executed += len(outcomes)
        return Report(rc, out, outcomes, end)


RUNS = threading.RLock()  # make's tries run side by side (--jobs) and count into one Sandbox
LIVE, STOPPING = set(), threading.Event()  # the runs under way, and whether a signal asked to stop them


def stop(signum, frame):
    """SIGTERM: kill every run under way and start no other, so threads waiting on runs (make --jobs, survey)
    end at once and the process exits, its temporary folders and cgroups removed on the way out."""
    with RUNS:
        STOPPING.set()
        for p in LIVE:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    # whatever the unwinding waits on, the process is gone in 20 s (the next start sweeps what it left)
    threading.Thread(target=lambda: (time.sleep(20), os._exit(143)), daemon=True).start()
    sys.exit(143)


@contextlib.contextmanager
def stoppable(jobs):
    """A thread pool whose queued work is dropped when the block is left by an exception (SIGTERM's exit):
    only the work under way, whose runs stop() killed, is waited for."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        try:
            yield pool
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def parsed(text):
    """What a sandboxed process wrote (a line of results, a report), parsed as JSON; None where it is not JSON
    or is nested past what the parser takes. The child's bytes can be anything: a malformed line is that
    run's failure, never an exception in the host."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError, MemoryError):
        return None


def tail(f, limit):
    """The last limit bytes written to an open file, as text: what a run wrote can be any size."""
    f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
    data = f.read()
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def readable(paths):
    """Make paths inside a run's folder, mounted as they are, readable by the sandbox's user (httpretty's
    sdist ships its tox.ini as 0600: verify's read-only configuration could not be read); links untouched."""
    for top in paths:
        walk = [] if os.path.islink(top) else os.walk(top)  # nothing for a file
        inside = [Path(d, x) for d, dirs, files in walk for x in dirs + files]
        for x in [Path(top), *inside]:
            st = os.lstat(x)
            if not stat.S_ISLNK(st.st_mode):
                os.chmod(x, st.st_mode | (0o555 if stat.S_ISDIR(st.st_mode) else 0o444))


def owner(folders, uid):
    """Hand folders (an install's venv) to uid, every file in them."""
    for top in folders:
        for d, dirs, files in os.walk(top):
            for x in [d, *(os.path.join(d, f) for f in dirs + files)]:
                os.chown(x, uid, uid, follow_symlinks=False)


class Report(NamedTuple):
    rc: int  # pytest's exit code
    out: str  # what it printed: for error messages only
    # {node id: {"setup"|"call"|"teardown": outcome}}; None: not what the plugin writes
    outcomes: Optional[dict]
    end: Optional[int]  # the exit status the session finished with; None: it never finished

    @property
    def passed(self):
        return {t for t, o in (self.outcomes or {}).items()
                if o.get("call") == "passed" and set(o.values()) == {"passed"}}


# A test's outcome is written by the reporter plugin, loaded with -p before collection imports any code of the
# repository, to a descriptor the caller opened; a closing record follows. The plugin also turns bytecode off
# for everything imported after it, so a planted .pyc is never loaded (pytest and the standard library, loaded
# before it from read-only folders, keep theirs: the whole run under PYTHONPYCACHEPREFIX took 1.3x as long).
# In verify, code that forges what pytest prints or patches the runner is caught by the canaries (further
# down), not by this report alone.
class Reporter:
    """The reporting plugin. It runs inside the repository's pytest, not here: Sandbox.pytest writes REPORTER,
    this class's source after a line that turns bytecode off, into the module it loads with -p. fd: the
    descriptor the outcomes go to (None in pytest-xdist's workers, whose controller reports); select: a JSON
    file of the node ids to run (make's runs; verify runs whole files); limit: the seconds one test may take
    (setup, call and teardown, less the setup of fixtures shared with other tests) before it fails, so that a
    test that never ends costs the run one failure, not the whole run."""

    def __init__(self, fd, select, limit):
        self.out = os.fdopen(int(fd), "w", buffering=1) if fd else None
        self.dumps = json.dumps  # bound now: a test may patch json.dumps (radon's: a MagicMock while it runs)
        self.select = set(json.loads(open(select).read())) if select else None
        self.limit = float(limit or 0)

    def runtest_protocol(self):  # SIGALRM in the main thread, as pytest-timeout's signal method
        on = self.limit > 0 and threading.current_thread() is threading.main_thread()
        if on:
            def over(signum, frame):
                raise pytest.fail.Exception(f"the test ran past {self.limit:g} s", pytrace=False)
            before = signal.signal(signal.SIGALRM, over)
            signal.setitimer(signal.ITIMER_REAL, self.limit)
        try:
            yield
        finally:
            if on:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, before)

    def fixture_setup(self, fixturedef):
        """A fixture wider than a test (a session's server, a module's data) is set up once for all the tests
        that use it: its time is the run's, not charged to the test that happens to be first."""
        shared = fixturedef.scope != "function"
        left = (signal.setitimer(signal.ITIMER_REAL, 0)[0] if self.limit > 0 and shared
                and threading.current_thread() is threading.main_thread() else 0)
        try:
            yield
        finally:
            if left:
                signal.setitimer(signal.ITIMER_REAL, left)

    @staticmethod
    def configure(config):
        """Every test selected runs: options that end a run at a failure (`-x`, `--maxfail`, `--sw` in a
        configuration's addopts) are turned off. The must-fail canary fails in every verify, wherever it lies."""
        config.option.maxfail = 0
        for name in ("stepwise", "stepwise_skip"):
            if hasattr(config.option, name):
                setattr(config.option, name, False)

    def pytest_collection_modifyitems(self, config, items):
        """A run of whole files keeps at most CASES_AT_MOST cases of a parametrized test, evenly spaced (the
        same in every run: the ids make's runs select come from one): requests-oauth2client's product of
        parameters, 130,405 cases of 30-odd tests, ran past three times its timeout traced."""
        if self.select is not None:
            items[:] = [item for item in items if item.nodeid in self.select]
            return
        cases = {}
        for item in items:
            cases.setdefault(item.nodeid.partition("[")[0], []).append(item)
        kept = {id(group[len(group) * i // CASES_AT_MOST]) if len(group) > CASES_AT_MOST else id(group[i])
                for group in cases.values() for i in range(min(len(group), CASES_AT_MOST))}
        items[:] = [item for item in items if id(item) in kept]

    def pytest_runtest_logreport(self, report):
        if self.out:
            self.out.write(self.dumps([report.nodeid, report.when, report.outcome]) + "\n")

    def pytest_sessionfinish(self, session, exitstatus):
        if self.out:
            self.out.write(self.dumps(["<end>", "", int(exitstatus)]) + "\n")


REPORTER = f"""import json, os, signal, sys, threading
import pytest
CASES_AT_MOST = {CASES_AT_MOST}
sys.pycache_prefix = {NO_BYTECODE!r}  # from here on (conftests, tests, the solution) no bytecode is used
{inspect.getsource(Reporter)}
# popped: the tests never see which descriptor (the limit is kept for pytest-xdist's workers)
_reporter = Reporter(os.environ.pop("FEATDEL_REPORT_FD", None), os.environ.pop("FEATDEL_SELECT", None),
                     os.environ.get("FEATDEL_TEST_S"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield from _reporter.runtest_protocol()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    yield from _reporter.fixture_setup(fixturedef)


@pytest.hookimpl(tryfirst=True)  # before the stepwise plugin reads its option
def pytest_configure(config):
    _reporter.configure(config)


pytest_collection_modifyitems = _reporter.pytest_collection_modifyitems
pytest_runtest_logreport = _reporter.pytest_runtest_logreport
pytest_sessionfinish = _reporter.pytest_sessionfinish
"""


def first_error(out):
    """What a pytest run printed about its first failure, in one line: the file that failed to collect and its
    exception, or the first FAILED/ERROR line of the short summary."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"_+ ERROR collecting (\S+) _+$", line)
        if m:
            e = next((x[1:].strip() for x in lines[i + 1:] if x.startswith("E ")), None)
            return f"{m[1]} does not collect: " + (e or next((x.strip() for x in lines[i + 1:] if x.strip()),
                                                             "no reason printed"))
    summary = next((x.split(" - ")[0].strip() for x in lines if re.match(r"(FAILED|ERROR) ", x)), None)
    e = next((x[1:].strip() for x in lines if x.startswith("E ") and x[1:].strip()), None)
    return f"{summary}: {e}" if summary and e else summary or (lines[-1].strip() if lines else "no output")
