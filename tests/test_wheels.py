"""Every member as an installable package (``nox -s wheels``; skipped elsewhere).

For each member (a folder with a ``pyproject.toml``):

- ``python -m build`` makes its sdist and then its wheel from that sdist, from a
  copy of the folder alone (nothing outside it may be needed);
- the sdist holds ``pyproject.toml``, the README and every file under ``src/``,
  and the wheel every file of the package, ``py.typed`` included;
- the wheel goes into a fresh virtual environment (no pip, no setuptools, no
  system site packages) together with the wheels of the members it declares,
  built the same way; everything else comes from the registry through
  ``pip install -c constraints.txt``, so only declared dependencies are there;
- in that environment every module of the package imports (a module of
  ``conformance`` may only miss what its extras or the third-party libraries
  bring), ``py.typed`` is installed, the version is the one in
  ``pyproject.toml``, ``pip check`` passes, and a few lines use the package for
  real (a config, a reference run, a problem's gradient, one optimizer step).

Set ``SHAMPOO_WHEELS=1`` to run it; a fresh environment with torch or jax takes
a while, so ``nox -s tests`` skips it. The environments (about 2.5 GB in all) stay
in pytest's temporary folder, which ``nox -s wheels`` puts in ``.nox/wheels/tmp``
and empties at its next run: deleting them on a busy disk costs as much as making
them.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("SHAMPOO_WHEELS"),
    reason="builds and installs every member in fresh environments: nox -s wheels",
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
#: The members, in dependency order (each one has a check in USE below).
MEMBERS = ("spec", "reference", "datasets", "torch_impl", "jax_impl", "conformance")
#: Left out of the copy that is built: caches and earlier builds of the working tree.
IGNORED = ("__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis")
#: Top-level modules a submodule of a member may miss in its bare environment: its
#: extras' packages and the third-party libraries that its adapters wrap.
OPTIONAL_IMPORTS = {
    "conformance": ("torch", "jax", "optax", "shampoo_torch", "shampoo_jax", "matplotlib",
                    "distributed_shampoo", "precondition", "pytorch_optimizer", "heavyball"),
}

#: Runs in the fresh environment: argv[1] is JSON with the package, its
#: distribution name, version and the imports it may miss.
CHECK = """
import importlib, importlib.metadata, importlib.resources, json, pkgutil, sys
args = json.loads(sys.argv[1])
package = importlib.import_module(args["package"])
assert package.__file__.startswith(sys.prefix), (package.__file__, sys.prefix)
assert importlib.resources.files(package).joinpath("py.typed").is_file(), "py.typed"
version = importlib.metadata.version(args["dist"])
assert version == args["version"], (version, args["version"])
missing = []
def walk(pkg):
    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        if info.name.endswith(".__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in args["optional"]:
                raise
            missing.append(f"{info.name} ({error.name})")
            continue
        if info.ispkg:
            walk(module)
walk(package)
print(f"{args['package']} {version}: every module imports")
for name in missing:
    print(f"  left out (an extra's import): {name}")
"""

#: What each member's check does with it, beyond importing it.
USE = {
    "spec": """
from shampoo_spec import GraftingConfig, ShampooConfig, from_meta, plan_parameter
config = ShampooConfig(learning_rate=0.1, grafting=GraftingConfig(type="adagrad"))
assert ShampooConfig.from_dict(config.to_dict()) == config
assert from_meta({"lr": 0.1}).learning_rate == 0.1
plan_parameter((8, 3), config)
""",
    "reference": """
import numpy as np
from shampoo_spec import ShampooConfig
from shampoo_reference import run
rng = np.random.default_rng(0)
grads = [{"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)} for _ in range(2)]
steps = run(ShampooConfig(learning_rate=0.1), {"w": np.zeros((4, 3)), "b": np.zeros(3)}, grads)
assert len(steps) == 2 and np.isfinite(steps[-1]["w"]).all() and steps[-1]["w"].any()
""",
    "datasets": """
from shampoo_datasets import load_problem
problem = load_problem("digits_softmax")  # scikit-learn's bundled digits
params = problem.copy_init_params()
grads = problem.grad(params)
assert set(grads) == set(params) and problem.loss(params) > 0
""",
    "torch_impl": """
import torch
from shampoo_spec import ShampooConfig
from shampoo_torch import Shampoo
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
before = model.weight.detach().clone()
opt = Shampoo(model.parameters(), ShampooConfig(learning_rate=0.01))
model(torch.randn(16, 8)).square().mean().backward()
opt.step()
assert not torch.equal(before, model.weight) and torch.isfinite(model.weight).all()
""",
    "jax_impl": """
import jax.numpy as jnp
import optax
from shampoo_spec import ShampooConfig
from shampoo_jax import shampoo
params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
grads = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
tx = shampoo(ShampooConfig(learning_rate=0.1))
updates, state = tx.update(grads, tx.init(params), params)
params = optax.apply_updates(params, updates)
assert bool(jnp.isfinite(params["w"]).all()) and bool((params["w"] != 0).any())
""",
    "conformance": """
import numpy as np
from shampoo_spec import ShampooConfig
from shampoo_conformance import available_backends, get_backend
assert "reference" in available_backends()
grads = [{"w": np.ones((4, 3))}, {"w": -np.ones((4, 3))}]
steps = get_backend("reference").run(ShampooConfig(learning_rate=0.1), {"w": np.zeros((4, 3))},
                                     grads)
assert len(steps) == 2 and steps[-1]["w"].any()
""",
}


def project(member: str) -> dict:
    """The ``[project]`` table of the member's pyproject.toml."""
    with open(ROOT / member / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


#: Distribution name -> member folder.
BY_NAME = {project(member)["name"]: member for member in MEMBERS}


def package_name(member: str) -> str:
    """The member's one import package (``src/<package>``)."""
    (package,) = [p.name for p in (ROOT / member / "src").iterdir() if (p / "__init__.py").exists()]
    return package


def sibling_closure(member: str) -> list[str]:
    """The member and every member it declares, directly or not (dependencies first)."""
    seen: list[str] = []

    def visit(m: str) -> None:
        for requirement in project(m).get("dependencies", []):
            name = requirement.split(";")[0].split("[")[0]
            for op in "<>=!~ ":
                name = name.split(op)[0]
            if name in BY_NAME and BY_NAME[name] not in seen:
                visit(BY_NAME[name])
        if m not in seen:
            seen.append(m)

    visit(member)
    return seen


def source_files(member: str) -> list[str]:
    """Every file under the member's src/ (caches and build outputs aside), relative."""
    base = ROOT / member
    skip = ("__pycache__", ".egg-info")
    return sorted(
        str(p.relative_to(base)) for p in (base / "src").rglob("*")
        if p.is_file() and not any(part.endswith(skip) for part in p.parts)
    )


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``command``; fail the test with its output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode:
        pytest.fail(f"{' '.join(map(str, command))}\n{done.stdout}\n{done.stderr}", pytrace=False)
    return done


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this tree's PYTHONPATH or an active virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)  # also pins setuptools for build isolation
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """``built(member)``: (sdist, wheel) of the member, built once per run."""
    work = tmp_path_factory.mktemp("wheels")
    cache: dict[str, tuple[pathlib.Path, pathlib.Path]] = {}

    def build(member: str) -> tuple[pathlib.Path, pathlib.Path]:
        if member not in cache:
            copy = work / "src" / member
            shutil.copytree(ROOT / member, copy, ignore=shutil.ignore_patterns(*IGNORED))
            out = work / "dist" / member
            # Default build: the sdist, then the wheel from the unpacked sdist.
            run([sys.executable, "-m", "build", "--outdir", str(out), str(copy)],
                env=clean_env())
            (sdist,) = out.glob("*.tar.gz")
            (wheel,) = out.glob("*.whl")
            cache[member] = sdist, wheel
        return cache[member]

    return build


def test_every_member_is_checked() -> None:
    """A new member (a folder with a pyproject.toml) joins MEMBERS and USE."""
    found = {p.parent.name for p in ROOT.glob("*/pyproject.toml")}
    assert found == set(MEMBERS) == set(USE)


@pytest.mark.parametrize("member", MEMBERS)
def test_sdist_and_wheel_contents(member: str, built) -> None:
    """The sdist holds the sources and the metadata files; the wheel built from it, the package."""
    sdist, wheel = built(member)
    meta = project(member)
    with tarfile.open(sdist) as tar:
        prefix = tar.getnames()[0].split("/")[0]
        in_sdist = {name.removeprefix(prefix + "/") for name in tar.getnames()}
    wanted = {"pyproject.toml", "PKG-INFO", *source_files(member)}
    if "readme" in meta:
        wanted.add(meta["readme"])
    assert not wanted - in_sdist, f"missing from {sdist.name}: {sorted(wanted - in_sdist)}"
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        metadata = whl.read(f"{prefix}.dist-info/METADATA").decode()
    package_files = {f.removeprefix("src/") for f in source_files(member)}
    assert not package_files - in_wheel, f"missing from {wheel.name}: {package_files - in_wheel}"
    assert f"{package_name(member)}/py.typed" in in_wheel
    assert f"Version: {meta['version']}" in metadata
    assert "Description-Content-Type: text/markdown" in metadata, "no README as description"


@pytest.mark.parametrize("member", MEMBERS)
def test_wheel_installs_and_imports_alone(member: str, built, tmp_path: pathlib.Path) -> None:
    """Fresh environment, only the member's declared dependencies: it imports and works."""
    wheels = [str(built(m)[1]) for m in sibling_closure(member)]
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    env = clean_env()
    # pip from this environment installs into the fresh one (which has no pip of its own);
    # pip's cache is reused, the members' wheels are the files just built.
    pip = [sys.executable, "-m", "pip", "--python", python]
    run([*pip, "install", "--quiet", "-c", str(CONSTRAINTS), *wheels], env=env)
    run([*pip, "check"], env=env)
    meta = project(member)
    args = {"package": package_name(member), "dist": meta["name"], "version": meta["version"],
            "optional": OPTIONAL_IMPORTS.get(member, ())}
    # -I: isolated (no PYTHONPATH, no user site, not this folder on sys.path).
    done = run([python, "-I", "-c", CHECK + USE[member], json.dumps(args)], env=env,
               cwd=tmp_path)
    print(done.stdout)
