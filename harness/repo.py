"""A repository's files, as the tasks need them told apart and read. Which files are its source (the import
packages, flat or under src/, or a project that is one module) and which are its tests and their configuration
(never editable, never a feature); a work tree read without trusting it; a git snapshot that is the same
commit for the same tree.

A solution's work tree is hostile: the host walks it with lstat and opens a file only after lstat says it is
regular, with O_NOFOLLOW and O_NONBLOCK, reading a bounded number of bytes, so a link, a FIFO or a device is
refused by its kind before anything opens it; a walk stops at TREE_AT_MOST entries or the caller's deadline.
Nothing is copied from a work tree: materialize builds a solution's tree from the snapshot plus the accepted
files' bytes, never writing through a link the snapshot holds.

Imported by tasks.py (make, verify, judge_deletion, scan) and the rest of the harness; tested in test_all.py
(`python -m pytest test_all.py -k "never_trusts or layout"`).
"""

import ast
import contextlib
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

from harness import Refused, TaskError

# -----------------------------------------------------------------------------
# Layout: which files are source, which are tests and test configuration (never editable).

SKIP_DIRS = {".git", "__pycache__", ".tox", ".nox", ".venv", "venv", "node_modules"}
# top-level scripts that are never the project's module
NOT_MODULES = {"setup", "conftest", "noxfile", "fabfile", "tasks", "manage", "versioneer", "ez_setup",
               "distribute_setup", "bootstrap", "runtests", "run_tests", "docs", "conf"}
CONFIG = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "noxfile.py",
          ".coveragerc", "sitecustomize.py", "usercustomize.py"}


def is_protected(rel):
    p = Path(rel)
    return (p.name in CONFIG or p.suffix == ".pth" or bool(re.fullmatch(r"test_.*\.py|.*_test\.py|tests?\.py",
                                                                     p.name))
            or any(part in ("tests", "test", "testing") for part in p.parts[:-1]))


def walk(root, skip=SKIP_DIRS):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        for f in sorted(files):
            yield os.path.relpath(os.path.join(d, f), root)


def packages(root):
    """The top-level import packages (folders with __init__.py, flat or src/ layout), the portions of a
    namespace package the tests import (jaraco/text: a folder without __init__.py under a name several
    distributions share, PEP 420) and, for a project that is one module, its module file (`name.py`,
    declared as py-modules or imported by the tests); tests excluded. Relative paths: "pkg", "src/pkg",
    "ns/pkg", "name.py"."""
    root = Path(root)
    bases = [b for b in (root, root / "src") if b.is_dir()]
    ours = lambda p: not is_protected(p.name + "/x") and p.name not in SKIP_DIRS and p.name.isidentifier()
    found = [p for base in bases for p in sorted(base.iterdir()) if (p / "__init__.py").is_file() and ours(p)]
    loose = [p for base in bases for p in sorted(base.glob("*.py")) if not is_protected(p.name)
             and p.stem not in NOT_MODULES and p.is_file() and not p.is_symlink()]
    spaces = [p for base in bases for p in sorted(base.iterdir()) if p.is_dir() and not p.is_symlink()
              and ours(p) and not (p / "__init__.py").exists() and not list(p.glob("*.py"))
              and any((s / "__init__.py").is_file() for s in p.iterdir())]
    if loose or spaces:  # a single-module project, or a namespace's portions: what the tests import
        # by the tests: their files and conftest.py, not setup.py's helpers (a release script beside it)
        imported = imports(root, lambda rel: rel.endswith(".py") and is_protected(rel)
                           and Path(rel).name not in CONFIG - {"conftest.py"}, ast.walk)
        found += [p for p in loose if p.stem in imported | declared_modules(root)
                  and p.stem not in {f.name for f in found}]
        found += [s for p in spaces if p.name in imported for s in sorted(p.iterdir())
                  if (s / "__init__.py").is_file() and ours(s)]
    return [str(p.relative_to(root)) for p in found]


def declared_modules(root):
    """The single modules a project's build configuration declares as its own: setuptools' py_modules, in
    setup.py (read, never run), setup.cfg or pyproject.toml."""
    import configparser, tomllib
    names = set()
    with contextlib.suppress(SyntaxError, ValueError, OSError):
        for n in ast.walk(ast.parse(Path(root, "setup.py").read_bytes())):
            listed = isinstance(n, ast.keyword) and isinstance(n.value, (ast.List, ast.Tuple))
            if listed and n.arg == "py_modules":
                names |= {e.value for e in n.value.elts
                          if isinstance(e, ast.Constant) and type(e.value) is str}
    with contextlib.suppress(configparser.Error, OSError, UnicodeDecodeError):
        config = configparser.ConfigParser()
        config.read(Path(root, "setup.cfg"))
        names |= set(config.get("options", "py_modules", fallback="").replace(",", " ").split())
    with contextlib.suppress(tomllib.TOMLDecodeError, OSError, UnicodeDecodeError, AttributeError, TypeError):
        declared = tomllib.loads(Path(root, "pyproject.toml").read_text()).get("tool", {})
        declared = declared.get("setuptools", {})
        names |= {m for m in declared.get("py-modules", []) if type(m) is str}
    return names


def imports(root, which, nodes):
    """Top-level module names that the files `which` picks import, in the statements nodes(tree) gives
    (ast.walk: anywhere; a tree's body: at module level only)."""
    names = set()
    for rel in walk(root):
        if which(rel):
            with contextlib.suppress(SyntaxError, ValueError, OSError):
                for n in nodes(ast.parse(Path(root, rel).read_bytes())):
                    if isinstance(n, ast.Import):
                        names |= {a.name.split(".")[0] for a in n.names}
                    elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                        names.add(n.module.split(".")[0])
    return names


def package_name(pkg):
    """The name an entry of packages() imports by: "src/pkg" -> pkg, "name.py" -> name, "ns/pkg" -> ns.pkg."""
    parts = Path(pkg).with_suffix("").parts if pkg.endswith(".py") else Path(pkg).parts
    return ".".join(parts[1:] if parts[0] == "src" and len(parts) > 1 else parts)


def package_files(root, pkg):
    """The files of one entry of packages(root), relative to root."""
    return [pkg] if pkg.endswith(".py") else [os.path.join(pkg, r) for r in walk(Path(root) / pkg)]


def inside(rel, pkgs):
    return any(rel == p or rel.startswith(p + "/") for p in pkgs)


def package_roots(root):
    """Path prefixes of root's packages, as the tracer and recorder match code objects' files against."""
    return os.pathsep.join(os.path.realpath(Path(root, p)) + ("" if p.endswith(".py") else os.sep)
                           for p in packages(root))


def source_files(root, parse=True):
    """The packages' modules, their tests left out; parse: only those this interpreter parses (a module of
    Python 2 that a version check keeps from import, func-timeout's, is never a feature nor cut from)."""
    return [r for pkg in packages(root) for r in package_files(root, pkg)
            if r.endswith(".py") and not is_protected(r) and (not parse or parses(Path(root, r)))]


def parses(path):
    try:
        ast.parse(path.read_bytes())
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OSError):
        return False
# -----------------------------------------------------------------------------
# A work tree read without trusting it (the docstring says how), and a solution's tree rebuilt from the snapshot.

TREE_AT_MOST = 50_000  # entries a work tree may have
# never read, never copied: version control, virtual environments, bytecode, caches and what installing or
# measuring the package leaves (egg-info, build and dist at the top, coverage data)
IGNORED = SKIP_DIRS | {".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "htmlcov"}
IGNORED_FILES = re.compile(r"(.*/)?[^/]*\.py[co]|\.coverage(\..*)?|(.*/)?[^/]*\.egg-info/.*|(build|dist)/.*")


def lstat_tree(root, deadline):
    """{rel: os.stat_result} of everything under root but what IGNORED and IGNORED_FILES name, links not
    followed."""
    out, todo = {}, [""]
    while todo:
        d = todo.pop()
        with os.scandir(Path(root, d)) as entries:
            for e in entries:
                rel = os.path.join(d, e.name)
                if len(out) >= TREE_AT_MOST or time.time() > deadline:
                    raise Refused(f"the work tree has over {TREE_AT_MOST} entries or took too long to list")
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    todo += [] if e.name in IGNORED else [rel]
                elif not IGNORED_FILES.fullmatch(rel):
                    out[rel] = st
    return out


def read_regular(path, limit):
    """The bytes of a regular file, never following a link or waiting on a FIFO; None past limit bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 16):
            chunks, size = chunks + [chunk], size + len(chunk)
            if size > limit:
                return None
        return b"".join(chunks)
    finally:
        os.close(fd)


def linked(root, rel):
    """Whether writing rel under root would go through a link or onto something that is not a regular file
    (a repository may hold a link to anywhere)."""
    p = Path(root)
    try:
        for i, part in enumerate(rel.split("/")):
            p = p / part
            last = i == len(rel.split("/")) - 1
            if p.is_symlink() or (p.exists() and not (p.is_file() if last else p.is_dir())):
                return True
    except OSError:  # a name the file system refuses (too long): nothing can be written there either
        return True
    return False


def materialize(snap, edits, dest):
    """A solution's tree as a folder: the snapshot, then its edits {rel: bytes, or None where deleted}
    written, never through a link the snapshot holds (CodeEnv refuses such edits; verify and judge_deletion
    refuse such a solution)."""
    shutil.copytree(snap, dest, symlinks=True)
    for rel, data in edits.items():
        if linked(dest, rel):
            raise TaskError(f"refused to write {rel}: it is behind a link")
        if data is None:  # deleted
            Path(dest, rel).unlink(missing_ok=True)
            continue
        Path(dest, rel).parent.mkdir(parents=True, exist_ok=True)
        Path(dest, rel).write_bytes(data)
    return dest


# -----------------------------------------------------------------------------
# A snapshot's history: one commit, the same for the same tree.

def fresh_git(root):
    # fixed author, committer and dates: the same tree gives the same commit
    when = "2000-01-01T00:00:00+0000"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "task", "GIT_AUTHOR_EMAIL": "task@example.com", "GIT_AUTHOR_DATE": when,
           "GIT_COMMITTER_NAME": "task", "GIT_COMMITTER_EMAIL": "task@example.com",
           "GIT_COMMITTER_DATE": when}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["commit", "-q", "--no-gpg-sign", "-m", "snapshot"]):
        subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)
