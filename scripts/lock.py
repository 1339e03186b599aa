"""The project's locks, made and checked in one place (`make lock`, `make lock-check`).

    python3 scripts/lock.py write [PACKAGE ... | all]   refresh every lock (upgrading PACKAGEs)
    python3 scripts/lock.py check                       exit 1, with one line, if a lock is stale

`uv.lock` is uv's universal lock of pyproject.toml: the runtime and every extra. The others:

- deploy/image/requirements{,-storage}.txt: exported from uv.lock for the image's pip.
- deploy/image/build-requirements.txt: what builds modelyard's wheel (pyproject's
  [build-system]); the image and every uv install here build with it (UV_BUILD_CONSTRAINT).
- tests/fixtures/bounds/{lowest,newest}.txt: the runtime alone, at the lower bound of every
  requirement (uv's lowest-direct) and at the newest versions the ranges admit; `make test-bounds`.
- tests/fixtures/mlserver/requirements.txt: MLServer's own venv in the tests (it pins numpy,
  fastapi and protobuf of its own: it cannot share an environment with modelyard[dev]).

The compiled ones are universal (every Python this project supports) and start with a line
naming a hash of what they were made from, so `check` needs no network for them: a lock is stale
when its inputs changed. uv.lock's own check is `uv lock --check`.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = os.environ.get("UV", "uv")  # the Makefile passes the uv it pins
PYPROJECT = ROOT / "pyproject.toml"
IMAGE = ROOT / "deploy" / "image"
BUILD = IMAGE / "build-requirements.txt"
BOUNDS = ROOT / "tests" / "fixtures" / "bounds"
MLSERVER = ROOT / "tests" / "fixtures" / "mlserver"
# The oldest Python the project supports: compiled locks are universal from it on.
PYTHON = "3.11"
INPUTS = re.compile(r"^# inputs: sha256:([0-9a-f]{64})$", re.MULTILINE)


class Stale(Exception):
    """A lock no longer matches what it is made from."""


def uv(*args: str, capture: bool = False) -> str:
    done = subprocess.run([UV, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"uv {args[0]} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout if capture else ""


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def locked_versions() -> dict[str, str]:
    """Every package's version in uv.lock (a package locked at two versions: the first)."""
    versions: dict[str, str] = {}
    for package in tomllib.loads((ROOT / "uv.lock").read_text())["package"]:
        versions.setdefault(package["name"], package.get("version", ""))
    return versions


# --- the compiled locks: what each is made from, and how --------------------------------------


def build_inputs() -> tuple[str, list[str]]:
    requires = project()["build-system"]["requires"]
    return digest(*requires), requires


def bounds_inputs() -> tuple[str, list[str]]:
    """The runtime (`-e .`: pyproject's dependencies) and the test runner, at uv.lock's versions."""
    data = project()
    tools = [line.split("#")[0].strip() for line in (BOUNDS / "requirements.in").read_text().splitlines()]
    tools = [name for name in tools if name and name != "-e ."]
    versions = locked_versions()
    missing = [name for name in tools if name not in versions]
    if missing:
        raise RuntimeError(f"tests/fixtures/bounds/requirements.in: {', '.join(missing)} not in uv.lock")
    pins = [f"{name}=={versions[name]}" for name in tools]
    inputs = digest(*data["project"]["dependencies"], data["project"]["requires-python"], *pins)
    return inputs, ["-e .", *pins]


def mlserver_inputs() -> tuple[str, list[str]]:
    text = (MLSERVER / "requirements.in").read_text()
    return digest(text), [line for line in text.splitlines() if line and not line.startswith("#")]


def compile_lock(
    path: Path, inputs: str, requirements: list[str], *flags: str, constraints: list[str] = ()
) -> None:
    """`uv pip compile` of `requirements` into `path`, keeping the pins already there (uv prefers
    them) unless `flags` upgrade, behind the line naming the inputs' hash."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "requirements.in"
        source.write_text("\n".join(requirements) + "\n")
        if constraints:
            (Path(folder) / "constraints.txt").write_text("\n".join(constraints) + "\n")
            flags = (*flags, "--constraint", str(Path(folder) / "constraints.txt"))
        out = Path(folder) / "lock.txt"
        if path.exists():
            out.write_text(path.read_text())
        uv(
            "pip", "compile", "-q", "--universal", "--python-version", PYTHON, "--generate-hashes",
            "--no-header", *flags, str(source), "-o", str(out),
        )  # fmt: skip
        body = out.read_text().replace(str(source), "requirements")
    how = f"{path.relative_to(ROOT)}: made by `make lock` (scripts/lock.py); edit what it is made from"
    path.write_text(f"# inputs: sha256:{inputs}\n# {how}\n{body}")


def lower_bounds() -> dict[str, str]:
    """Each runtime requirement's `>=` bound, by normalised name."""
    bounds = {}
    for requirement in project()["project"]["dependencies"]:
        found = re.match(r"\s*([A-Za-z0-9_.-]+)[^;]*?>=\s*([0-9][^,;\s]*)", requirement)
        if found:
            bounds[re.sub(r"[-_.]+", "-", found.group(1)).lower()] = found.group(2)
    return bounds


def release(version: str) -> tuple[int, ...]:
    """"2.10" and "2.10.0" alike (enough for the plain release numbers of these bounds)."""
    numbers = [int(part) for part in re.findall(r"\d+", version.split("+")[0])]
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def pinned(path: Path) -> dict[str, set[str]]:
    """The versions a compiled lock pins, by name (a universal lock may pin two, by marker)."""
    pins: dict[str, set[str]] = {}
    for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)", path.read_text(), re.MULTILINE):
        pins.setdefault(re.sub(r"[-_.]+", "-", name).lower(), set()).add(version)
    return pins


def lowest_is_at_the_bounds() -> list[str]:
    """Where tests/fixtures/bounds/lowest.txt is not at pyproject's lower bounds. uv may pick a
    later release when the bound itself has no file for some Python (then the bound should move)."""
    pins = pinned(BOUNDS / "lowest.txt")
    return [
        f"{name} {bound} (lowest.txt has {', '.join(sorted(pins.get(name, {'none'})))})"
        for name, bound in lower_bounds().items()
        if {release(pin) for pin in pins.get(name, set())} != {release(bound)}
    ]


def at_the_bounds() -> list[str]:
    """Constraints holding every runtime requirement at its lower bound: lowest-direct alone lets a
    transitive requirement's newest release raise one (googleapis-common-protos, protobuf)."""
    return [f"{name}=={bound}" for name, bound in lower_bounds().items()]


# Each compiled lock: what makes its inputs, uv's extra flags for it, and what it is made from.
COMPILED = {
    BUILD: (build_inputs, (), "pyproject.toml's [build-system]"),
    BOUNDS / "lowest.txt": (bounds_inputs, ("--resolution", "lowest-direct"), "pyproject.toml"),
    BOUNDS / "newest.txt": (bounds_inputs, (), "pyproject.toml"),
    MLSERVER / "requirements.txt": (mlserver_inputs, (), "tests/fixtures/mlserver/requirements.in"),
}


def exports() -> dict[Path, str]:
    header = "# Exported from uv.lock by `make lock`: the image's pip installs exactly these.\n"
    base = ("export", "-q", "--frozen", "--no-dev", "--no-emit-project", "--no-header")
    return {
        IMAGE / "requirements.txt": header + uv(*base, capture=True),
        IMAGE / "requirements-storage.txt": header + uv(*base, "--extra", "storage", capture=True),
    }


# --- the commands -------------------------------------------------------------------------------


def write(upgrade: list[str]) -> None:
    flags: list[str] = []
    if upgrade == ["all"]:
        flags = ["--upgrade"]
    else:
        for name in upgrade:
            flags += ["--upgrade-package", name]
    subprocess.run([UV, "lock", *flags], cwd=ROOT, check=True)
    for path, text in exports().items():
        path.write_text(text)
    for path, (inputs, how, _source) in COMPILED.items():
        digest_, requirements = inputs()
        bounds = at_the_bounds() if path == BOUNDS / "lowest.txt" else []
        if bounds and path.exists() and lowest_is_at_the_bounds():
            path.unlink()  # a bound moved: the old pins must not hold it where it was
        compile_lock(path, digest_, requirements, *how, *flags, constraints=bounds)


def check() -> None:
    checked = subprocess.run([UV, "lock", "--check", "-q"], cwd=ROOT, capture_output=True, text=True)
    if checked.returncode != 0:
        if "needs to be updated" in checked.stderr:
            raise Stale("uv.lock is out of date with pyproject.toml")
        raise RuntimeError(f"could not check uv.lock: {checked.stderr.strip()}")
    for path, text in exports().items():
        if not path.exists() or path.read_text() != text:
            raise Stale(f"{path.relative_to(ROOT)} is out of date with uv.lock")
    for path, (inputs, _how, source) in COMPILED.items():
        made_from = INPUTS.search(path.read_text()) if path.exists() else None
        if made_from is None or made_from.group(1) != inputs()[0]:
            raise Stale(f"{path.relative_to(ROOT)} is out of date with {source}")
    if off := lowest_is_at_the_bounds():
        raise Stale(f"tests/fixtures/bounds/lowest.txt is not at pyproject.toml's lower bounds ({off[0]})")


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["write"]:
            write(argv[1:])
        elif argv == ["check"]:
            check()
        else:
            print(__doc__.split("\n\n")[1], file=sys.stderr)
            return 2
    except Stale as stale:
        print(f"{stale}: run make lock", file=sys.stderr)
        return 1
    except RuntimeError as failed:
        print(failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
