"""A virtual environment per repository, holding its dependencies and the test requirements it declares, so
its pytest configuration runs as its authors meant (plugins, coverage options, doctests). The repository's own
code is removed from the venv after install in every form (installed_copies: the package, its bytecode, links
to a checkout; uninstall_own: every file its install wrote, scripts and data files too; its metadata stays,
less the hashes of the files removed): the tests import the work folder's
copy, and any copy of deleted code would be a leak. make and verify check it (check_interpreter): in the
sandbox, with no work tree, nothing of the packages imports or lies in bytecode.

The configuration is read as pytest itself reads it (pytest.ini, pyproject.toml, tox.ini, setup.cfg, in that
order), and a plugin it cannot run without (an addopts option's, an ini key's, required_plugins) is installed
too.

    python tasks.py env --repo DIR --venv DIR   # prints the venv's interpreter, for make --python
"""

import ast
import configparser
import contextlib
import csv
import datetime
import email.parser
import fnmatch
import functools
import importlib.machinery
import inspect
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from harness import TaskError
from harness.repo import CONFIG, imports, is_protected, package_name, packages, walk
from harness.sandbox import Sandbox, first_error, parsed, scratch

# extras and dependency groups that hold test requirements
TEST_EXTRAS = ("test", "tests", "testing", "dev")
# a pytest command-line option -> the plugin that provides it
PLUGIN_OPTIONS = {"--cov": "pytest-cov", "-n": "pytest-xdist", "--numprocesses": "pytest-xdist",
                  "--dist": "pytest-xdist", "--timeout": "pytest-timeout", "--asyncio-mode": "pytest-asyncio",
                  "--benchmark": "pytest-benchmark", "--reruns": "pytest-rerunfailures",
                  "--doctest-plus": "pytest-doctestplus", "--mypy": "pytest-mypy",
                  "--hypothesis": "hypothesis", "--randomly": "pytest-randomly", "--flake8": "pytest-flake8"}
# ini keys of a pytest configuration that only a plugin understands
INI_PLUGINS = {"asyncio_mode": "pytest-asyncio", "asyncio_default_fixture_loop_scope": "pytest-asyncio",
               "timeout": "pytest-timeout", "env": "pytest-env", "mock_use_standalone_module": "pytest-mock",
               "doctest_plus": "pytest-doctestplus", "xdist_auto_num_workers": "pytest-xdist"}
# a mark or fixture a test uses -> the module of the plugin that gives it (wait-for2's @pytest.mark.asyncio,
# pytest-asyncio declared nowhere: every test failed, "async def functions are not natively supported")
PLUGIN_MODULES = {"asyncio": "pytest_asyncio", "trio": "pytest_trio", "anyio": "anyio",
                  "mocker": "pytest_mock", "benchmark": "pytest_benchmark", "requests_mock": "requests_mock",
                  "httpserver": "pytest_httpserver"}
# a test's import -> the distribution that provides it, where the two names differ
DISTRIBUTIONS = {"yaml": "pyyaml", "dateutil": "python-dateutil", "PIL": "pillow", "attr": "attrs",
                 "bs4": "beautifulsoup4", "jwt": "pyjwt", "pytest_mock": "pytest-mock", "dns": "dnspython",
                 "pytest_asyncio": "pytest-asyncio", "pytest_benchmark": "pytest-benchmark", "Crypto":
                 "pycryptodome", "OpenSSL": "pyopenssl", "google": "protobuf", "pkg_resources": "setuptools",
                 "typing_extensions": "typing-extensions", "sklearn": "scikit-learn", "serial": "pyserial",
                 "magic": "python-magic", "docutils": "docutils", "markdown": "markdown"}
SELF_REQUIREMENT = re.compile(r"\s*(-e\s+|--editable[=\s]\s*)?\.(/)?(\[[^\]]*\])?\s*(#.*)?")  # ., -e .[dev]
COMPILED = "featdel-compiled"  # in a venv from `env`: the package's compiled modules, kept for its tests


def make_env(repo, venv, isolate=True, log=print, as_of=None):
    """Create venv with this interpreter's venv module, upgrade its pip, install repo[test extras], the test
    requirements it declares and pytest into it (network allowed, nothing writable but the venv and a copy of
    the repo), then what its tests import and is still missing (best effort). The repository's own packages
    are taken out again; compiled modules of theirs that have no Python twin are kept in venv/COMPILED, for
    make to put beside the sources. Returns the venv's interpreter. as_of: an ISO time; what the package
    index held then is installed (pip's --uploaded-prior-to), made again so when a dependency newer than
    an sdist broke its tests' imports."""
    repo, venv = Path(repo).resolve(), Path(venv).resolve()
    if not repo.is_dir() or not packages(repo):
        raise TaskError(f"--repo {repo} is not a directory with a Python package (a folder with __init__.py) "
                        f"or a single module the tests import")
    if venv.exists() and any(venv.iterdir()):
        raise TaskError(f"--venv {venv} exists and is not empty")
    t0, (extras, reqs) = time.time(), test_requirements(repo)
    p = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if p.returncode:
        raise TaskError(f"python -m venv {venv} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    python = str(venv / "bin" / "python")
    box = Sandbox(python=python, isolate=isolate, timeout=1800)
    keep = {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k.lower().endswith("_proxy")}
    pip = ["-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
    # the index alone where a time is given: local folders and file indexes carry no upload times
    dated = keep | {"PIP_FIND_LINKS": " ", "PIP_EXTRA_INDEX_URL": " "} if as_of else keep
    then = ["--uploaded-prior-to", as_of] if as_of else []
    with scratch() as tmp:
        # the build writes into its source folder: a copy, so the repository is untouched; an sdist's copy
        # without the git history it was given, whose missing tags would make setuptools-scm call it 0.1.dev1
        src = Path(tmp, repo.name)
        sdist = (repo / "PKG-INFO").is_file()
        shutil.copytree(repo, src, symlinks=True, ignore=shutil.ignore_patterns(".git") if sdist else None)
        for arg in reqs:  # a requirements file that installs the project itself (-e .[dev]): it is installed
            f = src / arg.partition("=")[2] if arg.startswith("--requirement=") else None
            if f and f.is_file() and not f.is_symlink():
                lines = f.read_text(errors="replace").splitlines()
                f.write_text("\n".join(x for x in lines if not SELF_REQUIREMENT.fullmatch(x)) + "\n")
        # a fresh venv's pip can be too old to read today's package metadata
        rc, out = box.run([*pip, "--upgrade", "pip"], src, writable=[venv], network=True, extra_env=keep)
        target = f"{src}[{','.join(extras)}]" if extras else str(src)
        log(f"installing {repo.name}{'[' + ','.join(extras) + ']' if extras else ''} {' '.join(reqs)} pytest")
        for _ in range(5) if not rc else ():
            rc, out = box.run([*pip, *then, target, *reqs, "pytest"], src, writable=[venv], network=True,
                              extra_env=dated)
            name = rc and unreachable(out)
            left = without(reqs, src, name) if name else None
            if left is None:  # installed, another failure, or a dependency of the project itself
                break
            reqs = left
            log(f"{name}, a test requirement, is not on the package index for this Python or not reachable: "
                f"left out")
        if rc and "No module named 'pkg_resources'" in out:  # an old setup.py; setuptools 81 dropped it
            log("its build needs pkg_resources: building with setuptools<81 in the venv instead")
            rc, out = box.run([*pip, "setuptools<81", "wheel"], src, writable=[venv], network=True,
                              extra_env=keep)
            rc, out = (rc, out) if rc else box.run([*pip, "--no-build-isolation", target, *reqs, "pytest"],
                                                    src, writable=[venv], network=True, extra_env=keep)
        name, version = release(src) if sdist and rc else (None, None)
        if name and version and (f"Failed to build 'file://{src}" in out  # an sdist that does not build
                                 or f"failed building wheel for {name.lower()}" in out.lower()
                                 or "metadata-generation-failed" in out and f"from file://{src}" in out):
            # (aiobreaker's setup.py reads a readme it does not ship; bumpver's build needs lib3to6; pyrtf3's
            # setup_requires, setuptools-markdown, fails): the same release's wheel, with the same
            # dependencies; its code is taken out below
            log(f"its sdist does not build ({pip_failure(out)}): installing the wheel of {name}=={version}")
            wheel = f"{name}{target[len(str(src)):]}=={version}"
            rc, out = box.run([*pip, *then, "--only-binary", name, wheel, *reqs, "pytest"], src,
                              writable=[venv], network=True, extra_env=dated)
        if rc:
            raise TaskError(f"pip install failed in {venv}: {pip_failure(out)}")
        # a pin older than this interpreter (pytest<6 on Python 3.11 cannot rewrite an assert): the newest
        # 7.x, which still takes the hook arguments such suites' conftests use (path), or else the newest
        Path(tmp, "probe").mkdir()
        Path(tmp, "probe", "test_probe.py").write_text("def test_probe():\n    assert 1\n")
        probe = lambda: box.run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
                                Path(tmp, "probe"))
        rc, out = probe()
        for newer in ("pytest<8", "pytest") if rc else ():
            log(f"its pytest does not run on this Python ({first_error(out)}): installing {newer}")
            rc, out = box.run([*pip, "--upgrade", newer], src, writable=[venv], network=True, extra_env=keep)
            if rc:
                raise TaskError(f"pip install failed in {venv}: {pip_failure(out)}")
            rc, out = probe()
            if not rc:
                break
        site_dir = next(venv.glob("lib/python3*/site-packages"))
        names = {package_name(pkg).split(".")[0] for pkg in packages(repo)}  # a namespace's portion: its top
        missing = sorted(m for m in test_imports(repo) - names
                         if not (site_dir / m).exists() and not list(site_dir.glob(m + ".*")))
        if missing:
            dists = [DISTRIBUTIONS.get(m, m.replace("_", "-")) for m in missing]
            log(f"the tests import or use {', '.join(missing)}, which nothing declares: installing "
                + " ".join(dists))
            for d in dists:  # one at a time: a name that is no distribution must not stop the others
                rc, out = box.run([*pip, *then, d], src, writable=[venv], network=True, extra_env=dated)
                if rc:
                    log(f"  {d}: {pip_failure(out)}")
        # a suite written for an older pytest (Flask's tests import _pytest.monkeypatch.notset, gone in 9;
        # plumbum's conftest reads config.inicfg, deprecated in 9, under filterwarnings = error): the newest
        # pytest that collects it, one major version older at a time
        collect = lambda: box.run(["-m", "pytest", "-q", "--co", "-p", "no:cacheprovider"], src)
        rc, out = collect()
        for older in ("pytest<9", "pytest<8"):
            if not OLD_PYTEST.search(out):
                break
            log(f"its tests need an older pytest ({first_error(out)}): installing {older}")
            rc, out = box.run([*pip, older], src, writable=[venv], network=True, extra_env=keep)
            if rc:
                raise TaskError(f"pip install failed in {venv}: {pip_failure(out)}")
            rc, out = collect()
        stale = NEWER_DEPENDENCY.search(out)
        if stale and not as_of and (repo / "PKG-INFO").is_file():
            # a dependency released after the sdist broke its tests' imports (openapi-schema-pydantic's
            # `from pydantic.schema import schema`, gone in pydantic 2): what the index held a day after the
            # sdist was built (its PKG-INFO's time), or once this Python had been out a season where that is
            # later (pydantic 1.9 of June 2022 does not run on 3.11), in a new venv
            built = datetime.datetime.fromtimestamp((repo / "PKG-INFO").stat().st_mtime, datetime.UTC)
            released = datetime.datetime.fromisoformat(PYTHON_RELEASED.get(sys.version_info[1], "2000-01-01")
                                                       + "T00:00:00+00:00")
            when = max(built + datetime.timedelta(days=1), released + datetime.timedelta(days=90))
            if when < datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30):
                log(f"its tests' imports fail in a dependency ({stale[0].strip()}): installing what the "
                    f"package index held on {when:%Y-%m-%d}")
                shutil.rmtree(venv)
                return make_env(repo, venv, isolate, log, when.strftime("%Y-%m-%dT%H:%M:%SZ"))
    kept, names = 0, [package_name(pkg) for pkg in packages(repo)]
    for name in names:
        installed = site_dir.joinpath(*name.split("."))
        for f in sorted(installed.rglob("*")) if installed.is_dir() else []:
            suffix = next((x for x in importlib.machinery.EXTENSION_SUFFIXES if f.name.endswith(x)), None)
            if suffix and not f.with_name(f.name[:-len(suffix)] + ".py").exists():  # no mypyc twin
                to = venv / COMPILED / name / f.relative_to(installed)
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, to)
                kept += 1
    uninstall_own(site_dir, names)
    log(f"environment for {repo.name} ready in {time.time() - t0:.0f} s"
        + (f", {kept} compiled modules kept for the tests" if kept else "")
        + f"; run its tests with --python {python}")
    return python


# what a collection says when the suite needs an older pytest than the newest: a name pytest no longer has,
# a deprecation its configuration turns into an error, a plugin that does not load (pytest-cases calls
# pytest's IdMaker with the arguments pytest 8 took)
OLD_PYTEST = re.compile(r"(ImportError|AttributeError)\b[^\n]*\b_?pytest\b|PytestRemovedIn\d+Warning|"
                        r"Error while loading plugin|docs\.pytest\.org/en/stable/deprecations\.html#")
# when each Python 3 minor version came out: a venv made as of a date takes nothing older than ran on it
PYTHON_RELEASED = {10: "2021-10-04", 11: "2022-10-24", 12: "2023-10-02", 13: "2024-10-07", 14: "2025-10-07"}
# ...and when a dependency installed into the venv lacks a name its tests import
NEWER_DEPENDENCY = re.compile(r"ImportError: cannot import name [^\n]* from '[\w.]+' "
                              r"\([^\n)]*/site-packages/")


def unreachable(out):
    """The requirement a failed install could not get, or None: one the index lacks for this Python, or one
    from a repository this machine cannot reach (pytest-socket's dev group takes mutmut from GitHub)."""
    m = re.search(r"No matching distribution found for ([A-Za-z0-9][\w.-]*)|"
                  r"Failed to build '([A-Za-z0-9][\w.-]*)' when git clone", out)
    return m and (m[1] or m[2])


def without(reqs, src, name):
    """The pip arguments reqs less the requirement `name`, given directly or in a requirements file under src
    (rewritten without it); None where neither names it (a dependency of the project itself)."""
    fold = lambda x: re.sub(r"[-_.]+", "-",
                            (re.match(r"\s*([A-Za-z0-9][\w.-]*)", x) or [None, ""])[1].lower())
    kept = [r for r in reqs if fold(r) != fold(name)]
    dropped = len(kept) < len(reqs)
    for arg in kept:
        f = Path(src, arg.partition("=")[2]) if arg.startswith("--requirement=") else None
        if f and f.is_file() and not f.is_symlink():
            lines = f.read_text(errors="replace").splitlines()
            left = [x for x in lines if fold(x) != fold(name)]
            if len(left) < len(lines):
                f.write_text("\n".join(left) + "\n")
                dropped = True
    return kept if dropped else None


def test_requirements(repo):
    """(extras, pip arguments) for the test requirements a repository declares: extras and dependency groups
    named test/tests/testing/dev, Poetry groups and dev-dependencies, PDM dev-dependencies, hatch test
    environments, setup.py's tests_require, requirements files, tox deps, and the plugins its pytest
    configuration needs."""
    repo, extras, args = Path(repo), [], []
    pp = repo / "pyproject.toml"
    try:
        data = tomllib.loads(pp.read_text()) if pp.is_file() else {}
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{pp} is not valid TOML: {e}")
    extras += [k for k in data.get("project", {}).get("optional-dependencies", {})
               if k.lower() in TEST_EXTRAS]
    groups = data.get("dependency-groups", {})

    def group(name, seen=()):  # PEP 735, with {include-group = ...}
        for item in groups.get(name, []):
            if isinstance(item, str):
                yield item
            elif isinstance(item, dict) and item.get("include-group") in groups and name not in seen:
                yield from group(item["include-group"], (*seen, name))
    args += [r for g in groups if g.lower() in TEST_EXTRAS for r in group(g)]
    tool = data.get("tool", {})
    poetry = tool.get("poetry", {})
    tables = [poetry.get("dev-dependencies", {})] + [g.get("dependencies", {}) for k, g in poetry.get(
        "group", {}).items() if k.lower() in TEST_EXTRAS]
    args += [poetry_requirement(k, v) for t in tables for k, v in t.items() if k.lower() != "python"]
    args += [r for k, v in tool.get("pdm", {}).get("dev-dependencies", {}).items() if k.lower() in TEST_EXTRAS
             for r in v if isinstance(r, str) and not r.startswith("-")]
    hatch = tool.get("hatch", {}).get("envs", {})
    args += [r for e in ("default", "test", "tests") for r in hatch.get(e, {}).get("dependencies", [])
             if "{" not in r]
    cfg = configparser.ConfigParser(interpolation=None)
    with contextlib.suppress(configparser.Error, UnicodeDecodeError):
        cfg.read([repo / "setup.cfg", repo / "tox.ini"])
    if cfg.has_section("options.extras_require"):
        extras += [k for k in cfg["options.extras_require"] if k.lower() in TEST_EXTRAS]
    args += [x.strip() for x in cfg.get("options", "tests_require", fallback="").splitlines() if x.strip()]
    if (repo / "setup.py").is_file():
        with contextlib.suppress(SyntaxError, ValueError, UnicodeDecodeError):
            # tests_require=[...] and extras_require={"test": [...]} as literals in setup.py
            for n in ast.walk(ast.parse((repo / "setup.py").read_bytes())):
                for kw in n.keywords if isinstance(n, ast.Call) else []:
                    with contextlib.suppress(ValueError):
                        v = ast.literal_eval(kw.value)
                        if kw.arg == "tests_require" and isinstance(v, (list, tuple)):
                            args += [x for x in v if isinstance(x, str)]
                        elif kw.arg == "extras_require" and isinstance(v, dict):
                            extras += [k for k in v if isinstance(k, str) and k.lower() in TEST_EXTRAS]
        if not extras:  # setup.py declares extras in code; pip ignores the ones it lacks
            extras += ["test", "tests", "testing"]
    for dep in cfg.get("testenv", "deps", fallback="").splitlines():
        # tox's names for the repository's folder and for the path separator
        dep = dep.strip().replace("{toxinidir}/", "").replace("{/}", "/")
        if dep.startswith("-r") and "{" not in dep:  # a file the sdist lacks (radon's): left out
            args += [f"--requirement={dep[2:].strip()}"] * (repo / dep[2:].strip()).is_file()
        elif dep and not dep.startswith(("#", "-", ".")) and "{" not in dep \
                and not re.match(r"[\w,!{}.-]+:\s", dep):  # `docs: sphinx`: another tox env's
            args.append(dep.split(" #")[0].strip())
    for pattern in ("requirements*test*.txt", "requirements-dev.txt", "requirements_dev.txt",
                    "test*requirements.txt", "dev-requirements.txt", "requirements/test*.txt",
                    "requirements/dev*.txt", "test*/requirements*.txt"):
        for f in sorted(repo.glob(pattern)):
            args.append(f"--requirement={f.relative_to(repo)}")
    args += config_plugins(repo)
    return sorted(set(extras)), list(dict.fromkeys(a for a in args if a.split("[")[0].lower() != "pytest"))


def poetry_requirement(name, spec):
    """A Poetry dependency table entry as a pip requirement (its version constraint dropped: Poetry's ^ and ~
    are not PEP 440; the resolver picks a version the package's own metadata admits)."""
    extras = spec.get("extras", []) if isinstance(spec, dict) else []
    return name + (f"[{','.join(extras)}]" if extras else "")


def config_plugins(repo):
    """The plugins a repository's pytest configuration cannot run without: those its addopts' options
    belong to, its ini keys need, and its required_plugins."""
    cfg = pytest_config(repo)

    def words(v):
        with contextlib.suppress(ValueError):
            return v if isinstance(v, list) else shlex.split(str(v))
        return str(v).split()
    need = [plugin_for(w) for w in words(cfg.get("addopts", ""))] + [INI_PLUGINS.get(k) for k in cfg]
    need += words(cfg.get("required_plugins", ""))
    return list(dict.fromkeys(x for x in need if x))


def old_config(root):
    """Bring a configuration today's pytest refuses to the form it reads, in place (a task's snapshot is
    made from the result): setup.cfg's `[pytest]` section, which pytest 7 stopped reading, as
    `[tool:pytest]`. -> what changed, a line each."""
    f, done = Path(root, "setup.cfg"), []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = f.read_text()
        if re.search(r"(?m)^\[pytest\]\s*$", text) and "[tool:pytest]" not in text:
            f.write_text(re.sub(r"(?m)^\[pytest\]\s*$", "[tool:pytest]", text))
            done.append("setup.cfg: its [pytest] section renamed [tool:pytest], as pytest 7 and later read "
                        "it")
    return done


def collect_args(root):
    """pytest options that collect the test modules the configured python_files patterns miss (a project's
    root tests.py, tests/tests.py: a user runs them by name): modules in test folders, or named tests.py or
    test.py, that define tests (test_ functions, Test classes or unittest cases) and import the packages.
    Patterns that name the project's own modules too (packageurl-python's `python_files = *.py`) are
    pytest's defaults here: its tests are the test files, found by the same rule."""
    named = pytest_config(root).get("python_files") or "test_*.py *_test.py"
    pats = named if isinstance(named, list) else str(named).replace(",", " ").split()
    wide = any(rel.endswith(".py") and not is_protected(rel) and any(fnmatch.fnmatch(Path(rel).name, pat)
                                                                    for pat in pats) for rel in walk(root))
    pats = ["test_*.py", "*_test.py"] if wide else pats
    own = {package_name(p).split(".")[0] for p in packages(root)}
    extra = set()
    for rel in walk(root):
        name = Path(rel).name
        if not rel.endswith(".py") or name in CONFIG or not is_protected(rel) \
                or any(fnmatch.fnmatch(name, pat) for pat in pats):
            continue
        with contextlib.suppress(SyntaxError, ValueError, OSError):
            tree = ast.parse(Path(root, rel).read_bytes())
            tests = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
                        or isinstance(n, ast.ClassDef) and (n.name.startswith("Test") or "TestCase" in
                                                            ast.unparse(n.bases)) for n in tree.body)
            uses = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
            uses |= {n.module.split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.module}
            if tests and uses & own:  # by its path: another file of that name may be no test
                extra.add(str(Path(root).resolve() / rel))
    return ["-o", "python_files=" + " ".join([*pats, *sorted(extra)])] if extra or wide else []


def pytest_config(repo):
    """{ini key: value} of the pytest configuration pytest itself would pick (pytest.ini, pyproject.toml,
    tox.ini, setup.cfg, in that order)."""
    repo = Path(repo)
    for name, section in (("pytest.ini", "pytest"), ("pyproject.toml", None), ("tox.ini", "pytest"),
                          ("setup.cfg", "tool:pytest")):
        f = repo / name
        if not f.is_file():
            continue
        if section is None:
            with contextlib.suppress(tomllib.TOMLDecodeError, UnicodeDecodeError):
                opts = tomllib.loads(f.read_text()).get("tool", {}).get("pytest", {}).get("ini_options")
                if opts is not None:
                    return opts
            continue
        cfg = configparser.ConfigParser(interpolation=None)
        with contextlib.suppress(configparser.Error, UnicodeDecodeError):
            cfg.read(f)
            if cfg.has_section(section):
                return dict(cfg[section])
    return {}


def plugin_for(option):
    """The pytest plugin that provides a command-line option (--cov-report=x -> pytest-cov), or None."""
    name = option.split("=")[0]
    return next((v for k, v in PLUGIN_OPTIONS.items() if name == k or name.startswith(k + "-")
                 or k == "-n" and re.fullmatch(r"-n\d+|-nauto", name)), None)


def test_imports(repo):
    """Top-level modules the test modules and conftests import unconditionally (at module level, outside
    try), and the plugins whose marks and fixtures they use (PLUGIN_MODULES); not what other scripts among
    the tests import (a test may run one only where it can)."""
    tests = lambda rel: re.fullmatch(r"test_.*\.py|.*_test\.py|conftest\.py", Path(rel).name)
    names = imports(repo, tests, lambda tree: tree.body)
    for rel in filter(tests, walk(repo)):
        with contextlib.suppress(SyntaxError, ValueError, OSError):
            for n in ast.walk(ast.parse(Path(repo, rel).read_bytes())):
                if isinstance(n, ast.Attribute) and "mark" in (getattr(n.value, "attr", None),
                                                               getattr(n.value, "id", None)):
                    names.add(PLUGIN_MODULES.get(n.attr, ""))  # @pytest.mark.asyncio, @mark.trio
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names |= {PLUGIN_MODULES.get(a.arg, "") for a in n.args.args}  # def test_x(mocker)
    names.discard("")
    local = {part for rel in walk(repo) for part in Path(rel).with_suffix("").parts}  # helpers, conftest
    return names - local - set(sys.stdlib_module_names) - {"__future__"}


def release(src):
    """(name, version) from an sdist's PKG-INFO (None where it has none)."""
    meta = email.parser.Parser().parsestr((Path(src) / "PKG-INFO").read_text(errors="replace"), headersonly=True)
    return meta["Name"], meta["Version"]


def pip_failure(out):
    """The line of pip's output that says why it failed: its `ERROR: ...` line, or, after `ERROR: Exception:`
    (pip itself crashed), the last line of the traceback."""
    lines = [x.strip() for x in out.strip().splitlines() if x.strip()] or ["no output"]
    if "The conflict is caused by:" in lines:  # the resolver: what conflicts with what
        cause = itertools.takewhile(lambda x: not x.startswith(("To fix", "Additionally", "ERROR")),
                                    lines[lines.index("The conflict is caused by:") + 1:])
        return "conflicting requirements: " + "; ".join(itertools.islice(cause, 4))
    err = next((x for x in reversed(lines) if x.startswith("ERROR") and x != "ERROR: Exception:"), None)
    return err or lines[-1]

def uninstall_own(site_dir, names):
    """Take the repository's own code out of a venv: every copy installed_copies finds, whatever folder its
    install wrote it to. Its metadata stays (version lookups), without the rows of the files removed."""
    copies = list(installed_copies([site_dir], names))
    for p, what in copies:
        if what != "metadata" and os.path.lexists(p):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p, what in copies:
        if what == "metadata" and Path(p, "RECORD").is_file():
            rows = [r for r in csv.reader(Path(p, "RECORD").read_text().splitlines())
                    if r and os.path.lexists(Path(site_dir, r[0]))]
            with open(Path(p, "RECORD"), "w", newline="") as f:
                csv.writer(f, lineterminator="\n").writerows(rows)


def installed_copies(site_dirs, names):
    """(path, what) for each copy of the packages `names` (ns.pkg: a namespace's portion) in site
    directories, in any form: the package or module itself, its bytecode (a module's __pycache__ entry
    outlives its source, and a loader runs it without one), .pth and .egg-link lines and editable-install
    finders that lead to a checkout, and the metadata (what is "metadata": it holds no code); and every other
    file the install of its distribution wrote, wherever its RECORD says (a script in bin/, a one-module
    project's `script-files`, data files)."""
    paths = [n.replace(".", "/") for n in names]  # where each lies under a site directory
    own = lambda r: any(r == f"{x}.py" or r.startswith(f"{x}/") for x in paths)
    for sp in map(Path, site_dirs):
        for record in sorted(sp.glob("*.dist-info/RECORD")) if sp.is_dir() else []:
            with contextlib.suppress(OSError, csv.Error):
                rows = [r[0] for r in csv.reader(record.read_text(errors="replace").splitlines()) if r]
                if not any(map(own, rows)):
                    continue  # another distribution's
                if not re.match(rf"({'|'.join(map(re.escape, names))})-", record.parent.name):
                    yield record.parent, "metadata"  # (one named as the package is found below)
                for r in rows:
                    f = Path(os.path.normpath(sp / r))
                    if f.parent != record.parent and not own(r) and os.path.lexists(f):
                        yield f, "installed file"
        tops = sorted(sp.iterdir()) if sp.is_dir() else []
        for name, path in zip(names, paths):
            home, leaf = Path(sp, path).parent, Path(path).name  # the folder it lies in, its own name
            for p in sorted([*home.iterdir(), *Path(home, "__pycache__").glob("*")]) if home.is_dir() else []:
                if p.name in (leaf, f"{leaf}.py") or p.name.startswith(f"{leaf}.") and p.suffix in (".pyc",
                                                                                                   ".so"):
                    yield p, "bytecode" if p.suffix == ".pyc" else "installed copy"
            for p in tops:
                if re.fullmatch(rf"{re.escape(name)}-[^/]*\.(dist|egg)-info", p.name):
                    yield p, "metadata"
                elif p.suffix in (".pth", ".egg-link") or p.name.startswith("__editable__"):
                    with contextlib.suppress(OSError, ValueError):
                        text = p.read_text(errors="replace")[:1 << 20]
                        links = [Path(sp, x.strip()) for x in text.splitlines() if x.strip()
                                 and not x.startswith(("import", "#"))]
                        if any(Path(x, path).exists() or Path(x, f"{path}.py").exists() for x in links) \
                                or p.suffix == ".py" and re.search(r"['\"]%s['\"]" % re.escape(name), text):
                            yield p, "link to a checkout"


# Run in the sandbox in an empty folder with the task's interpreter: what a solution could load of the
# repository's packages from the interpreter alone, by import or by a loader pointed at leftover bytecode.
INTERPRETER_CHILD = "\n".join(["import contextlib, csv, importlib.util, json, os, re, sys",
                                "from pathlib import Path", inspect.getsource(installed_copies), """
names, found = json.loads(sys.argv[1]), []
for n in names:
    spec = None
    with contextlib.suppress(Exception):
        spec = importlib.util.find_spec(n)
    if spec is not None:
        found.append(f"it imports {n} from {spec.origin or ', '.join(spec.submodule_search_locations or [])}")
dirs = [d for d in sys.path if d and os.path.isdir(d) and os.path.realpath(d) != os.getcwd()]
found += [f"{p} ({what})" for p, what in installed_copies(dirs, names) if what != "metadata"]
print(json.dumps(found))"""])


@functools.cache
def interpreter_copies(python, isolate, names):
    """What the interpreter holds of the packages `names` (a tuple), as a sandboxed run sees it: [] when it
    holds nothing, the gold in no form."""
    with scratch() as empty:
        rc, out = Sandbox(python, isolate, 120).run(["-c", INTERPRETER_CHILD, json.dumps(names)], empty)
    found = parsed((out.strip().splitlines() or [""])[-1])
    return found if isinstance(found, list) else [f"the check did not run (exit {rc}): {out.strip()[-200:]}"]
