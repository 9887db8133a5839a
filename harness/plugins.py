"""The plugins that run inside a repository's own pytest process, loaded with -p before collection imports any
of its code, each writing what it saw to a descriptor the host opened (never to what the tests can print):

- Tracer: profiles every Python call into the packages and files it under the running test's node id (calls
  made before the first test are the import bucket): make's test -> feature map.
- Recorder: while the gold code runs its tests, copies the arguments of each call into the features (receiver
  included, a generator by its items) and a pool of values of the same types that the tests pass to the
  packages' other functions: the oracle's traced inputs, from which the child makes held-out ones.

Each class runs there, not here: its source is written into the module loaded with -p (TRACER_MODULE,
RECORDER_MODULE), and plugin_run makes that one pytest run in the sandbox.

Imported by tasks.py (make's map, the oracle's recording); tested in test_all.py
(`python -m pytest test_all.py -k "make_picks or oracle"`).
"""

import contextlib
import inspect
import json
import os
import re
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

from harness.child import COPY_MODULE, INPUT_AT_MOST, INPUTS_AT_MOST, POOL_AT_MOST, RECORD_AT_MOST, Copier
from harness.env import collect_args, pytest_config
from harness.repo import CONFIG, is_protected
from harness.sandbox import scratch, tail

class Recorder:
    """The recording plugin. Like Tracer it runs inside the repository's pytest (record_calls writes its
    source into the module loaded with -p). targets: {(file, qualname): feature index}; out: where the records
    go, [[feature index, base64 pickle of (args, kwargs)], ...], and [null, base64 pickle of a value] for the
    pool: the values of the types the features take (or the packages define) that the tests pass to any other
    function of the packages, which mutation may put in place of a feature's argument. each: the distinct
    inputs kept for a feature."""

    def __init__(self, targets, out, repo, pkgs, each=RECORD_AT_MOST):
        import base64, dis, io
        self.out, self.records, seen, tries, starts, ours, taken = out, [], set(), Counter(), {}, {}, set()

        def keep(key, value, fresh=None, most=each):  # a copy of value, under key
            if tries[key] >= 10 * most:
                return
            tries[key] += 1
            try:
                buffer = io.BytesIO()
                Copier(buffer, repo, pkgs, fresh).dump(value)
                data = buffer.getvalue()
            except Exception:  # locks, open files, generators: not copyable, not recorded
                return
            if len(data) < INPUT_AT_MOST and tries[key, "bytes"] + len(data) <= INPUTS_AT_MOST \
                    and (key, data) not in seen and tries[key, "kept"] < most:
                seen.add((key, data))
                tries[key, "kept"] += 1
                tries[key, "bytes"] += len(data)
                self.records.append([key if type(key) is int else None, base64.b64encode(data).decode()])

        def own_source(path):  # a file of the packages' own source (not their tests)
            return path.startswith(pkgs) and not is_protected(os.path.relpath(path, repo))

        def pooled(t):  # whether values of type t go to the pool
            if t not in ours:
                module = sys.modules.get(t.__module__)
                ours[t] = own_source(os.path.realpath(getattr(module, "__file__", None) or "/"))
            return ours[t] or t in taken

        def profile(frame, event, arg):
            if event != "call":
                return
            code = frame.f_code
            if code not in starts:  # the first RESUME: a generator's later resumptions are not new calls
                path = os.path.realpath(code.co_filename)
                starts[code] = (targets.get((path, code.co_qualname)), next(
                    (i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0),
                    own_source(path))
            i, start, inside = starts[code]
            if frame.f_lasti != start or i is None and (not inside or tries[code] >= POOL_AT_MOST):
                return
            tries[code] += i is None  # a function called in a loop: its first calls' values suffice
            names, n, loc = code.co_varnames, code.co_argcount, frame.f_locals  # at the call: the arguments
            k = n + code.co_kwonlyargcount
            args, kwargs = [loc[x] for x in names[:n]], {x: loc[x] for x in names[n:k]}
            if code.co_flags & inspect.CO_VARARGS:
                args += loc[names[k]]
                k += 1
            if code.co_flags & inspect.CO_VARKEYWORDS:
                kwargs.update(loc[names[k]])
            fresh = args[0] if code.co_name == "__init__" and args else None  # a receiver yet to be built
            if i is not None:
                if tries[i] >= 10 * each or tries[i, "kept"] >= each:
                    return
                for j, x in enumerate(names[:n + code.co_kwonlyargcount]):
                    if inspect.isgenerator(loc[x]):  # recorded as an iterator over its items; the call gets
                        items, loc[x] = Recorder.drained(loc[x])  # them all the same (the frame takes loc)
                        if items is None:
                            return
                        if j < n:
                            args[j] = iter(items)
                        else:
                            kwargs[x] = iter(items)
                with contextlib.suppress(TypeError):
                    taken.update(type(v) for v in (*args, *kwargs.values()) if v is not fresh)
                keep(i, (tuple(args), kwargs), fresh)
                return
            for v in (*args, *kwargs.values()):
                try:  # a class its metaclass makes unhashable, say: never an error in the tests' code
                    if v is not fresh and pooled(type(v)):
                        keep(type(v), v, most=POOL_AT_MOST)
                except Exception:
                    pass

        sys.setprofile(profile)
        threading.setprofile(profile)

    @staticmethod
    def drained(gen, most=1000):
        """A generator's first items, and a generator that gives all the first would have: (items or None
        where it raised, the new generator). A profile function's changes to f_locals reach the frame."""
        items, error = [], None
        try:
            for x in gen:
                items.append(x)
                if len(items) >= most:
                    break
        except Exception as e:
            error = e

        def replay():
            yield from items
            if error is not None:
                raise error
            yield from gen
        return None if error else items, replay()

    def pytest_sessionfinish(self, session):
        sys.setprofile(None)
        with os.fdopen(int(self.out), "w") as f:
            json.dump(self.records, f)


RECORDER_MODULE = f"""import asyncio, contextlib, copyreg, enum, importlib, inspect, io, json, marshal, os, pickle, re
import sys, tempfile, threading, types, weakref
RECORD_AT_MOST, POOL_AT_MOST, CONFIG = {RECORD_AT_MOST}, {POOL_AT_MOST}, {CONFIG!r}
INPUT_AT_MOST, INPUTS_AT_MOST = {INPUT_AT_MOST}, {INPUTS_AT_MOST}
from collections import Counter
from pathlib import Path
{inspect.getsource(is_protected)}
{COPY_MODULE}
{inspect.getsource(Recorder)}
# popped: the tests never see them
_recorder = Recorder({{(p, q): i for p, q, i in json.loads(os.environ.pop("FEATDEL_TARGETS"))}},
                     os.environ.pop("FEATDEL_OUT"), os.environ.pop("FEATDEL_REPO"),
                     tuple(os.environ.pop("FEATDEL_ROOTS").split(os.pathsep)),
                     int(os.environ.pop("FEATDEL_EACH")))
pytest_sessionfinish = _recorder.pytest_sessionfinish
"""


class Tracer:
    """The tracing plugin. It runs inside the repository's pytest, not here: trace_tests writes this class's
    source into the plugin module it loads with -p, which makes one Tracer at import (before collection
    imports any of the package) and hands pytest its hooks. roots: the package folders; out: where the calls
    go, a JSON line as each test starts (["start", id]) and ends (["calls", id, [[file, qualname], ...]]), the
    calls outside tests under "<import>" and "<between>", then ["end"]: a run the profiler makes crash (a
    test of deep recursion) keeps what it traced, and trace_tests runs the rest without the test in flight."""

    def __init__(self, roots, out):
        self.out, self.current, self.calls = os.fdopen(int(out), "w", buffering=1), "<import>", {}
        keys = {}  # code object -> (file, qualname) inside the package, or None

        def profile(frame, event, arg):  # a closure, not a method: it runs on every call the tests make
            if event != "call":
                return
            code = frame.f_code
            key = keys.get(code, 0)
            if key == 0:  # first sight of this code object: inside the package or not
                path = os.path.realpath(code.co_filename)
                key = keys[code] = (path, code.co_qualname) if path.startswith(roots) else None
            if key is not None:
                self.calls.setdefault(self.current, set()).add(key)

        sys.setprofile(profile)
        threading.setprofile(profile)

    def write(self, *record):
        self.out.write(json.dumps(record) + "\n")

    def flush(self, *buckets):
        for b in buckets:
            self.write("calls", b, sorted(self.calls.pop(b, ())))

    def pytest_runtest_logstart(self, nodeid, location):
        # setup, call and teardown all count: a fixture that needs the feature breaks it
        self.flush("<import>", "<between>")
        self.write("start", nodeid)
        self.current = nodeid

    def pytest_runtest_logfinish(self, nodeid, location):
        self.current = "<between>"
        self.flush(nodeid)

    def pytest_sessionfinish(self, session):
        sys.setprofile(None)
        self.flush("<import>", "<between>")
        self.write("end")
        self.out.close()


TRACER_MODULE = f"""import json, os, sys, threading
{inspect.getsource(Tracer)}
_tracer = Tracer(tuple(os.environ.pop("FEATDEL_ROOTS").split(os.pathsep)), os.environ.pop("FEATDEL_OUT"))
pytest_runtest_logstart = _tracer.pytest_runtest_logstart
pytest_runtest_logfinish = _tracer.pytest_runtest_logfinish
pytest_sessionfinish = _tracer.pytest_sessionfinish
"""


def plugin_run(box, root, name, source, env, select=None, timeout=None, args=()):
    """One pytest run of root (select: node ids, as Sandbox.pytest) with one more plugin (source, loaded with
    -p name), which writes its result to the descriptor in FEATDEL_OUT: (report, what it wrote or None). A
    configuration that hands the tests to pytest-xdist's workers (addopts -n) runs them in this one process
    instead (-n 0): the plugin sees them only here."""
    opts = str(pytest_config(root).get("addopts", ""))
    here = ["-n", "0"] if re.search(r"(^|\s)(-n|--numprocesses|--dist)\b", opts) else []
    here += collect_args(root) if select is None else []
    with scratch() as tmp, tempfile.TemporaryFile() as fd:
        Path(tmp, f"{name}.py").write_text(source)
        r = box.pytest(root, ["-p", name, *here, *args], path=[tmp], pass_fds=[fd.fileno()], select=select,
                       timeout=timeout, extra_env={**env, "FEATDEL_OUT": str(fd.fileno())})
        return r, tail(fd, box.disk) or None  # whole: a large trace is over 64 MiB; bounded by RLIMIT_FSIZE
