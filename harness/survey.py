"""Packages nobody here chose, as a user would meet them: the list a survey draws from (SURVEY_PACKAGES), a
release's sdist fetched from the package index, checked against its SHA-256 and unpacked with nothing outside
its folder, and the survey's table. What a package's row measures (env, make, verify of each task's gold and
of its untouched snapshot, strength, served) is tasks.py's survey_one; this file runs it over a rank's share
of the packages, each in a process of its own that writes the package's record, a few at a time, and writes
the index.

    python tasks.py survey --draw 30 --seed S --exclude README.md experiments.md test_all.py --out DIR
    torchrun --nproc_per_node 4 --max-restarts 2 tasks.py survey --draw 30 --out DIR   # a restart resumes
"""

import collections
import concurrent.futures
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import tarfile
import threading
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from harness import TaskError
from harness.sandbox import LIVE, RUNS, STOPPING, stoppable

# 512 pure-Python projects of the index's top 10,000 by downloads (hugovk/top-pypi-packages, 2026-04-01)
# whose newest sdist ships a tests/ or test/ folder of at least 5 test files, no C, Cython or Rust source and
# only pure wheels, and admits Python 3.11, each at that release; left out: projects that need numpy, Django,
# cryptography, lxml or a like stack, and those whose tests need a service (a cloud's or a site's client, a
# database or broker server, hardware, a display). 248 were screened by hand; 264 by a script over all 10,000
SURVEY_PACKAGES = tuple("""
affine==3.0.1 agate==1.14.2 aiobreaker==1.2.0 aioconsole==0.8.2 aiofiles==25.1.0 aiologic==0.17.1
aiostream==0.8.1 aiotools==2.2.4 aiounittest==1.5.0 aniso8601==10.0.1 antsibull-core==3.6.0
antsibull-docs-parser==1.2.3 antsibull-docutils==1.4.1 antsibull-fileutils==1.5.3 anyconfig==0.16.0
anyio==4.16.0 anys==0.3.1 anytree==2.13.0 application-properties==0.9.3 aqtinstall==3.3.0 argdantic==1.3.3
argh==0.31.3 Arpeggio==2.0.3 arrow==1.4.0 asdf-standard==1.5.0 asgiref==3.13.0 astral==3.2 astroid==4.3.4
asttokens==3.0.2 async-cache==2.0.3 async-lru==2.4.0 async-property==0.2.2 asyncclick==8.4.2.1 asyncer==0.0.18
attrs==26.1.0 autologging==1.3.2 autoray==0.11.0 awesomeversion==25.8.0 babel==2.19.0 bandit==1.9.4
baron==0.10.1 beautifulsoup4==4.15.0 behave==1.3.3 beniget==0.5.0 better-exceptions==0.3.3 bibtexparser==2.1.0
bigtree==1.5.3 binapy==0.8.0 bitmath==2.1.1 bleach==6.4.0 blessed==1.52.0 boltons==26.2.0 bottle==0.13.4
brazilnum==0.10.0 bumpver==2026.1132 busypie==0.6.1 cachetools==8.0.2 cachy==0.3.0 casbin==1.43.0
cattrs==26.2.1 cel-python==0.5.0 Chameleon==4.6.0 check-wheel-contents==0.6.3 cheroot==11.1.2 chz==0.4.0
ciscoconfparse==1.9.52 cleo==2.1.0 click-configfile==0.2.3 click-repl==0.4.1 click==8.5.1 clize==5.0.2
cloup==4.0.0 cmd2==4.3.1 colorama==0.4.6 colorful==0.5.8 colorlog==6.12.0 commentjson==0.9.0 compalgo==0.1.2
condense-json==1.1 confuse==2.3.0 construct==2.10.70 convertdate==2.5.1 cookiecutter==2.7.1
coverage-threshold==0.6.2 cpe==1.3.1 cron-descriptor==2.2.1 cron-validator==1.0.8 croniter==7.0.0
crossplane==0.5.8 cssutils==2.15.0 csv23==0.3.4 curtsies==0.4.3 dataclass-wizard==1.0.0 DataProperty==1.1.1
dateparser==1.5.0 dbutils==3.2.0 decopatch==1.4.10 deepdiff==9.1.0 deepmerge==4.0.0 dep-logic==0.7.2
dependency-groups==1.3.2 deprecat==2.1.3 diceware==1.0.1 dill==0.4.1 dirty-equals==0.11 dishka==1.10.1
diskcache==5.6.3 docstring-parser==0.18.0 docstring-to-markdown==0.17 docutils==0.23 dogpile-cache==1.5.0
doit==0.37.0 dominate==2.9.1 dpath==2.2.0 draccus==0.11.6 dynaconf==3.3.5 elementpath==5.1.4 emoji==2.16.0
enlighten==1.14.1 entrypoint2==1.1 essentials==1.1.9 excelrd==3.0.0 exceptiongroup==1.3.2 ezodf==0.3.2
factory-boy==3.3.3 Faker==40.63.0 fasteners==0.20 fastjsonschema==2.22.3 feedgen==1.0.0 filelock==4.3.1
filetype==1.2.0 fixtures==4.3.2 flake8-async==26.8.1 flake8-requirements==2.3.0 flaky==3.8.1 flasgger==0.9.7.1
flashtext==2.7 flask-cors==6.0.5 flask-httpauth==4.8.1 flask-jwt-extended==4.7.4 flask-marshmallow==1.5.0
flask-openapi3==4.3.2 flask-restful==0.3.10 flask-restx==1.3.2 flask-smorest==0.47.0 Flask-WTF==1.3.0
Flask==3.1.3 formencode==2.1.1 freezegun==1.5.5 fs==2.4.16 ftfy==6.3.1 ftputil==5.2.0 func-timeout==4.3.5
funcy==2.1 future==1.0.0 gast==0.7.0 genson==1.4.0 geojson==3.3.0 glom==25.12.0 graphql-query==1.4.0
graphtty==0.1.8 graphviz==0.21 graypy==2.1.0 gunicorn==27.0.1 h11==0.16.0 h2==4.4.1
hatch-fancy-pypi-readme==25.1.0 haversine==2.9.0 hijridate==2.6.0 hiyapyco==0.7.0 hjson==3.1.0 hl7==0.4.5
honcho==2.0.0 hpack==4.2.0 html-to-json==3.0.0 html5lib==1.1 htmltools==0.7.0 htpy==26.5.1 httpcore==1.0.9
httpretty==1.1.4 human-readable==2.0.3 humanize==4.17.0 Hypercorn==0.18.0 hyperlink==21.0.0 icalendar==7.3.2
icontract==2.7.3 idna==3.20 imagesize==2.0.1 importlab==0.8.1 importlib-metadata==10.2.0
importlib-resources==7.1.0 inflect==7.6.0 iniparse==0.5.3 inject==5.5.0 inline-snapshot==0.36.1
installer==1.1.0 interface-meta==2.0.1 interrogate==1.7.0 intervals==0.9.2 intervaltree==3.2.1 iopath==0.1.10
isodate==0.7.2 itsdangerous==2.2.0 javaobj-py3==0.6.1 javaproperties==0.8.2 jedi==0.20.1
jinja2-simple-tags==0.6.1 Jinja2==3.1.6 jiwer==4.0.0 jmespath==1.1.0 jproperties==2.1.2 jschon==0.11.1
json-ref-dict==0.7.2 jsonpath-ng==1.16.0 jsonpath-python==1.1.6 jsonpickle==4.1.4 jsonquerylang==2.1.0
jsonschema-pydantic-converter==0.4.1 jsonschema==4.26.0 jupyter-core==5.9.1 jurigged==0.6.1
keyrings-alt==5.0.2 kim-edn==1.6.0 langcodes==3.5.1 lark==1.3.1 leather==0.4.1 lkml==1.3.7 logutils==0.3.5
lunr==0.8.0 luqum==1.0.0 m3u8==6.0.0 magma-lang==3.0.2 mailbits==0.2.3 maison==2.0.2 makefun==1.16.0
Mako==1.4.3 mando==0.8.2 markdown-it-py==4.3.0 Markdown==3.11.3 marko==2.2.4 marshmallow-dataclass==8.7.1
marshmallow-jsonapi==0.24.0 marshmallow-jsonschema==0.16.0 marshmallow==4.4.0 mechanize==0.4.10
memory-profiler==0.61.0 mido==1.3.3 mimesis==22.2.0 mistletoe==1.6.0 mistune==3.4.0 mixer==7.2.2
mockito==2.0.4 model-index==0.1.11 mpmath==1.4.1 multipart==2.0.1 mutagen==1.48.1 nameparser==2.6.0
natsort==8.4.0 nbformat==5.11.1 nbstripout==0.9.1 nbval==0.11.0 netaddr==1.3.0 nose2==0.16.0 num2words==0.5.14
number-parser==0.3.2 nutree==1.2.0 oauthlib==4.0.1 objprint==0.3.0 openapi-schema-pydantic==1.2.4
opentracing==2.4.0 overrides==7.7.0 packageurl-python==0.17.6 packaging==26.4 parse-type==0.6.6 parse==1.22.4
parsel==1.12.1 parso==0.8.7 parver==1.0.1.post0 passlib==1.7.4 Paste==3.10.1 PasteDeploy==3.1.0
pathlib-abc==0.5.2 pathlib-mate==1.3.2 pathspec==1.1.1 pathvalidate==3.3.1 pdfrw2==0.5.0 pdfrw==0.4
pdoc==16.0.0 pep517==0.13.1 perky==0.10 petl==1.7.30 pexpect==4.9.0 pgzip==0.4.0
pip-requirements-parser==32.0.1 pkginfo==2.0 plaster-pastedeploy==1.0.1 platformdirs==4.14.9 pluginlib==0.11.0
plumbum==2.0.2 plux==1.16.0 portion==2.6.3 prettyprinter==0.18.0 prettytable==3.18.0 progressbar2==4.6.0
prometheus-flask-exporter==0.23.2 prompt_toolkit==3.0.53 proxy-protocol==0.11.3 pscript==0.8.1
ptyprocess==0.7.0 py-automapper==2.2.0 py-walk==0.3.3 pyasn1-modules==0.4.2 pyasn1==0.6.5 pybtex==0.26.1
pycasbin==2.8.0 pycep-parser==0.7.1 pycnite==2024.7.31 pycodestyle==2.15.0 pycparser==3.12 pydash==8.1.0
pydbml==1.2.1 pydifact==0.2.3 pydocstringformatter==1.0.0 pydot==4.0.1 pyelftools==0.33 pyexcel-io==0.6.8
pyexcel-xls==0.7.1 pyexcel-xlsx==0.6.1 pyexcel==0.7.6 pyfakefs==6.3.2 pyflakes==4.1.0 pyformance==0.4
pygal==3.1.3 pygelf==0.4.3 pygeoif==1.6.0 Pygments==2.21.0 pygnuutils==0.1.1 pygount==3.2.0 PyHamcrest==2.1.0
pyhocon==0.3.63 pyhumps==3.8.0 pyink==26.5.1 PyJWT==2.15.1 pykakasi==2.3.0 pykwalify==1.8.0 pylatex==1.4.2
pylatexenc==2.11 pyleak==0.2.0 pymdown-extensions==13.1.2 PyMeeus==0.5.12 pymorphy3==2.0.6 Pympler==1.1
pynmea2==1.19.0 pyparsing==3.3.3 pyperf==2.11.0 pypi-simple==1.8.0 pypinyin==0.55.0 pyramid==2.1
pyrepl==0.11.5 pyro5==5.17 pyrtf3==0.47.5 pyscaffold==4.6 pysen==0.12.1 pyserial==3.5 PySnooper==1.2.3
pystache==0.6.8 pytablewriter==1.2.1 pyte==0.8.2 pytest-asyncio==1.5.0 pytest-benchmark==5.3.1
pytest-cases==3.10.1 pytest-dependency==0.6.1 pytest-describe==3.2.0 pytest-examples==0.0.18
pytest-flask==1.3.0 pytest-order==1.5.0 pytest-profiling==1.8.1 pytest-random-order==1.2.0
pytest-regressions==2.11.0 pytest-shutil==1.8.1 pytest-socket==0.8.1 pytest-structlog==1.2
pytest-subprocess==1.6.0 pytest-watcher==0.6.3 pytest_httpserver==1.2.1 python-backoff==3.0.0
python-barcode==0.16.1 python-crontab==3.4.0 python-daemon==3.1.2 python-dateutil==4.0.0 python-dotenv==1.2.4
python-json-config==1.2.3 python-jsonschema-objects==0.5.7 python-pcapng==2.1.1 python-slugify==9.2.0
python-statemachine==3.2.2 python-stdnum==2.2 pytkdocs==0.16.5 pytoolconfig==1.3.1 pyunpack==0.3
pyventus==0.8.0 pyxb-x==1.2.6.4 pyxdg==0.28 qrcode==8.2 radon==6.0.1 rarfile==4.5 rdflib==7.6.0
readme-renderer==46.0 redbaron==0.9.2 redlines==0.6.2 referencing==0.37.0 requests-mock==1.12.1
requests-oauth2client==1.8.0 responses==0.26.3 rfc3986==2.0.0 rich-click==1.9.9 robotspy==0.13.0 Routes==2.5.1
rstcheck-core==1.3.2 rules==3.5 sanic-routing==23.12.0 scalecodec==1.2.12 scantree==0.0.4 schedula==1.6.15
segno==1.6.6 semantic-version==2.10.0 semver==3.1.2 Send2Trash==2.2.0 setoptconf-tmp==0.3.1
simple-parsing==0.1.9 simpleeval==1.0.8 simpy==4.1.2 snapshottest==0.6.0 soupsieve==4.1.3 sparklines==1.0.0
spdx-tools==0.8.5 sphinx-lint==1.0.2 sqids==0.5.2 sqlite-utils==4.2.1 sqlitedict==2.1.0 sqlparams==6.2.0
sqlparse==0.6.1 stamina==26.1.0 structlog==26.1.0 suds==1.2.0 super-collections==0.6.2 svcs==26.2.0
svgelements==1.9.6 svgwrite==1.1.9 sybil==10.1.0 syrupy==7.0.2 tabledata==1.3.5 tableschema==1.21.0
tabulate==0.10.0 tap-py==3.2.1 tblib==3.2.2 tenacity==9.2.1 testfixtures==12.4.0 testresources==2.1.2
testtools==2.9.1 textile==4.0.4 textstat==0.7.13 throttled-py==3.5.0 throttler==1.2.3 tinydb==4.9.0
tomlkit==0.15.2 toolz==1.2.0 towncrier==26.9.0 traitlets==5.16.1 transitions==0.9.3 Twiggy==0.5.1
typed-argument-parser==1.12.0 typedload==2.41 typeguard==4.6.1 typepy==2.0.0 typer==0.29.2 ua-parser==1.0.2
ubiquerg==0.9.3 uncertainties==3.2.3 uncompyle6==3.9.3 url-normalize==3.1.0 userpath==1.9.2 validators==0.36.0
varname==1.0.0 versioningit==3.3.0 vulture==2.16 w3lib==2.5.0 wait-for2==0.4.1 waitress==3.0.2 wcmatch==12.0.3
webargs==8.7.1 webassets==3.0.0 WebOb==1.8.11 websocket-client==1.9.2 WebTest==3.0.7 webvtt-py==0.6.0
Werkzeug==3.1.9 wheel==0.48.0 Whoosh==2.7.4 workalendar==17.0.0 ws4py==0.6.0 wsproto==1.3.2 WTForms==3.3.2
x-wr-timezone==2.0.1 xdoctest==1.3.2 xlsx2html==0.6.4 xlwt==1.3.0 xmlschema==4.3.2 yamlfix==1.19.1
yamllint==1.38.0 yaspin==3.5.1 yorm==1.6.2
""".split())
INDEX = "https://pypi.org/pypi"


def unnamed(specs, files):
    """The specs whose project name none of files mentions (as a word; '-', '_' and '.' alike, any case)."""
    fold = lambda text: re.sub(r"[-_.]+", "-", text.lower())
    try:
        text = fold(" ".join(Path(f).read_text(errors="replace") for f in files))
    except OSError as e:
        raise TaskError(f"--exclude: cannot read {e.filename}: {e.strerror}") from None
    named = lambda name: re.search(rf"(?<![\w-]){re.escape(fold(name))}(?![\w-])", text)
    return [s for s in specs if not named(s.partition("==")[0])]


def fetch_sdist(spec, dest):
    """Download name==version's sdist from the package index into dest, checked against its SHA-256, and
    unpack it (nothing outside dest, no links out, no special files): the unpacked folder."""
    name, _, version = spec.partition("==")
    if not name or not version:
        raise TaskError(f"package spec {spec!r} is not name==version")
    try:
        with urllib.request.urlopen(f"{INDEX}/{name}/json", timeout=60) as r:
            urls = json.load(r)["releases"][version]
    except (OSError, ValueError, KeyError) as e:
        raise TaskError(f"{spec}: the package index has no such release ({e})") from None
    sdist = next((u for u in urls if u.get("packagetype") == "sdist"), None)
    if sdist is None:
        raise TaskError(f"{spec}: the release has no sdist (only wheels, which ship no tests)")
    archive = Path(dest, sdist["filename"])
    with urllib.request.urlopen(urllib.parse.urljoin(f"{INDEX}/{name}/json", sdist["url"]), timeout=300) as r:
        archive.write_bytes(r.read())
    if hashlib.sha256(archive.read_bytes()).hexdigest() != sdist["digests"]["sha256"]:
        raise TaskError(f"{spec}: {archive.name} does not match the index's SHA-256")
    src = Path(dest, "src")
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for m in z.infolist():
                if not m.is_dir() and ".." not in Path(m.filename).parts and not m.filename.startswith("/"):
                    Path(src, m.filename).parent.mkdir(parents=True, exist_ok=True)
                    Path(src, m.filename).write_bytes(z.read(m))
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(src, filter="data")
    tops = list(src.iterdir())
    return tops[0] if len(tops) == 1 and tops[0].is_dir() else src


def valid_tasks(row):
    return sum(g == 1 and u == 0 for g, u in zip(row["gold"], row["untouched"]))


def survey_line(r):
    valid = valid_tasks(r)
    num = (lambda x, f: "-" if x is None else f % x)
    score = lambda x: "-" if x is None else f"{100 * x:.0f}"
    killed = " ".join(f"{score(a)}/{score(b)}" for a, b in r.get("strength", [])) or "-"
    return (f"{r['package']:<32} {num(r['tests'], '%6d'):>6} {num(r['env_s'], '%5.0f'):>5} "
            f"{num(r['make_s'], '%6.0f'):>6} {r['made']:>2}/{r['tried'] or 0:<2} {valid:>5} "
            f"{''.join(map(str, r['gold'])) or '-':>4} {''.join(map(str, r['untouched'])) or '-':>4} "
            f"{num(r['executed'], '%7d'):>7} {killed:>23} {r.get('served', 0):>6}  {r['why']}")


def package_dir(spec):
    """A package's folder in a survey's output: name-version, or a local repository's folder name."""
    return Path(spec).resolve().name if Path(spec).is_dir() else spec.replace("==", "-")


def record_of(root, spec):
    """Where a package's record is: root/NAME/row.json."""
    return Path(root, package_dir(spec), "row.json")


def write_whole(path, data):
    """JSON written to a temporary file and renamed over path: a reader (a restart, merge) sees the old
    file or the new, never half of one."""
    temp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.{threading.get_ident()}")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


TRIES = 2  # runs of a package a survey starts; a package no run of which wrote its record is failed


def survey(specs, root, command, rank=0, world=1, jobs=2, timeout=None, log=print):
    """This rank's share of specs (every world-th from its rank: the same split on every rank, from the list
    and the world size), each package in a process of its own (command(spec) -> its argv, which writes the
    package's record root/NAME/row.json), up to jobs at once, killed with what it started past timeout
    seconds. A package whose record is on disk is not run again (a restart goes on from the records); one
    whose runs ended TRIES times without a record (killed, out of memory, past its time, or the run around
    it killed) gets a record saying so. Prints a row as each finishes; -> this rank's rows."""
    Path(root, ".tries").mkdir(parents=True, exist_ok=True)

    def one(spec):
        record, tries = record_of(root, spec), Path(root, ".tries", package_dir(spec))
        why = "no record"
        while not record.is_file():
            done = int(tries.read_text()) if tries.is_file() else 0
            if done >= TRIES:
                Path(record.parent).mkdir(parents=True, exist_ok=True)
                write_whole(record, blank_row(spec, f"failed {TRIES} times: {why}"))
                break
            write_whole(tries, done + 1)  # before the run: a run the whole process dies in counts too
            why = run_whole(command(spec), timeout)
            if STOPPING.is_set():  # the process was stopped (SIGTERM, as torchrun stops the other ranks
                write_whole(tries, done)  # when one dies): no try of the package's
                raise TaskError("stopped by a signal")
        return json.loads(record.read_text())

    log(HEAD)
    rows = []
    with stoppable(jobs) as pool:
        for fut in concurrent.futures.as_completed([pool.submit(one, spec) for spec in specs[rank::world]]):
            rows.append(fut.result())
            log(survey_line(rows[-1]))
    return rows


def blank_row(spec, why=""):
    """A package's row before anything of it is made (survey_one fills it in)."""
    return {"package": spec, "tests": None, "env_s": None, "make_s": None, "made": 0, "tried": 0, "gold": [],
            "untouched": [], "executed": None, "strength": [], "served": 0, "tasks": [], "why": why}


HEAD = (f"{'package':<32} {'tests':>6} {'env s':>5} {'make s':>6} made  valid gold untc   execs "
        f"{'% killed: tests/+oracle':>23} served  why")


def die_with_parent():
    """This process is killed when the one that started it dies (Linux's PR_SET_PDEATHSIG): a package's run
    never outlives the survey process running it, which a restart replaces with one that runs it again."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before that took hold
        os._exit(1)


def run_whole(argv, timeout):
    """argv in a session of its own, killed whole past timeout seconds; SIGTERM's stop() kills it too. ->
    why it ended, in words."""
    with RUNS:
        if STOPPING.is_set():
            raise TaskError("stopped by a signal")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True, text=True, errors="replace")
        LIVE.add(p)
    try:
        _, err = p.communicate(timeout=timeout)
        return f"exit status {p.returncode}: {(err.strip().splitlines() or [''])[-1][:200]}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return f"past the package's {timeout} s"
    finally:
        LIVE.discard(p)


def index(rows, root, n=3, log=print):
    """Every package's outcome in one index, root/survey.json (sorted by package: the same whatever the split
    that made it), each task's strength and serving verdict in its row; prints the table and the summary."""
    rows = sorted(rows, key=lambda r: r["package"])
    good = sum(valid_tasks(r) >= n for r in rows)
    log("\n" + "\n".join([HEAD, *map(survey_line, rows)]))
    log(f"{good} of {len(rows)} packages gave {n} valid tasks (gold 1, untouched 0)")
    scores = [x for r in rows for x in r["strength"] if None not in x]
    if scores:
        both, alone = (100 * statistics.median(x[i] for x in scores) for i in (1, 0))
        served, made = (sum(r[k] for r in rows) for k in ("served", "made"))
        log(f"mutants killed on the median task: {both:.0f}% by tests and oracle, {alone:.0f}% by the tests "
            f"alone; {served} of {made} tasks made are served")
    seconds = collections.Counter()
    for r in rows:
        seconds.update(r.get("seconds", {}))
    total, made = sum(v for k, v in seconds.items() if k != "oracle"), sum(r["made"] for r in rows)
    if total:  # the oracle's time is part of the tries'
        log(f"{made} tasks in {total / 3600:.2f} hours of package processes ({3600 * made / total:.1f} an "
            "hour of one): " + ", ".join(f"{k} {100 * seconds[k] / total:.0f}%" for k in PHASES if seconds[k])
            + (f" (the oracle {100 * seconds['oracle'] / total:.0f}%)" if seconds["oracle"] else ""))
    write_whole(Path(root, "survey.json"), rows)
    return rows


PHASES = ("env", "trace", "tries", "strength", "verify")  # a package's time, in order (tasks.py's clocked)


def merge(root, log=print):
    """The index from the records of a survey run in shards (--shard K/N, each writing root/shards/K-of-N.json
    with its packages when it is through): the same index as one run's. -> (its rows, --n). TaskError naming
    a shard not through or a package without its record."""
    shards = sorted(Path(root, "shards").glob("*-of-*.json")) if Path(root, "shards").is_dir() else []
    if not shards:
        raise TaskError(f"{root}: no shard records (shards/K-of-N.json): run tasks.py survey --shard K/N")
    parts = [json.loads(f.read_text()) for f in shards]
    world = parts[0]["world"]
    missing = sorted(set(range(world)) - {p["rank"] for p in parts if p["world"] == world})
    if missing or any(p["world"] != world for p in parts):
        raise TaskError(f"{root}: shards {', '.join(f'{k}/{world}' for k in missing) or 'of other counts'} "
                        "have not written their records")
    rows = []
    for spec in (s for p in parts for s in p["specs"]):
        record = record_of(root, spec)
        if not record.is_file():
            raise TaskError(f"{root}: {spec} has no record ({record})")
        rows.append(json.loads(record.read_text()))
    return index(rows, root, parts[0]["n"], log), parts[0]["n"]
