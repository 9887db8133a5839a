"""The harness: the machinery tasks.py runs untrusted code with, one mechanism a file. None of it is an idea
of the recipe (tasks.py holds those: make, verify, the oracle's comparison, strength, scan, monitor, the
environments); it is what SWE-bench's harness keeps apart from its tasks: isolation, environments, the code
that runs inside the sandboxed processes, fetching packages. It imports nothing of the project; tasks.py
imports it.

    repo.py      a repository's files: which are source, tests and configuration; a work tree read without
                 trusting it; a git snapshot
    sandbox.py   bubblewrap: every run of a repository's tests or of a solution, as nobody, on bounded tmpfs,
                 with a timeout; pytest runs whose outcomes come from the verifier's own reporter plugin
    env.py       a virtual environment per repository, with the test requirements it declares and no copy of
                 its own packages; its pytest configuration
    child.py     the oracle's sandboxed child: the copier, canonical results, held-out inputs by mutation
    plugins.py   plugins inside the repository's pytest run: the tracer (test -> feature map) and the
                 recorder (the feature's inputs while the gold code runs)
    survey.py    packages from the index: the list a survey draws from, sdists fetched and checked; a rank's
                 share, each package in a process of its own, its record on disk (a restart goes on from
                 them); the index and the table

Standard library only. The two errors every mechanism raises are defined here.
"""


class TaskError(Exception):
    """Bad input or an unusable repository; the CLI prints it as one `error: ...` line."""


class Refused(Exception):
    """A solution refused before anything of it runs; verify scores it 0 with this one line."""
