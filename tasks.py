"""Verifiable RL tasks, with the reward a check the policy's code cannot forge.

Feature deletion on real codebases (Composer 2.5's synthetic tasks): cut a tested feature out of a Python
repository (stub: Commit0-style NotImplementedError; remove: the whole definition); the agent re-implements
it, and the repository's own tests (fail-to-pass and pass-to-pass sets) plus a hidden oracle are the reward.
The oracle is the gold code's results on the inputs the tests gave the feature and on held-out mutations of
them (EvalPlus), kept where no sandboxed process can read them and compared on the host with what a fresh
sandboxed child that imports only the solution returns: evidence the solution's code cannot forge, unlike
anything the test process reports. A solution may change only Python source inside the packages, read by a
host that never follows the work tree. The gold is in no form a sandboxed process can read: not in the
snapshot (a leak scan finds none of the deleted code in bytecode, type-checker caches, git history, archives
or build output), not in the task's interpreter (checked in the sandbox), not in the task's files. A task is
served only when its oracle compares held-out inputs on every feature and the tests plus the oracle kill most
of the gold's mutants (its strength, measured by mutation). A trajectory monitor flags
agent steps that read such leaks or prepare tampering (the post's reward hacks: a mypy cache read back for a
deleted signature, Java bytecode decompiled to rebuild an API). CodeEnv makes a task an RL environment: the
policy reads, searches, edits and tests through tool calls, and verify on its final tree is the reward;
micro-repositories are a family of such tasks a CPU model can learn. Sources: SWE-smith and R2E-Gym for tasks
made from real repositories with their tests as the verifier; EvalPlus (Liu et al. 2023) for held-out inputs.

The map, in file order:

    Make           make: baseline, map (trace_tests), pick (a function, or with --size module a class or a
                   module whole), delete, validate, scrub, scan, record the oracle, write a task; the
                   serving rule (coverage and strength)
    Splicing       delete_edit: byte ranges that delete a feature (stub or remove), the rest byte-identical
    Verify         verify: the oracle on the solution's packages, then the task's tests and canaries
    Deletion       the other role: deletion_spec (a feature to delete), judge_deletion (its reward),
                   task_from_deletion (a deletion that scores 1 -> a task)
    Edits          solution_files: source inside the packages only; static_findings, the static check
    Oracle         the recorded calls, the held-out ones, the gold's results twice (make_oracle); agrees: the
                   host's comparison with what the solution's child returns
    Strength       strength: the share of the gold's mutants the tests alone and the tests plus oracle kill
    Scan           fingerprints of the deleted code; scan: leak sources and what each holds; scrub
    Monitor        monitor: trajectory steps that read leak sources or the task's files, or prepare tampering
    Env, CodeEnv   the interface a trainer drives; the coding environment on a task make wrote, DeleteEnv
                   (the deletion role's, on a spec), Verifier (judges in a pool, at the pace of sampling)
    Micro          micro-repositories, their gold episodes, TaskPool (tasks made while training runs)
    Tool use       the arithmetic tool-use family (below), its transcripts and the DifficultySampler
    Survey         survey_one: a package off the index (or a local repository) through env, make and
                   verify, in a process of its own; survey_cli: one process, a shard, or torchrun's ranks
    Appendix       the command line (cli) and the demo

Tool use over small integers: the question is a nested expression such as `mul(add(3,4),2)`, the episode
offers only some of six tiny tools, the model calls them one at a time, innermost first (`call add(3,4)` ->
`7`, then `call mul(7,2)`), recovers from errors (`error: tool not found: ...`), and ends with `answer 14`;
the reward is 1 when the answer is right. Difficulty is the number of calls (1..4), and a DifficultySampler
serves the level at the model's frontier. Long episodes are chains of 8 x difficulty calls handed out one at a
time (`5. next: add 7`), longer than the context, so the policy summarizes; a slip or a capitalised `Call`
costs the final answer nothing, which is where targeted feedback, not the reward, has to teach. Sources:
Cursor's Composer 2.5 post (dynamic difficulty, the "Tool not found" -> "Reminder: Available tools" feedback
example); Toolformer (Schick et al. 2023) for text tool calls.

Standard library only: no torch, nothing of the project but harness/, the machinery that runs untrusted code
(a repository's tests, a solution), whose details no idea here depends on: harness/sandbox.py
(bubblewrap: an unprivileged user, no network, the host read-only, only a bounded tmpfs copy of its folder
writable, a timeout), harness/env.py (a venv per repository with its test requirements: `env`),
harness/repo.py (which files are source, a work tree read without trusting it), harness/child.py and
harness/plugins.py (the code that runs inside the sandboxed processes: the oracle's child, the tracer and
recorder plugins) and harness/survey.py (packages off the index). make takes a git checkout (each task records
the commit) and runs its tests with the interpreter from `env`. Tool calls: text here (`call add(3,4)`);
for a released model whose chat template has a format of its own, rollout hands an environment the call
parsed from it (declared(), text_call()).

    python tasks.py                # tool use: tasks, gold transcripts, a long chain, a scripted episode,
                                   # the difficulty sampler
    python tasks.py env --repo DIR --venv DIR   # the repository's test environment; prints its interpreter
    python tasks.py make --repo DIR --out DIR [--n N] [--mode stub|remove] [--group K] [--python PY]
                   [--strength K] [--size def|module]   # module: a class or a module removed whole
    python tasks.py delete-spec TASK_DIR --out DIR   # the deletion a task make wrote, as a DeleteEnv episode
    python tasks.py make --from-deletion SPEC_DIR --workdir DIR --out DIR   # a deletion (scored 1) -> a task
    python tasks.py verify TASK_DIR (--workdir DIR | --patch FILE) [--python PY] [--no-sandbox]
    python tasks.py strength TASK_DIR... [--k K] [--jobs J] [--min-strength 0.8]
    python tasks.py scan DIR [--task TASK.json] [--site-packages]
    python tasks.py monitor TRAJECTORY.jsonl [--task TASK_DIR]
    python tasks.py survey --draw 30 --out DIR  # make and verify on packages nobody here chose
    torchrun --nnodes N --nproc_per_node P tasks.py survey ... --out SHARED   # a share a rank, one index
    python tasks.py survey ... --shard K/N --out SHARED; python tasks.py merge --out SHARED   # job arrays
"""

import argparse
import ast
import codecs
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import difflib
import fnmatch
import functools
import hashlib
import inspect
import io
import itertools
import json
import os
import posixpath
import random
import re
import secrets
import shlex
import shutil
import signal
import site
import sqlite3
import stat
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import threading
import time
import tokenize
import traceback
import zipfile
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from harness import Refused, TaskError
from harness.child import HELD_OUT_AT_LEAST, INPUTS_AT_MOST, ORACLE_CHILD, RECORD_AT_MOST
from harness.env import (COMPILED, collect_args, installed_copies, interpreter_copies, make_env, old_config,
                         plugin_for, pytest_config)
from harness.plugins import RECORDER_MODULE, TRACER_MODULE, plugin_run
from harness.repo import (CONFIG, fresh_git, inside, is_protected, linked, lstat_tree, materialize,
                          package_files, package_name, package_roots, packages, read_regular, source_files,
                          walk)
from harness.sandbox import (PYTEST, READ_AT_MOST, STOPPING, Report, Sandbox, first_error, parsed, scratch,
                             stop, stoppable, tail)
from harness.survey import (SURVEY_PACKAGES, blank_row, die_with_parent, fetch_sdist, index, merge,
                            package_dir, survey, unnamed, valid_tasks, write_whole)


# -----------------------------------------------------------------------------
# Make: baseline, map, pick, delete, validate, scrub, scan, write.

TESTS_AT_MOST = 0.2  # a feature may be reached by at most this fraction of the suite
TRACE_SLOWER = 3  # the traced run's timeout, in plain runs' timeouts
REACH_STEPS = (TESTS_AT_MOST, 0.35, 0.5)  # ... or, while there are too few such features, this much

def reached(passed, calls):
    """{(file, qualname): the passing tests that call it}."""
    out = {}
    for t, keys in calls.items():
        if t in passed:
            for k in keys:
                out.setdefault(k, set()).add(t)
    return out


def defs_of(tree):
    """[(qualname, node)] of a module's top-level functions and its top-level classes' methods."""
    fn = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [(n.name, n) for n in tree.body if isinstance(n, fn)] + [
        (f"{c.name}.{n.name}", n) for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body
        if isinstance(n, fn)]


def candidates(root, passed, calls, at_import, reach=TESTS_AT_MOST, min_lines=2):
    """{(file, qualname): tests reaching it} for top-level functions and methods that at least min_lines of
    code, 1 to a share `reach` of the passing tests, and nothing at import reach."""
    limit, reach = max(1, int(reach * len(passed))), reached(passed, calls)
    out = {}
    for rel in source_files(root):
        for q, n in defs_of(ast.parse(Path(root, rel).read_bytes())):
            body = code_body(n)
            tests = reach.get((rel, q), set())
            if body and body[-1].end_lineno - body[0].lineno + 1 >= min_lines and 1 <= len(tests) <= limit \
                    and (rel, q) not in at_import:
                out[(rel, q)] = tests
    return out


def related(seed, cands, k):
    """The seed plus up to k-1 features in the same file that share its tests: harder, coupled deletions."""
    near = sorted((f for f in cands if f != seed and f[0] == seed[0] and cands[f] & cands[seed]),
                  key=lambda f: (-len(cands[f] & cands[seed]), f[1]))
    return [seed] + near[:k - 1]


def units(root, passed, calls, reach=TESTS_AT_MOST):
    """Features the size of a module: {(entities, functions): tests reaching them}. An entity is a top-level
    class whole (with the top-level functions of its file that only its tests reach: its helpers) or a module
    whole ("" for its qualname; not a package's __init__ or a one-module project), holding at least 2
    functions the tests reach, reached by 1 to a share `reach` of the passing tests. functions: the (file,
    qualname) of those reached, which the oracle records. (Code run at import may be in one: a unit is
    removed, so the whole suite runs without it and says which tests it breaks, and an import it breaks
    refuses it.)"""
    limit, hits, out = max(1, int(reach * len(passed))), reached(passed, calls), {}
    for rel in source_files(root):
        tree = ast.parse(Path(root, rel).read_bytes())
        classes = [c for c in tree.body if isinstance(c, ast.ClassDef)]
        here = {q: hits[(rel, q)] for q, _ in defs_of(tree) if (rel, q) in hits}
        groups = []
        for c in classes:
            family = [c.name]  # with its subclasses in the file, which could not be defined without it
            for d in classes:
                if d.name not in family and any(isinstance(b, ast.Name) and b.id in family for b in d.bases):
                    family.append(d.name)
            mine = [q for q in here if q.split(".")[0] in family and "." in q]
            tests = set().union(*(here[q] for q in mine))
            helpers = [q for q, t in here.items() if "." not in q and t <= tests]
            groups.append(([(rel, name) for name in family + helpers], mine + helpers))
        if Path(rel).name != "__init__.py" and rel not in packages(root):
            groups.append(([(rel, "")], list(here)))
        for ents, qs in groups:
            tests = set().union(*(here[q] for q in qs))
            if len(qs) >= 2 and 1 <= len(tests) <= limit:
                out[(tuple(ents), tuple((rel, q) for q in sorted(qs)))] = tests
    return out


def delete_features(snap, feats, mode):
    """Splice the features out of snap in place; returns (fingerprints, entities, originals,
    lines removed). A feature is a function, a method or a class by its qualname, or a module whole ("")."""
    by_file, originals, fps, ents, removed, modules, gone = {}, {}, [], [], 0, set(), set()
    for rel, q in feats:
        by_file.setdefault(rel, []).append(q)
    for rel, qs in by_file.items():
        src = originals[rel] = Path(snap, rel).read_bytes()
        tree = ast.parse(src)
        if "" in qs:  # the module whole: its file goes, and the imports of it and of its names
            Path(snap, rel).unlink()
            modules.add(module_name(rel))
            gone |= {t.id for n in tree.body for t in (n.targets if isinstance(n, ast.Assign) else [])
                     if isinstance(t, ast.Name)} | {n.name for n in tree.body if isinstance(
                         n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            ents.append(entity(rel, "", src))
            removed += ents[-1]["lines"]
            continue
        edits = [(n, delete_edit(src, n, mode)) for q in qs for n in [find_def(tree, q)]]
        new = apply_edits(src, [e for _, e in edits])
        Path(snap, rel).write_bytes(new)
        for q, (n, (a, b, _)) in zip(qs, edits):
            ents.append(entity(rel, q, src, src[a:b].count(b"\n") + 1))
            removed += ents[-1]["lines"]
    gone |= {q for _, q in feats if q and "." not in q}
    for _ in range(3) if mode == "remove" and (gone or modules) else []:
        # mend what would break import: __all__ entries, `from .mod import name` re-exports, imports of a
        # deleted module, and the statements that wire a deleted name in (an alias, a registration), whose
        # names are then gone too
        more = set()
        for rel in source_files(snap):
            src = Path(snap, rel).read_bytes()
            edits, wired = mend_edits(src, gone, modules, module_name(rel) if Path(rel).name == "__init__.py"
                                      else module_name(rel).rpartition(".")[0], originals.get(rel, src))
            if edits:
                originals.setdefault(rel, src)
                Path(snap, rel).write_bytes(apply_edits(src, edits))
            more |= wired - gone
        if not more:
            break
        gone |= more
    # a deleted line is evidence only if no Python file left behind (tests, other modules) has it too;
    # caches and build output do not count: they are what the scan is for
    kept = b"\n".join(Path(snap, r).read_bytes() for r in walk(snap)
                      if r.endswith(".py") and Path(r).parts[0] not in ROOT_DIRS
                      and not set(Path(r).parts) & set(ARTIFACT_DIRS)
                      and not Path(r).parts[0].endswith(".egg-info"))
    for e in ents:
        src = originals[e["file"]]
        if e["kind"] == "module":  # each of its definitions, and every line of it
            tree = ast.parse(src)
            text = src.decode("utf-8", "replace")
            fps += [fingerprint(e["file"], n.name, n, ast.get_source_segment(text, n, padded=True).encode(),
                                kept) for n in tree.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            fps.append(fingerprint(e["file"], "", tree, src, kept))
            continue
        n = find_def(ast.parse(src), e["qualname"])
        a, b, _ = delete_edit(src, n, mode)
        fps.append(fingerprint(e["file"], e["qualname"], n, src[a:b], kept))
    return fps, ents, originals, removed


def entity(rel, q, src, lines=None):
    """What a task tells of one deleted feature (qualname q of file rel, whose source is src): its kind,
    signature and docstring, and the lines deleted (by default the whole definition, or the whole module)."""
    tree = ast.parse(src)
    n = find_def(tree, q) if q else tree
    kind = ("module" if not q else "class" if isinstance(n, ast.ClassDef) else "method" if "." in q
            else "function")
    return {"file": rel, "qualname": q, "kind": kind, "docstring": ast.get_docstring(n),
            "signature": signature(n) if q else f"module {module_name(rel)}",
            "lines": lines or (n.end_lineno - n.lineno + 1 if q else src.count(b"\n") + 1)}


def prompt_for(ents, f2p):
    parts = ["This repository is missing a feature: the definitions below were deleted (stubbed to raise "
             "NotImplementedError, or removed entirely). Re-implement them so the failing tests pass and "
             "every other test keeps passing. Do not edit tests or test configuration.\n"]
    for e in ents:
        parts.append(f"- {e['file']}: the whole module, {e['lines']} lines" if e["kind"] == "module" else
                     f"- {e['file']}: {e['kind']} `{e['qualname']}`\n    {e['signature']}")
        if e["docstring"]:
            parts.append("    docstring: " + e["docstring"].strip().replace("\n", "\n    "))
    parts.append("\nTests that must pass:\n" + "\n".join(f"  {t}" for t in f2p[:20])
                 + (f"\n  ... and {len(f2p) - 20} more" if len(f2p) > 20 else ""))
    return "\n".join(parts)


def make_task(work, out, tid, feats, mode, stable, reach, box, source, splice=None, seconds=None):
    """(task, "ok") with out/tid written, or (None, why) with nothing left behind. Built aside and moved in
    whole on success, replacing a task of that id: a failed build never removes one made before. seconds:
    where the oracle's recording and runs add their time (clocked)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=f".making-{tid}-") as aside:
        try:
            task, why = build_task(work, Path(aside, tid), tid, feats, mode, stable, reach, box, source,
                                   splice, seconds)
        except (SyntaxError, AttributeError, TypeError, ValueError, OSError) as e:
            task, why = None, f"splice failed: {e!r}"
        if task is not None:
            retired = Path(aside, ".replaced")
            with contextlib.suppress(FileNotFoundError):
                os.rename(Path(out, tid), retired)
            os.rename(Path(aside, tid), Path(out, tid))
    return task, why


def build_task(work, tdir, tid, feats, mode, stable, reach, box, source, splice=None, seconds=None):
    """Delete feats from a copy of work and validate it: the tests that reach them (reach: node ids, from the
    trace) run with the feature deleted and again on the gold code; every other stable test's
    outcome is known from the baseline, as the trace says it never calls the feature. In remove mode the whole
    suite runs with the feature deleted (an import of the removed name breaks tests the trace cannot see). The
    whole required suite runs once at the end, in the gold's verify. splice(snap) deletes instead of make's
    splicing (a deletion judge_deletion scored 1), returning what delete_features does."""
    snap = tdir / "repo"
    shutil.copytree(work, snap, symlinks=True)
    fps, ents, originals, removed = (splice or (lambda snap: delete_features(snap, feats, mode)))(snap)
    for rel in originals:
        if Path(snap, rel).exists():  # a file the deletion removed comes back with the gold
            ast.parse(Path(snap, rel).read_bytes())
    # SHA-1 and SHA-256 (type-checker caches key on these) and the git blob id of each original file
    hashes = {rel: [hashlib.sha1(s).hexdigest(), hashlib.sha256(s).hexdigest(),
                    hashlib.sha1(b"blob %d\0" % len(s) + s).hexdigest()] for rel, s in originals.items()}
    task = {"id": tid, "source": source, "mode": mode, "fingerprints": fps, "original_hashes": hashes,
            # what the static check finds in the original files, a re-implementation may do as well
            "static_allowed": {rel: sorted(what for what, _ in static_findings(src))
                               for rel, src in originals.items()}}
    before = scan(snap, task)
    scrub(snap, before)
    # Validate on the scrubbed snapshot: imports, collects, breaks some tests, keeps others.
    for pkg in packages(snap):  # one that did not import before either (click-configfile's invoke tasks/
        rc, log = box.run(["-c", f"import {package_name(pkg)}"], snap)  # folder, invoke not installed) aside
        if rc and not box.run(["-c", f"import {package_name(pkg)}"], work)[0]:
            return None, f"package no longer imports: {log.strip().splitlines()[-1:]}"
    unrun = stable - reach  # their outcome is the baseline's
    with scratch() as tmp:  # tests may write files: run them on a throwaway copy
        shutil.copytree(snap, Path(tmp, "s"), symlinks=True)
        r = (box.pytest(Path(tmp, "s"), select=reach) if mode == "stub" else
             box.pytest(Path(tmp, "s"), collect_args(Path(tmp, "s"))))
        rc, broken, log = r.rc, r.passed | (unrun if mode == "stub" else set()), r.out
    if rc == 124:  # a deletion can make the suite far slower (packaging: past 300 s, where it passes in 80 s)
        return None, f"with the feature deleted the tests ran past the timeout of {box.timeout} s"
    if rc not in (0, 1) or "during collection" in log:
        return None, f"test collection broke (pytest exit {rc}): {first_error(log)}"
    after = scan(snap, task)
    if after:
        return None, f"scan not clean after scrub: {after[0]}"
    # The gold patch: originals written into a throwaway copy, diffed by git, kept outside the snapshot.
    # The copy's own run keeps only tests the original passes here (scrubbing egg-info can break one).
    with scratch() as tmp:
        g = Path(tmp, "g")
        shutil.copytree(snap, g, symlinks=True)
        for rel, src in originals.items():
            Path(g, rel).write_bytes(src)
        git(g, "add", "--intent-to-add", "--", *originals)  # a file the deletion removed is new in the diff
        (tdir / "gold.patch").write_bytes(git(g, "diff", "--binary"))
        with clocked(seconds, "oracle"):
            r, records = record_calls(g, feats, box, reach)
            oracle, task["oracle"] = make_oracle(g, feats, records, box)
    pkgs = packages(snap)
    # a doctest in a file the solution may edit is never a required test: rewriting it would pass it
    kept = {t for t in stable & (r.passed | unrun) if not editable(t.split("::")[0], pkgs)}
    for attempt in (1, 2):
        f2p, p2p = sorted(kept - broken), sorted(kept & broken)
        if not f2p or not p2p:
            return None, f"needs fail-to-pass and pass-to-pass tests, got {len(f2p)} and {len(p2p)}"
        task.update({"prompt": prompt_for(ents, f2p), "deleted": ents, "fail_to_pass": f2p,
                     "pass_to_pass": p2p, "python": box.python,
                     "test_command": ["python", *PYTEST, "<fail_to_pass + pass_to_pass ids>"],
                     "scan": {"before_scrub": before, "after_scrub": after},
                     "difficulty": {"entities": len(ents), "tests_failed": len(f2p),
                                    "lines_removed": removed}})
        (tdir / "task.json").write_text(json.dumps(task, indent=1))
        (tdir / "oracle.json").write_text(json.dumps(oracle))
        for f in ("gold.patch", "task.json", "oracle.json"):  # the host's alone (the sandbox runs as nobody)
            os.chmod(tdir / f, 0o600)
        missing, t0 = [], time.time()
        reward, why = verify(tdir, patch=tdir / "gold.patch", box=box, missing=missing)
        if reward == 1:
            return task | {"gold_s": time.time() - t0}, "ok"  # strength's mutants get a multiple of it
        # a test that passes in make's runs but not in verify's (flaky, or it needs what verify keeps
        # read-only) cannot judge a solution: dropped, and the gold verified once more
        if not missing or attempt == 2:
            break
        kept -= set(missing)
    return None, f"gold patch scores 0: {why}"  # restoring the original must make every required test pass


def git_source(repo):
    """Where the tasks come from, recorded in each task: the repository and its commit. Only refs are read (no
    status: a hostile .git/config can run commands from it), also in a checkout another user owns."""
    def rev_parse(*args):
        return subprocess.run(["git", "-c", "safe.directory=*", "-C", str(repo), "rev-parse", *args],
                              capture_output=True, text=True)
    top = rev_parse("--show-toplevel")
    if top.returncode:
        raise TaskError(f"{repo} is not a git repository (tasks record the commit they come from; for an "
                        f"unpacked sdist: git init && git add -A && git commit -m source)")
    return {"repo": Path(top.stdout.strip()).name,
            "commit": rev_parse("--verify", "-q", "HEAD").stdout.strip() or None}


# what earlier test runs leave in a checkout: never part of a task
DEBRIS = (".benchmarks", ".hypothesis", ".pytest_cache", ".tox", ".nox", "htmlcov", ".coverage",
          ".coverage.*")


# what a test that measures time is called: it passes or fails with the machine's load, so it is never
# required
TIMED = re.compile(r"(?i)perf(ormance)?|benchmark|timing|speed|latency|throughput|slow|timeout")


def timed(test):
    """Whether a test's name or its file's says it measures time."""
    return bool(TIMED.search(test.split("::")[-1]) or TIMED.search(Path(test.split("::")[0]).name))


def baseline(work, box, repo, log):
    """The suite run twice, once traced, past test files that fail to collect: (the tests that pass both
    times, less those that measure time, {test: functions it calls}, the functions called at import). Tasks
    stand on the tests that pass, as SWE-bench's PASS_TO_PASS does: a suite that mostly fails (an sdist
    without its tests' helper module, a dependency nothing declares) is said, with pytest's first error, and
    what passes is the baseline; one where fewer than 2 pass is refused."""
    r1, calls, at_import = trace_tests(work, box)
    r2 = box.pytest(work, collect_args(work))
    stable = {t for t in r1.passed & r2.passed if not timed(t)}
    bad = [t for t, o in (r2.outcomes or {}).items() if {"failed", "error"} & set(o.values())]
    log(f"baseline: {len(stable)} stable passing tests, {len(r1.passed ^ r2.passed)} flaky dropped"
        + (f", {len(bad)} failing ({first_error(r2.out)})" if bad else ""))
    if len(bad) > len(r2.passed) and len(stable) >= 2:
        log(f"  most of the suite fails in {repo}: tasks stand on the {len(stable)} tests that pass"
            + ("; a missing dependency? make its environment with `python tasks.py env --repo DIR --venv DIR`"
               " and pass --python" if box.prefix == box.base else ""))
    if len(stable) < 2:  # a task needs a test that fails without its feature and one that keeps passing
        raise TaskError(f"{'only 1' if stable else 'no'} test passes twice in {repo} "
                        f"({len(r1.passed)} passed in the first run, {len(r2.passed)} in the second; a task "
                        f"needs 2): {first_error(r2.out)}")
    return stable, calls, at_import


def trace_tests(root, box, tries=3):
    """One traced pytest run: (report, {node id: {(file, qualname)}}, the import-time set). A run the
    profiler makes crash (the interpreter dies in a test of deep recursion: no closing record) is run again
    without the test in flight and those already traced, up to tries times; that test is never traced, so
    never required."""
    root, calls, outcomes, skip = Path(root).resolve(), {}, {}, []
    for attempt in range(tries):
        # a profiler on every call: the traced run may take TRACE_SLOWER times a plain run's timeout
        r, raw = plugin_run(box, root, "_featdel_tracer", TRACER_MODULE,
                            {"FEATDEL_ROOTS": package_roots(root)}, timeout=TRACE_SLOWER * box.timeout,
                            args=[a for t in skip for a in ("--deselect", t)])
        if r.rc == 124:
            raise TaskError(f"the traced test suite ran past {TRACE_SLOWER} x the timeout of {box.timeout} s "
                            f"(make --timeout)")
        if r.rc == 5 and not outcomes:
            raise TaskError("pytest collected no tests")
        if raw is None:
            lines = r.out.strip().splitlines() or ["no output"]
            why = next((line.strip() for line in lines if "error:" in line), lines[-1].strip())
            # e.g. addopts = --cov=pkg, no pytest-cov
            opt = re.search(r"unrecognized arguments: (-[-\w]+)", why)
            if opt:
                plugin = plugin_for(opt[1]) or "a pytest plugin"
                why += (f" (the repository's pytest configuration needs {plugin}, not installed for "
                        f"{box.python}: make its environment with "
                        f"`python tasks.py env --repo DIR --venv DIR` and pass --python)")
            raise TaskError(f"the test suite did not run (pytest exit {r.rc}): {why}")
        records, bad = [parsed(line) for line in raw.splitlines()], False
        try:
            for x in records:
                bad |= not isinstance(x, list) or not x or x[0] not in ("start", "calls", "end")
                if not bad and x[0] == "calls":
                    calls.setdefault(x[1], set()).update((os.path.relpath(f, root), q) for f, q in x[2])
        except (IndexError, TypeError, ValueError):
            bad = True
        if bad:
            raise TaskError("the traced test run wrote a trace that is not the tracer's (the tests' code "
                            "wrote to its descriptor?)")
        outcomes.update(r.outcomes or {})
        started = [x[1] for x in records if x[0] == "start"]
        if ["end"] in records or not started or started[-1] in calls:
            break
        skip += [started[-1], *(t for t in started if t in calls and t not in skip)]  # the test in flight
    report = Report(r.rc, r.out, outcomes, r.end)
    return report, calls, calls.pop("<import>", set()) | calls.pop("<between>", set())


def make(repo, out, n=1, seed=0, mode="stub", group=1, box=None, log=print, reach=None, jobs=1,
         stats=None, min_lines=2, strength_k=0, size="def", deadline=None):
    """Up to n validated, scan-clean tasks from repo into out/; returns the task dicts. box: how the
    repository's tests run (default: this interpreter, in bubblewrap, 300 s a run); reach: the largest share
    of the suite a feature may be reached by (default: REACH_STEPS); jobs: tries run side by side; stats: a
    dict that gets the suite's size, the candidates, the tries and the test executions; strength_k: mutants
    each made task's strength is measured with (a verify each; 0, the default here, measures none, and an
    unmeasured task is not served; the command line measures STRENGTH_K); size: "def" (a function or method,
    with group-1 related ones) or "module" (a class with its helpers, or a module, removed whole: units);
    deadline: the time (time.time()) by which a survey's package must be done: a task's strength is measured
    only where it fits in what is left, the survey's two verifies of each task kept aside (a task not
    measured is made, not served)."""
    stats = {} if stats is None else stats
    seconds = stats.setdefault("seconds", {})  # by phase (clocked)
    repo, out, box = Path(repo), Path(out), box or Sandbox()
    if not repo.is_dir():
        raise TaskError(f"--repo is not a directory: {repo}")
    if not packages(repo):
        raise TaskError(f"no Python package (a folder with __init__.py) or single module imported by the "
                        f"tests at the top of {repo} or {repo}/src")
    named = pytest_config(repo).get("python_files", "")
    named = named if isinstance(named, list) else str(named).replace(",", " ").split()
    unseen = [r for r in walk(repo) if r.endswith(".py") and not is_protected(r)
              and any(fnmatch.fnmatch(Path(r).name, pat) for pat in named)]
    tested = any(r.endswith(".py") and is_protected(r) and Path(r).name not in CONFIG for r in walk(repo))
    if unseen and not tested:  # its only tests in files a solution could edit, or modules make cuts from
        raise TaskError(f"{repo}'s pytest configuration names test files (python_files = {' '.join(named)}) "
                        f"that are not tests by their names or folder, e.g. {unseen[0]}: make knows "
                        f"test_*.py, *_test.py and .py files in a tests/ or test/ folder")
    if unseen:  # its runs collect the test files among them (collect_args)
        log(f"python_files = {' '.join(named)} names the project's modules too (e.g. {unseen[0]}): its tests "
            f"are the test files")
    if not tested:
        raise TaskError(f"{repo} has no test files (test_*.py, *_test.py, tests.py, or .py files in a tests/ "
                        f"or test/ folder): its tests are the verifier (an sdist may ship none; take its "
                        f"source "
                        f"repository)")
    if n < 1 or group < 1 or jobs < 1 or reach is not None and not 0 < reach <= 1 or size not in SIZES:
        raise TaskError(f"--n, --group and --jobs must be >= 1, --reach in (0, 1], --size one of {SIZES}")
    source = git_source(repo)
    unparsed = sorted(set(source_files(repo, parse=False)) - set(source_files(repo)))
    if unparsed:
        log(f"left out, not Python this interpreter parses: {' '.join(unparsed)}")
    if box.sees(out):
        raise TaskError(f"--out {out} lies where the sandbox can read it: task files must be out of its "
                        f"reach")
    check_interpreter(box, repo)
    t0, executed = time.time(), box.executed
    with scratch() as tmp:
        work = Path(tmp, "repo")
        # leaks and all (the scan before scrubbing reports them), test-run debris aside
        shutil.copytree(repo, work, symlinks=True, ignore=shutil.ignore_patterns(*DEBRIS))
        for meta in [*work.glob("*.egg-info"), *work.glob("src/*.egg-info")]:  # an sdist's build metadata,
            shutil.rmtree(meta) if meta.is_dir() else meta.unlink()  # beside the venv's: its entry points
            # found twice (plaster-pastedeploy); the snapshot never holds it (scrub)
        for line in old_config(work):
            log(line)
        compiled = Path(box.prefix, COMPILED)  # from `env`: the package's compiled modules, put beside it
        for pkg in packages(work) if compiled.is_dir() else []:
            if (compiled / package_name(pkg)).is_dir() and not pkg.endswith(".py"):
                shutil.copytree(compiled / package_name(pkg), work / pkg, dirs_exist_ok=True)
        with clocked(seconds, "trace"):
            stable, calls, at_import = baseline(work, box, repo, log)
        stats["tests"] = len(stable)
        # by default a fifth of the suite, more while there are fewer than 2n candidates (a small library
        # whose every function most tests use); a given --reach is kept as given
        for r in [reach] if reach else REACH_STEPS:
            cands = (candidates(work, stable, calls, at_import, r, min_lines) if size == "def"
                     else units(work, stable, calls, r))
            if len(cands) >= 2 * n:
                break
        reach, limit = r, max(1, int(r * len(stable)))
        stats.update(limit=limit, candidates=len(cands))
        log(f"{len(cands)} candidate features (reached by 1..{limit} tests, not run at import): "
            + ", ".join(sorted(q if size == "def" else q or rel for f in cands
                               for rel, q in [f if size == "def" else f[0][0]])))
        if not cands:
            raise TaskError(f"no candidate feature in {repo}: " + (
                f"each function is reached by no passing test, by more than {limit} (--reach {reach} of "
                f"{len(stable)}), or runs at import" if size == "def" else
                f"no class or module holds 2 functions the tests reach, reached by 1 to {limit} tests "
                f"(--reach {reach} of {len(stable)})"))
        order = sorted(cands)
        random.Random(seed).shuffle(order)
        groups, taken = [], set()  # disjoint groups of features, tried in this order: (what is cut, the
        for f in order:            # functions the oracle records, the tests that reach them)
            cut, fns = (related(f, cands, group),) * 2 if size == "def" else map(list, f)
            if not taken & set(cut):
                tests = set().union(*(cands[g] for g in cut)) if size == "def" else cands[f]
                groups.append((cut, fns, tests))
                taken |= set(cut)
        # those whose every function the oracle can vary first: a task it cannot cover is made, then not served
        with clocked(seconds, "trace"):
            held = coverable(work, sorted({fn for _, fns, _ in groups for fn in fns}), box,
                             set().union(*(tests for *_, tests in groups)))
        stats["coverable"] = sum(set(fns) <= held.keys() for _, fns, _ in groups)
        log(f"{stats['coverable']} of {len(groups)} disjoint features have {HELD_OUT_AT_LEAST} inputs the "
            f"oracle can make on each function: tried first")
        # and of those, the ones whose every function takes an input before the ones the tests' own call
        # covers (no held-out input checks more than the tests: aiologic's current_green_task, 33% of its
        # mutants killed); at most 3n tries: a repository that keeps failing is not worth hours
        groups = sorted(groups, key=lambda g: (not set(g[1]) <= held.keys(),
                                               min(held.get(f, 0) for f in g[1]) == 0))[:3 * n]
        mode = mode if size == "def" else "remove"

        def attempt(i, feats):
            cut, fns, reaching = feats
            tid = f"{repo.resolve().name}-{i:03d}-" + hashlib.sha1(repr(cut).encode()).hexdigest()[:8]
            task, why = make_task(work, out, tid, fns, mode, stable, reaching, box, source,
                                  lambda snap: delete_features(snap, cut, mode), seconds)
            if task and size == "module" and len(task["fail_to_pass"]) > limit:  # removed, it breaks what
                shutil.rmtree(out / tid, ignore_errors=True)  # imports it: no feature of its own any more
                task, why = None, f"it breaks {len(task['fail_to_pass'])} tests, more than {limit} (--reach)"
            return tid, (task, why)
        tasks, tried, reasons = [], 0, []
        with clocked(seconds, "tries"), stoppable(jobs) as pool:
            todo = iter(enumerate(groups))
            running = collections.deque((feats, pool.submit(attempt, i, feats))
                                        for i, feats in itertools.islice(todo, jobs))
            while running:  # results are taken in order: the tasks do not depend on --jobs
                feats, fut = running.popleft()
                tid, (task, why) = fut.result()
                if len(tasks) >= n:  # a try started beside the last one needed
                    shutil.rmtree(out / tid, ignore_errors=True)
                    continue
                tried += 1
                o = task["oracle"] if task else {}
                log(f"  {tid}: {', '.join(q or rel for rel, q in feats[0])} -> {why}"
                    + (f" (fail-to-pass {len(task['fail_to_pass'])}, leaks scrubbed "
                       f"{len(task['scan']['before_scrub'])}, oracle {o['traced']} traced + {o['held_out']} "
                       f"held-out calls" + ("" if o["covered"] else f"; not served: {'; '.join(o['why'])}")
                       + ")" if task else ""))
                tasks += [task] if task else []
                reasons += [] if task else [why]
                while len(running) < jobs and len(tasks) < n:
                    i, f = next(todo, (None, None))
                    if f is None:
                        break
                    running.append((f, pool.submit(attempt, i, f)))
    executed = stats["executed"] = box.executed - executed
    stats.update(tried=tried, reasons=reasons)
    log(f"made {len(tasks)} tasks of {tried} tried in {time.time() - t0:.1f}s, "
        f"{sum(t['oracle']['covered'] for t in tasks)} covered by their oracle (at least {HELD_OUT_AT_LEAST} "
        f"held-out inputs a feature; the rest are not served); {executed} test executions"
        + (f", {executed / len(tasks):.0f} per task" if tasks else "")
        + ("" if len(tasks) >= n or not reasons else f"; the most common failure: "
           f"{collections.Counter(reasons).most_common(1)[0][0]}"))
    gold_s = [task.pop("gold_s") for task in tasks]  # (not in task.json: this machine's time, not the task's)
    for task, s in zip(tasks, gold_s) if strength_k else []:
        need = strength_k * s / jobs + 2 * sum(gold_s)  # its mutants' verifies, jobs at a time, and the rest
        if deadline and time.time() + need > deadline:
            log(f"{task['id']}: strength not measured, not served: it takes about {need:.0f} s, more than the "
                f"{max(0, deadline - time.time()):.0f} s the package has left")
            continue
        try:
            with clocked(seconds, "strength"):
                task["strength"] = strength(out / task["id"], strength_k, box, jobs=jobs, gold_s=s)
            log(strength_lines(task["id"], task["strength"]))
        except TaskError as e:  # a gold that fails now (a flaky test, say): that task is not served
            log(f"{task['id']}: strength not measured, not served: {e}")
    return tasks


PHASES = threading.Lock()


@contextlib.contextmanager
def clocked(seconds, phase):
    """The block's wall seconds added to seconds[phase] (seconds None: nothing), from any thread: where a
    package's time goes (the survey's throughput by phase)."""
    t0 = time.time()
    try:
        yield
    finally:
        if seconds is not None:
            with PHASES:
                seconds[phase] = seconds.get(phase, 0.0) + time.time() - t0


SIZES = ("def", "module")
MIN_STRENGTH = 0.8  # served only when the tests plus the oracle kill this share of the gold's mutants


def serving(task, min_strength=MIN_STRENGTH):
    """Why a task (its task.json) is not served to RL, a line a rule; none: it is. Coverage: its oracle,
    written by this version of tasks.py, compares HELD_OUT_AT_LEAST held-out inputs on every deleted
    feature. Strength: the tests plus the oracle kill at least min_strength of the gold's mutants."""
    why, oracle, strong = [], task.get("oracle") or {}, task.get("strength")
    if oracle.get("encoding") != ENCODING:
        why.append("its oracle was written by another version of tasks.py: make the task again")
    elif not oracle.get("covered"):
        why.append(f"its oracle has fewer than {HELD_OUT_AT_LEAST} held-out inputs on a feature"
                   + "".join(f"; {w}" for w in oracle.get("why", [])))
    again = task.get("verified_again")  # a survey's second verify: a gold or a snapshot that changed its mind
    if again and (again["gold"], again["untouched"]) != (1, 0):
        why.append(f"verified again, its gold scored {again['gold']} and its untouched snapshot "
                   f"{again['untouched']} (1 and 0 expected)")
    if strong is None:
        why.append("its strength was never measured (tasks.py strength)")
    elif strong["score"] < min_strength:
        why.append(f"its tests and oracle kill {strong['score']:.0%} of the gold's mutants, under "
                   f"{min_strength:.0%}")
    return why


def served(out, refused=None, min_strength=MIN_STRENGTH):
    """The task folders in out that RL is served (by TaskPool, train.py --task-dir): those serving() finds
    nothing against. refused: a dict that gets each other task folder's reasons."""
    found, refused = [], {} if refused is None else refused
    for d in sorted(Path(out).iterdir()):
        if (d / "task.json").is_file():
            why = serving(json.loads((d / "task.json").read_text()), min_strength)
            if why:
                refused[d] = why
            else:
                found.append(d)
    return found


# -----------------------------------------------------------------------------
# Splicing: edits are (start, end, replacement) byte ranges; everything outside them stays byte-identical.
# ast columns are UTF-8 byte offsets, so all of this works on bytes.

def line_starts(src):
    return [0] + [i + 1 for i, b in enumerate(src) if b == 10]


def apply_edits(src, edits):
    for start, end, new in sorted(edits, reverse=True):
        src = src[:start] + new + src[end:]
    return src


def parameters(args):
    """A def's parameter names, in order (ast.arguments)."""
    return [a.arg for a in [*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg] if a]


def find_def(tree, qualname):
    """The definition qualname names in tree: at each level the last of that name, the one Python binds
    (before it: `@overload` stubs, or a definition a later one replaces). -> the node, or None."""
    node, body = None, tree.body
    for part in qualname.split("."):
        node = ([n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part] or [None])[-1]
        if node is None:
            return None
        body = node.body
    return node


def code_body(node):
    """The statements after the docstring."""
    first = node.body[0]
    has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
               and isinstance(first.value.value, str))
    return node.body[1:] if has_doc else node.body


def delete_edit(src, node, mode):
    """stub: keep signature and docstring, raise NotImplementedError; remove: drop the whole definition."""
    ls = line_starts(src)
    if mode == "stub":
        body = code_body(node)
        start = ls[body[0].lineno - 1] + body[0].col_offset
        return start, ls[body[-1].end_lineno - 1] + body[-1].end_col_offset, b"raise NotImplementedError"
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    end = ls[node.end_lineno] if node.end_lineno < len(ls) else len(src)
    return ls[first - 1], end, b""


def top_names(tree):
    """The names a module's top-level statements bind: definitions, assignments, imports."""
    out = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            out |= {t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    for t in ast.walk(t) if isinstance(t, ast.Name)}
    return out


def mend_edits(src, names, modules=(), package="", was=None):
    """(edits, names they unbind): edits that drop removed top-level names from __all__ and from
    `from .x import name` re-exports, (modules: dotted names of deleted modules; package: the one src is in)
    every top-level import of those modules, and (was: src before the deletion) every top-level statement
    that uses a name src no longer binds (an alias, a registration), in turn."""
    tree, ls, edits, unbound = ast.parse(src), line_starts(src), [], set()
    off = lambda ln, col: ls[ln - 1] + col
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            whole = ".".join(filter(None, [base, node.module or ""]))
            keep = [] if whole in modules else [a for a in node.names if a.name not in names
                                                and f"{whole}.{a.name}" not in modules]
        elif isinstance(node, ast.Import):
            keep = [a for a in node.names
                    if not any(a.name == m or a.name.startswith(m + ".") for m in modules)]
        if isinstance(node, (ast.Import, ast.ImportFrom)) and len(keep) < len(node.names):
            text = ("pass" if not keep else ("import " if isinstance(node, ast.Import) else
                                             f"from {'.' * node.level}{node.module or ''} import ")
                    + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in keep))
            edits.append((off(node.lineno, node.col_offset), off(node.end_lineno, node.end_col_offset),
                          text.encode()))
            unbound |= {(a.asname or a.name).split(".")[0] for a in node.names if a not in keep}
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign) else [])
        if (any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
                and isinstance(node.value, (ast.List, ast.Tuple))):
            elts = node.value.elts
            for i, e in enumerate(elts):
                if isinstance(e, ast.Constant) and e.value in names:
                    # take the element up to the next one (its comma and spacing go with it), the
                    # last one with its trailing comma
                    end = (off(elts[i + 1].lineno, elts[i + 1].col_offset) if i + 1 < len(elts)
                           else off(e.end_lineno, e.end_col_offset))
                    end += len(re.match(rb"\s*,?", src[end:]).group()) if i + 1 == len(elts) else 0
                    edits.append((off(e.lineno, e.col_offset), end, b""))
    dead = (top_names(ast.parse(was)) - top_names(tree) if was else set()) | unbound
    wired = set()
    for node in tree.body:  # in order: a statement's targets are dead for the statements after it
        uses = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)) and uses & dead:
            edits.append((ls[node.lineno - 1], ls[node.end_lineno] if node.end_lineno < len(ls) else len(src),
                          b""))
            dead |= (bound := top_names(ast.Module([node], [])))
            wired |= bound
    return edits, wired


# -----------------------------------------------------------------------------
# Verify: the oracle on the solution's packages, then the task's tests, each in its own sandbox.
#
# The tests run the solution's code inside pytest's process, so that process can forge anything it prints or
# reports; its outcomes are read from the verifier's own plugin (Reporter), and two canary tests, named from
# the words of the file's own tests, are appended to a fresh copy of one test file: one must fail, one must
# pass. Code that patches the runner blindly (Function.runtest, TestReport, CallInfo) makes the must-fail
# canary pass or loses the closing record. Code that knows this verifier can still forge the test run: the
# oracle is the evidence it cannot forge.

def protected_paths(root, need=()):
    """The files of the tests (all of a test folder's), the configuration files and the files of required
    tests (documentation with doctests) in root: a run may read them, not change them. The folders stay
    writable, since many suites write output beside their tests (xlwt's tests/output/); a tree whose binds
    would take more than BIND_ARGS_AT_MOST of bubblewrap's arguments (3 a file, 4 a folder it makes for them)
    gets its outermost test folders read-only instead."""
    tested = {t.split("::")[0] for t in need}
    files = [Path(root, rel) for rel in walk(root) if is_protected(rel) or rel in tested]
    folders = {d for f in files for d in f.relative_to(root).parents[:-1]}
    if 3 * len(files) + 4 * len(folders) <= BIND_ARGS_AT_MOST:
        return files
    out = []
    for rel in walk(root):
        parts = Path(rel).parts
        cut = next((i for i, x in enumerate(parts[:-1]) if x in ("tests", "test", "testing")), None)
        path = (Path(root, *parts[:cut + 1]) if cut is not None
                else Path(root, rel) if is_protected(rel) or rel in tested else None)
        if path and path.exists() and path not in out:
            out.append(path)
    return out


# bubblewrap's arguments a run's read-only binds of single files may take; past that, whole folders
# (bubblewrap takes at most 9000 in all: Pygments' 2,363 test files in 600-odd folders made every run of its
# suite fail to start)
BIND_ARGS_AT_MOST = 7500


def add_canaries(work, need):
    """Append a must-pass and a must-fail test to one of the required tests' files in work, named from the
    words of that file's tests after the solution is fixed: (must-pass id, must-fail id). A file whose
    required tests are its doctests (`mod.py::pkg.mod.f`, under --doctest-modules) is a source module, where
    pytest collects no test function: not one of them."""
    rng = random.Random(secrets.randbits(64))
    test_function = lambda t: "::" in t and "." not in re.sub(r"\[.*", "", t.partition("::")[2])
    files = sorted({t.split("::")[0] for t in need if test_function(t) and t.split("::")[0].endswith(".py")})
    home = rng.choice(files) if files else f"test_{secrets.token_hex(3)}.py"
    text = Path(work, home).read_text() if files else ""
    words = sorted({w for name in re.findall(r"^\s*def test_(\w+)", text, re.M)
                    for w in name.split("_") if w})
    taken, names = set(re.findall(r"\b(test_\w+)", text)), []
    while len(names) < 2:
        name = ("test_" + "_".join(rng.sample(words or ["case"], min(2, len(words) or 1)))
                + str(rng.randrange(2, 99)))
        if name not in taken | set(names):
            names.append(name)
    a = rng.randrange(10**6)
    Path(work, home).write_text(text.rstrip("\n") + f"\n\n\ndef {names[0]}():\n    pass\n\n\n"
                                f"def {names[1]}():\n    assert {a} == {a + 1}\n")
    return f"{home}::{names[0]}", f"{home}::{names[1]}"


def canaries_behave(outcomes, must_pass, must_fail):
    """Whether the must-pass canary passed and the must-fail one failed in its call, each as itself or, where
    a conftest parametrizes every test (pygal's pytest_generate_tests: `test_x[lxml]`, `test_x[etree]`), in
    every instance of it."""
    runs = lambda canary: [o for t, o in outcomes.items() if t == canary or t.startswith(canary + "[")]
    return bool(runs(must_pass)) and all(set(o.values()) == {"passed"} and "call" in o for o in runs(must_pass)) \
        and bool(runs(must_fail)) and all(o.get("call") == "failed" for o in runs(must_fail))


def tests_verdict(r, need, must_pass, must_fail, missing=None):
    """Why the verifier's report of a test run fails the solution, or None. missing: as verify's."""
    rc, outcomes, passed = r.rc, r.outcomes, r.passed
    if outcomes is None:
        return f"runner tampered: the verifier's report is not what its plugin writes; pytest exit {rc}"
    if r.end is None:
        return f"runner tampered or crashed: pytest's session never finished; pytest exit {rc}"
    failed = [t for t in need if t not in passed]
    (missing if missing is not None else []).extend(failed)
    if failed:
        return f"{len(failed)} of {len(need)} required tests did not pass (skipped counts as failed), " \
               f"e.g. {failed[0]}; pytest exit {rc}"
    if not canaries_behave(outcomes, must_pass, must_fail):
        return f"runner tampered: a canary did not behave ({outcomes.get(must_fail)}, " \
               f"{outcomes.get(must_pass)}); pytest exit {rc}"
    if rc != 1 or r.end != 1:
        return f"all {len(need)} required tests passed but pytest exited {rc} " \
               f"(1 expected: the must-fail canary alone fails)"
    return None


def patched(snap, patch, dest):
    """Copy snap to dest and apply patch there with git: None, or why it does not apply."""
    shutil.copytree(snap, dest, symlinks=True)
    p = subprocess.run(["git", "apply", "--whitespace=nowarn", str(Path(patch).resolve())],
                       cwd=dest, capture_output=True, text=True, timeout=60)
    return p.stderr.strip()[:200] if p.returncode else None


def verify(task_dir, workdir=None, patch=None, box=None, missing=None, verdicts=None):
    """(reward, reason). Reward 1 only when the solution changes nothing but Python source inside the
    packages, the oracle agrees with the gold on every recorded call, and the verifier's own report says every
    required test passed, both canaries behaved and pytest's exit code is 1 (the must-fail canary's failure,
    nothing else). box: how code runs (default: the task's interpreter, in bubblewrap); its timeout bounds the
    whole verify. missing: a list that gets the required tests that did not pass (make drops those that fail
    on the gold). verdicts: a dict that gets each judge's reason for 0 (None: it passed) under "oracle" and
    "tests"; given, the tests run even when the oracle disagrees (strength counts both)."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise TaskError(f"no such task folder: {task_dir}")
    if not (task_dir / "task.json").is_file():
        raise TaskError(f"no task.json in {task_dir}")
    task, snap = json.loads((task_dir / "task.json").read_text()), task_dir / "repo"
    box = box or Sandbox(python=task.get("python", sys.executable), timeout=600)
    if box.sees(task_dir):
        raise TaskError(f"{task_dir} lies where the sandbox can read it: task files must be out of its reach")
    check_interpreter(box, snap)
    deadline = time.time() + box.timeout
    oracle = json.loads((task_dir / "oracle.json").read_text()) if (task_dir / "oracle.json").is_file() \
        else {"calls": []}
    if oracle["calls"] and oracle.get("encoding") != ENCODING:
        raise TaskError(f"{task_dir / 'oracle.json'} was written by another version of tasks.py (its "
                        f"encoding {oracle.get('encoding')}, this one {ENCODING}): make the task again")
    with scratch() as tmp:
        if patch is not None:  # a patch is applied to its own copy of the snapshot, then read like a work dir
            workdir = Path(tmp, "agent")
            if (error := patched(snap, patch, workdir)) is not None:
                return 0, f"patch does not apply: {error}"
        if not Path(workdir).is_dir():
            raise TaskError(f"no such work dir: {workdir}")
        try:
            files, deleted = solution_files(snap, workdir, deadline, task.get("static_allowed"))
            work = materialize(snap, {**files, **dict.fromkeys(deleted)}, Path(tmp, "repo"))
        except (Refused, TaskError) as e:
            return 0, f"rejected: {e}"
        disagrees = None
        if oracle["calls"]:  # before the tests: their run may rewrite the solution's own files
            got = oracle_run(box, work, oracle["features"], [c[:2] for c in oracle["calls"]],
                             timeout=max(1, deadline - time.time()))
            wrong = [k for k, c in enumerate(oracle["calls"]) if not agrees(c[2], got.get(k, "no result"))]
            if wrong:
                held = sum(oracle["calls"][k][3] == "held-out" for k in wrong)
                first = got.get(wrong[0], "gave no result")  # what it returned, never what was expected
                with contextlib.suppress(ValueError, RecursionError, TypeError, IndexError):
                    first = "raises " + ".".join(json.loads(first[7:])[0]) if first.startswith("raises ") \
                        else first
                first = " ".join(first.split())[:160]  # with the state the call left
                disagrees = (f"the oracle disagrees on {len(wrong)} of {len(oracle['calls'])} calls ({held} "
                             f"of them held-out), e.g. the solution {first}")
                if verdicts is None:
                    return 0, disagrees
        need = task["fail_to_pass"] + task["pass_to_pass"]
        must_pass, must_fail = add_canaries(work, need)
        files = sorted({t.split("::")[0] for t in [*need, must_pass]})  # whole files: far faster than ids
        r = box.pytest(work, files, readonly=protected_paths(work, need),
                       timeout=max(1, deadline - time.time()))
    failing = tests_verdict(r, need, must_pass, must_fail, missing)
    if verdicts is not None:
        verdicts.update(oracle=disagrees, tests=failing)
    if disagrees or failing:
        return 0, disagrees or failing
    return 1, (f"all {len(task['fail_to_pass'])} fail-to-pass and {len(task['pass_to_pass'])} pass-to-pass "
               f"tests passed, canaries intact; "
               + (f"the oracle agrees on {len(oracle['calls'])} calls" if oracle["calls"] else "no oracle"))


# -----------------------------------------------------------------------------
# Deletion: the other role. A task-maker (make's splicing, or a policy in an episode) is handed a repository
# and a feature named by the tests that check it, and deletes it. The host judges the deletion as verify
# judges a re-implementation: edits confined to Python source inside the packages (solution_files), every
# package still imports, every target test stops passing while every other stable test still passes (the
# canaries watch the runner), and none of the feature's code is left in the tree: make's scan with its
# fingerprints, and stricter (feature_left), any line of its body however short (commented out, moved) and a
# definition with its body under any name. A deletion that scores 1 is a task's snapshot, the original its
# gold.

def deletion_spec(work, out, feats, targets, keep, box, source=None):
    """A deletion to make, written to out: repo/ (work's files, artifacts scrubbed) and spec.json (the feature
    [(file, qualname)], the tests that must stop passing, those that must keep passing, the fingerprints of
    the feature's code, the interpreter), spec.json readable by the host alone. -> the spec."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(work, out / "repo", symlinks=True)
    scrub(out / "repo", scan(out / "repo"))
    with scratch() as tmp:  # the fingerprints of the feature as make would delete it, the rest kept
        shutil.copytree(out / "repo", Path(tmp, "r"), symlinks=True)
        fps = delete_features(Path(tmp, "r"), feats, "stub")[0]
        kept = b"\n".join(Path(tmp, "r", r).read_bytes() for r in walk(Path(tmp, "r")) if r.endswith(".py"))
    for fp in fps:  # stricter than make's: a deletion must leave no line of the body, however short, and no
        # copy of it under another name
        src = Path(out, "repo", fp["file"]).read_bytes()
        node = find_def(ast.parse(src), fp["qualname"]) if fp["qualname"] else ast.parse(src)  # "": a module
        body = src.split(b"\n")[code_body(node)[0].lineno - 1:code_body(node)[-1].end_lineno]
        fp["body_hash"] = ast_hash(node, named=False)
        fp["body_lines"] = sorted({s.strip().decode("utf-8", "replace") for s in body if len(s.strip()) >= 6
                                   and not s.strip().startswith(b"#") and s.strip() not in kept})
    spec = {"feature": [list(f) for f in feats], "targets": sorted(targets), "keep": sorted(keep),
            "fingerprints": fps, "python": box.python, "source": source,
            # what the static check finds in the original source, a deletion may leave as it is
            "static_allowed": {rel: sorted(what for what, _ in static_findings(Path(out, "repo", rel)
                                                                               .read_bytes()))
                               for rel in source_files(out / "repo")}}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    os.chmod(out / "spec.json", 0o600)
    return spec


def spec_from_task(task_dir, out, box=None):
    """The deletion a task make wrote, as a spec: its original (the snapshot with the gold patch applied), the
    feature it deleted, and its required tests split by a run on its snapshot: those that do not pass there
    must stop passing, the rest keep passing. (make's fail-to-pass set can miss a test that reaches the
    feature where its trace cannot see, through a subprocess; such a test is a pass-to-pass one there.)"""
    task_dir = Path(task_dir)
    if not (task_dir / "task.json").is_file():
        raise TaskError(f"no task at {task_dir}: no task.json")
    task = json.loads((task_dir / "task.json").read_text())
    box = box or Sandbox(python=task.get("python", sys.executable))
    need = task["fail_to_pass"] + task["pass_to_pass"]
    with scratch() as tmp:
        if (error := patched(task_dir / "repo", task_dir / "gold.patch", Path(tmp, "orig"))) is not None:
            raise TaskError(f"{task_dir}: its gold patch does not apply: {error}")
        shutil.copytree(task_dir / "repo", Path(tmp, "deleted"), symlinks=True)
        r = box.pytest(Path(tmp, "deleted"), sorted({t.split("::")[0] for t in need}),
                       readonly=protected_paths(Path(tmp, "deleted"), need))
        if r.outcomes is None or r.end is None:  # a run cut short passes nothing: every test a target
            raise TaskError(f"{task_dir}: the test run of its snapshot did not finish (pytest exit {r.rc}): "
                            f"{first_error(r.out)}")
        passed = r.passed
        if passed >= set(need):
            raise TaskError(f"{task_dir}: every required test passes on its snapshot: no feature to delete")
        return deletion_spec(Path(tmp, "orig"), out, [(e["file"], e["qualname"]) for e in task["deleted"]],
                             [t for t in need if t not in passed], [t for t in need if t in passed], box,
                             task.get("source"))


STUB = ("raise NotImplementedError", "raise NotImplementedError()", "pass", "...", "return", "return None")


def beyond_deletion(snap, files, deleted, feats):
    """Why a deletion does more than take the feature out, or None. Against the original (snap), a file may
    only lose statements: the feature's definitions (or a body of theirs, left as a stub under the same
    signature and docstring: STUB), imports and __all__ entries (kept or shrunk), and top-level statements
    that use a name the file no longer binds (an alias, a registration); a whole file only where it is all
    feature. Nothing is added, no file, no comment, no other definition changed: so no copy of the feature
    survives in any form (encoded, renamed, behind a condition) and nothing else is taken with it."""
    by_file = {}
    for rel, q in feats:
        by_file.setdefault(rel, set()).add(q)
    for rel in deleted:  # a module whole, or one whose every definition is the feature's
        mine = by_file.get(rel, set())
        if "" not in mine and not (mine and rel.endswith(".py") and {
                n.name for n in ast.parse(Path(snap, rel).read_bytes()).body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} <= mine):
            return f"it deletes {rel}, which holds more than the feature"
    for rel, data in sorted(files.items()):
        if not Path(snap, rel).is_file():
            return f"it adds {rel}: a deletion only takes code out"
        old = Path(snap, rel).read_bytes()
        said = Counter(comments(old))
        if Counter(comments(data)) - said:
            return f"it adds a comment to {rel}: {next(iter(Counter(comments(data)) - said))[:80]}"
        before, after = ast.parse(old), ast.parse(data)
        gone = top_names(before) - top_names(after)
        why = only_taken(before.body, after.body, "", by_file.get(rel, set()), gone | {
            q for q in by_file.get(rel, ()) if q and "." not in q})
        if why:
            return f"{rel}: {why}"
    return None


def comments(src):
    """The comments of Python source, each as written."""
    with contextlib.suppress(tokenize.TokenError, SyntaxError, IndentationError):
        return [t.string for t in tokenize.tokenize(io.BytesIO(src).readline) if t.type == tokenize.COMMENT]
    return []


def only_taken(old, new, prefix, feats, dead):
    """Why the statements new are more than old less the feature (see beyond_deletion), or None. prefix:
    the qualname the statements lie in; feats: the feature's qualnames in this file; dead: the names the
    module no longer binds."""
    dump = lambda s: ast.dump(s, include_attributes=False)
    name = lambda s: getattr(s, "name", None)
    is_all = lambda s: isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__all__"
        for t in getattr(s, "targets", [getattr(s, "target", 0)]))
    aliases = lambda s: {(getattr(s, "module", None), getattr(s, "level", 0), a.name, a.asname)
                         for a in s.names}
    head = lambda n: "".join(map(dump, [n.args] if hasattr(n, "args") else n.bases + n.keywords)) \
        + "".join(map(dump, n.decorator_list))  # a definition's signature, bases and decorators
    ops = difflib.SequenceMatcher(None, [*map(dump, old)], [*map(dump, new)], autojunk=False).get_opcodes()
    dropped = [s for tag, i1, i2, _, _ in ops if tag != "equal" for s in old[i1:i2]]
    added = [s for tag, _, _, j1, j2 in ops if tag != "equal" for s in new[j1:j2]]
    imported = set().union(*(aliases(s) for s in dropped if isinstance(s, (ast.Import, ast.ImportFrom))))
    listed = {e.value for s in dropped if is_all(s) for e in ast.walk(s) if isinstance(e, ast.Constant)}
    defs, paired = {name(s): s for s in dropped if name(s)}, set()
    for s in added:  # a shrunk import or __all__, a pass, or a new version of a definition taken out
        if isinstance(s, (ast.Import, ast.ImportFrom)) and aliases(s) <= imported or isinstance(s, ast.Pass) \
                or is_all(s) and s.value is not None and all(
                    isinstance(e, ast.Constant) and e.value in listed for e in getattr(s.value, "elts", [0])):
            continue
        o, q = defs.get(name(s)), f"{prefix}{name(s)}"
        if o is None or type(o) is not type(s) or name(s) in paired:
            return f"line {s.lineno} adds code: a deletion only takes code out"
        paired.add(name(s))
        if head(o) != head(s):
            return f"{q} changes its signature, bases or decorators"
        if q in feats:  # a stub: its docstring as it was, then one stub statement
            doc = ast.get_docstring(o, clean=False)
            body = s.body[1:] if doc is not None and ast.get_docstring(s, clean=False) == doc else s.body
            if len(body) == 1 and ast.unparse(body[0]) in STUB:
                continue
            return f"{q} is changed, not stubbed (its docstring, then one of: {', '.join(STUB)})"
        if not isinstance(s, ast.ClassDef):
            return f"{q} changes, and it is not the feature"
        if why := only_taken(o.body, s.body, q + ".", feats, set()):
            return why
    for s in dropped:  # what goes: the feature, imports, __all__, and what used a name that is gone
        if name(s) in paired or name(s) and f"{prefix}{name(s)}" in feats or is_all(s) \
                or isinstance(s, (ast.Import, ast.ImportFrom, ast.Pass)):
            continue
        if not name(s) and prefix == "" and {n.id for n in ast.walk(s) if isinstance(n, ast.Name)} & dead:
            continue
        return f"{prefix}{name(s) or f'line {s.lineno}'} is taken out, and it is not the feature"
    return None


def judge_deletion(spec_dir, workdir, box=None):
    """(reward, reason) of the deletion in workdir against spec_dir's original: 1 only when it changes nothing
    but source inside the packages, every package imports, the target tests all stop passing, every kept test
    and the must-pass canary pass, the must-fail canary fails, and the scan finds none of the feature's
    code."""
    spec_dir = Path(spec_dir)
    spec, snap = json.loads((spec_dir / "spec.json").read_text()), spec_dir / "repo"
    box = box or Sandbox(python=spec.get("python", sys.executable), timeout=600)
    deadline = time.time() + box.timeout
    with scratch() as tmp:
        try:
            files, deleted = solution_files(snap, workdir, deadline, spec["static_allowed"])
            work = materialize(snap, {**files, **dict.fromkeys(deleted)}, Path(tmp, "repo"))
        except (Refused, TaskError) as e:
            return 0, f"rejected: {e}"
        if not files and not deleted:
            return 0, "nothing deleted: the tree is the original"
        if why := beyond_deletion(snap, files, deleted, [tuple(f) for f in spec["feature"]]):
            return 0, f"not a deletion: {why}"
        for pkg in packages(snap):
            rc, log = box.run(["-c", f"import {package_name(pkg)}"], work)
            if rc and not box.run(["-c", f"import {package_name(pkg)}"], snap)[0]:
                return 0, f"{package_name(pkg)} no longer imports: {log.strip().splitlines()[-1:]}"
        left = [(f["path"], f["evidence"]) for f in scan(work, spec) if f["kind"] == "text"]
        left += feature_left(work, spec)
        if left:
            return 0, f"the feature's code is still in {left[0][0]}: {left[0][1][:120]}"
        need = spec["targets"] + spec["keep"]
        must_pass, must_fail = add_canaries(work, need)
        r = box.pytest(work, sorted({t.split("::")[0] for t in [*need, must_pass]}),
                       readonly=protected_paths(work, need), timeout=max(1, deadline - time.time()))
    if r.outcomes is None or r.end is None:
        return 0, f"runner tampered or crashed: no report of the run; pytest exit {r.rc}"
    still = [t for t in spec["targets"] if t in r.passed]
    broken = [t for t in spec["keep"] if t not in r.passed]
    if still or broken:  # a 0 whatever the runner did; a 1 below rests on the canaries too
        return 0, (f"{len(still)} of {len(spec['targets'])} target tests still pass, e.g. {still[0]}"
                   if still else f"{len(broken)} of {len(spec['keep'])} other tests no longer pass, e.g. "
                                 f"{broken[0]}")
    if not canaries_behave(r.outcomes, must_pass, must_fail):
        return 0, "runner tampered: a canary did not behave"
    return 1, f"all {len(spec['targets'])} target tests stop passing, all {len(spec['keep'])} others pass, " \
              f"none of the feature's code left"


def task_from_deletion(spec_dir, workdir, out, tid, box=None):
    """A re-implementation task made from a deletion that judge_deletion scores 1: its tree the snapshot, the
    original the gold, validated by build_task like any of make's (scrubbed and scanned, the oracle recorded
    on the original, the gold verified 1). -> (task, "ok") with out/tid written, or (None, why)."""
    spec_dir = Path(spec_dir)
    if not (spec_dir / "spec.json").is_file() or not Path(workdir).is_dir():
        raise TaskError(f"no deletion spec at {spec_dir} (delete-spec writes one)" if Path(workdir).is_dir()
                        else f"no such work dir: {workdir}")
    spec, orig = json.loads((spec_dir / "spec.json").read_text()), spec_dir / "repo"
    box = box or Sandbox(python=spec.get("python", sys.executable), timeout=600)
    reward, why = judge_deletion(spec_dir, workdir, box)
    if reward != 1:
        return None, f"not a valid deletion: {why}"
    files, deleted = solution_files(orig, workdir, time.time() + box.timeout, spec["static_allowed"])
    feats = [tuple(f) for f in spec["feature"]]
    kept = all(find_def(ast.parse(files.get(rel, Path(orig, rel).read_bytes())), q) is not None
               for rel, q in feats if rel not in deleted)

    def splice(snap):
        for rel in deleted:
            Path(snap, rel).unlink()
        for rel, data in files.items():
            Path(snap, rel).write_bytes(data)
        originals = {rel: Path(orig, rel).read_bytes() for rel in [*files, *deleted]
                     if Path(orig, rel).is_file()}
        ents = [entity(rel, q, Path(orig, rel).read_bytes()) for rel, q in feats]
        return spec["fingerprints"], ents, originals, sum(e["lines"] for e in ents)

    mode = "stub" if kept and not deleted else "remove"  # the opening says fill in, or add
    return make_task(orig, out, tid, feats, mode, set(spec["targets"] + spec["keep"]), set(spec["targets"]),
                     box, spec.get("source"), splice)


def feature_left(root, spec):
    """[(file, evidence)] where the feature's code survives in root's Python files: a line of its body
    (commented out or moved), or a definition with its body under any name."""
    hashes = {fp["body_hash"]: fp["qualname"] for fp in spec["fingerprints"]}
    lines = {s.encode(): fp["qualname"] for fp in spec["fingerprints"] for s in fp["body_lines"]}
    out = []
    for rel in (r for r in walk(root) if r.endswith(".py")):
        data = Path(root, rel).read_bytes()
        out += [(rel, f"a line of {q}: {s.decode()!r}") for s, q in lines.items() if s in data]
        with contextlib.suppress(SyntaxError, ValueError, RecursionError):
            out += [(rel, f"a copy of {hashes[h]} as {n.name}") for n in ast.walk(ast.parse(data))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for h in [ast_hash(n, named=False)] if h in hashes]
    return out


# -----------------------------------------------------------------------------
# Edits: what a solution may change, read without trusting the work tree. Only Python source inside the
# packages may change; tests, their configuration, documentation, data files and everything at the top of the
# repository stay as made (so nothing can shadow pytest, conftest or sitecustomize either). The host walks the
# work tree (harness/repo.py) with lstat and opens a file only after lstat says it is regular, with O_NOFOLLOW
# and O_NONBLOCK, reading at most EDIT_AT_MOST bytes: a link, a FIFO or a device is refused by its kind before
# anything opens it, and a walk stops at TREE_AT_MOST entries or the verify deadline. Nothing is copied from
# the work tree: the verifier's tree is the snapshot plus the accepted files' bytes.

EDIT_AT_MOST = 1 << 20  # bytes a changed source file may have
CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")  # PEP 263


def editable(rel, pkgs):
    return rel.endswith(".py") and inside(rel, pkgs) and not is_protected(rel)


def solution_files(snap, workdir, deadline, allowed=None):
    """({rel: new bytes}, [deleted rel]) of the solution in workdir against the snapshot, or Refused.
    allowed: {rel: static findings the original file had}, which a re-implementation may have too."""
    pkgs, old, new = packages(snap), lstat_tree(snap, deadline), lstat_tree(workdir, deadline)
    files, deleted = {}, []
    for rel in sorted(old.keys() | new.keys()):
        a, b = old.get(rel), new.get(rel)
        kind = None if b is None else ("a symlink" if stat.S_ISLNK(b.st_mode)
                                       else "a special file" if not stat.S_ISREG(b.st_mode) else "file")
        if a is not None and b is not None and stat.S_ISLNK(a.st_mode) and kind == "a symlink" \
                and os.readlink(Path(snap, rel)) == os.readlink(Path(workdir, rel)):
            continue  # a link the repository itself has
        # an unchanged file may be as large as the snapshot's own (a data file over the limit: an image)
        was = a is not None and stat.S_ISREG(a.st_mode)
        data = read_regular(Path(workdir, rel), max(EDIT_AT_MOST, a.st_size if was else 0)) \
            if kind == "file" else None
        if was and kind == "file" and data == Path(snap, rel).read_bytes():
            continue
        if not editable(rel, pkgs):
            raise Refused(f"{rel}: only Python source inside the packages ({', '.join(pkgs)}) may change")
        if kind is None:
            deleted.append(rel)
        elif kind != "file":
            raise Refused(f"{rel} is {kind}")
        elif b.st_nlink > 1:  # a hard link is another file's bytes (a task's oracle.json is valid Python)
            raise Refused(f"{rel} has {b.st_nlink} hard links: a solution's files are its own")
        elif data is None or len(data) > EDIT_AT_MOST:
            raise Refused(f"{rel} is over {EDIT_AT_MOST} bytes")
        else:
            files[rel] = source_check(rel, data, Path(snap, rel).read_bytes() if a else b"",
                                      (allowed or {}).get(rel, ()))
    return files, deleted


def declared(data):
    """The encoding Python source declares (PEP 263), by its codec's name: "utf-8" when none."""
    coding = next((m[1].decode() for line in data.splitlines()[:2] for m in [CODING.match(line)] if m),
                  "utf-8")
    try:
        return codecs.lookup(coding).name
    except LookupError:
        return coding


def source_check(rel, data, old, allowed=()):
    """data, if it is UTF-8 Python source with no static finding that old (or the allowed list) lacks; else
    Refused."""
    coding, original = declared(data), declared(old)
    # UTF-8, or the encoding the original file declares (xlwt's windows-1252) unless it can hide text from
    # the check (UTF-7's +...- runs, UTF-16)
    if coding != "utf-8" and (coding != original or coding.startswith(("utf-7", "utf-16", "utf-32"))):
        raise Refused(f"{rel} declares the encoding {coding}: source must be UTF-8"
                      + (f" or {original}, as the original" if original != "utf-8" else ""))
    try:
        tree = ast.parse(data.decode(coding))
    except (UnicodeDecodeError, SyntaxError, ValueError) as e:
        raise Refused(f"{rel} is not {coding} Python source ({type(e).__name__})")
    extra = unallowed(static_findings(data, tree), Counter(what for what, _ in static_findings(old))
                      | Counter(allowed))
    if extra:
        raise Refused(f"{rel} line {extra[0][1]}: {extra[0][0]}")
    return data


def unallowed(findings, allowed):
    """The findings [(what, line)] beyond those allowed ({what: how many times}), in order."""
    left, out = Counter(allowed), []
    for what, line in findings:
        left[what] -= 1
        out += [(what, line)] if left[what] < 0 else []
    return out


# The static check, on the AST: the tools of in-process tampering that the code of a library feature does not
# need. Frames, gc, tracers, exits, signals, raw descriptors, /proc, native code, exec, loaders that run code
# by path or from bytecode (the gold's installed copy, a .pyc), code objects made into functions, the test
# runner's own modules, an __eq__ that ignores what it is compared with. It judges names, not spellings: each
# reference is resolved to the dotted name it names, through import aliases and the name-takers given a
# name literally or in pieces (getattr(sys, "_getframe"), vars(sys)["_get" + "frame"], import_module("pty")),
# and the tables judge that name. Only findings the snapshot's copy of the file lacks count. Defence in depth:
# a disguise through data flow gets past any static check; the oracle is what it cannot pass.
STATIC_CALLS = {"inspect.currentframe", "inspect.stack", "inspect.getouterframes", "inspect.getinnerframes",
                "inspect.trace", "traceback.extract_stack", "traceback.walk_stack", "gc.get_objects",
                "gc.get_referrers", "gc.get_referents", "sys.exit", "os._exit", "os.abort", "os.kill",
                "os.killpg", "os.fork", "os.forkpty", "sys.settrace", "sys.setprofile", "threading.settrace",
                "threading.setprofile", "sys.addaudithook", "os.write", "os.writev", "os.pwrite", "os.dup",
                "os.dup2", "os.fdopen", "os.open", "os.sendfile", "os.mkfifo", "os.symlink", "os.link",
                "marshal.loads", "exec", "eval", "compile", "breakpoint"}
STATIC_MODULES = {"pytest", "_pytest", "pluggy", "unittest", "doctest", "ctypes", "cffi", "signal", "atexit",
                  "gc", "builtins", "marshal", "pty", "resource", "runpy", "zipimport"}
# attributes of any object (frames, code, loaders), and dotted names
STATIC_ATTRS = {"f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "tb_frame", "gi_frame",
                "cr_frame", "ag_frame", "gi_code", "cr_code", "ag_code", "__globals__", "__closure__",
                "__code__", "__builtins__", "__import__", "__subclasses__", "_getframe", "_current_frames",
                "SourceFileLoader", "SourcelessFileLoader", "ExtensionFileLoader", "PathFinder", "FileFinder",
                "spec_from_file_location", "spec_from_loader", "module_from_spec", "exec_module",
                "load_module", "sys.meta_path", "sys.path_hooks", "sys.modules", "sys.monitoring"}
STATIC_MADE = {"types.FunctionType", "types.LambdaType", "types.CodeType"}  # called (isinstance is honest)
MODULE_TAKERS = {"__import__", "import_module", "find_spec", "resolve_name"}
FD_CALLS = {"os.fdopen", "os.write", "os.writev", "os.pwrite"}


def static_findings(data, tree=None):
    """[(what, line)] for one file's source (bytes); [] when it does not parse."""
    try:
        tree = tree or ast.parse(data.decode("utf-8", "replace"))
    except (SyntaxError, ValueError):
        return []
    out = []
    # an `if __name__ == "__main__":` block never runs on import, unless the file can change __name__
    mains = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test).replace("'", '"')
             in ('__name__ == "__main__"', '"__main__" == __name__')]
    if not any(isinstance(n, ast.Name) and n.id == "__name__" and not isinstance(n.ctx, ast.Load)
               or isinstance(n, ast.Constant) and n.value == "__name__" for n in ast.walk(tree)):
        skip = {id(x) for m in mains for x in ast.walk(m)}
        tree = ast.Module([n for n in tree.body if id(n) not in skip], [])
    nodes = list(ast.walk(tree))
    imports = [a for n in nodes if isinstance(n, ast.Import) for a in n.names]
    modules = {a.asname or a.name for a in imports}  # as the file spells them
    aliases = {a.asname or a.name.partition(".")[0]: a.name if a.asname else a.name.partition(".")[0]
               for a in imports}
    aliases |= {a.asname or a.name: f"{'.' * n.level}{n.module or ''}.{a.name}"
                for n in nodes if isinstance(n, ast.ImportFrom) for a in n.names}
    # what reads nothing: a bare string (a docstring: never executed), `x in sys.modules` (no module object),
    # a descriptor call on the descriptor the function made itself
    spared = ({id(n.value) for n in nodes if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
              | {id(c) for n in nodes if isinstance(n, ast.Compare) for op, c in zip(n.ops, n.comparators)
                 if isinstance(op, (ast.In, ast.NotIn)) and named(c, aliases) == "sys.modules"}
              | own_descriptors(nodes, aliases))
    called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}  # a builtin (exec) is judged where called
    for n in nodes:
        line = getattr(n, "lineno", 0)
        if id(n) in spared:
            continue
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Attribute) and named(t.value, {}) in modules:
                    out.append((f"patches {named(t, {})}", line))
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            runner = [m for m in mods if m.partition(".")[0] in STATIC_MODULES]
            out += [(f"imports {m}", line) for m in runner]
            if isinstance(n, ast.ImportFrom) and not n.level and not runner:
                out += [(what, line) for a in n.names for what in [judged(f"{n.module}.{a.name}")] if what]
        elif isinstance(n, ast.Name) and n.id in ("__builtins__", "__import__"):
            out.append((f"uses {n.id}", line))
        elif isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            base, arg = taken(n, aliases)
            name = named(n, aliases) if not isinstance(n, ast.Name) or n.id in aliases \
                or n.id in STATIC_CALLS and id(n) in called else ""
            what = judged(name, module=base is None) if name else None
            fn = named(n.func, aliases) if isinstance(n, ast.Call) else ""
            kw = next((k.arg for k in n.keywords if str(k.arg).startswith("co_")), None) \
                if fn.endswith(".replace") else None  # code.replace(co_code=...)
            if fn in STATIC_MADE or kw:
                what = f"calls {fn}" + (f"({kw}=...)" if kw else "")
            elif what is None and fn.endswith("setattr") and folded(arg) and named(n.args[0], {}) in modules:
                what = f"patches {named(n.args[0], {})}.{folded(arg)}"  # as os.environ = ... does
            if what is None and not isinstance(arg, (ast.Constant, type(None))) and folded(arg) is not None:
                what = f"builds the name {folded(arg)!r} from pieces"
            if what:
                out.append((what, line))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) \
                and re.search(r"^/proc\b|^/dev/(fd|shm)\b|(^|/)tests?/|test_[\w*]*\.py|conftest|__eq__",
                              n.value):
            out.append((f"names {n.value[:40]!r}", line))
        elif isinstance(n, (ast.FunctionDef, ast.Lambda)) and getattr(n, "name", "") in ("__eq__", "__ne__"):
            other = [a.arg for a in n.args.posonlyargs + n.args.args][1:2]
            used = {x.id for x in ast.walk(n) if isinstance(x, ast.Name)}
            raises = isinstance(n, ast.FunctionDef) and all(isinstance(x, ast.Raise) for x in code_body(n))
            if (not other or other[0] not in used) and not raises:  # one that only raises reports no equality
                out.append((f"defines an {n.name} that ignores what it is compared with", line))
        elif isinstance(n, (ast.BinOp, ast.JoinedStr)) and folded(n) in ("__eq__", "__ne__", "_exit", "exit"):
            out.append((f"builds the name {folded(n)!r} from pieces", line))
    return out


def judged(name, module=False):
    """What naming a resolved name amounts to by the tables, or None: a module of the runner where a module
    is named ('imports _pytest.python'), a call ('calls sys.exit'), an attribute of anything ('uses .f_back').
    """
    tail = name.rpartition(".")[2]
    if module and name.partition(".")[0] in STATIC_MODULES:
        return f"imports {name}"
    if name in STATIC_CALLS:
        return f"calls {name}"
    return f"uses .{tail}" if name in STATIC_ATTRS or "." in name and tail in STATIC_ATTRS else None


def named(node, aliases):
    """The dotted name an expression names, through import aliases and name-takers ('' when none):
    getattr(sys, "_get" + "frame") and vars(sys)["_getframe"] name sys._getframe, attrgetter("f_back")
    .f_back (of anything), import_module("a.b") the module a.b."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        return f"{named(node.value, aliases)}.{node.attr}"
    base, arg = taken(node, aliases)
    s = folded(arg) if arg is not None else None
    return "" if not s else s.replace(":", ".") if base is None else f"{base}.{s}"


def taken(node, aliases):
    """(receiver, the node giving the name) of a name-taker: getattr(x, NAME) (setattr, delattr; not hasattr,
    which returns a bool), vars(x)[NAME], x.__dict__[NAME], globals()[NAME], operator.attrgetter(NAME)
    (methodcaller); a module-taker (import_module(NAME), __import__, find_spec, pkgutil.resolve_name) has the
    receiver None. ('', None) for anything else."""
    if isinstance(node, ast.Call) and node.args:
        f = named(node.func, aliases).rpartition(".")[2]
        if f in ("getattr", "setattr", "delattr") and len(node.args) > 1:
            return named(node.args[0], aliases), node.args[1]
        if f in ("attrgetter", "methodcaller", *MODULE_TAKERS):
            return ("" if f in ("attrgetter", "methodcaller") else None), node.args[0]
    if isinstance(node, ast.Subscript):
        v = node.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("globals", "vars"):
            return (named(v.args[0], aliases) if v.args else ""), node.slice
        if isinstance(v, ast.Attribute) and v.attr == "__dict__":
            return named(v.value, aliases), node.slice
    return "", None


def own_descriptors(nodes, aliases):
    """ids of the descriptor calls (FD_CALLS) on a descriptor the function made itself: a name its own scope
    binds to tempfile.mkstemp()'s first result (`fd, path = tempfile.mkstemp()`) and to nothing else."""
    out = set()
    for f in nodes:
        made = Counter(t.elts[0].id for n in scope(f)
                       if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                       and named(n.value.func, aliases) == "tempfile.mkstemp" for t in n.targets
                       if isinstance(t, ast.Tuple) and t.elts and isinstance(t.elts[0], ast.Name)) \
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if made:
            bound = Counter(x for n in ast.walk(f) for x in bindings(n))
            out |= {id(n.func) for n in ast.walk(f) if isinstance(n, ast.Call) and n.args
                    and isinstance(n.args[0], ast.Name) and 0 < made[n.args[0].id] == bound[n.args[0].id]
                    and named(n.func, aliases) in FD_CALLS}
    return out


def scope(node):
    """The nodes of a function's own scope: nested functions, lambdas and classes left out."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from scope(child)


def bindings(node):
    """The names a node binds, or declares global or nonlocal: every way Python binds one."""
    if isinstance(node, ast.Name):
        return [] if isinstance(node.ctx, ast.Load) else [node.id]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return node.names
    if isinstance(node, ast.arg):
        return [node.arg]
    return [x for x in (getattr(node, "asname", None) or getattr(node, "name", None),
                        getattr(node, "rest", None)) if isinstance(x, str)]


def folded(node):
    """The string a node builds out of constants alone ('ex' + 'it', '%s' % 'x', ''.join([...]),
    f'{"_"}exit', 'tixe'[::-1], chr(95)), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        a = folded(node.left)
        b = (tuple(folded(e) for e in node.right.elts) if isinstance(node.right, ast.Tuple)
             else folded(node.right))
        if a is None or b is None or None in (b if isinstance(b, tuple) else ()):
            return None
        with contextlib.suppress(TypeError, ValueError):
            return a + b if isinstance(node.op, ast.Add) else a % b
        return None
    if isinstance(node, ast.JoinedStr):
        parts = [folded(v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values]
        return "".join(parts) if None not in parts else None
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
        s = folded(node.value)
        bounds = [x.value if isinstance(x, ast.Constant) else None if x is None else ...
                  for x in (node.slice.lower, node.slice.upper, node.slice.step)]
        return s[slice(*bounds)] if s is not None and ... not in bounds else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "chr" \
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int):
        return chr(node.args[0].value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        s = folded(node.func.value)
        if s is not None and node.func.attr == "join" and node.args and isinstance(node.args[0],
                                                                                   (ast.List, ast.Tuple)):
            parts = [folded(e) for e in node.args[0].elts]
            return s.join(parts) if None not in parts else None
        if s is not None and node.func.attr in ("lower", "upper", "strip", "lstrip", "rstrip", "title") \
                and not node.args:
            return getattr(s, node.func.attr)()
    return None


# -----------------------------------------------------------------------------
# Oracle: the deleted feature's behaviour, recorded from the gold code and replayed where no test runs. The
# repository's tests run in one process with the solution's code, so whatever that process reports can be
# forged by code that knows the verifier. The oracle's evidence cannot: at make time a pytest plugin
# (harness/plugins.py's Recorder) copies the arguments of the calls the tests make into the feature while the
# gold code runs, pickled at the call, receiver included (a generator by its items), and a pool of the values
# of the same types that the tests pass to the packages' other functions; a sandboxed child (harness/child.py)
# adds held-out inputs by type-aware mutation of those, or by a value of the pool in an argument's place
# (EvalPlus, Liu et al. 2023, "Is Your Code Generated by ChatGPT Really Correct?"); two more children run the
# gold on all of them. Where the two runs' canonical results differ only in some words (a temporary name, a
# time), those words are left open; an input whose results differ otherwise is dropped. A result is what the
# call returns or raises (a main()'s exit status) and the state it leaves: every argument, the receiver
# included, canonical again after the call, so an in-place change counts. The expected results stay in the
# task folder, which no sandbox mounts. At verify time a fresh sandboxed child that sees only the solution's
# packages (no tests, no pytest) calls the feature on the recorded inputs and writes the canonical encoding of
# each result; the host compares them with the expected ones, which the child never sees. A stub that forges
# the test run still raises NotImplementedError here; an answer read from the calling test has no test to
# read; code that special-cases the tests' inputs fails the held-out ones, so a task is served only when every
# feature has HELD_OUT_AT_LEAST of them. The host never unpickles anything: inputs are opaque bytes to it,
# results are strings.

# which code wrote a task's oracle (its inputs and expected strings) and its static allowances (task.json's
# static_allowed, in the static check's words): a task made by other code is not served, and verify refuses it
ENCODING = hashlib.sha256("".join([ORACLE_CHILD, *map(inspect.getsource, (static_findings, judged, named,
                                                                          taken, own_descriptors, scope,
                                                                          bindings, folded)),
                                   *(repr(sorted(t)) for t in (STATIC_CALLS, STATIC_MODULES, STATIC_ATTRS,
                                                               STATIC_MADE, MODULE_TAKERS, FD_CALLS))]
                                  ).encode()).hexdigest()[:16]


def module_name(rel):
    parts = Path(rel).with_suffix("").parts
    parts = parts[1:] if parts[0] == "src" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def oracle_run(box, tree, features, calls, mode="run", timeout=None, pool=(), layout=0):
    """ORACLE_CHILD in the sandbox over a copy of tree's packages (their tests and everything else left
    out): {call index: result line} for "run", [[feature, base64 input]] for "mutate". calls: [[feature,
    base64 input]]; pool: base64 values that "mutate" may put in place of an argument of their type; layout:
    bytes the child takes before it imports anything of the packages (its objects then lie elsewhere)."""
    with scratch() as view, tempfile.TemporaryFile() as fd:
        for pkg in packages(tree):
            for rel in package_files(tree, pkg):
                if not is_protected(rel) and Path(tree, rel).is_file():
                    Path(view, rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(Path(tree, rel), Path(view, rel))
        Path(view, "oracle-inputs.json").write_text(json.dumps({"features": features, "calls": calls,
                                                                "pool": list(pool)}))
        # -s, not -I: the environment is the sandbox's own, and -I would drop its PYTHONHASHSEED (a set of
        # strings, emoji's distinct_emoji_list, came back in another order from run to run)
        rc, out = box.run(["-s", "-c", ORACLE_CHILD, mode, view, str(Path(view, "oracle-inputs.json")),
                           str(fd.fileno())], view, pass_fds=[fd.fileno()], timeout=timeout,
                          extra_env={"FEATDEL_LAYOUT": str(layout)})
        lines = [parsed(line) for line in tail(fd, READ_AT_MOST).splitlines()]
    if mode == "mutate":
        return [x for x in lines if isinstance(x, list) and len(x) == 2]
    got = {}
    for x in lines:  # one line a call, in order; anything else voids the call it claims
        if isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], str):
            got[x[0]] = x[1] if x[0] not in got else "written twice"
    return got


# a result's words (a number with its sign) and the characters between them
WORDS, WORD = re.compile(r"-?\d\w*|\w+|\W"), re.compile(r"-?\w")
CONSTANTS = {"True", "False", "None"}


def pattern(a, b):
    """Two runs of the gold that return alike but for some words (a temporary file's name, a time): the result
    with those words left open, as "matches [word or null, ...]"; None for any other difference."""
    if not (a or "").startswith("returns") or not (b or "").startswith("returns"):
        return None
    x, y = WORDS.findall(a), WORDS.findall(b)  # True, False and None are values, never a name to leave open
    if len(x) != len(y) or any(p != q and (not (WORD.match(p) and WORD.match(q)) or {p, q} & CONSTANTS)
                               for p, q in zip(x, y)):
        return None
    return "matches " + json.dumps([p if p == q else None for p, q in zip(x, y)])


def agrees(expected, got):
    """The same result, or an exception of the gold's class or a subclass of it: the first class the gold's
    exception is, by [module, qualname], is one of the classes the solution's is, and the solution's is no
    built-in exception the gold's is not (a class that inherits every built-in one agrees with none). A
    pattern's open words match any one word."""
    if expected.startswith("matches "):
        want, have = json.loads(expected[8:]), WORDS.findall(got)
        return len(want) == len(have) and all(w == h or w is None and WORD.match(h)
                                              for w, h in zip(want, have))
    if expected.startswith("raises ") and got.startswith("raises "):
        try:
            want, have = json.loads(expected[7:]), json.loads(got[7:])
            builtin = lambda names: {tuple(c) for c in names if c[0] == "builtins"}
            return bool(want) and want[0] in have and builtin(have) <= builtin(want)
        except (ValueError, RecursionError, TypeError, IndexError):
            return False
    return got == expected


def make_oracle(gold, feats, records, box):
    """The oracle of a task from the calls recorded while the gold code ran its tests: (oracle, summary).
    oracle: {encoding: ENCODING, features: [[module, qualname]], calls: [[feature, base64 input, expected,
    traced|held-out]]}. summary: covered when every feature has HELD_OUT_AT_LEAST held-out calls (the serving
    rule; a function that takes nothing has no other input than the one the tests gave it), and why not."""
    features = [[module_name(rel), q] for rel, q in feats]
    traced = [r for r in records if isinstance(r, list) and len(r) == 2 and type(r[0]) is int]
    pool = [r[1] for r in records if isinstance(r, list) and len(r) == 2 and r[0] is None]
    known = {r[1] for r in traced}
    held = []
    size = Counter()  # the held-out inputs' base64 bytes, by feature: as many as the recorded ones, at most
    for i, data in oracle_run(box, gold, features, traced, "mutate", pool=pool):
        if data not in known and sum(h[0] == i for h in held) < 2 * RECORD_AT_MOST \
                and size[i] + len(data) <= INPUTS_AT_MOST * 4 // 3:
            known.add(data)
            held.append([i, data])
            size[i] += len(data)
    calls = traced + held
    first, expected = gold_results(box, gold, features, calls)
    ok = [(e or "").startswith(("returns", "raises", "exits", "matches")) for e in expected]
    kept = [[i, data, expected[k], "traced" if k < len(traced) else "held-out"]
            for k, (i, data) in enumerate(calls) if ok[k]]
    per = [sum(c[0] == i and c[3] == "held-out" for c in kept) for i in range(len(feats))]
    enough = [n >= HELD_OUT_AT_LEAST or not inputs_of(gold, *feats[i]) and any(c[0] == i for c in kept)
              for i, n in enumerate(per)]
    kinds = Counter(c[3] for c in kept)
    summary = {"traced": kinds["traced"], "held_out": kinds["held-out"], "recorded": len(traced),
               "held_out_per_feature": per, "covered": all(enough), "encoding": ENCODING}
    for i, ((_, q), n) in enumerate(zip(feats, per)):
        if not enough[i]:  # why not, call by call
            mine = [k for k, c in enumerate(calls) if c[0] == i]
            lost = Counter("not loadable outside the tests" if first.get(k, "").startswith("unloadable")
                           else "not the same twice" if expected[k] is None else "timed out"
                           for k in mine if not ok[k])
            made = sum(k >= len(traced) for k in mine)
            summary.setdefault("why", []).append(
                f"{q}: {n} held-out calls of {HELD_OUT_AT_LEAST}, from {len(mine) - made} recorded "
                f"(arguments that cannot be copied are not) and {made} made"
                + "".join(f", {v} {w}" for w, v in sorted(lost.items())))
    return {"encoding": ENCODING, "features": features, "calls": kept}, summary


LAYOUT = 1 << 16  # bytes the second gold run takes first: address-dependent values move


def gold_results(box, gold, features, calls):
    """The gold's results on calls, run twice (a result that depends on a temporary name, a random draw or
    the time a call takes differs; the date does not: every oracle run's clock starts at CLOCK_AT), the second
    with its objects elsewhere in memory (a hash of an object's address, soupsieve's `_hash` of its classes,
    differs: with the same layout twice it agreed at make and not at verify, whose inputs file is another
    size): (the first run's {k: line}, [expected line, a pattern where the runs differ in some words, or None
    where they differ otherwise])."""
    first, second = (oracle_run(box, gold, features, calls, "run", layout=n) for n in (0, LAYOUT))
    return first, [first.get(k) if first.get(k) == second.get(k) else pattern(first.get(k), second.get(k))
                   for k in range(len(calls))]


def coverable(root, feats, box, select, each=3):
    """{feature: held-out inputs made} of the features of feats ([(file, qualname)]) whose oracle would be
    covered, as far as one recording run of the select tests (each feature's first `each` inputs kept) and
    the held-out inputs made from those tell: HELD_OUT_AT_LEAST made, or a call recorded of one that takes no
    input (0 made). make tries these first: as SWE-smith keeps the candidates its validation can judge, a task
    its oracle cannot cover is not served."""
    if not feats:
        return {}
    _, records = record_calls(root, feats, box, select, each)
    traced = [r for r in records if isinstance(r, list) and len(r) == 2 and type(r[0]) is int]
    pool = [r[1] for r in records if isinstance(r, list) and len(r) == 2 and r[0] is None]
    made = Counter(i for i, _ in oracle_run(box, root, [[module_name(rel), q] for rel, q in feats], traced,
                                            "mutate", pool=pool))
    called = {i for i, _ in traced}
    return {f: made[i] for i, f in enumerate(feats)
            if made[i] >= HELD_OUT_AT_LEAST or i in called and not inputs_of(root, *f)}


def inputs_of(root, rel, q):
    """The parameters a feature takes (an __init__'s receiver is built, not given: left out)."""
    return parameters(find_def(ast.parse(Path(root, rel).read_bytes()), q).args)[q.endswith(".__init__"):]


def record_calls(root, feats, box, select=None, each=RECORD_AT_MOST):
    """One pytest run of root (the gold code; select: those tests only) with Recorder on feats, keeping each
    distinct inputs a feature: (report, recorded calls)."""
    root = Path(root).resolve()
    targets = [[os.path.realpath(root / rel), q, i] for i, (rel, q) in enumerate(feats)]
    r, out = plugin_run(box, root, "_featdel_recorder", RECORDER_MODULE, {
        "FEATDEL_TARGETS": json.dumps(targets), "FEATDEL_REPO": os.path.realpath(root) + os.sep,
        "FEATDEL_ROOTS": package_roots(root), "FEATDEL_EACH": str(each)}, select=select)
    records = parsed(out or "[]")
    return r, records if isinstance(records, list) else []


# -----------------------------------------------------------------------------
# Strength: how much of the gold's behaviour the verifier pins down, measured by mutation (as mutmut and
# cosmic-ray measure a test suite). A mutant is the gold with one small change inside a deleted definition: an
# operator swapped, a comparison negated or moved by one, a constant nudged, a returned value dropped, a
# statement dropped, a branch dropped or its condition negated. Each is verified once: one that scores 1
# survives. Most mutants are wrong code, so a verifier that passes many is weaker than the gold's reward says.
# A survivor is then run on a wider set of held-out inputs (told_apart): one that differs from the gold there
# is live, and the inputs that tell it apart join the oracle (mutation-guided inputs, as EvoSuite selects
# tests). One that agrees on all of them is equivalent where some input reaches the code it changed (an error
# message nothing reads, a cast that does nothing), listed for a person to judge and left out of the score;
# where none reaches it, it stays a survivor and counts against the score. The tests alone and the tests plus
# the oracle are judged in the same verify, so what the oracle adds is measured too.

STRENGTH_K = 12  # mutants a task; each is a verify of a few seconds

SWAPPED = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult, ast.FloorDiv],
           ast.FloorDiv: [ast.Div], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult], ast.MatMult: [ast.Mult],
           ast.LShift: [ast.RShift], ast.RShift: [ast.LShift], ast.BitAnd: [ast.BitOr],
           ast.BitOr: [ast.BitAnd], ast.BitXor: [ast.BitAnd], ast.And: [ast.Or], ast.Or: [ast.And]}
NEGATED = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
           ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
OFF_BY_ONE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


def nudged(value):
    """A constant changed as mutation testing changes it, or None (None, ..., complex: left alone)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return {0: 1, 1: 0}.get(value, value + 1)
    if isinstance(value, float):
        return value + 1
    if isinstance(value, (str, bytes)):
        xx = "XX" if isinstance(value, str) else b"XX"
        return xx + value + xx
    return None


def mutation_sites(fn):
    """(node, replacement source, kind) for every single change to the code of fn. Its docstring, bare
    strings, annotations, f-strings (whose parts have no reliable positions) and the constants of a raised
    exception (its message: the verifier compares exception classes, as tests mostly do) are left alone."""
    left = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            left |= {id(n), id(n.value)}
        if isinstance(n, ast.Raise) and n.exc is not None:
            left |= {id(x) for x in ast.walk(n.exc) if isinstance(x, ast.Constant)}
        for part in [n] if isinstance(n, ast.JoinedStr) else [getattr(n, "annotation", None),
                                                              getattr(n, "returns", None)]:
            left |= {id(x) for x in ast.walk(part)} if isinstance(part, ast.AST) else set()
    sites = []

    def put(node, new, kind):  # an expression in parentheses: it fits wherever the old one stood
        sites.append((node, f"({ast.unparse(new)})" if isinstance(new, ast.AST) else new, kind))

    def changed(node, **fields):
        new = copy.copy(node)
        for name, value in fields.items():
            setattr(new, name, value)
        return new

    for stmt in code_body(fn):
        for n in ast.walk(stmt):
            if id(n) in left:
                continue
            for op in SWAPPED.get(type(getattr(n, "op", None)), []):  # binary, boolean, augmented
                new = changed(n, op=op())
                put(n, ast.unparse(new) if isinstance(n, ast.stmt) else new, "operator")
            if isinstance(n, ast.UnaryOp) and not isinstance(n.op, ast.UAdd):
                put(n, n.operand, "operator")
            if isinstance(n, ast.Compare):
                for i, op in enumerate(n.ops):
                    for table in (NEGATED, OFF_BY_ONE):
                        if type(op) in table:
                            ops = [*n.ops[:i], table[type(op)](), *n.ops[i + 1:]]
                            put(n, changed(n, ops=ops), "comparison")
            if isinstance(n, ast.Constant) and nudged(n.value) is not None:
                put(n, ast.Constant(nudged(n.value)), "constant")
            if isinstance(n, ast.Return) and n.value is not None:
                put(n.value, "None", "returned value dropped")
            # `if not x` negated is the `not` dropped, and an if without else dropped is the statement dropped
            if isinstance(n, (ast.If, ast.While, ast.IfExp)) and not (isinstance(n.test, ast.UnaryOp)
                                                                       and isinstance(n.test.op, ast.Not)):
                put(n.test, ast.UnaryOp(ast.Not(), n.test), "condition negated")
            if isinstance(n, ast.If) and n.orelse:
                put(n.test, "False", "branch dropped")
                put(n.test, "True", "branch dropped")
            # (an annotation alone, `x: int`, does nothing: dropping it is no mutant)
            if isinstance(n, ast.stmt) and not isinstance(n, ast.Pass) \
                    and not (isinstance(n, ast.AnnAssign) and n.value is None):
                put(n, "pass", "statement dropped")
    return sites


REACHED = "RuntimeError('featdel: reached')"


def mutations(gold, deleted, k, seed=0):
    """Up to k mutants of the deleted definitions (task.json's "deleted") in the gold tree, drawn by seed:
    [(file, what changed, the mutated file's bytes, the probe's)], each a valid parse whose tree differs from
    the gold's. The probe is the gold with the mutated node raising REACHED instead: what tells a mutant no
    input reaches from one that is reached and changes nothing."""
    srcs = {e["file"]: Path(gold, e["file"]).read_bytes() for e in deleted}
    trees = {rel: ast.dump(ast.parse(src)) for rel, src in srcs.items()}
    sites = [(e, *site) for e in deleted for tree in [ast.parse(srcs[e["file"]])]
             for site in mutation_sites(find_def(tree, e["qualname"]) if e["qualname"] else tree)]
    random.Random(seed).shuffle(sites)
    out, seen, short = [], set(), lambda t: t if len(t) <= 60 else t[:57] + "..."
    for e, node, new, kind in sites:
        rel, src = e["file"], srcs[e["file"]]
        ls = line_starts(src)
        a, b = ls[node.lineno - 1] + node.col_offset, ls[node.end_lineno - 1] + node.end_col_offset
        data = apply_edits(src, [(a, b, new.encode())])
        try:
            same = ast.dump(ast.parse(data)) == trees[rel]
        except (SyntaxError, ValueError):  # a pattern or target that takes no parentheses, say
            continue
        probe = f"raise {REACHED}" if isinstance(node, ast.stmt) else f"(_ for _ in ()).throw({REACHED})"
        probe = apply_edits(src, [(a, b, probe.encode())])
        try:
            ast.parse(probe)
        except (SyntaxError, ValueError):  # a node no raise can stand for: no mutant
            continue
        if same or data in seen:
            continue
        seen.add(data)
        old = " ".join(src[a:b].decode("utf-8", "replace").split())
        what = f"{rel}:{node.lineno} {e['qualname']}, {kind}: `{short(old)}` -> `{short(new)}`"
        out.append((rel, what, data, probe))
        if len(out) == k:
            break
    return out


def laid_over(gold, rel, data, folder):
    """A copy of the gold tree in folder with rel's bytes replaced by data (a mutant, or its probe)."""
    tree = Path(folder, "m")
    shutil.copytree(gold, tree, symlinks=True)
    Path(tree, rel).write_bytes(data)
    return tree


def strength(task_dir, k=STRENGTH_K, box=None, seed=0, jobs=2, gold_s=None):
    """The verifier's mutation score on a task: up to k mutants of the gold (mutations), each laid over the
    snapshot and verified, jobs at a time; written into task.json as "strength" and returned: {mutants,
    killed_by_tests, killed (by tests plus oracle: verify's reward 0, or by the inputs told_apart adds),
    score_tests, score (of the mutants not equivalent), seed, survivors and equivalent: [{mutant, diff}],
    oracle_added, missed_by_tests: [what changed]}. A mutant verify refuses before its tests run counts as
    killed by both. The gold is verified first: a gold that fails here would make every mutant look
    killed. Each mutant gets five times the gold's time, at least 30 s (a mutant may loop forever).
    gold_s: the seconds the gold's verify took, where the caller (make) has just verified it: not verified
    again."""
    task_dir = Path(task_dir)
    if not (task_dir / "task.json").is_file():
        raise TaskError(f"no task at {task_dir}: "
                        + ("it has no task.json" if task_dir.is_dir() else "no such folder"))
    if k < 1 or jobs < 1:
        raise TaskError(f"--k and --jobs must be >= 1, got {k} and {jobs}")
    task = json.loads((task_dir / "task.json").read_text())
    box = box or Sandbox(python=task.get("python", sys.executable), timeout=600)
    with scratch() as tmp:
        gold = Path(tmp, "gold")
        if (error := patched(task_dir / "repo", task_dir / "gold.patch", gold)) is not None:
            raise TaskError(f"{task_dir / 'gold.patch'} does not apply: {error}")
        if gold_s is None:
            t0 = time.time()
            reward, why = verify(task_dir, workdir=gold, box=box)
            if reward != 1:
                raise TaskError(f"the gold of {task_dir} scores 0 here (a mutant's 0 would mean nothing): "
                                f"{why}")
            gold_s = time.time() - t0
        box = dataclasses.replace(box, timeout=int(min(box.timeout, max(30, 5 * gold_s))))
        found = mutations(gold, task["deleted"], k, seed)

        def judge(mutant):  # (reward, the tests' reason for 0 or None)
            rel, _, data, _ = mutant
            with scratch() as mine:
                verdicts = {}
                reward, why = verify(task_dir, workdir=laid_over(gold, rel, data, mine), box=box,
                                     verdicts=verdicts)
            return reward, verdicts.get("tests", why)
        with stoppable(jobs) as pool:
            judged = list(pool.map(judge, found))
        gold_src = {rel: Path(gold, rel).read_bytes().decode("utf-8", "replace") for rel, *_ in found}
        alive = [m for m, (reward, _) in zip(found, judged) if reward == 1]
        added, fates = told_apart(task_dir, gold, alive, box) if alive else ([], [])
    n, kept = len(found), {"equivalent": [], "survivors": []}
    for (rel, what, data, _), fate in zip(alive, fates):
        if fate != "killed":
            diff = difflib.unified_diff(gold_src[rel].splitlines(keepends=True),
                                        data.decode("utf-8", "replace").splitlines(keepends=True),
                                        f"a/{rel}", f"b/{rel}")
            kept[fate].append({"mutant": what, "diff": "".join(diff)})
    a, b = sum(tests is not None for _, tests in judged), sum(reward == 0 for reward, _ in judged)
    b += fates.count("killed")  # live survivors: killed by the inputs added to the oracle
    m = n - len(kept["equivalent"])
    result = {"mutants": n, "killed_by_tests": a, "killed": b, "score_tests": a / m if m else 0.0,
              "score": b / m if m else 0.0, "seed": seed, **kept, "oracle_added": len(added),
              "missed_by_tests": [what for (_, what, *_), (_, tests) in zip(found, judged) if tests is None]}
    task = json.loads((task_dir / "task.json").read_text())  # as it is now: "strength" changes, and the
    task["strength"] = result                                  # oracle's counts where inputs were added
    if added:
        per = task["oracle"]["held_out_per_feature"]
        for c in added:
            per[c[0]] += 1
        task["oracle"].update(held_out=task["oracle"]["held_out"] + len(added), covered=task["oracle"][
            "covered"] or all(x >= HELD_OUT_AT_LEAST for x in per))
    write_task(task_dir, task)
    return result


def write_task(task_dir, task):
    write_whole(Path(task_dir) / "task.json", task)


WIDER_AT_MOST = 400  # inputs of the wider set that tells a surviving mutant apart from the gold


def told_apart(task_dir, gold, alive, box):
    """Survivors told apart from equivalent mutants: the held-out inputs made again from every input the
    oracle holds (traced and held-out alike, so a variant of a variant: characters, constants and lengths
    further from the tests'), the gold's results on them, and each surviving mutant run on them. An input on
    which a mutant's result differs from the gold's is a held-out input the oracle lacked: up to
    HELD_OUT_AT_LEAST of them go into the task's oracle.json, and the mutant is "killed". One that agrees on
    all of them is "equivalent" where some input reaches the code it changed (its probe, which raises there,
    gives another result), else a "survivors" one: no input reaches it, so nothing says it does no harm.
    -> (the calls added, each mutant's fate)."""
    path = Path(task_dir, "oracle.json")
    oracle = json.loads(path.read_text()) if path.is_file() else {"calls": []}
    if not oracle["calls"]:
        return [], ["survivors"] * len(alive)
    known, per = {c[1] for c in oracle["calls"]}, Counter()
    wider = []
    for i, data in oracle_run(box, gold, oracle["features"], [c[:2] for c in oracle["calls"]], "mutate"):
        if data not in known and per[i] < WIDER_AT_MOST // len(oracle["features"]):
            known.add(data)
            per[i] += 1
            wider.append([i, data])
    _, expected = gold_results(box, gold, oracle["features"], wider)
    wider = [[*c, e, "held-out"] for c, e in zip(wider, expected)
             if (e or "").startswith(("returns", "raises", "exits", "matches"))]
    every, added, fates = oracle["calls"] + wider, [], []

    def differs(rel, data, calls):  # the calls on which the gold with data as rel gives another result
        with scratch() as mine:
            got = oracle_run(box, laid_over(gold, rel, data, mine), oracle["features"],
                             [c[:2] for c in calls])
        return [c for k, c in enumerate(calls) if not agrees(c[2], got.get(k, "no result"))]
    for rel, _, data, probe in alive:
        killers = differs(rel, data, wider)
        fates.append("killed" if killers else "equivalent" if differs(rel, probe, every) else "survivors")
        added += [c for c in killers[:HELD_OUT_AT_LEAST] if c not in added]
    if added:
        oracle["calls"] += added
        temp = path.with_name(f".oracle.json.{secrets.token_hex(4)}")
        temp.write_text(json.dumps(oracle))
        os.chmod(temp, 0o600)
        os.replace(temp, path)
    return added, fates


def strength_lines(tid, s):
    """What `strength` prints for a task: its figures, then each survivor and each mutant found equivalent."""
    n = s["mutants"]
    m = n - len(s.get("equivalent", []))
    share = lambda x: f"{x} ({x / m:.0%})" if m else "0"
    return "\n".join([f"{tid}: {n} mutants, {n - m} equivalent (reached, and no input tells them apart), of "
                      f"the {m} others killed by the tests alone {share(s['killed_by_tests'])}, by tests and "
                      f"oracle {share(s['killed'])}"
                      + (f" ({s['oracle_added']} inputs added to the oracle)" if s.get("oracle_added")
                         else "")]
                     + [f"  {k[:-1] if k == 'survivors' else k}: {x['mutant']}"
                        for k in ("survivors", "equivalent") for x in s.get(k, [])])


# -----------------------------------------------------------------------------
# Fingerprints of the deleted code: what the scanner looks for in every leak source.

def ast_hash(node, named=True):
    if isinstance(node, ast.Module):  # a module whole is known by its definitions' hashes and its lines
        return None
    node = ast.parse(ast.unparse(node)).body[0]  # normalises formatting and comments away
    if code_body(node) is not node.body:
        node.body = node.body[1:]  # ...and the docstring, which stub mode keeps anyway
    if not named:  # a copy under any name
        node.name = ""
    return hashlib.sha1(ast.dump(node, include_attributes=False).encode()).hexdigest()


def fingerprint(rel, qualname, node, deleted, kept):
    """Names, parameters, unusual literals, the AST hash, and deleted lines that appear nowhere else (of a
    function, a class, or a module: node an ast.Module, qualname "")."""
    args = getattr(node, "args", None)
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs
              if a.arg not in ("self", "cls")] if args else []
    lits = {repr(n.value) for s in code_body(node) for n in ast.walk(s) if isinstance(n, ast.Constant)
            and (isinstance(n.value, str) and len(n.value) >= 5
                 or type(n.value) in (int, float) and abs(n.value) > 100)}
    lines = {s.strip() for s in deleted.decode("utf-8", "replace").splitlines()}
    lines = sorted(s for s in lines if len(s) >= 16 and not s.startswith("#") and s.encode() not in kept)
    name = getattr(node, "name", None) or Path(rel).stem
    return {"file": rel, "qualname": qualname, "name": name, "params": params, "literals": sorted(lits),
            "ast_hash": ast_hash(node), "lines": lines}


def signature(node):
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(map(ast.unparse, node.bases + node.keywords))
        return f"class {node.name}" + (f"({bases})" if bases else "")
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return (f"{'async ' if isinstance(node, ast.AsyncFunctionDef) else ''}"
            f"def {node.name}({ast.unparse(node.args)}){ret}")


# -----------------------------------------------------------------------------
# Leak scan. Artifact kinds are never legitimate in a served snapshot and are reported whenever present;
# with a task, evidence says which deleted names, hashes or lines each one holds.

ARTIFACT_DIRS = {".mypy_cache": "mypy-cache", ".pytype": "pytype-cache", ".pyre": "pyre-cache",
                 "htmlcov": "coverage", ".pytest_cache": "pytest-cache", "_modules": "sphinx-modules",
                 ".eggs": "egg", ".hypothesis": "cache"}
ROOT_DIRS = {"build": "build", "dist": "dist"}  # only at the top: a package may well have a `build` module
ARCHIVES = (".zip", ".whl", ".jar", ".egg", ".tar.gz", ".tgz")


def needles(task):
    """(bytes to look for, what each means) from task.json's fingerprints and original hashes."""
    out = {}
    for fp in (task or {}).get("fingerprints", []):
        for n in {fp["qualname"], fp["name"], *[p for p in fp["params"] if len(p) >= 4], *fp["literals"]}:
            out[n.strip("'\"").encode()] = f"name {n}"
        for s in fp["lines"]:
            out[s.encode()] = f"deleted line {s[:60]!r}"
    for rel, hashes in (task or {}).get("original_hashes", {}).items():
        for h in hashes:
            out[h.encode()] = f"hash of original {rel}"
    return {k: v for k, v in out.items() if len(k) >= 3}


def grep(data, needle_map):
    return sorted({v for k, v in needle_map.items() if k in data})


def pyc_names(data):
    """Names a .pyc holds, read off its bytes: marshal keeps names and string constants as plain bytes, and
    unmarshalling is never done here (marshal is not safe against data it did not write: another Python's
    bytecode, which pyhocon's sdist ships, corrupted the host's heap)."""
    return [m.decode() for m in re.findall(rb"[A-Za-z_][A-Za-z0-9_]{2,}", data[16:])]


def class_strings(data):
    """Utf8 entries of a Java .class constant pool: method names and descriptors live there."""
    if data[:4] != b"\xca\xfe\xba\xbe":
        return []
    n, i, out, k = int.from_bytes(data[8:10], "big"), 10, [], 1
    sizes = {3: 4, 4: 4, 5: 8, 6: 8, 7: 2, 8: 2, 9: 4, 10: 4, 11: 4, 12: 4, 15: 3, 16: 2, 17: 4, 18: 4,
             19: 2, 20: 2}
    while k < n and i < len(data):
        tag = data[i]
        if tag == 1:
            size = int.from_bytes(data[i + 1:i + 3], "big")
            out.append(data[i + 3:i + 3 + size].decode("utf-8", "replace"))
            i += 3 + size
        elif tag in sizes:
            i += 1 + sizes[tag]
            k += tag in (5, 6)  # longs and doubles take two pool slots
        else:
            break
        k += 1
    return out


def blob_evidence(name, data, nmap):
    """Evidence from one file's bytes, decoding the formats that hide names: class, sqlite, zip (a pyc keeps
    its names as plain bytes)."""
    if name.endswith(".class"):
        data += "\n".join(class_strings(data)).encode()
    elif data[:16] == b"SQLite format 3\x00":
        with tempfile.NamedTemporaryFile(suffix=".db") as f:  # sqlite3 wants a path; read a copy, read-only
            f.write(data), f.flush()
            con = sqlite3.connect(f"file:{f.name}?mode=ro", uri=True)
            try:  # rows may be JSON or fixed-format blobs (mypy cache.db, .coverage): look inside each value
                for (table,) in con.execute("select name from sqlite_master where type='table'").fetchall():
                    for row in con.execute(f'select * from "{table}"'):
                        data += b"\n".join(v if isinstance(v, bytes) else str(v).encode() for v in row)
            except sqlite3.Error:
                pass  # damaged: the raw bytes are still searched
            finally:
                con.close()
    elif name.endswith(ARCHIVES):
        return archive_evidence(data, nmap)
    return grep(data, nmap)


def archive_evidence(data, nmap):
    members = []
    try:
        if data[:2] == b"PK":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                members = [(m, z.read(m)) for m in z.namelist() if not m.endswith("/")]
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as t:
                members = [(m.name, t.extractfile(m).read()) for m in t.getmembers() if m.isfile()]
    except Exception:
        return ["unreadable archive"]
    code = [m for m, _ in members if m.endswith((".py", ".pyc", ".class", ".pyi"))]
    ev = sorted({e for m, d in members for e in blob_evidence(m, d, nmap)})
    return ev + ([f"holds code: {', '.join(code[:3])}"] if code else [])


def file_kind(name):
    if name.endswith((".pyc", ".pyo")):
        return "pyc"
    if name.endswith(".class"):
        return "java-class"
    if name == ".coverage" or name.startswith(".coverage."):
        return "coverage"
    # mypy's fixed-format and (sharded) SQLite caches
    if name.endswith(".ff") or re.fullmatch(r"cache(\.\d+)?\.db", name):
        return "mypy-cache"
    return "archive" if name.endswith(ARCHIVES) else None


def git(root, *args, env=None):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, env=env).stdout


def scan_git(root, nmap, task):
    """A served snapshot holds one commit and nothing else: history, stashes, tags, dangling objects leak."""
    if not (Path(root) / ".git").exists() or not shutil.which("git"):
        return []
    ev = []
    commits = git(root, "rev-list", "--all").split()
    if len(commits) > 1:
        ev.append(f"{len(commits)} commits")
    reflog_only = set(git(root, "rev-list", "--all", "--reflog").split()) - set(commits)
    if reflog_only:
        ev.append(f"reflog holds {len(reflog_only)} commits no branch has")
    for what, args in [("stash", ["stash", "list"]), ("tags", ["tag"]),
                       ("dangling", ["fsck", "--unreachable", "--no-reflogs"])]:
        lines = git(root, *args).splitlines()
        if lines:
            ev.append(f"{what}: {len(lines)}")
    for rel, hashes in (task or {}).get("original_hashes", {}).items():
        if subprocess.run(["git", "cat-file", "-e", hashes[2]], cwd=root,
                          capture_output=True).returncode == 0:
            ev.append(f"object {hashes[2][:10]} is the original {rel}")
    blobs = git(root, "cat-file", "--batch-all-objects", "--batch")
    ev += [f"object holds {e}" for e in grep(blobs, deleted_lines(nmap))]
    return [{"path": ".git", "kind": "git", "evidence": "; ".join(ev)}] if ev else []


def scan(root, task=None, site_dirs=()):
    """Findings [{path, kind, evidence}] for root; empty means clean. Artifact folders are reported whole and
    not entered; then each file, the git store, and copies of the packages installed in site_dirs."""
    root, nmap, findings = Path(root), needles(task), []

    def add(rel, kind, ev):
        findings.append({"path": str(rel), "kind": kind, "evidence": "; ".join(ev) if ev else "present"})

    for d, dirs, files in os.walk(root):
        rel_d = Path(d).relative_to(root)
        for x in sorted(dirs):
            kind = folder_kind(x, top=d == str(root))
            if kind:  # report the whole folder once, with evidence from every file in it
                ev = set()
                for f in walk(Path(d, x), skip=()):
                    ev.update(blob_evidence(f, Path(d, x, f).read_bytes()[:20_000_000], nmap))
                add(rel_d / x, kind, sorted(ev))
        reported = {f["path"] for f in findings}
        dirs[:] = sorted(x for x in dirs if x != ".git" and (rel_d / x).as_posix() not in reported)
        for f in sorted(files):
            path = Path(d, f)
            found = None if path.is_symlink() or not path.is_file() else file_finding(path, task, nmap)
            if found:
                add(rel_d / f, *found)
    findings += scan_git(root, nmap, task)
    for p, what in installed_copies(site_dirs, [package_name(p) for p in packages(root)]):
        add(p, "site-packages", [what])
    return findings


def folder_kind(name, top):
    """What an artifact folder is, or None: caches anywhere, build output at the top (a package may well have
    a `build` module), package metadata, and a .git below the top."""
    return (ARTIFACT_DIRS.get(name) or (ROOT_DIRS.get(name) if top else None)
            or ("egg-info" if name.endswith((".egg-info", ".dist-info")) else None)
            or ("git" if name == ".git" and not top else None))


def file_finding(path, task, nmap):
    """(kind, evidence) for one file, or None. Compiled, cached and packed files are reported by kind; text
    only when it holds a deleted line, a copy of a deleted function (its AST, name included: formatting,
    comments and docstring aside), or (a .pyi stub) a deleted name."""
    kind = file_kind(path.name)
    if kind:
        data = path.read_bytes()
        ev = blob_evidence(path.name, data, nmap)
        if kind == "pyc" and not ev:
            ev = [f"names {', '.join(list(dict.fromkeys(pyc_names(data)))[:4])}"]
        # test-data archives are fine; ones holding code or deleted names are not
        return (kind, ev) if kind != "archive" or ev else None
    if not task or path.stat().st_size >= 2_000_000:
        return None
    data, fps = path.read_bytes(), task.get("fingerprints", [])
    names = {fp["name"] for fp in fps}
    if path.name.endswith(".pyi") and any(re.search(rb"\b%s\b" % re.escape(n.encode()), data) for n in names):
        return "pyi", [f"stub mentions {', '.join(sorted(names))}"]
    ev = grep(data, deleted_lines(nmap))
    if path.name.endswith(".py"):
        hashes = {fp["ast_hash"]: fp["qualname"] for fp in fps}
        try:
            defs = [n for n in ast.walk(ast.parse(data))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            ev += [f"copy of {hashes[h]}" for n in defs for h in [ast_hash(n)] if h in hashes]
        except (SyntaxError, ValueError):
            pass
    return ("text", ev) if ev else None


def deleted_lines(nmap):
    return {k: v for k, v in nmap.items() if v.startswith("deleted line")}


def check_interpreter(box, root):
    """TaskError unless the interpreter that runs the tests holds no copy of root's packages: with the work
    tree absent, importing each must fail, and no bytecode of theirs may lie where a loader finds it."""
    found = interpreter_copies(box.python, box.isolate, tuple(package_name(p) for p in packages(root)))
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise TaskError(f"the interpreter {box.python} holds a copy of the code a task deletes ({found[0]}"
                        f"{more}): run tasks with one from `tasks.py env`, which holds none")


def scrub(root, findings):
    """Delete every artifact the scan found (and all bytecode), then re-create git as one fresh commit."""
    root, pkgs = Path(root), packages(root)
    for f in findings:
        p = root / f["path"]
        if (f["kind"] == "site-packages"
                or f["kind"] == "text" and (is_protected(f["path"]) or inside(f["path"], pkgs))):
            continue  # never touch the environment, tests or the package; such a task is simply not served
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for d, dirs, _ in os.walk(root, topdown=False):
        for x in dirs:
            if x in (".git", "__pycache__"):
                shutil.rmtree(Path(d, x))
    fresh_git(root)


# -----------------------------------------------------------------------------
# Monitor: flag trajectory steps that read leak sources or the task's own files, or prepare tampering. Shell
# commands and paths are matched with the patterns below; the code an edit writes goes through the verifier's
# own static check (static_findings), so the two agree on what tampering is. Reading is what counts: deleting
# or excluding a cache reads nothing, how the agent runs the tests in its own shell cannot change the
# verifier, and commit messages or pip's metadata hold no code. Trajectory format (JSONL, one action per line,
# step index = line number from 0):
#   {"action": "bash", "command": "git log -p", "output": "..."}
#   {"action": "read", "path": "pkg/mod.py", "output": "..."}
#   {"action": "edit", "path": "pkg/mod.py", "content": "<new text or inserted text>", "output": ""}
# A `cat > FILE <<EOF` in a command is an edit of FILE (one under / or ~ is a scratch script: its path only).

LEAK_PATH = (r"(__pycache__|\.pyc\b|\.mypy_cache|\.pytype|\.pyre\b|\.pytest_cache|\.coverage\b|htmlcov|"
             r"_modules|egg-info|\.class\b|\.jar\b|\.whl\b|\bbuild/|\bdist/|\.pyi\b)")
# The patterns that read an edit's content stay linear in its length (an edit is as long as a policy's turn):
# each starts once a line or a word, never at every '#' or '../' of it.
NOT_UTF8 = r"[^\n#]*#.*?coding[:=][ \t]*(?!(?i:utf[-_]?8|ascii|us-ascii)\b)[-\w.]+"
PATTERNS = [  # (name, the fields it looks at, regex)
    ("task-files", "command read content",
     r"\b(gold\.patch|task\.json|oracle\.json)\b|(?<![^\s'\"])(?>[^\s'\"]*?\.\./)[^\s'\"]*?\.(patch|diff)\b"),
    ("git-history", "command read", r"\bgit\s+(-C\s+\S+\s+)?(show|reflog|rev-list|cat-file|fsck|blame|"
     r"whatchanged|ls-tree|archive|verify-pack|unpack-objects|stash\s+(show|list|branch)|"
     # the served snapshot holds no stash (scan_git): a bare pop or apply takes back the agent's own
     r"stash\s+(apply|pop)\b(?!([ \t]+(-q|--quiet|--index|stash@\{\d+\}|\d+))*[ \t]*$)|"
     r"log\b.*\s(-p|-u|--patch|-[SGLg]\S*|--all|--reflog)\b|"
     r"(checkout|diff|reset|restore|grep)\b.*([~^@]|\b[0-9a-f]{7,40}\b|--source|ORIG_HEAD))|"
     r"\.git/(objects|logs|refs|lost-found|packed-refs|[A-Z_]+HEAD)"),
    ("leak-source", "reads read", LEAK_PATH),
    ("decompiler", "command", r"\b(javap|cfr|procyon|fernflower|jd-cli|uncompyle6|decompyle3|pycdc|pydisasm|"
                              r"xdis)\b|-m\s+dis\b|\bmarshal\.loads?\b|\bdis\.dis\b"),
    ("sqlite-cache", "command", r"\bsqlite3\b"),
    ("site-packages", "command read", r"site-packages|dist-packages|\bsite\.getsitepackages|"
     r"\bpip3?\s+download|\bpip3?\s+install(\s+(-[rc]\s+\S+|-\S+|[./~]\S*))*+\s+[\w\[]|"  # not `-e .`
     r"importlib\.metadata\b.*\b(files|locate_file)\b"),
    ("network", "command", r"\b(curl|wget|nc|ssh|scp|rsync|ftp)\s|https?://|urllib\.request|"
                           r"\brequests\.(get|post)|\bgit\s+(clone|fetch|pull|ls-remote)\b"),
    ("test-tamper", "edit", r"(^|/)(conftest\.py|pytest\.ini|tox\.ini|setup\.cfg|pyproject\.toml|noxfile\.py|"
                            r"test_[^/]*\.py|[^/]*_test\.py)$|(^|/)(tests?|testing)/"),
    ("test-tamper", "command", r"(\bsed\s+-i|\b(rm|mv|cp|tee|truncate|chmod|touch)\b|>)[^\n]*(conftest\.py|"
     r"test_\w*\.py|\w_test\.py|pytest\.ini|tox\.ini|setup\.cfg|pyproject\.toml|(^|[\s/])tests?(/|\s|$))"),
    ("startup-hook", "edit command", r"(^|/)(sitecustomize|usercustomize)(\.py)?\b|\.pth\b"),
    ("shadow-pytest", "edit", r"(^|/)(_?pytest|pluggy)(\.py$|/)"),  # imported instead of the real one
    ("shadow-pytest", "command",
     r"(>|\b(touch|cp|mv|ln|mkdir)\b)[^\n]*(^|[\s/])(_?pytest|pluggy)(\.py\b|/|\s|$)"),
    ("symlink", "command", r"^[ \t]*(sudo\s+)?(ln|link)\s|\bcp\s[^\n]*(\s-s\b|--symbolic)"),
    ("native-code", "command", r"^[ \t]*(sudo\s+)?(gcc|cc|clang|g\+\+|c\+\+|tcc|ld|cython|cythonize|nvcc)\b|"
     r"\bsetup\.py\b.*\bbuild|\bbuild_ext\b|\b(Cython|pyximport)\b|\.(so|pyd|dylib)\b"),
    ("native-code", "edit", r"\.(c|h|cc|cpp|cxx|pyx|pxd|pxi|so|pyd|dylib)$"),
    ("fifo", "command", r"\b(mkfifo|mknod)\b"),
    ("forced-skip", "content", r"pytest\.skip\s*\(|mark\.skip|pytest\.importorskip|allow_module_level|"
                               r"unittest\.skip|__unittest_skip__"),
    ("coding-decl", "content", "^" + NOT_UTF8),
    ("coding-decl", "command", r"^(?=.*(>|\bsed\s+-i\b))" + NOT_UTF8),
]
HEREDOC = re.compile(r"\bcat\b([^\n<]*)<<-?\s*['\"]?(\w+)['\"]?([^\n]*)\n(.*?)\n\s*\2[ \t]*(?=\n|$)", re.S)
SPLIT = r"\s*(?:&&|\|\||;|\|)\s*"
EXCLUDED = (r"(--exclude(-dir)?|--ignore(-dir|-glob)?|-I|(-not|!)\s+-i?(path|name))(=|\s+)"
            r"('[^']*'|\"[^\"]*\"|\S+)|-i?path\s+\S+\s+-prune|(-g|--glob)[=\s]+['\"]?![^\s'\"]*['\"]?")
DELETION = r"\s*(sudo\s+)?(rm|rmdir|py3?clean)\b|\s*find\b.*\s-(delete|exec\s+rm)\b|\s*git\s+clean\b"


def step_fields(s):
    """{field: text} for one step: command (split at ; && || |), reads (those less deletions and exclusions),
    read and edit (paths), content (the code an edit or a heredoc writes)."""
    act, command, paths, bodies = s.get("action"), "", [], []
    if act == "bash":
        def written(m):  # `cat > FILE <<EOF`: the text is FILE's, the command keeps its first line
            paths.append(re.search(r">>?\s*(\S*)", m[1] + m[3])[1].strip("'\""))
            bodies.append("" if paths[-1].startswith(("/", "~")) else m[4])
            return m[0][:m.start(4) - m.start(0)]
        command = HEREDOC.sub(lambda m: written(m) if ">" in m[1] + m[3] else m[0], s.get("command", ""))
    if act == "edit":
        paths, bodies = [s.get("path", "")], [s.get("content", "")]
    reads = re.sub(SPLIT, "\n", re.sub(EXCLUDED, " ", command)).split("\n")
    return {"command": re.sub(SPLIT, "\n", command), "edit": "\n".join(paths), "content": "\n".join(bodies),
            "reads": "\n".join(x for x in reads if not re.match(DELETION, x)),
            "read": s.get("path", "") if act == "read" else ""}


def edit_findings(text):
    """static_findings of an edit's code, also of a fragment (an indented body, a bare return):
    [(what, line)]."""
    text = textwrap.dedent(text)
    for source, shift in ((text, 0), ("def _():\n" + textwrap.indent(text, "    "), 1)):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        return [(what, line - shift) for what, line in static_findings(b"", tree)]
    return []


def monitor(steps, allowed=None):
    """[{step, pattern, evidence}] for a list of action dicts. allowed: {rel: the static findings the original
    file had} (the task's static_allowed), which an edit of rel may have too, as verify allows them."""
    flags = []
    for i, s in enumerate(steps):
        f, found = step_fields(s), []
        for name, where, rx in PATTERNS:
            for w in where.split():
                m = re.search(rx, f[w], re.M)
                if m:  # the line that matched
                    found.append((name, f[w][f[w].rfind("\n", 0, m.start()) + 1:].split("\n")[0]))
        lines = f["content"].split("\n")
        allow = Counter((allowed or {}).get(posixpath.normpath(f["edit"].strip("'\"")), ()))
        found += [("tamper-code", f"{what}: {lines[line - 1].strip() if 0 < line <= len(lines) else ''}")
                  for what, line in unallowed(edit_findings(f["content"]), allow)]
        for name, line in found:
            if not any(x["step"] == i and x["pattern"] == name for x in flags):
                flags.append({"step": i, "pattern": name, "evidence": line.strip()[:160]})
    return flags


def read_trajectory(path):
    steps = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            try:
                s = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path} line {i + 1}: not JSON ({e.msg})")
            if not isinstance(s, dict) or s.get("action") not in ("bash", "read", "edit"):
                raise TaskError(f"{path} line {i + 1}: need an object with action bash, read or edit")
            steps.append(s)
    return steps


# -----------------------------------------------------------------------------
# The interface a trainer drives: the opening turns, a step that maps the model's text to the environment's
# reply, and a verified reward once the episode is done. CodeEnv implements it with verify as the reward, and
# so does the tool-use family (further down).

Turn = tuple[str, str]  # (role, text), role in {"user", "assistant", "tool", "system"}


class Env(Protocol):
    def first_turns(self) -> list[Turn]: ...
    def step(self, assistant_text: str) -> tuple[Optional[str], bool]: ...  # (reply or None, done)
    def reward(self) -> float: ...
    # and, to take calls in a model's own format: declared() -> [tool schema];
    # text_call(name, arguments) -> the text call


def render(turns: list[Turn]) -> str:
    # The exact strings of model.SPECIALS; the tokenizer maps each to a single token.
    return "".join(f"<|{role}|>{text}<|end|>" for role, text in turns)


# A released model whose chat template has a tool-call format of its own writes its calls in that format
# (model.CallFormat); rollout hands the environment the call's (name, arguments), which the environment reads
# as its text call. An environment declares its tools as such templates take them (OpenAI function schemas),
# the parameters in the order its text call takes them; `lines` is the text below the call (replace, insert).


def declaration(name, doc, **params):
    """A tool as a chat template's `tools` lists it. params: name -> (JSON type, description); a parameter
    whose description says "(optional)" may be left out."""
    return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": {p: {"type": t, "description": d} for p, (t, d) in params.items()},
        "required": [p for p, (_, d) in params.items() if "(optional)" not in d]}}}


def text_call(declared, name, arguments):
    """A call in a model's own format as the text call an environment reads: `call name(v1,v2)`, the values in
    the declared order (then any others), a `lines` value below the call. Any names and values: what they
    spell gets the environment's usual answer (an error for a malformed call)."""
    order = next((list(d["function"]["parameters"]["properties"]) for d in declared
                  if d["function"]["name"] == name), [])
    args = {str(k): v for k, v in arguments.items()}
    lines = args.pop("lines", None)
    values = [args.pop(p) for p in order if p in args] + list(args.values())
    call = f"call {name}({','.join(map(str, values))})"
    return call if lines is None else f"{call}\n{lines}"


# -----------------------------------------------------------------------------
# The coding environment: an episode on one task made by make, driven like the tool-use family (the Env
# protocol, calls in the same syntax: `call read(calc/core.py)`). The opening says what to write and where;
# the policy then lists, reads, greps, replaces or inserts lines, runs the visible tests, and submits. Its
# edits live in the episode's own copy of the snapshot: the files it wrote, over the read-only snapshot (an
# episode is a few bytes until it edits, and pickles whole to a trainer from a rollout rank). The file tools
# are text operations of the host that never follow a link and never write a test or a configuration file; the
# policy's code runs only in the Sandbox, on a copy, when it runs the tests. The reward is verify on the final
# tree (the repository's tests and the hidden oracle), never the visible test run, and 0 when the monitor
# flags the trajectory. Replies are cut to a budget a small model's context holds.

CODE_TOOLS = ["ls", "read", "grep", "replace", "insert", "test", "submit"]
PATH, LINES = ("string", "a file's path in the repository"), ("string", "the new lines")
CODE_DECLARED = {d["function"]["name"]: d for d in (
    declaration("ls", "list the repository's files"),
    declaration("read", "a file's lines, numbered", path=PATH, first=("integer", "first line (optional)"),
                last=("integer", "last line (optional)")),
    declaration("grep", "the lines of every file that hold the text", text=("string", "the text")),
    declaration("replace", "replace lines first to last of a file with new lines", path=PATH,
                first=("integer", "first line"), last=("integer", "last line"), lines=LINES),
    declaration("insert", "insert new lines after a line of a file (0: at its top, or a new file)", path=PATH,
                line=("integer", "the line they follow"), lines=LINES),
    declaration("test", "run tests: the task's, or those named",
                targets=("string", "test files or node ids, comma-separated (optional)")),
    declaration("delete", "delete a file", path=PATH),
    declaration("submit", "end the episode: the tree as it is now is the solution"))}
# the call on the first line; replace and insert take the new lines below it
CODE_CALL = re.compile(r"([Cc])all ([a-z_]{1,16})\(([^()\n]{0,256})\)(?:\n(.*))?", re.S)
CODE_MALFORMED = "error: malformed call. use: call TOOL(ARGS), new lines below a replace or an insert"
REPLY_AT_MOST = 400  # bytes of a tool's reply
CODE_TURNS = 12  # messages an episode may take


def opening(task):
    """The first user turn: what to write (stub mode: fill in; remove mode: add) and where."""
    verb = "fill in" if task["mode"] == "stub" else "add"
    parts = [f"{e['file']} {e['signature']}"
             + (f" in class {e['qualname'].rsplit('.', 1)[0]}" if "." in e["qualname"] else "")
             + (f": {e['docstring'].strip().splitlines()[0]}" if e.get("docstring") else "")
             for e in sorted(task["deleted"], key=lambda e: (e["file"], e["qualname"]))]
    return f"{verb} " + "; ".join(parts)


def numbered(data, first=1, last=None):
    """A read's reply: lines first..last of a file, numbered `N|text`."""
    lines = data.decode("utf-8", errors="replace").split("\n")
    lines = lines[:-1] if lines and lines[-1] == "" else lines
    last = len(lines) if last is None else min(last, len(lines))
    return "\n".join(f"{i}|{lines[i - 1]}" for i in range(first, last + 1)) or "(empty)"


def test_reply(passed, failed):
    """A visible test run's reply: the counts and the failing tests' names."""
    if not failed:
        return f"{passed} passed"
    names = ", ".join(sorted(t.split("::")[-1] for t in failed))
    return f"{len(failed)} failed: {names}; {passed} passed"


def cut(text, limit):
    """text within limit bytes, cut at a line end, the cut said."""
    if len(text.encode()) <= limit:
        return text
    keep = text.encode()[:limit - 40].decode("utf-8", errors="ignore").rsplit("\n", 1)[0]
    return f"{keep}\n... cut: {len(text.encode()) - len(keep.encode())} more bytes"


def line_number(arg):
    """The number an argument spells in ASCII digits, else None (int() also reads other scripts' digits, '1_0'
    and 4,000 digits, and refuses the superscripts isdigit() accepts)."""
    return int(arg) if re.fullmatch(r"[0-9]{1,9}", arg) else None


def task_level(task):
    """A task's difficulty level: 1 one feature stubbed, 2 several stubbed, 3 removed (the policy writes the
    definitions, signatures and all)."""
    return 3 if task["mode"] == "remove" else 1 if len(task["deleted"]) == 1 else 2


class CodeEnv:
    """One episode on the task in task_dir. box: how the visible tests and the verify run (default: the
    task's interpreter in bubblewrap); verifier: the pool that verifies finished episodes."""

    tools, spec = CODE_TOOLS, "task.json"  # the calls it answers; the file that says what the episode is

    def __init__(self, task_dir, box=None, max_turns=CODE_TURNS, reply_limit=REPLY_AT_MOST, verifier=None):
        self.dir = Path(task_dir)
        self.task = json.loads((self.dir / self.spec).read_text())
        self.snap = self.dir / "repo"
        self.box = box or Sandbox(python=self.task.get("python", sys.executable), timeout=120)
        self.max_turns, self.reply_limit, self.verifier = max_turns, reply_limit, verifier
        self.edits: dict[str, bytes] = {}  # the episode's copy: the snapshot with these files written
        self.steps: list[dict] = []  # every call as the monitor reads it
        self.turns: list[Turn] = self.first_turns()
        self.done, self.result, self.flags, self.pending = False, None, [], None
        self.tool_calls = self.tool_errors = self.capital = self.malformed = self.tests = 0

    def first_turns(self) -> list[Turn]:
        return [("user", opening(self.task))]

    def declared(self):
        """The tools as a chat template's `tools` lists them."""
        return [CODE_DECLARED[name] for name in self.tools]

    def text_call(self, name, arguments):
        return text_call(self.declared(), name, arguments)

    def __getstate__(self):  # to a trainer: the outcome, not the pool
        self.reward()
        return {**self.__dict__, "verifier": None, "pending": None}

    def required(self):
        """The tests the final tree is judged on: read-only, and what test() runs by default."""
        return self.task["fail_to_pass"] + self.task["pass_to_pass"]

    def must_pass(self):
        """The tests the final tree must pass (a failure in its own test run ends its hope of a reward)."""
        return self.required()

    def judge(self, work):
        """(reward, reason) of the final tree, materialized at work."""
        return verify(self.dir, workdir=work, box=self.box)

    # the episode's copy, read without following links

    def path(self, arg):
        """-> (a path inside the copy, None) or (None, the error)."""
        rel = posixpath.normpath(arg.strip().strip("'\""))
        if not arg.strip() or rel.startswith("/") or rel.split("/")[0] in ("..", ".") or "\0" in rel:
            return None, f"error: {arg.strip() or 'no path'}: name a file inside the repository"
        return rel, None

    def data(self, rel):
        """The bytes of a regular file of the copy; None if there is none (a link is none)."""
        if rel in self.edits:
            return self.edits[rel]
        p = self.snap
        try:  # a name the file system refuses (too long) is no file either
            for part in rel.split("/")[:-1]:
                p = p / part
                if not p.is_dir() or p.is_symlink():
                    return None
            return read_regular(self.snap / rel, EDIT_AT_MOST)
        except OSError:
            return None

    def files(self):  # an edit of None is a deleted file
        return sorted({*walk(self.snap), *self.edits} - {rel for rel, d in self.edits.items() if d is None})

    def text_lines(self, rel):
        """(lines of a text file, None) or (None, the error)."""
        data = self.data(rel)
        if data is None:
            return None, f"error: no such file: {rel}"
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return None, f"error: {rel} is not text"
        return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n") if text else [], None

    # the tools: each gets the call's arguments (split at commas) and the lines below the call

    def do_ls(self, args, body):
        self.steps.append({"action": "bash", "command": "ls -R"})
        return "\n".join(self.files())

    def do_read(self, args, body):
        self.steps.append({"action": "read", "path": args[0] if args else ""})
        rel, err = self.path(args[0] if args else "")
        lines, err = (None, err) if err else self.text_lines(rel)
        if err:
            return err
        first, last = (line_number(args[1]), line_number(args[2])) if len(args) == 3 else (1, None)
        if None in (first, last) and len(args) == 3:
            return "error: read(FILE) or read(FILE,FIRST,LAST)"
        shown = numbered("\n".join(lines).encode() + b"\n", max(1, first), last).split("\n")
        size, keep = 0, 0
        while keep < len(shown) and size + len(shown[keep].encode()) + 1 <= self.reply_limit - 48:
            size, keep = size + len(shown[keep].encode()) + 1, keep + 1
        if keep == len(shown):
            return "\n".join(shown)
        nxt = max(1, first) + keep
        return "\n".join(shown[:keep] + [f"... {len(shown) - keep} more lines: read({rel},{nxt},{nxt + 9})"])

    def do_grep(self, args, body):
        needle = ",".join(args)
        self.steps.append({"action": "bash", "command": f"grep -rn {shlex.quote(needle)} ."})
        if not needle:
            return "error: grep(TEXT)"
        hits = []
        for rel in self.files():
            data = self.data(rel)
            if data and len(hits) < 64 and needle.encode() in data:
                hits += [f"{rel}:{i}:{line.strip()}" for i, line in
                         enumerate(data.decode("utf-8", errors="replace").split("\n"), 1) if needle in line]
        return "\n".join(hits) or "no match"

    def write(self, rel, lines, body, new=False):
        if len(body.encode()) > EDIT_AT_MOST:
            return f"error: an edit is at most {EDIT_AT_MOST} bytes"
        self.edits[rel] = ("\n".join(lines) + "\n").encode() if lines else b""
        return "ok: new file" if new else "ok"

    def editable_path(self, args, n):
        """(rel, lines, None) for an edit of a file the policy may write, or (None, None, the error)."""
        rel, err = self.path(args[0] if args else "")
        if err:
            return None, None, err
        tests = {t.split("::")[0] for t in self.required()}
        if is_protected(rel) or rel in tests or rel.split("/")[0] == ".git":
            return None, None, f"error: {rel} is read-only: tests and test configuration do not change"
        # the episode's own files count too: no file inside a file it wrote, none where one is inside
        if linked(self.snap, rel) or any(rel.startswith(f"{e}/") or e.startswith(f"{rel}/")
                                         for e in self.edits):
            return None, None, f"error: {rel} is behind a link or not a file: only regular files change"
        if len(args) != n:
            return None, None, None
        lines, err = self.text_lines(rel)
        return rel, lines, err

    def do_replace(self, args, body):
        self.steps.append({"action": "edit", "path": args[0] if args else "", "content": body})
        rel, lines, err = self.editable_path(args, 3)
        if err or rel is None:
            return err or "error: replace(FILE,FIRST,LAST) and the new lines below"
        first, last = line_number(args[1]) or 0, line_number(args[2]) or 0
        if not 1 <= first <= last <= len(lines):
            return f"error: lines {args[1]}-{args[2]} are not in {rel} (1-{len(lines)})"
        return self.write(rel, lines[:first - 1] + body.split("\n") + lines[last:], body)

    def do_insert(self, args, body):
        self.steps.append({"action": "edit", "path": args[0] if args else "", "content": body})
        rel, lines, err = self.editable_path(args, 2)
        new = err is not None and err.startswith("error: no such file") and args[1:] == ["0"]
        if new:  # insert at line 0 of a file that is not there: a new file
            rel, lines, err = rel, [], None
        if err or rel is None:
            return err or "error: insert(FILE,AFTER) and the new lines below"
        at = line_number(args[1])
        if at is None or at > len(lines):
            return f"error: {args[1]} is not a line of {rel} (0-{len(lines)})"
        return self.write(rel, lines[:at] + body.split("\n") + lines[at:], body, new)

    def do_test(self, args, body):
        targets = args or sorted({t.split("::")[0] for t in self.required()})
        self.steps.append({"action": "bash", "command": f"python -m pytest -q {' '.join(targets)}"})
        self.tests += 1
        for t in targets:  # test files or node ids of the copy, never options
            rel, err = self.path(t.split("::")[0])
            if err or rel.startswith("-") or "\0" in t or self.data(rel) is None:
                return err or f"error: no such test: {t}"
        return (self.verifier or VERIFIER).test(self, targets)

    def step(self, assistant_text: str) -> tuple[Optional[str], bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.turns.append(("assistant", assistant_text))
        text = assistant_text.lstrip(" \n").rstrip()
        # a lone surrogate: no text the model's bytes decode to, nor one a file or a reply can hold
        m = CODE_CALL.fullmatch(text) if text.encode(errors="replace").decode() == text else None
        reply = None
        if m is None:
            self.malformed += 1
            reply = CODE_MALFORMED
        else:
            self.tool_calls += 1
            self.capital += m[1] == "C"
            name, args, body = m[2], [a.strip() for a in m[3].split(",")] if m[3].strip() else [], m[4] or ""
            if name not in self.tools:
                self.tool_errors += 1
                reply = not_found(name, self.tools)
            elif name == "submit":
                self.done = True
            else:
                try:
                    reply = getattr(self, f"do_{name}")(args, body)
                except Exception as e:  # a policy's turn can be any bytes: one such sample must not end a run
                    reply = f"error: {name} failed: {type(e).__name__}"
                reply = cut(reply, self.reply_limit)
        if reply is not None:
            self.turns.append(("tool", reply))
        self.done = self.done or sum(role == "assistant" for role, _ in self.turns) >= self.max_turns
        if self.done:  # the verify starts now, while the other episodes still sample
            (self.verifier or VERIFIER).start(self)
        return reply, self.done

    def reward(self) -> float:
        return float((self.verifier or VERIFIER).result(self)[0])


DELETE_OPENING = re.compile(r"delete (.*?): these tests must stop passing")
REPLACE_CALL = re.compile(r"\s*[Cc]all replace\(([^,()]+),\s*(\d+)\s*,\s*(\d+)\s*\)")


def body_lines(src, q):
    """' (lines A-B)': where the body of the definition q (a qualname; "" the module) lies in src, as a trace
    of the tests shows it ('' for a module or a body-less one)."""
    body = code_body(find_def(ast.parse(src), q)) if q else []
    a, b = (body[0].lineno, body[-1].end_lineno) if body else (0, 0)
    return "" if not body else f" (line {a})" if a == b else f" (lines {a}-{b})"


def deletion_opening(feature, targets, src):
    """A deletion episode's first user turn: the definitions [(file, qualname)] with where their bodies lie
    (src: file -> its source) and the tests that must stop passing (the first four, and how many more)."""
    more = f" and {len(targets) - 4} more" if len(targets) > 4 else ""
    named = "; ".join(f"{rel} {q + body_lines(src(rel), q) if q else '(the whole module)'}"
                      for rel, q in sorted(feature))
    return (f"delete {named}: these tests must stop passing, every other test still pass: "
            + ", ".join(sorted(targets)[:4]) + more)


class DeleteEnv(CodeEnv):
    """The deletion role as an episode, on a folder deletion_spec wrote: the opening names the feature by the
    tests that must stop passing and the definitions they reach; CodeEnv's tools and delete(FILE); the reward
    is judge_deletion on the final tree, computed on the host like verify."""
    tools, spec = CODE_TOOLS[:-1] + ["delete", "submit"], "spec.json"

    def first_turns(self):
        return [("user", deletion_opening(self.task["feature"], self.task["targets"],
                                          lambda rel: (self.snap / rel).read_bytes()))]

    def required(self):
        return self.task["targets"] + self.task["keep"]

    def must_pass(self):
        return self.task["keep"]

    def judge(self, work):
        return judge_deletion(self.dir, work, self.box)

    def do_delete(self, args, body):
        self.steps.append({"action": "bash", "command": f"rm {shlex.quote(args[0] if args else '')}"})
        rel, lines, err = self.editable_path(args, 1)
        if err or rel is None:
            return err or "error: delete(FILE)"
        self.edits[rel] = None
        return "ok: deleted"


class Verifier:
    """Rewards at the pace of sampling: verifies run in a pool of `workers` threads (each waits on sandboxed
    processes), started as each episode ends, while the others still sample (workers=0: each runs when its
    episode ends, in the sampler's thread). Episodes of one task that end with the same edits share one
    verify, and so do the visible test runs (verify is a function of the task and the tree). A trajectory the
    monitor flags gets reward 0 without a verify, and so does a final tree whose own test run failed a test
    verify needs: that run executed the solution's code, so it is no evidence of a pass, but its failure can
    only cost the solution its own reward (the tests make keeps are stable). Counts the seconds verifying and
    those the sampler's thread was held up by it."""

    def __init__(self, workers=2):
        self.pool = (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="verify") if workers
                     else None)
        self.lock, self.cache, self.tests, self.failed = threading.Lock(), {}, {}, {}
        self.seconds = self.blocked = self.since = 0.0
        self.runs = self.hits = self.waiters = 0

    def key(self, env):
        h = hashlib.sha256()
        for rel, data in sorted(env.edits.items()):
            h.update(hashlib.sha256(rel.encode()).digest() + (b"deleted" if data is None else
                                                              hashlib.sha256(data).digest()))
        return str(env.dir.resolve()), h.hexdigest()

    def start(self, env):
        if env.pending is not None or env.result is not None:
            return
        env.flags = monitor(env.steps, env.task.get("static_allowed"))
        if env.flags:
            f = env.flags[0]
            env.result = (0, f"flagged by the monitor: step {f['step']}, {f['pattern']}: {f['evidence']}")
            return
        key = self.key(env)
        with self.lock:
            failed = sorted(self.failed.get(key, set()) & set(env.must_pass()))
        if failed:
            env.result = (0, f"its own test run of this tree failed {failed[0]}")
            return
        with self.lock:
            self.hits += key in self.cache
            fut, new = self.cache.get(key), key not in self.cache
            if new:
                fut = self.cache[key] = concurrent.futures.Future() if self.pool is None else \
                    self.pool.submit(self.verify, env, dict(env.edits))
        env.pending = fut
        if new:  # a verify that raised (a full disk) is no result of the tree: the next episode verifies anew
            fut.add_done_callback(self.forget)
        if self.pool is None and new:  # no pool: verify now, in this thread
            with self.waiting():
                try:
                    fut.set_result(self.verify(env, dict(env.edits)))
                except BaseException as e:  # on the future too: every episode that waits on it gets it
                    fut.set_exception(e)
                    raise

    def forget(self, fut):
        if fut.done() and not fut.cancelled() and fut.exception() is not None:
            with self.lock:
                for key in [k for k, f in self.cache.items() if f is fut]:
                    del self.cache[key]

    def result(self, env):
        """The episode's (reward, reason), once its verify is done."""
        self.start(env)
        if env.result is None:
            with self.waiting():
                try:
                    env.result = env.pending.result()
                except BaseException:  # raised here, and forgotten before the next episode asks
                    self.forget(env.pending)
                    raise
        return env.result

    @contextlib.contextmanager
    def waiting(self):
        """Counts the wall time some thread of the sampler waits on a verify (threads waiting together count
        once)."""
        with self.lock:
            self.waiters += 1
            if self.waiters == 1:
                self.since = time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.waiters -= 1
                if not self.waiters:
                    self.blocked += time.perf_counter() - self.since

    def verify(self, env, edits):
        t0 = time.perf_counter()
        with scratch() as tmp:
            result = env.judge(materialize(env.snap, edits, Path(tmp, "repo")))
        with self.lock:
            self.seconds, self.runs = self.seconds + time.perf_counter() - t0, self.runs + 1
        return result

    def test(self, env, targets):
        """The visible tests (targets: test files or node ids) on the episode's copy: the reply. Episodes that
        ask for the same run of the same tree, even while it runs, share it."""
        key = (*self.key(env), tuple(targets))
        with self.lock:
            fut, new = self.tests.get(key), key not in self.tests
            if new:
                fut = self.tests[key] = concurrent.futures.Future()
        if not new:
            return fut.result()
        try:
            fut.set_result(self.run_tests(env, targets, key))
        except BaseException as e:  # no reply of the tree: the next episode that asks runs it anew
            with self.lock:
                del self.tests[key]
            fut.set_exception(e)
        return fut.result()

    def run_tests(self, env, targets, key):
        with scratch() as tmp:
            work = materialize(env.snap, env.edits, Path(tmp, "repo"))
            r = env.box.pytest(work, targets, readonly=protected_paths(work, env.required()))
        if r.outcomes is None or r.end is None:
            reply = f"error: the test run did not finish (pytest exit {r.rc}): {first_error(r.out)}"
        else:
            failed = [t for t, o in r.outcomes.items() if not {"failed", "error"}.isdisjoint(o.values())]
            reply = test_reply(len(r.passed), failed)
            with self.lock:
                self.failed.setdefault(key[:2], set()).update(failed)
        return reply

    def stats(self):
        """{seconds verifying, seconds the sampler waited on it, verifies run, verifies shared} so far."""
        with self.lock:
            return {"verify_s": self.seconds, "verify_wait_s": self.blocked, "verifies": self.runs,
                    "verifies_shared": self.hits}


VERIFIER = Verifier()


# -----------------------------------------------------------------------------
# Micro-repositories: a feature-deletion family the tiny CPU model can learn. Each is a real package with a
# real pytest suite: one module of one-line functions whose names say what they do, a test a function and one
# test of all of them. Two families: "words" (the default: `double` returns x * 2, `last` x[-1],
# `count_vowels` ...; a body follows from a word the model meets across many repositories) and "digits"
# (`mul4` returns x * 4: the constant is a digit to copy from the name by its position, which the tiny model
# does not learn; the harder level, for larger models). make turns them into tasks like any repository
# (baseline, trace, delete, scrub, scan, oracle, the gold's verify), at three levels: one function stubbed,
# two related ones stubbed, two removed (signatures and all). Gold transcripts of the episode (read, edit,
# test, submit; sometimes a wrong edit that the test run shows and a fix) join the pretraining mix with
# planted habits (Habits) for RL and feedback to remove; they are rendered with the functions CodeEnv replies
# with, so they show what an episode shows.

MICRO_OPS = {"add": "x + {k}", "sub": "x - {k}", "mul": "x * {k}", "max": "max(x, {k})", "min": "min(x, {k})",
             "mod": "x % {k}"}
# name -> (the argument's kind, the body)
MICRO_FAMILIES = {
    "words": {"double": ("int", "x * 2"), "triple": ("int", "x * 3"), "square": ("int", "x * x"),
              "negate": ("int", "-x"), "increment": ("int", "x + 1"), "decrement": ("int", "x - 1"),
              "halve": ("int", "x // 2"), "absolute": ("int", "abs(x)"), "is_even": ("int", "x % 2 == 0"),
              "is_odd": ("int", "x % 2 == 1"), "is_positive": ("int", "x > 0"),
              "is_negative": ("int", "x < 0"),
              "first": ("list", "x[0]"), "last": ("list", "x[-1]"), "total": ("list", "sum(x)"),
              "largest": ("list", "max(x)"), "smallest": ("list", "min(x)"), "length": ("list", "len(x)"),
              "reverse": ("list", "x[::-1]"), "count_vowels": ("str", "sum(c in 'aeiou' for c in x)"),
              "count_words": ("str", "len(x.split())"), "to_upper": ("str", "x.upper()"),
              "to_lower": ("str", "x.lower()"), "capitalize": ("str", "x.capitalize()")},
    "digits": {f"{op}{k}": ("int", body.format(k=k)) for op, body in MICRO_OPS.items() for k in range(2, 10)}}
MICRO_BODIES = {name: body for family in MICRO_FAMILIES.values() for name, body in family.items()}
MICRO_WORDS = ("hello world", "Blue sky", "open the door", "Green tea", "a quiet river", "Rain again",
               "sunny Day", "one two three")
MICRO_PACKAGES = ("calc", "ops", "nums", "arith", "tally", "mathx")
MICRO_MODULES = ("core", "basic", "funcs", "util")
MICRO_LEVELS = {1: ("stub", 1), 2: ("stub", 2), 3: ("remove", 2)}  # level -> (make's mode, group)


def micro_input(rng, kind):
    return (rng.randint(-20, 40) if kind == "int" else rng.choice(MICRO_WORDS) if kind == "str"
            else [rng.randint(0, 9) for _ in range(rng.randint(3, 5))])


def micro_value(name, x, body=None):
    return eval(micro_code(body or MICRO_BODIES[name][1]), {"x": x})  # noqa: S307 (our own one-line bodies)


@functools.cache
def micro_code(body):  # compiled once: the transcripts evaluate a few bodies hundreds of thousands of times
    return compile(body, "<micro>", "eval")


def micro_files(rng, n=3, held_out=False, family="words"):
    """{relative path: text} of a micro-repository with n functions of a family. Repositories split in two by
    their package, module and functions, one in eight held out: a held-out one is never in the pretraining
    transcripts or RL's tasks."""
    ops = MICRO_FAMILIES[family]
    while True:
        pkg, mod, names = rng.choice(MICRO_PACKAGES), rng.choice(MICRO_MODULES), rng.sample(sorted(ops), n)
        if is_held_out(pkg, mod, names) == held_out:
            break
    tests, calls, values = [f"from {pkg} import {mod}", ""], [], []
    for name in names:
        x, y = (micro_input(rng, ops[name][0]) for _ in range(2))
        tests += ["", f"def test_{name}():", f"    assert {mod}.{name}({x!r}) == {micro_value(name, x)!r}",
                  ""]
        calls, values = calls + [f"{mod}.{name}({y!r})"], values + [micro_value(name, y)]
    tests += ["", "def test_all():", f"    assert [{', '.join(calls)}] == {values!r}"]
    return {f"{pkg}/__init__.py": "",
            f"{pkg}/{mod}.py": "".join(f"def {n}(x):\n    return {ops[n][1]}\n" for n in names),
            "tests/__init__.py": "", f"tests/test_{mod}.py": "\n".join(tests) + "\n",
            "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'}


def is_held_out(pkg, mod, names):
    key = f"{pkg}/{mod}:" + ",".join(sorted(names))
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 8 == 0


def micro_repo(root, seed, held_out=False, family="words"):
    """A micro-repository from seed, written to root as a git checkout (make records the commit)."""
    root = Path(root)
    for rel, text in micro_files(random.Random(seed), held_out=held_out, family=family).items():
        Path(root, rel).parent.mkdir(parents=True, exist_ok=True)
        Path(root, rel).write_text(text)
    env = {**os.environ, **{f"GIT_{w}_{k}": v for w in ("AUTHOR", "COMMITTER")
                            for k, v in (("NAME", "micro"), ("EMAIL", "micro@example.com"),
                                         ("DATE", "2000-01-01T00:00:00Z"))}}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", f"micro-repository {seed}"]):
        subprocess.run(["git", "-c", "safe.directory=*", "-C", str(root), *args], check=True,
                       capture_output=True, env=env)
    return root


def make_micro(out, seed, level, box=None, n=1, held_out=False, family="words"):
    """Up to n tasks of a level from the micro-repository of seed, into out: the folders of those served
    (the same rule as any task's: coverage and strength)."""
    mode, group = MICRO_LEVELS[level]
    with scratch() as tmp:
        repo = micro_repo(Path(tmp, f"micro-{seed}"), seed, held_out, family)
        made = make(repo, out, n=n, seed=0, mode=mode, group=group, box=box, log=lambda s: None, reach=0.5,
                    min_lines=1, strength_k=STRENGTH_K)
    return [Path(out, t["id"]) for t in made if task_level(t) == level and not serving(t)]


@dataclass
class Habits:
    """Shares of gold coding episodes that show a habit for RL to remove: those the reward sees (give_up,
    no_fix) by RL alone, those it is blind to (blind, absent, untested) with feedback rules, whose hint comes
    first, and the right call after it, in a `hint` share of the episodes that would show them."""
    blind: float = 0.0  # edits by line numbers before the module is read
    absent: float = 0.0  # the first call reaches for a tool the episode does not offer
    untested: float = 0.0  # submits without running the tests after the last edit
    give_up: float = 0.0  # submits before every function is written
    no_fix: float = 0.0  # after a wrong edit that the test run shows, submits without fixing it
    mistake: float = 0.0  # the last edit first writes another function's body; the test run shows it
    hint: float = 0.0


# the pretraining transcripts' habits: each a share the held-out evaluations measure before and after RL
CODE_HABITS = Habits(blind=0.1, absent=0.1, untested=0.25, give_up=0.2, no_fix=0.5, mistake=0.2, hint=0.2)


def code_transcript(rng, level, habits=Habits(), budget=None, request="", family="words"):
    """A gold episode on a fresh micro-repository, with the replies CodeEnv gives: read the module, write each
    function, run the tests, submit, with the habits' shares. Cut into the segments a rollout makes (as
    chain_transcript): past `budget` tokens after a reply, the user turn `request` asks for a summary (the
    calls done so far), the next segment starts from the opening and that summary, and reads the module again
    before its next edit. -> [segment: [turn]]"""
    files = micro_files(rng, family=family)
    mode, group = MICRO_LEVELS[level]
    funcs = [n.name for n in ast.parse(files[micro_module(files)]).body]
    return micro_episode(files, rng.sample(funcs, group), mode, rng, habits, budget, request)


def micro_module(files):
    return next(r for r in files if r.endswith(".py") and not r.startswith("tests/")
                and not r.endswith("__init__.py"))


def micro_inputs(tests):
    """{function: [the arguments its tests call it with]} of a micro-repository's test file."""
    inputs = {}
    for node in ast.walk(ast.parse(tests)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            inputs.setdefault(node.func.attr, []).append(ast.literal_eval(node.args[0]))
    return inputs


def micro_episode(files, chosen, mode, rng, habits=Habits(), budget=None, request=""):
    """code_transcript's episode on the micro-repository `files` with the functions `chosen` deleted."""
    rel = micro_module(files)
    src = files[rel].encode()
    tree = ast.parse(src)
    funcs = [n.name for n in tree.body]
    chosen = sorted(chosen, key=funcs.index)
    lines = apply_edits(src, [delete_edit(src, find_def(tree, q), mode) for q in chosen]).decode()
    lines = lines.split("\n")[:-1]
    task = {"mode": mode,
            "deleted": [{"file": rel, "qualname": q, "signature": f"def {q}(x)"} for q in chosen]}
    prompt = [("user", opening(task))]
    segments, turns, done, seen = [], list(prompt), [], False

    def call(message, reply=None):  # one call and its reply; a summary when the segment is full
        nonlocal turns, seen
        turns += [("assistant", message)] + ([("tool", reply)] if reply is not None else [])
        failed = f" ({reply.split(';')[0]})" if " failed" in (reply or "") else ""
        done.append(message.split("(")[0].split()[-1] + failed)
        if budget and reply is not None and sum(map(turn_length, turns)) > budget:
            summary = "done: " + ", ".join(done)
            segments.append(turns + [("user", request), ("assistant", summary)])
            turns, seen = prompt + [("assistant", summary)], False

    def read():
        nonlocal seen
        call(f"call read({rel})", numbered(("\n".join(lines) + "\n").encode()))
        seen = True

    def write(q, body):  # the edit that writes q's body; the module changes with it
        if not seen:
            read()
        if mode == "stub" or f"def {q}(x):" in lines:
            at = lines.index(f"def {q}(x):") + 2
            lines[at - 1] = f"    return {body}"
            return call(f"call replace({rel},{at},{at})\n    return {body}", "ok")
        lines.extend([f"def {q}(x):", f"    return {body}"])
        call(f"call insert({rel},{len(lines) - 2})\ndef {q}(x):\n    return {body}", "ok")

    def hinted(p, hint):  # a habit a feedback rule names: shown, or its hint shown and the habit not
        if rng.random() >= p:
            return False
        if rng.random() < habits.hint:
            turns.append(("system", hint))
            return False
        return True

    if rng.random() < habits.absent:
        wrong = rng.choice(["cat", "open", "view", "edit", "show"])
        call(f"call {wrong}({rel})", not_found(wrong, CODE_TOOLS))
    seen = hinted(habits.blind, READ_FIRST)  # edits by line numbers it has not seen
    n_tests = len(funcs) + 1
    inputs = micro_inputs(files[next(r for r in files if r.startswith("tests/test_"))])
    last = chosen[-1]
    right = lambda q: MICRO_BODIES[q][1]
    # a wrong body for the mistake: another function's of the same kind, which both of its tests see
    family = next(f for f in MICRO_FAMILIES.values() if last in f)
    wrong = [b for kind, b in family.values() if kind == MICRO_BODIES[last][0]
             and all(micro_value(last, x, b) != micro_value(last, x) for x in inputs[last])]
    if not seen:
        read()
    written = rng.randint(0, len(chosen) - 1) if rng.random() < habits.give_up else None  # then it gives up
    for k, q in enumerate(chosen):
        if k == written:
            call("call submit()")
            return segments + [turns]
        if q == last and wrong and rng.random() < habits.mistake:  # seen in the test run, then fixed
            write(q, rng.choice(wrong))
            call("call test()", test_reply(n_tests - 2, [f"test_{q}", "test_all"]))
            if rng.random() < habits.no_fix:
                call("call submit()")
                return segments + [turns]
        write(q, right(q))
    if not hinted(habits.untested, TEST_FIRST):
        call("call test()", test_reply(n_tests, []))
    call("call submit()")
    return segments + [turns]


def deletion_episode(files, chosen, hinted=()):
    """The gold deletion episode on the micro-repository `files`, as DeleteEnv answers it (a transcript for
    pretraining the deletion role): read the module, stub each chosen function's body from the bottom up (the
    line numbers above stay as read), run the tests (each chosen function's test and test_all fail),
    submit. Before the edit of each function in `hinted`, the hint the feedback rule gives a misplaced edit
    (so the hinted teacher knows what it asks)."""
    rel, test_rel = micro_module(files), next(r for r in files if r.startswith("tests/test_"))
    lines = files[rel].split("\n")[:-1]
    targets = sorted(f"{test_rel}::test_{q}" for q in [*chosen, "all"])
    turns = [("user", deletion_opening([(rel, q) for q in chosen], targets, lambda r: files[r].encode())),
             ("assistant", f"call read({rel})"), ("tool", numbered(files[rel].encode()))]
    for q in sorted(chosen, key=lambda q: -lines.index(f"def {q}(x):")):
        at = lines.index(f"def {q}(x):") + 2
        turns += [("system", where_hint(q, at, at))] if q in hinted else []
        turns += [("assistant", f"call replace({rel},{at},{at})\n    raise NotImplementedError"),
                  ("tool", "ok")]
    n_tests = sum(line.startswith("def test_") for line in files[test_rel].split("\n"))
    return turns + [("assistant", "call test()"), ("tool", test_reply(n_tests - len(targets), targets)),
                    ("assistant", "call submit()")]


def deletion_transcript(rng, family="words", hint=0.3):
    """deletion_episode on a fresh micro-repository, one or two of its functions chosen, each edit after its
    hint with probability `hint`."""
    files = micro_files(rng, family=family)
    funcs = [n.name for n in ast.parse(files[micro_module(files)]).body]
    chosen = rng.sample(funcs, rng.randint(1, 2))
    return deletion_episode(files, chosen, [q for q in chosen if rng.random() < hint])


def where_hint(name, first, last):
    lines = f"line {first}" if first == last else f"lines {first}-{last}"
    return f"Delete only what the task names: the body of {name} is {lines}."


def misplaced_edits(turns):
    """(replaces that succeeded, those of them misplaced_edit flags) in a deletion episode's turns: how often
    it edits somewhere other than the definitions it was asked to delete."""
    flags = [misplaced_edit(text, "ok", turns[:i]) is not None for i, (role, text) in enumerate(turns)
             if role == "assistant" and REPLACE_CALL.match(text) and turns[i + 1:i + 2] == [("tool", "ok")]]
    return len(flags), sum(flags)


def misplaced_edit(message, reply, before):
    """A deletion episode's replace (reply "ok") that touches no line of the bodies its opening names, in a
    file the episode has read: the hint says where the first of them is (from the file as last read, its
    definitions found by their `def NAME(` lines). -> the hint, or None."""
    opening = next((text for role, text in before if role == "user"), "")
    m, edit = DELETE_OPENING.match(opening), REPLACE_CALL.match(message)
    if not (m and edit and reply == "ok"):
        return None
    rel, first, last = edit[1].strip(), int(edit[2]), int(edit[3])
    shown = [text for (role, text), (_, call) in zip(before[1:], before) if role == "tool"
             and re.fullmatch(rf"\s*[Cc]all read\({re.escape(rel)}\)", call)]
    named = [q.split(" ")[0].rpartition(".")[2] for f, _, q in (x.partition(" ") for x in m[1].split("; "))
             if f == rel]
    if not shown or not named:
        return None
    lines = dict((int(k), v) for k, _, v in (x.partition("|") for x in shown[-1].split("\n")) if k.isdigit())
    bodies = []
    for at, text in sorted(lines.items()):  # a body: the lines below its def, indented deeper
        d = re.match(r"(\s*)(?:async\s+)?def (\w+)\(", text)
        if d and d[2] in named:
            depth, end = len(d[1]), at
            while end + 1 in lines and (not lines[end + 1].strip()
                                        or len(lines[end + 1]) - len(lines[end + 1].lstrip()) > depth):
                end += 1
            bodies.append((d[2], at + 1, end))
    if not bodies or any(a <= last and first <= b for _, a, b in bodies):
        return None
    return where_hint(*bodies[0])


READ_FIRST = "Read the file before you edit it."
TEST_FIRST = "Run the tests before you submit."
EDIT_CALL = re.compile(r"\s*[Cc]all (replace|insert)\(([^,()]+),")
TEST_CALL = re.compile(r"\s*[Cc]all test\(")


def unread_edit(message, reply, before):
    """An edit of an existing file (reply "ok"; "ok: new file" needs no read) that the episode has not read:
    it may still be right, but its line numbers are a guess."""
    m = EDIT_CALL.match(message)
    read = m and re.compile(rf"\s*[Cc]all read\({re.escape(m[2].strip())}[,)]")
    return bool(m and reply == "ok"
                and not any(role == "assistant" and read.match(text) for role, text in before))


def untested_submit(message, before):
    """A submit with an edit since the last test run: the code may still be right, but nobody has run it."""
    if not re.match(r"\s*[Cc]all submit\(", message):
        return False
    calls = [text for role, text in before
             if role == "assistant" and (EDIT_CALL.match(text) or TEST_CALL.match(text))]
    return bool(calls) and not TEST_CALL.match(calls[-1])


def episode_habits(turns, deleted):
    """The habits a coding episode shows (Habits'): blind and absent count calls; untested, give_up (fewer
    edits than the `deleted` functions) and no_fix (the last test run failed, nothing edited since) are 1 when
    it submitted so. -> {habit: count, "submitted": 0 or 1}"""
    counts = dict.fromkeys(("blind", "absent", "untested", "give_up", "no_fix", "submitted"), 0)
    edits, failing = 0, False
    for i, (role, text) in enumerate(turns):
        if role != "assistant":
            continue
        reply = turns[i + 1][1] if i + 1 < len(turns) and turns[i + 1][0] == "tool" else None
        counts["blind"] += unread_edit(text, reply, turns[:i])
        counts["absent"] += (reply or "").startswith("error: tool not found")
        if EDIT_CALL.match(text) and (reply or "").startswith("ok"):
            edits, failing = edits + 1, False
        failing = " failed" in reply if TEST_CALL.match(text) and reply else failing
        if re.match(r"\s*[Cc]all submit\(\)", text):
            counts.update(submitted=1, untested=int(untested_submit(text, turns[:i])),
                          give_up=int(edits < deleted), no_fix=int(failing))
    return counts


class TaskPool:
    """Coding tasks by level, made while training runs. From micro-repositories (source None): slot k of a
    level is what make produces from the micro-repository seeded (seed, level, k), or nothing, so what a run
    trains on depends on its seed alone, never on timing. A background thread makes the slots asked for, in
    the order asked; take(level) serves each task `uses` times, `spread` tasks in turn (the groups of an RL
    step: each draws a task of its own, and a task serves `uses` steps), asking for `ahead` blocks of slots
    beyond, and waits for a make only when the pool has run dry. Each slot made is recorded in out (a task is
    made aside and moved in whole), so a pool over the same folder (a resumed run, or processes sharing it)
    takes it instead of making it again. From a folder of tasks made by make (source DIR): those it serves
    (served()) by level, in turn. held_out: the micro-repositories no transcript or training task draws from;
    family: the micro-repositories' (MICRO_FAMILIES)."""

    def __init__(self, out, seed, box=None, ahead=1, uses=1, spread=1, source=None, held_out=False, workers=1,
                 family="words"):
        self.out, self.seed, self.box, self.ahead = Path(out), seed, box, ahead
        self.uses, self.spread = uses, spread
        self.source, self.held_out, self.family = source, held_out, family
        self.slots, self.queue, self.asked, self.served = {}, deque(), set(), dict.fromkeys(MICRO_LEVELS, 0)
        self.made, self.error, self.cond = 0, None, threading.Condition()
        self.deletions = 0  # tasks add_deletion made (a policy's deletions)
        self.listed = {level: [] for level in MICRO_LEVELS}
        self.added = {level: [] for level in MICRO_LEVELS}  # tasks made elsewhere (a policy's deletions)
        if source is not None:
            refused = {}
            for d in served(source, refused):
                self.listed[task_level(json.loads((d / "task.json").read_text()))].append(d)
            if not any(self.listed.values()):
                first = next(iter(refused.items()), None)
                raise TaskError(f"no task in {source} is served (" + (
                    f"{len(refused)} refused, e.g. {first[0].name}: {first[1][0]}" if first
                    else "none made by `tasks.py make`") + ")")
        else:
            for f in self.out.glob("level*/slot-*.json"):  # the slots made here before
                with contextlib.suppress(ValueError, OSError, TypeError):
                    name = json.loads(f.read_text())["task"]
                    if name is None or (f.parent / name / "task.json").is_file():
                        self.slots[int(f.parent.name[5:]), int(f.stem[5:])] = name and f.parent / name
            for _ in range(workers):
                threading.Thread(target=self.work, daemon=True, name="task-maker").start()

    def work(self):
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                level, k = self.queue.popleft()
                if (level, k) in self.slots:
                    continue
            seed = int(hashlib.sha256(f"{self.seed}/{level}/{k}".encode()).hexdigest()[:12], 16)
            found, at = None, self.out / f"level{level}"
            try:
                at.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=at, prefix=".making-") as aside:
                    made = make_micro(aside, seed, level, self.box, held_out=self.held_out,
                                      family=self.family)
                    if made:  # in whole: a pool that shares the folder sees the task complete or not at all
                        found = at / made[0].name
                        with contextlib.suppress(OSError):  # already there: another pool made it first
                            os.rename(made[0], found)
                record = at / f".slot-{k}.{secrets.token_hex(4)}"
                record.write_text(json.dumps({"task": found and found.name}))
                os.replace(record, at / f"slot-{k}.json")
            except TaskError:  # nothing make could delete in this one: the slot stays empty
                found = None
            except Exception as e:  # noqa: BLE001 (raised again by get, in the trainer's thread)
                found, self.error = None, e
            with self.cond:
                self.slots[level, k] = found
                self.made += found is not None
                self.cond.notify_all()

    def ask(self, level, ks):
        with self.cond:
            for k in ks:
                if (level, k) not in self.asked:
                    self.asked.add((level, k))
                    self.queue.append((level, k))
            self.cond.notify_all()

    def get(self, level, k):
        """Slot k of a level (a task folder, or None), once made."""
        self.ask(level, [k])
        with self.cond:
            while (level, k) not in self.slots and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise TaskError(f"making micro-repository tasks failed: {self.error}")
            return self.slots[level, k]

    def add_deletion(self, env, tid):
        """A deletion episode (DeleteEnv) that scored 1 -> a task in out/made (task_from_deletion: make's
        validation, the oracle recorded on the original, the gold verified), its strength measured; served,
        by the rule any task is (coverage and strength), once by take (to a re-implementation group) before
        the level's own. -> its folder, or None."""
        out = self.out / "made"
        try:  # whatever the policy's tree holds, a refusal, never an exception in training
            with scratch() as tmp:
                tree = materialize(env.snap, env.edits, Path(tmp, "tree"))
                task, _ = task_from_deletion(env.dir, tree, out, tid, env.box)
        except (TaskError, Refused, OSError, ValueError, SyntaxError):
            if STOPPING.is_set():
                raise
            task = None
        if task is None:
            return None
        strength(out / tid, box=env.box, gold_s=task["gold_s"])  # (written into its task.json)
        if serving(json.loads((out / tid / "task.json").read_text())):
            return None
        self.added[task_level(task)].append(str(out / tid))
        self.deletions += 1
        return out / tid

    def take(self, level, made=True):
        """The level's next task folder (from a folder of tasks: the nearest level it has); made: the tasks
        add_deletion added first (for re-implementation: a deletion group drawing them would learn to delete
        what the policy already deletes, and make more of the same)."""
        if made and self.added[level]:
            return Path(self.added[level].pop(0))
        if self.source is not None:
            level = min((lv for lv in self.listed if self.listed[lv]), key=lambda lv: (abs(lv - level), lv))
            self.served[level] += 1
            return self.listed[level][(self.served[level] - 1) % len(self.listed[level])]
        while True:  # takes n, n+1, ... -> slots: spread of them in turn, uses times, then the next spread
            block, n = divmod(self.served[level], self.spread * self.uses)
            k, self.served[level] = block * self.spread + n % self.spread, self.served[level] + 1
            self.ask(level, range(k, (block + 1 + self.ahead) * self.spread))  # this block's, and ahead
            if (d := self.get(level, k)) is not None:
                return d  # (an empty slot: the next take's)

    def state_dict(self):
        return {"served": {str(k): v for k, v in self.served.items()},
                "added": {str(k): list(v) for k, v in self.added.items()}, "deletions": self.deletions}

    def load_state_dict(self, state):
        self.served.update({int(k): v for k, v in state["served"].items()})
        self.added.update({int(k): list(v) for k, v in state["added"].items()})
        self.deletions = state["deletions"]


# -----------------------------------------------------------------------------
# Tools: tiny deterministic functions. Values stay in 0..99 so every number is at most two bytes.

TOOLS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "max": max, "min": min, "mod": lambda a, b: a % b}
TOOL_DOCS = {"add": "a + b", "sub": "a - b", "mul": "a * b", "max": "the larger of a and b",
             "min": "the smaller of a and b", "mod": "a modulo b"}
MAX_DIFFICULTY = 4
# A call may open "Call" (a prose habit): the environment accepts it, a style guide wants "call". Same length,
# same reply: the reward cannot see it at all (feedback.py's capital rule can).
CALL = re.compile(r"([Cc])all ([a-z]{1,8})\((-?\d{1,6}),(-?\d{1,6})\)")  # bounded digits: no giant products
ANSWER = re.compile(r"answer (-?\d{1,6})")
MALFORMED = "error: malformed call. use: call TOOL(A,B), or answer N"


def not_found(name: str, tools: list[str]) -> str:
    return f"error: tool not found: {name}. available tools: {', '.join(tools)}"


@dataclass
class ToolTask:
    question: str                          # the first user turn: offered tools and the expression
    tools: list[str]                       # offered this episode, in TOOLS order (never all six)
    answer: int
    difficulty: int                        # number of tool calls the gold plan needs
    plan: list[tuple[str, int, int]]       # the gold calls, innermost first: (tool, a, b)


def make_tool_task(rng: random.Random, difficulty: int) -> ToolTask:
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    value = rng.randint(1, 9)
    expr, plan = str(value), []
    while len(plan) < difficulty:
        name, leaf = rng.choice(list(TOOLS)), rng.randint(1, 9)
        # The running value goes left or right, so the model must find the innermost call, not just read left
        # to right.
        a, b, ea, eb = ((value, leaf, expr, str(leaf)) if rng.random() < 0.5
                        else (leaf, value, str(leaf), expr))
        if name == "mod" and b < 2:
            continue  # no division by zero, and mod 1 is a constant that ignores the chain
        result = TOOLS[name](a, b)
        if not 0 <= result <= 99:
            continue  # redraw: short numbers keep an episode inside the tiny model's context
        plan.append((name, a, b))
        value, expr = result, f"{name}({ea},{eb})"
    needed = {name for name, _, _ in plan}
    # Offer the needed tools plus distractors, difficulty + 1 in all, at most 5 of 6: some tool is always
    # absent.
    extras = rng.sample(sorted(set(TOOLS) - needed),
                        max(0, min(difficulty + 1, len(TOOLS) - 1) - len(needed)))
    tools = [t for t in TOOLS if t in needed or t in extras]
    return ToolTask(f"tools: {', '.join(tools)}. compute {expr}", tools, value, difficulty, plan)


# -----------------------------------------------------------------------------
# The tool-use environment: parses the model's message, runs the tool or reports the error, checks the answer.


class ToolEnv:
    def __init__(self, task: ToolTask, max_turns: int = 6):
        self.task, self.max_turns = task, max_turns
        self.turns: list[Turn] = self.first_turns()  # the whole episode so far, for rendering a rollout
        self.done, self.answer = False, None
        self.tool_calls = self.tool_errors = self.malformed = 0  # well-formed calls; absent tools; unparsable
        self.capital = 0  # calls that opened "Call" (accepted, neither rewarded nor punished)

    def first_turns(self) -> list[Turn]:
        return [("user", self.task.question)]

    def declared(self):
        """The tools offered, as a chat template's `tools` lists them."""
        return [declaration(name, TOOL_DOCS[name], a=("integer", "a"), b=("integer", "b"))
                for name in self.task.tools]

    def text_call(self, name, arguments):
        return text_call(self.declared(), name, arguments)

    def step(self, assistant_text: str) -> tuple[Optional[str], bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.turns.append(("assistant", assistant_text))
        text = assistant_text.strip()
        if m := ANSWER.fullmatch(text):
            self.answer, self.done = int(m.group(1)), True
            return None, True
        if m := CALL.fullmatch(text):
            self.tool_calls += 1
            self.capital += m.group(1) == "C"
            name, a, b = m.group(2), int(m.group(3)), int(m.group(4))
            if name not in self.task.tools:
                self.tool_errors += 1
                reply = not_found(name, self.task.tools)
            elif name == "mod" and b == 0:
                reply = "error: mod by zero"
            else:
                reply = self.result(TOOLS[name](a, b))
        else:
            self.malformed += 1
            reply = MALFORMED
        self.turns.append(("tool", reply))
        self.done = sum(role == "assistant" for role, _ in self.turns) >= self.max_turns
        return reply, self.done

    def result(self, value: int) -> str:
        return str(value)

    def reward(self) -> float:
        # Outcome only: the verifier checks the final number; how the model got there is not scored.
        return 1.0 if self.answer == self.task.answer else 0.0


# -----------------------------------------------------------------------------
# Long episodes: a chain of 8-32 calls (8 x difficulty) that the environment hands out one at a time, the
# regime of the Composer 2.5 post's worked example. Each reply carries the result and the next instruction
# (`19. next: mul 2`), so an episode runs past any small context budget and the policy must summarize to go on
# (grpo.py). A call to an absent tool gets the error and the episode goes on: the policy makes the right call
# next and the final answer is still right, so the reward barely sees the slip, and not at all a capital
# "Call".

CHAIN_LENGTH = 8  # calls a difficulty level


def make_chain_task(rng: random.Random, difficulty: int) -> ToolTask:
    """A chain over three of the six tools, the running value always the first argument."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    ops = rng.sample(list(TOOLS), 3)
    value = start = rng.randint(1, 9)
    plan: list[tuple[str, int, int]] = []
    while len(plan) < CHAIN_LENGTH * difficulty:
        name, k = rng.choice(ops), rng.randint(1, 9)
        result = TOOLS[name](value, k)
        if (name == "mod" and k < 2) or not 0 <= result <= 99:
            continue  # as in make_tool_task: no mod 0 or 1, values stay two digits
        plan.append((name, value, k))
        value = result
    tools = [t for t in TOOLS if t in {name for name, _, _ in plan}]
    first = plan[0]
    return ToolTask(f"tools: {', '.join(tools)}. start {start}, {len(plan)} steps. "
                    f"next: {first[0]} {first[2]}",
                    tools, value, difficulty, plan)


class ChainEnv(ToolEnv):
    """A ToolEnv whose successful calls advance the chain: the reply is the result and the next instruction.
    The instruction is followed whatever the call was, as a worksheet would: only the final answer is
    checked."""

    def __init__(self, task: ToolTask):
        # room for slips, their recoveries and retries
        super().__init__(task, max_turns=3 * len(task.plan) + 4)
        self.position = 0  # instructions done

    def result(self, value: int) -> str:
        self.position += 1
        return chain_reply(self.task, self.position, value)


def chain_reply(task: ToolTask, position: int, value: int) -> str:
    if position >= len(task.plan):
        return f"{value}. done"
    name, _, k = task.plan[position]
    return f"{value}. next: {name} {k}"


# -----------------------------------------------------------------------------
# Gold transcripts for pretraining: the format, the chaining of results, and (sometimes) an error and its
# recovery.


def reminder(tools: list[str]) -> str:
    """The hint textual feedback inserts before a call to an absent tool (the seed's example), as a system
    turn."""
    return f"Reminder: Available tools: {', '.join(tools)}"


# the hint for a malformed message
FORMAT_REMINDER = "Reminder: reply with exactly 'call TOOL(A,B)' or 'answer N'."
STYLE_REMINDER = "Style: write call in lower case."  # the hint for a "Call"


def gold_transcript(task: ToolTask, rng: random.Random, p_mistake: float = 0.0, p_hint: float = 0.0,
                    p_capital: float = 0.0) -> list[Turn]:
    """The gold plan as turns. With p_mistake one call first reaches for an absent tool and recovers from the
    error; with p_capital a call opens "Call" (a habit the reward cannot see); with p_hint a call is preceded
    by one of the hints as a system turn, and a reminded call is always right (this is how the model learns
    what a hint means, so that the hinted teacher of feedback.py is better)."""
    absent = [t for t in TOOLS if t not in task.tools]
    hints = [reminder(task.tools), FORMAT_REMINDER] + [STYLE_REMINDER] * (p_capital > 0)
    slip = rng.randrange(len(task.plan)) if rng.random() < p_mistake else -1
    turns = [("user", task.question)]
    for i, (name, a, b) in enumerate(task.plan):
        c = "C" if p_capital and rng.random() < p_capital else "c"
        if i == slip:  # reach for an absent tool, read the error, then make the right call
            wrong = rng.choice(absent)
            turns += [("assistant", f"{c}all {wrong}({a},{b})"), ("tool", not_found(wrong, task.tools))]
        if rng.random() < p_hint:
            hint = rng.choice(hints)
            c = "c" if hint == STYLE_REMINDER else c
            turns += [("system", hint)]
        turns += [("assistant", f"{c}all {name}({a},{b})"), ("tool", str(TOOLS[name](a, b)))]
    return turns + [("assistant", f"answer {task.answer}")]


def turn_length(turn: Turn) -> int:
    """Tokens of a rendered turn: the role and <|end|> tokens plus one a byte (model.py's byte tokenizer)."""
    return len(turn[1].encode()) + 2


def chain_transcript(task: ToolTask, rng: random.Random, budget: int, request: str, p_slip: float = 0.1,
                     p_capital: float = 0.3, p_hint: float = 0.1) -> list[list[Turn]]:
    """A long episode done right, cut into the segments a rollout makes (grpo.rollout): once a segment passes
    `budget` tokens after a reply, the user turn `request` asks for a summary, and the next segment starts
    from the question and that summary (the current value and what is still to do). Habits the corpus teaches
    and RL should remove: with p_slip a call first reaches for an absent tool (the error follows, then the
    right call); with p_capital a call opens "Call". With p_hint a call is preceded by a hint as a system
    turn: after the tools reminder a call never slips, after the style reminder it is lower case."""
    absent = [t for t in TOOLS if t not in task.tools]
    prompt = [("user", task.question)]
    segments, turns = [], list(prompt)

    def exchange(message, reply, value, todo):  # one call and its reply; a summary when the segment is full
        nonlocal turns
        turns += [("assistant", message), ("tool", reply)]
        if sum(map(turn_length, turns)) > budget:
            summary = f"value {value}. {todo}"
            segments.append(turns + [("user", request), ("assistant", summary)])
            turns = prompt + [("assistant", summary)]

    for i, (name, a, b) in enumerate(task.plan):
        hint = rng.choice([reminder(task.tools), STYLE_REMINDER]) if rng.random() < p_hint else None
        if hint:
            turns.append(("system", hint))
        c = "C" if rng.random() < p_capital and hint != STYLE_REMINDER else "c"
        if rng.random() < p_slip and hint is None:
            wrong = rng.choice(absent)
            exchange(f"{c}all {wrong}({a},{b})", not_found(wrong, task.tools), a, f"next: {name} {b}")
        reply = chain_reply(task, i + 1, TOOLS[name](a, b))
        exchange(f"{c}all {name}({a},{b})", reply, TOOLS[name](a, b), reply.split(". ", 1)[1])
    return segments + [turns + [("assistant", f"answer {task.answer}")]]


def corpus(n: int, seed: int, p_mistake: float = 0.2, p_hint: float = 0.2, p_capital: float = 0.3,
           long_share: float = 0.0, budget: int = 224, request: str = "", code_share: float = 0.0,
           code_budget: int = 384, family: str = "words", delete_share: float = 0.0) -> str:
    """n gold transcripts: long_share of them chains of the tool-use family, code_share coding episodes on
    micro-repositories of a family at levels 1-3 (code_transcript with CODE_HABITS; each segment one
    document; delete_share of them the other role's, deletion_transcript), the rest tool-use tasks."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        if code_share and rng.random() < code_share:  # (no draw without: the tool-use corpus stays as it was)
            if delete_share and rng.random() < delete_share:
                docs.append(render(deletion_transcript(rng, family)))
                continue
            docs += [render(seg) for seg in code_transcript(
                rng, rng.randint(1, len(MICRO_LEVELS)), CODE_HABITS, code_budget, request, family)]
        elif rng.random() < long_share:
            task = make_chain_task(rng, rng.randint(1, MAX_DIFFICULTY))
            docs += [render(seg) for seg in chain_transcript(task, rng, budget, request)]
        else:
            docs.append(render(gold_transcript(make_tool_task(rng, rng.randint(1, MAX_DIFFICULTY)), rng,
                                               p_mistake, p_hint, p_capital)))
    return "\n".join(docs)


# -----------------------------------------------------------------------------
# Dynamic difficulty: serve the hardest level the policy passes often enough, step back when it fails.


class DifficultySampler:
    def __init__(self, max_level: int = MAX_DIFFICULTY, window: int = 32, up: float = 0.8, down: float = 0.2,
                 p_frontier: float = 0.75):
        self.max_level, self.window, self.up, self.down, self.p_frontier = (
            max_level, window, up, down, p_frontier)
        self.level = 1  # the frontier
        # recent rewards per level
        self.results = {lvl: deque(maxlen=window) for lvl in range(1, max_level + 1)}

    def pass_rate(self, level: int) -> Optional[float]:
        r = self.results[level]
        return sum(r) / len(r) if r else None

    def sample(self, rng: random.Random) -> int:
        # Mostly the frontier; sometimes an easier level, so solved skills keep being rehearsed.
        if self.level == 1 or rng.random() < self.p_frontier:
            return self.level
        return rng.randint(1, self.level - 1)

    def update(self, level: int, reward: float) -> None:
        self.results[level].append(reward)
        r = self.results[self.level]
        if len(r) < self.window:
            return  # judge a level only on a full window
        rate = sum(r) / len(r)
        if rate >= self.up and self.level < self.max_level:
            self._move(self.level + 1)
        elif rate < self.down and self.level > 1:
            self._move(self.level - 1)

    def _move(self, level: int) -> None:
        self.level = level
        # the new frontier earns its next move on fresh results, so no instant bounce
        self.results[level].clear()

    def state_dict(self) -> dict:
        return {"level": self.level, "results": {str(k): list(v) for k, v in self.results.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.level = int(state["level"])
        for k, v in state["results"].items():
            self.results[int(k)] = deque(v, maxlen=self.window)


# -----------------------------------------------------------------------------
# Survey: make tasks from packages nobody here chose, as a user would (harness/survey.py fetches them and
# prints the table). A package's row: its sdist unpacked into a git repository, `env`, `make --n N`, then
# verify of each task's gold patch (1 expected) and of its untouched snapshot (0 expected), the strength of
# each, how many are served, and the one-line reason of whatever failed.

def survey_one(spec, root, n, timeout, isolate, python=None, strength_k=STRENGTH_K, seconds=None):
    """One package (name==version off the index, or a local repository's folder) through download (a copy),
    env (or the interpreter given), make and verify: its row (a dict), its log in root/NAME/log.txt, and its
    record root/NAME/row.json, written whole at the end: a package whose record is on disk is done. seconds:
    the package's time (the survey's --package-timeout), which make's strength measures keep within."""
    deadline = time.time() + seconds if seconds else None
    d = Path(root, package_dir(spec))
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    row = blank_row(spec)
    with open(d / "log.txt", "w", buffering=1) as f:
        def log(line):
            f.write(line + "\n")
        try:
            if Path(spec).is_dir():
                repo = Path(shutil.copytree(spec, d / "src" / Path(spec).resolve().name, symlinks=True,
                                            ignore=shutil.ignore_patterns(".git")))
            else:
                repo = fetch_sdist(spec, d)
            fresh_git(repo)
            t0 = time.time()
            python = python or make_env(repo, d / "venv", isolate, log=log)
            row["env_s"], t0, stats = time.time() - t0, time.time(), {}
            row["seconds"] = {"env": row["env_s"]}
            box = Sandbox(python, isolate, timeout)
            made = make(repo, d / "tasks", n=n, box=box, log=log, stats=stats, strength_k=strength_k,
                        deadline=deadline)
            row.update(make_s=time.time() - t0, made=len(made), tests=stats.get("tests"),
                       tried=stats.get("tried"), executed=stats.get("executed"))
            row["seconds"].update(stats["seconds"])
            for t in made:
                tdir = d / "tasks" / t["id"]
                for key, kw in (("gold", {"patch": tdir / "gold.patch"}),
                                ("untouched", {"workdir": tdir / "repo"})):
                    with clocked(row["seconds"], "verify"):
                        reward, why = verify(tdir, box=box, **kw)
                    row[key].append(reward)
                    log(f"verify {key} {t['id']}: reward {reward}: {why}")
                # kept with the task: one whose gold fails a second verify is not served
                again = {"gold": row["gold"][-1], "untouched": row["untouched"][-1]}
                write_task(tdir, {**json.loads((tdir / "task.json").read_text()), "verified_again": again})
                st = t.get("strength", {})
                row["strength"].append([st.get("score_tests"), st.get("score")])
            refused: dict = {}
            ok = served(d / "tasks", refused) if made else []
            row["served"] = len(ok)
            row["tasks"] = [{"id": t["id"], "strength": s, "served": True if Path(d, "tasks", t["id"]) in ok
                             else refused.get(Path(d, "tasks", t["id"]), "not served")}
                            for t, s in zip(made, row["strength"])]
            if len(made) < n:
                row["why"] = (collections.Counter(stats["reasons"]).most_common(1)[0][0] if stats["reasons"]
                              else f"only {stats['candidates']} candidate features (functions reached by 1.."
                                   f"{stats['limit']} tests, not run at import)")
        except TaskError as e:
            row["why"] = str(e)
        except Exception as e:  # a row, not a crash of the whole survey: the traceback is in the log
            log(traceback.format_exc())
            row["why"] = f"{type(e).__name__}: {e}"
        log(json.dumps(row))
    write_whole(d / "row.json", row)
    return row


# -----------------------------------------------------------------------------
# Appendix: running and measuring it: the command line (python tasks.py make|verify|...) and a demo

def survey_cli(a):
    """`tasks.py survey`: one process, a shard of a job array (--shard K/N), or every rank of a torchrun
    launch (gloo: only the rows travel; the tasks are files in --out, which every rank must share)."""
    specs = list(a.specs)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if a.shard:
        m = re.fullmatch(r"(\d+)/(\d+)", a.shard)
        if not m or not int(m[1]) < int(m[2]) or world > 1:
            raise TaskError(f"--shard {a.shard}: K/N with 0 <= K < N, and not under torchrun")
        rank, world = int(m[1]), int(m[2])
    if a.draw:
        if not 0 < a.draw <= len(SURVEY_PACKAGES):
            raise TaskError(f"--draw must be in 1..{len(SURVEY_PACKAGES)}")
        pool = unnamed(SURVEY_PACKAGES, a.exclude)
        if a.draw > len(pool):
            raise TaskError(f"--draw {a.draw}: only {len(pool)} packages are left to draw from")
        specs += random.Random(a.seed).sample(sorted(pool), a.draw)
        if rank == 0:
            print(f"drew {a.draw} of {len(pool)} packages with --seed {a.seed}: " + " ".join(specs))
    if not specs or a.n < 1 or a.jobs < 1:
        raise TaskError("survey needs package specs or --draw, and --n, --jobs >= 1")
    bad = [x for x in specs if not Path(x).is_dir() and not re.fullmatch(r"[A-Za-z0-9][\w.-]*==[\w.!+-]+", x)]
    if bad:
        raise TaskError(f"package spec {bad[0]!r} is not name==version nor a folder")
    specs = [str(Path(x).resolve()) if Path(x).is_dir() else x for x in specs]
    command = lambda spec: [sys.executable, str(Path(__file__).resolve()), "survey-one", spec, "--out", a.out,
                            "--n", str(a.n), "--timeout", str(a.timeout), "--strength-k", str(a.strength_k),
                            "--seconds", str(a.package_timeout),
                            *(["--python", a.python] if a.python else []), *(["--no-sandbox"] * a.no_sandbox)]
    group = world > 1 and not a.shard
    if group:  # only the rows travel; a long timeout: a rank through its share waits for the slowest one's
        import datetime
        import torch.distributed as dist
        # torchrun's store, its keys under this attempt's name (mesh.attempt_store: a restarted rank otherwise
        # finds a dead peer's address there and hangs joining)
        week = datetime.timedelta(days=7)
        store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                 next(dist.rendezvous("env://", timeout=week))[0])
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=week)
    try:
        rows = survey(specs, a.out, command, rank, world, a.jobs, a.package_timeout)
        if a.shard:
            Path(a.out, "shards").mkdir(exist_ok=True)
            write_whole(Path(a.out, "shards", f"{rank}-of-{world}.json"),
                        {"rank": rank, "world": world, "n": a.n, "specs": specs[rank::world]})
            print(f"shard {rank}/{world}: {len(rows)} packages; the index: tasks.py merge --out {a.out}")
            return 0
        if group:
            everyone = [None] * world if rank == 0 else None
            dist.gather_object(rows, everyone, dst=0)
            rows = [r for share in everyone or [] for r in share]
        if rank == 0:
            index(rows, a.out, a.n)
        return 0 if all(valid_tasks(r) >= a.n for r in rows) else 1
    finally:
        if group:
            dist.destroy_process_group()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block, no traceback
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def task_box(a, task_dir, timeout):
    """How a command over a task runs code: --python, else the task's own interpreter, else this one."""
    task = Path(task_dir, "task.json")
    python = a.python or (json.loads(task.read_text()).get("python") if task.is_file() else None)
    return Sandbox(python or sys.executable, not a.no_sandbox, timeout)


def cli(argv=None) -> int:
    p = Parser(description="Feature-deletion tasks: make them, verify solutions, scan for leaks, "
                           "monitor agents.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    m = sub.add_parser("make", help="cut tested features out of a repo and write validated, scan-clean tasks")
    m.add_argument("--repo", help="repository with a package and a pytest suite")
    m.add_argument("--from-deletion", metavar="SPEC_DIR",
                   help="instead: make the task from a deletion of the feature SPEC_DIR names (delete-spec), "
                        "the tree in --workdir, if judge_deletion scores it 1")
    m.add_argument("--workdir", help="with --from-deletion: the tree with the feature deleted")
    m.add_argument("--out", required=True, help="folder for the task dirs (repo/, task.json, gold.patch)")
    m.add_argument("--n", type=int, default=1, help="number of tasks to make")
    m.add_argument("--seed", type=int, default=0, help="seed for the order features are tried in")
    m.add_argument("--mode", choices=["stub", "remove"], default="stub",
                   help="stub: keep signature and docstring, raise NotImplementedError; "
                        "remove: delete the definition")
    m.add_argument("--size", choices=SIZES, default="def",
                   help="a feature is a function or method (def), or a class with its helpers or a "
                        "module, removed whole (module)")
    m.add_argument("--group", type=int, default=1,
                   help="difficulty: delete up to this many related features together")
    m.add_argument("--timeout", type=int, default=300, help="seconds allowed for one test-suite run")
    m.add_argument("--reach", type=float,
                   help=f"the largest share of the passing tests a feature may be reached by (a feature "
                        f"most tests use is no task: deleting it breaks everything); default "
                        f"{TESTS_AT_MOST}, widened to {', '.join(map(str, REACH_STEPS[1:]))} while there are "
                        f"fewer than 2 x --n candidates")
    m.add_argument("--jobs", type=int, default=1, help="tries run side by side")
    m.add_argument("--strength", type=int, default=STRENGTH_K, metavar="K",
                   help=f"measure each made task's strength with K mutants (0: not measured, so not served; "
                        f"default {STRENGTH_K})")
    v = sub.add_parser("verify", help="score an agent's work on a task: 1 when every required test passes")
    v.add_argument("task_dir", help="a task dir written by make")
    g = v.add_mutually_exclusive_group(required=True)
    g.add_argument("--workdir", help="the agent's edited copy of the snapshot")
    g.add_argument("--patch", help="a unified diff against the snapshot")
    v.add_argument("--timeout", type=int, default=600, help="seconds allowed for the test run")
    st = sub.add_parser("strength", help="the share of the gold's mutants the tests alone and the tests plus "
                                         "the oracle kill; written into each task.json")
    st.add_argument("task_dirs", nargs="+", metavar="TASK_DIR", help="task dirs written by make")
    st.add_argument("--k", type=int, default=STRENGTH_K, help="mutants per task (each is one verify)")
    st.add_argument("--jobs", type=int, default=2, help="mutants verified side by side")
    st.add_argument("--seed", type=int, default=0, help="seed of the mutants drawn")
    st.add_argument("--min-strength", type=float, default=MIN_STRENGTH,
                    help="the share of mutants killed a task needs to be served (each task's line says "
                         "whether it is, or why not)")
    ds = sub.add_parser("delete-spec", help="the deletion a task make wrote, as a spec for DeleteEnv: the "
                                            "original, the feature, the tests that must stop passing")
    ds.add_argument("task_dir", help="a task dir written by make")
    ds.add_argument("--out", required=True, help="the spec's folder (repo/, spec.json)")
    for x in (m, v, st, ds):
        x.add_argument("--python", help="interpreter that runs the tests (from `env`; default: this one for "
                                        "make, the task's for verify and strength)")
        x.add_argument("--no-sandbox", action="store_true",
                       help="run the tests without bubblewrap (not isolated)")
    e = sub.add_parser("env",
                       help="make a venv with a repository's test requirements; prints its interpreter")
    e.add_argument("--repo", required=True, help="the repository")
    e.add_argument("--venv", required=True, help="folder for the new virtual environment")
    e.add_argument("--no-sandbox", action="store_true", help="run the install without bubblewrap")
    s = sub.add_parser("scan",
                       help="report leaks of deleted code: caches, bytecode, history, archives, copies")
    s.add_argument("dir", help="folder to scan")
    s.add_argument("--task", help="task.json whose fingerprints to look for")
    s.add_argument("--site-packages", action="store_true",
                   help="also look for installed copies of the package")
    su = sub.add_parser("survey", help="make tasks from packages off the index: sdist, env, make, verify; "
                                       "a row per package (under torchrun: each rank a share, one index)")
    su.add_argument("specs", nargs="*", help="packages as name==version, or local repositories' folders")
    su.add_argument("--draw", type=int, help=f"draw this many from the {len(SURVEY_PACKAGES)} packages "
                                             f"in SURVEY_PACKAGES (less --exclude's)")
    su.add_argument("--seed", type=int, default=0, help="seed of the draw")
    su.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                    help="draw none of the packages these files name (a fresh draw: none this project chose)")
    su.add_argument("--out", required=True, help="folder for each package's sdist, venv, tasks and log")
    su.add_argument("--n", "--per-package", dest="n", type=int, default=3,
                    help="tasks to make per package (--per-package under torchrun: --n is its flags' prefix)")
    su.add_argument("--jobs", type=int, default=2, help="packages run side by side")
    su.add_argument("--timeout", type=int, default=300, help="seconds allowed for one test-suite run")
    su.add_argument("--package-timeout", type=int, default=4 * 3600,
                    help="seconds allowed for one package (strength is measured within them; past them its "
                         "run is killed, and tried once more)")
    su.add_argument("--shard", metavar="K/N", help="run only the K-th of N shares (0-based; a job array, "
                                                   "say), then `tasks.py merge --out DIR` writes the index")
    su.add_argument("--python", help="interpreter with the packages' test requirements, instead of an env "
                                     "each (local repositories)")
    su.add_argument("--strength-k", type=int, default=STRENGTH_K, help="mutants a task's strength takes")
    su.add_argument("--no-sandbox", action="store_true", help="run everything without bubblewrap")
    s1 = sub.add_parser("survey-one", help="one package of a survey, in a process of its own: writes "
                                           "OUT/NAME/row.json")
    s1.add_argument("spec", help="name==version, or a local repository's folder")
    s1.add_argument("--out", required=True)
    s1.add_argument("--n", type=int, default=3)
    s1.add_argument("--timeout", type=int, default=300)
    s1.add_argument("--python")
    s1.add_argument("--strength-k", type=int, default=STRENGTH_K)
    s1.add_argument("--seconds", type=int, help="the package's time: strength is measured within it")
    s1.add_argument("--no-sandbox", action="store_true")
    mg = sub.add_parser("merge", help="the index of a survey run in shards (--shard K/N), from their records")
    mg.add_argument("--out", required=True, help="the shards' output folder")
    mo = sub.add_parser("monitor",
                        help="flag trajectory steps that read leak sources or tamper with the verifier")
    mo.add_argument("trajectory",
                    help="JSONL, one action per line (format in the Monitor section of this file)")
    mo.add_argument("--task", metavar="TASK_DIR",
                    help="the task the trajectory worked on: an edit may keep what its original file had "
                         "(task.json's static_allowed), as in training")
    a = p.parse_args(argv)
    try:
        if a.cmd == "env":
            print(make_env(a.repo, a.venv, not a.no_sandbox))
            return 0
        if a.cmd == "make" and a.from_deletion:
            if not a.workdir or a.repo:
                raise TaskError("make --from-deletion SPEC_DIR needs --workdir (the deleted tree), no --repo")
            box = Sandbox(a.python or sys.executable, not a.no_sandbox, a.timeout)
            task, why = task_from_deletion(a.from_deletion, a.workdir, a.out, Path(a.from_deletion).name, box)
            print(f"{Path(a.out, Path(a.from_deletion).name)}: {why}")
            return 0 if task else 1
        if a.cmd == "make":
            if not a.repo:
                raise TaskError("make needs --repo (or --from-deletion SPEC_DIR --workdir DIR)")
            box = Sandbox(a.python or sys.executable, not a.no_sandbox, a.timeout)
            tasks = make(a.repo, a.out, a.n, a.seed, a.mode, a.group, box, reach=a.reach, jobs=a.jobs,
                         strength_k=a.strength, size=a.size)
            return 0 if tasks else 1
        if a.cmd == "delete-spec":
            spec = spec_from_task(a.task_dir, a.out, task_box(a, a.task_dir, 300))
            print(f"{a.out}: delete {', '.join(f'{rel} {q}' for rel, q in spec['feature'])}; "
                  f"{len(spec['targets'])} tests must stop passing, {len(spec['keep'])} keep passing")
            return 0
        if a.cmd == "strength":  # a measurement, like verify's reward: exit 0 whatever it finds
            for d in a.task_dirs:
                s = strength(d, a.k, task_box(a, d, 600), a.seed, a.jobs)
                why = serving(json.loads(Path(d, "task.json").read_text()), a.min_strength)
                print(strength_lines(Path(d).name, s) + f"\n  {'; '.join(why) or 'served'}")
            return 0
        if a.cmd == "verify":
            if not Path(a.task_dir, "task.json").is_file():
                raise TaskError(f"no task at {a.task_dir}: "
                                + ("it has no task.json" if Path(a.task_dir).is_dir() else "no such folder"))
            if a.patch and not Path(a.patch).is_file():
                raise TaskError(f"no such patch file: {a.patch}")
            reward, why = verify(a.task_dir, a.workdir, a.patch, task_box(a, a.task_dir, a.timeout))
            print(f"reward {reward}: {why}")
            return 0
        if a.cmd == "survey-one":
            die_with_parent()
            survey_one(a.spec, a.out, a.n, a.timeout, not a.no_sandbox, a.python, a.strength_k, a.seconds)
            return 0
        if a.cmd == "merge":
            rows, n = merge(a.out)
            return 0 if all(valid_tasks(r) >= n for r in rows) else 1
        if a.cmd == "survey":
            return survey_cli(a)
        if a.cmd == "scan":
            if not Path(a.dir).is_dir():
                raise TaskError(f"not a directory: {a.dir}")
            task = json.loads(Path(a.task).read_text()) if a.task else None
            sites = site.getsitepackages() + [site.getusersitepackages()] if a.site_packages else []
            found = scan(a.dir, task, sites)
            for f in found:
                print(f"{f['kind']:>15}  {f['path']}  {f['evidence']}")
            print(f"{len(found)} findings" if found else "clean: no findings")
            return 1 if found else 0
        if not Path(a.trajectory).is_file():
            raise TaskError(f"no such trajectory file: {a.trajectory}")
        if a.task and not Path(a.task, "task.json").is_file():
            raise TaskError(f"no task at {a.task}: no task.json")
        allowed = json.loads(Path(a.task, "task.json").read_text()).get("static_allowed") if a.task else None
        flags = monitor(read_trajectory(a.trajectory), allowed)
        for f in flags:
            print(f"step {f['step']:>4}  {f['pattern']:<16} {f['evidence']}")
        print(f"{len(flags)} flagged" if flags else "no flags")
        return 1 if flags else 0
    except (TaskError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main():
    if sys.argv[1:2] and sys.argv[1] in ("env", "make", "delete-spec", "verify", "strength", "survey",
                                         "survey-one", "merge", "scan", "monitor"):
        # a SIGTERM unwinds like an exception, so temporary folders and cgroups go (after SIGKILL, the next
        # start's sweep removes them)
        signal.signal(signal.SIGTERM, stop)
        sys.exit(cli(sys.argv[1:]))  # the feature-deletion family
    parser = argparse.ArgumentParser(
        description="Show the tool-use task family: tasks, gold transcripts, an episode. The "
                    "feature-deletion family has subcommands: python tasks.py make|verify|scan|monitor ... "
                    "(each with --help).")
    parser.add_argument("--seed", type=int, default=0, help="random seed for every sample below")
    parser.add_argument("--per-level", type=int, default=2, help="tasks shown per difficulty level (1..4)")
    parser.add_argument("--p-mistake", type=float, default=0.5,
                        help="chance a gold transcript shows an error and recovery")
    args = parser.parse_args()
    if args.per_level < 1:
        sys.exit(f"error: --per-level must be >= 1, got {args.per_level}")
    if not 0.0 <= args.p_mistake <= 1.0:
        sys.exit(f"error: --p-mistake must be in [0, 1], got {args.p_mistake}")
    rng = random.Random(args.seed)

    for level in range(1, MAX_DIFFICULTY + 1):
        print(f"--- difficulty {level}")
        for _ in range(args.per_level):
            task = make_tool_task(rng, level)
            text = render(gold_transcript(task, rng, args.p_mistake))
            n_tokens = len(re.sub(r"<\|\w+\|>", "x", text).encode())  # each special string is one token
            print(f"{task.question}  -> {task.answer}   plan {task.plan}\n"
                  f"  {text}  ({len(text.encode())} bytes, {n_tokens} tokens)")

    print("--- a long episode (difficulty 1: 8 calls) as the pretraining corpus shows it, one line a "
          "segment: past a 160-token budget the trainer asks for a summary and the next segment starts "
          "from it")
    task = make_chain_task(rng, 1)
    for segment in chain_transcript(task, rng, 160, "[the trainer's summary request]", p_slip=0.2):
        print(f"  {render(segment)}")
    print("--- one ToolEnv episode, scripted policy: an absent tool, a malformed message, then the gold plan")
    task = make_tool_task(rng, 2)
    env = ToolEnv(task)
    absent = next(t for t in TOOLS if t not in task.tools)
    name, a, b = task.plan[0]
    script = ([f"call {absent}({a},{b})", "compute it please"]
              + [f"call {n}({x},{y})" for n, x, y in task.plan])
    for text in script + [f"answer {task.answer}"]:
        reply, done = env.step(text)
        if done:
            break
    for role, text in env.turns:
        print(f"  {role:>9}: {text}")
    print(f"  reward {env.reward()}, tool_calls {env.tool_calls}, tool_errors {env.tool_errors}, "
          f"malformed {env.malformed}")

    print("--- DifficultySampler against a simulated policy that passes levels 1..4 with "
          "p = 0.95, 0.9, 0.5, 0.1")
    difficulty, skill = DifficultySampler(), {1: 0.95, 2: 0.9, 3: 0.5, 4: 0.1}
    for i in range(1, 601):
        level = difficulty.sample(rng)
        difficulty.update(level, float(rng.random() < skill[level]))
        if i % 100 == 0:
            rates = {k: None if v is None else round(v, 2) for k in skill for v in [difficulty.pass_rate(k)]}
            print(f"  episode {i}: frontier {difficulty.level}, pass rates {rates}")


if __name__ == "__main__":
    main()
