"""Sessions for the Shampoo monorepo; `nox -l` lists them with their docstrings.

Every install goes through the pinned ``constraints.txt``, and the member
packages are installed editable, so a session tests the working tree. Heavy
frameworks (torch, jax) are pinned there too, but only sessions that need
them install them.
"""

from __future__ import annotations

import os

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests"]

CONSTRAINTS = ("-c", "constraints.txt")
#: Installable members, in dependency order; the
#: framework implementations join when their folders exist.
MEMBERS = tuple(
    member
    for member in ("spec", "reference", "datasets", "torch_impl", "jax_impl", "conformance")
    if os.path.isdir(member)
)
#: Frameworks each implementation needs (pinned in constraints.txt).
FRAMEWORKS = {"torch_impl": ("torch",), "jax_impl": ("jax[cpu]", "optax")}
#: The conformance property suite, run against every installed backend.
SUITE = "conformance/src/shampoo_conformance/suite"
#: Trainers and checkpointers that drive our optimizers in the tests
#: (torch_impl/tests/test_trainers.py, jax_impl/tests/test_restore_check.py) and in
#: docs/integrations.md's examples (pinned in constraints.txt with their dependencies).
TRAINERS = ("lightning", "accelerate", "flax", "orbax-checkpoint")
#: The house rules (tests/), member tests, the documentation's runnable examples, the suite.
TEST_DIRS = ("tests", *(f"{member}/tests" for member in MEMBERS), "docs/tests", SUITE)
#: Options every pytest run gets: no .pytest_cache (a read-only checkout works).
PYTEST_OPTIONS = ("-p", "no:cacheprovider")
#: The CI sessions also list their slowest tests, to keep the run within its budget.
SLOWEST = ("--durations=20", "--durations-min=10")
#: Whole runs spread their tests over one worker per core (pytest-xdist, at most 4). Over
#: many files a file stays on one worker, so its module fixtures and compiled programs
#: serve all of its tests; a run of one or two large files (the suite on one backend, an
#: anchors file) spreads their tests. A run with args (``nox -s tests -- -k roots``) stays
#: in one process.
WORKERS = ("-n", "auto", "--maxprocesses=4")
PARALLEL = (*WORKERS, "--dist", "loadfile")
PARALLEL_TESTS = (*WORKERS, "--dist", "load")


def install_members(session: nox.Session, *extra: str) -> None:
    """Install the member packages editable plus ``extra``, all under the constraints."""
    editable = [arg for member in MEMBERS for arg in ("-e", member)]
    frameworks = [pkg for member in MEMBERS for pkg in FRAMEWORKS.get(member, ())]
    session.install(*CONSTRAINTS, *frameworks, *editable, *extra)


def blas_env() -> dict[str, str]:
    """``OPENBLAS_NUM_THREADS=1`` unless set: jaxlib 0.10.2's CPU eigh can deadlock
    against scipy's threaded OpenBLAS (docs/results.md)."""
    return {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}


def hypothesis_env(default_profile: str) -> dict[str, str]:
    """Environment selecting a Hypothesis profile (``HYPOTHESIS_PROFILE`` overrides it).

    One BLAS thread as in :func:`blas_env`.
    """
    return {
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", default_profile),
        "PYTHONDONTWRITEBYTECODE": "1",
        **blas_env(),
    }


#: Faster XLA CPU compiles for test runs (programs here are tiny; compile time
#: dominates). Set only where unset; the numerics are checked under it.
JAX_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


@nox.session
def tests(session: nox.Session) -> None:
    """Run every member's tests and the conformance suite on every installed backend (CI).

    Hypothesis profile "ci". Compiled backends (jax) skip the random-config
    properties here, since each example compiles a new program; they run
    in the ``conformance`` sessions. Args go to pytest (and replace the default paths).
    """
    install_members(session, "pytest", "pytest-xdist", "hypothesis", "scikit-learn", "matplotlib",
                    *TRAINERS)
    env = hypothesis_env("ci")
    if session.posargs:
        session.run("pytest", *PYTEST_OPTIONS, *session.posargs, env=env)
        return
    # torch-ddp: two gloo worker processes, started once and reused by the suite.
    eager = ["reference"] + (["torch", "torch-ddp"] if "torch_impl" in MEMBERS else [])
    session.run(
        "pytest", *PYTEST_OPTIONS, *PARALLEL, *SLOWEST, *TEST_DIRS,
        *(f"--backend={b}" for b in eager),
        env=env
    )
    if "torch_impl" in MEMBERS:
        # The branches a CUDA device takes, on this CPU (shampoo_torch.device_path): the
        # torch tests and the suite on torch and torch-ddp again, on the accelerator path
        # (but the compiled step's tests, which take that path themselves either way, and
        # the trainers' and torch's checkpoint path's, whose save / load calls are the same
        # on either path; test_optimizer_state checks the state dict on both).
        session.run(
            "pytest", *PYTEST_OPTIONS, *PARALLEL, *SLOWEST, "torch_impl/tests", SUITE,
            "--ignore=torch_impl/tests/test_compiled_step.py",
            "--ignore=torch_impl/tests/test_trainers.py",
            "--ignore=torch_impl/tests/test_torch_checkpoint_path.py",
            "--backend=torch", "--backend=torch-ddp",
            env={**env, "SHAMPOO_TORCH_PATH": "accelerator"},
        )
    if "jax_impl" in MEMBERS:
        session.run(
            "pytest", *PYTEST_OPTIONS, *PARALLEL_TESTS, *SLOWEST, SUITE, "--backend=jax",
            "--backend=jax-sharded",
            "-m", "not random_configs",
            env={**env, "XLA_FLAGS": os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)},
        )


@nox.session
def wheels(session: nox.Session) -> None:
    """Every member as a package: its wheel installs and imports alone (CI, tests/test_wheels.py).

    Per member: ``python -m build`` makes the sdist and the wheel from it (the
    sdist holds the sources, the wheel ``py.typed``); the wheel, with the wheels
    of the members it declares, goes into a fresh virtual environment where
    everything else comes from the registry under constraints.txt; there every
    module imports, the version is pyproject's, ``pip check`` passes, and a few
    lines use it (a config, a reference run, one torch and one jax step). Reuses
    pip's cache. Args go to pytest (e.g. ``-k spec``).
    """
    session.install(*CONSTRAINTS, "build", "pytest")
    env = {"SHAMPOO_WHEELS": "1", **blas_env(),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)}
    # --noconftest: the root conftest.py needs the members, which this session does not install.
    # --basetemp: the fresh environments stay in the session's folder until its next run.
    basetemp = os.path.join(session.create_tmp(), "pytest")
    session.run("pytest", *PYTEST_OPTIONS, "--noconftest", "-v", "--durations=12",
                f"--basetemp={basetemp}", "tests/test_wheels.py", *session.posargs, env=env)


#: The backends of the property suite, one ``conformance`` session each.
SUITE_BACKENDS = ("reference", "torch", "torch-ddp", "torch-fsdp2", "jax", "jax-sharded")


@nox.session
@nox.parametrize("backend", SUITE_BACKENDS)
def conformance(session: nox.Session, backend: str) -> None:
    """The whole conformance suite on one backend, Hypothesis profile "deep".

    ``nox -s "conformance(backend='torch')"``; ``nox -s conformance`` runs
    every backend. ``HYPOTHESIS_PROFILE=ci`` makes it quick. Args go to pytest.
    """
    install_members(session, "pytest", "pytest-xdist", "hypothesis", "scikit-learn")
    env = hypothesis_env("deep")
    if backend.startswith("jax"):
        env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)
    session.run(
        "pytest", *PYTEST_OPTIONS, SUITE, f"--backend={backend}", *session.posargs, env=env,
    )


#: The fuzzer's tests (docs/reliability.md); ``tests`` runs them with the ci profile.
FUZZ_TESTS = "conformance/tests/test_fuzz.py"


@nox.session
def fuzz(session: nox.Session) -> None:
    """The fuzzer on every installed backend, Hypothesis profile "fuzz" (docs/reliability.md).

    Hostile configs, importer arguments, shapes and gradient streams against
    the invariants (a)-(f), at least 10,000 cases per backend; the cases run
    per invariant are printed at the end and written to ``fuzz-counts.json``
    (``SHAMPOO_FUZZ_COUNTS`` overrides the path). ``HYPOTHESIS_PROFILE=ci``
    makes it quick. Args go to pytest (e.g. ``-k torch -x``).
    """
    install_members(session, "pytest", "pytest-xdist", "hypothesis")
    env = hypothesis_env("fuzz")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)
    env["SHAMPOO_FUZZ_COUNTS"] = os.environ.get("SHAMPOO_FUZZ_COUNTS", "fuzz-counts.json")
    session.run("pytest", *PYTEST_OPTIONS, FUZZ_TESTS, *session.posargs, env=env)


#: Source snapshots of the anchor libraries (test fixtures beside the project,
#: never its dependencies): file, pip flags, the extra packages it imports.
THIRDPARTY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared",
                          "thirdparty")
ANCHOR_LIBRARIES = {
    # torch-shampoo declares python >= 3.12 but runs on 3.11; its only dependency is torch.
    "meta": ("torch-shampoo-f606606.tar.gz", ("--ignore-requires-python",), ()),
    # Google's distributed_shampoo imports flax.struct, chex and their small helpers;
    # --no-deps keeps flax's checkpointing stack (orbax, tensorstore) out.
    "google": ("precondition-239a8cd.tar.gz", (), (
        "chex==0.1.92", "flax==0.12.8", "toolz==1.2.0", "msgpack==1.2.4", "rich==15.0.0",
        "pyyaml", "typing-extensions",
    )),
}


#: Third-party Shampoos on the package registry, with the dependencies our members do
#: not bring (pinned in constraints.txt; torch and numpy come with our members).
REGISTRY_LIBRARIES = {"pytorch-optimizer": ("pytorch-optimizer",),
                      "heavyball": ("heavyball", "opt-einsum"),
                      # Google's 2022 code: it imports what Google's does, and absl.
                      "optax-shampoo": ("optax-shampoo", "absl-py",
                                        *ANCHOR_LIBRARIES["google"][2]),
                      "sirfshampoo": ("sirfshampoo", "singd", "einconv", "einops"),
                      # Spectral descent shipped inside the frameworks themselves
                      # (torch.optim.Muon, optax.contrib.muon): nothing more to install.
                      "torch-optim": (),
                      "optax-contrib": ()}
#: Every library a third-party conformance backend runs.
LIBRARIES = (*ANCHOR_LIBRARIES, *REGISTRY_LIBRARIES)
#: The conformance backends of each library (shampoo_conformance/thirdparty/registry.py).
LIBRARY_BACKENDS = {
    # Google's package ships distributed_shampoo and precondition.tearfree.
    "google": ("google", "tearfree"),
    "pytorch-optimizer": ("pytorch-optimizer", "pytorch-optimizer-shampoo",
                          "pytorch-optimizer-soap"),
    "heavyball": ("heavyball-soap", "heavyball-klshampoo", "heavyball-klsoap", "heavyball-muon"),
    "torch-optim": ("torch-muon",),
    "optax-contrib": ("optax-muon",),
}
#: The adapter tests of each library (default: conformance/tests/test_adapter_<library>.py).
ADAPTER_TESTS = {
    "google": ("conformance/tests/test_adapter_google.py",
               "conformance/tests/test_adapter_tearfree.py"),
    "pytorch-optimizer": ("conformance/tests/test_adapter_pytorch_optimizer.py",
                          "conformance/tests/test_adapter_soap.py"),
    "heavyball": ("conformance/tests/test_adapter_soap.py",
                  "conformance/tests/test_adapter_heavyball_kl.py",
                  "conformance/tests/test_adapter_muon.py"),
    "torch-optim": ("conformance/tests/test_adapter_muon.py",),
    "optax-contrib": ("conformance/tests/test_adapter_muon.py",),
}


def install_snapshot(session: nox.Session, library: str) -> bool:
    """Install ``library``: from the registry, or from its snapshot in
    ../shared/thirdparty (False where that is absent)."""
    if library in REGISTRY_LIBRARIES:
        if REGISTRY_LIBRARIES[library]:
            session.install(*CONSTRAINTS, "--no-deps", *REGISTRY_LIBRARIES[library])
        return True
    tarball, flags, extra = ANCHOR_LIBRARIES[library]
    path = os.path.normpath(os.path.join(THIRDPARTY, tarball))
    if not os.path.exists(path):
        return False
    session.install(*CONSTRAINTS, "--no-deps", *flags, path, *extra)
    return True


def install_library(session: nox.Session, library: str) -> None:
    """Our members and the real ``library`` from its snapshot in ../shared/thirdparty
    (the session skips, naming the file and the backend's install command, where the
    snapshot is absent)."""
    install_members(session, "pytest", "pytest-xdist", "hypothesis", "scikit-learn")
    if not install_snapshot(session, library):
        session.skip(f"{ANCHOR_LIBRARIES[library][0]} not found in {THIRDPARTY}: this session "
                     "needs the library's snapshot (shampoo_conformance/thirdparty/registry.py has "
                     "the install command)")


def run_anchors(session: nox.Session, library: str) -> None:
    """The anchors tests of Meta's or Google's library (installed)."""
    env = hypothesis_env("ci")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)
    session.run("pytest", *PYTEST_OPTIONS, *PARALLEL_TESTS, f"anchors/test_{library}_library.py",
                *session.posargs, env=env)


def run_anchors_tearfree(session: nox.Session) -> None:
    """The anchors tests of Google's ``precondition.tearfree`` (installed)."""
    env = hypothesis_env("ci")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)
    session.run("pytest", *PYTEST_OPTIONS, *PARALLEL_TESTS, "anchors/test_tearfree_library.py",
                *session.posargs, env=env)


def run_thirdparty(session: nox.Session, *libraries: str) -> None:
    """The backends' own contract tests (they skip without their library), then the suite
    on each of their backends (``libraries`` installed), in one pytest run."""
    env = hypothesis_env("deep")
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS)
    adapter_tests = {test: None for library in libraries for test in ADAPTER_TESTS.get(
        library, (f"conformance/tests/test_adapter_{library.replace('-', '_')}.py",))}
    backends = [f"--backend={name}" for library in libraries
                for name in LIBRARY_BACKENDS.get(library, (library,))]
    session.run("pytest", *PYTEST_OPTIONS, *PARALLEL_TESTS, *adapter_tests,
                # docs/third-party.md lists each installed backend's DEVIATIONS, name and kind.
                "conformance/tests/test_third_party_docs.py",
                SUITE, *backends, "-rxX", *session.posargs, env=env)


@nox.session
@nox.parametrize("library", tuple(ANCHOR_LIBRARIES))
def anchors(session: nox.Session, library: str) -> None:
    """Meta's or Google's real library against ours on the digits MLP (anchors/).

    Every inventory row of docs/migrating.md with numerical effect, from the
    same kwargs through our importer, 50 steps in float64, <= 1e-8 relative.
    Installs the library from ../shared/thirdparty (skips, naming the file,
    where it is absent). ``nox -s "anchors(library='meta')"``; args go to pytest.
    Beyond the named cases, seeded pairs and triples of their options
    (anchors/combinations.py): a few in CI, ``ANCHORS_DRAWS=200`` for the deep
    profile (``ANCHORS_SEED``: the first seed; docs/migrating.md).
    """
    install_library(session, library)
    run_anchors(session, library)


@nox.session
def anchors_tearfree(session: nox.Session) -> None:
    """Google's ``precondition.tearfree`` against ``from_tearfree`` + shampoo_jax (anchors/).

    Tearfree runs with each stack's eigh one matrix per call (jaxlib's batched
    CPU eigh deadlocks tearfree's program on 2 cores;
    ``shampoo_conformance.thirdparty.tearfree.sequential_eigh``, bitwise the same
    numbers). Installs Google's library as ``anchors`` does; args go to pytest.
    """
    install_library(session, "google")
    run_anchors_tearfree(session)


@nox.session
@nox.parametrize("library", LIBRARIES)
def thirdparty(session: nox.Session, library: str) -> None:
    """The conformance suite on a real third-party library (docs/third-party.md).

    Configs the library cannot express are skipped with the reason; its
    documented deviations are expected failures, each still demonstrated;
    anything else that fails is an undocumented deviation and fails the
    session. Hypothesis profile "deep" (``HYPOTHESIS_PROFILE=ci``: the short
    run CI makes). ``nox -s "thirdparty(library='meta')"``; args go to pytest.
    """
    install_library(session, library)
    run_thirdparty(session, library)


@nox.session
def libraries(session: nox.Session) -> None:
    """CI: the anchors, anchors_tearfree and thirdparty runs in one environment.

    One install of every library instead of one per session (the same tests,
    the thirdparty ones in one pytest run; a library whose snapshot is absent is
    named and left out). ``HYPOTHESIS_PROFILE=ci`` makes the thirdparty runs short.
    """
    install_members(session, "pytest", "pytest-xdist", "hypothesis", "scikit-learn")
    present = [library for library in LIBRARIES if install_snapshot(session, library)]
    for library in LIBRARIES:
        if library not in present:
            session.log(f"{library}: {ANCHOR_LIBRARIES[library][0]} not found in "
                        f"{THIRDPARTY}; its anchors and thirdparty runs are left out")
    for library in ANCHOR_LIBRARIES:
        if library in present:
            run_anchors(session, library)
    if "google" in present:
        run_anchors_tearfree(session)
    run_thirdparty(session, *present)  # one run: the workers start once


@nox.session
def compare(session: nox.Session) -> None:
    """The report over every Shampoo a user could pick: ours and each installable library.

    Installs Meta's and Google's libraries from ../shared/thirdparty (those
    absent are reported as not installed, with their install command) and
    the others from the registry, and writes shampoo-compare/ (table, Markdown,
    plots, the libraries' console output in library-output.log). Each library's
    verdict at its own defaults comes first, then at the config nearest the
    report's. By default the ``--compare`` size (three problems, 15 minutes on
    2 cores); ``--full`` runs every problem. Args go to
    ``python -m shampoo_conformance report`` (e.g. ``--full``, ``--problems``).
    """
    install_members(session, "scikit-learn", "matplotlib")
    libraries = [name for name in LIBRARIES if install_snapshot(session, name)]
    backends = [b for name in libraries for b in LIBRARY_BACKENDS.get(name, (name,))]
    # The 15-minute comparison unless another size is asked for (--full, --quick).
    size = [] if {"--full", "--quick"} & set(session.posargs) else ["--compare"]
    session.run(
        "python", "-m", "shampoo_conformance", "report", "--out", "shampoo-compare",
        *size, "--backends", "reference", "torch", "jax", *backends, *session.posargs,
        env=blas_env(),
    )


@nox.session
def mutation(session: nox.Session) -> None:
    """Run the suite against every mutant of the reference; print the kill rate."""
    install_members(session, "pytest", "pytest-xdist", "hypothesis")
    session.run("python", "-m", "shampoo_conformance", "mutants", env=hypothesis_env("ci"))


@nox.session
def scaling(session: nox.Session) -> None:
    """Block plan and owners on Llama-2 7B/70B shapes at 8-4096 ranks (docs/scaling.md).

    Per-rank root work, step work, factor memory and optimizer bytes per step
    of DDP, fully_shard lossless, local shard and HSDP; writes a CSV, a markdown
    table and a plot to ``shampoo-scaling/`` (``--out DIR``). Pure shapes: no
    device, about a minute. Args go to ``python -m shampoo_conformance scaling``.
    """
    # Shapes only: the spec and conformance's own dependencies, no torch or jax.
    members = [arg for m in ("spec", "reference", "datasets", "conformance") for arg in ("-e", m)]
    session.install(*CONSTRAINTS, *members, "matplotlib")
    session.run("python", "-m", "shampoo_conformance", "scaling", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The backend report on its embedded default: table, Markdown and PNGs in shampoo-report/."""
    install_members(session, "scikit-learn", "matplotlib")
    session.run(
        "python", "-m", "shampoo_conformance", "demo", "--out", "shampoo-report",
        *session.posargs, env=blas_env(),
    )


@nox.session
def convergence(session: nox.Session) -> None:
    """Convergence benchmark: Shampoo vs tuned AdamW on every problem, 5 seeds (report --full)."""
    install_members(session, "scikit-learn", "matplotlib")
    session.run(
        "python", "-m", "shampoo_conformance", "report", "--full", "--out", "convergence-report",
        *session.posargs, env=blas_env(),
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks that print ratios measured side by side (docs/results.md). Args go to each."""
    install_members(session)
    if "torch_impl" in MEMBERS:
        session.run("python", "-m", "shampoo_conformance.bench.torch_step", *session.posargs)
        session.run("python", "-m", "shampoo_conformance.bench.torch_variants", *session.posargs)
        session.run("python", "-m", "shampoo_conformance.bench.torch_distributed", *session.posargs)
    if "jax_impl" in MEMBERS:
        session.run("python", "-m", "shampoo_conformance.bench.jax_step", *session.posargs)
        session.run("python", "-m", "shampoo_conformance.bench.jax_sharded", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The prepared check for a lent GPU: agreement with the reference on the device,
    launches and host syncs per step, step times beside Meta's and AdamW
    (``shampoo_conformance.bench.gpu``). Runs in the current Python, whose torch has
    CUDA (the pinned CPU torch would not), with the members from this tree; without a
    GPU, a dry run on the CPU's accelerator path. Args go to the script (``--quick``)."""
    members = os.pathsep.join(os.path.abspath(os.path.join(m, "src")) for m in MEMBERS)
    session.run("python", "-m", "shampoo_conformance.bench.gpu", *session.posargs,
                env={"PYTHONPATH": members, **blas_env()}, external=True)


@nox.session
def bench_anchors(session: nox.Session) -> None:
    """Ours, Meta's / Google's library and AdamW side by side, one process per framework.

    Installs Meta's and Google's libraries from ../shared/thirdparty (a side
    runs without the one that is absent, naming its install command) and
    prints step time, p99, optimizer time, efficiency, memory and compile
    ratios; then per-rank FSDP2 state and step time at 1, 2 and 4 gloo ranks,
    ours and Meta's fully_shard distributors (docs/results.md). Args go to
    ``python -m shampoo_conformance.bench.anchors`` (and skip the FSDP2 part).
    """
    install_members(session)
    for library in ANCHOR_LIBRARIES:
        if not install_snapshot(session, library):
            session.log(f"{ANCHOR_LIBRARIES[library][0]} not found in {THIRDPARTY}: "
                        f"the benchmark runs without {library}")
    session.run("python", "-m", "shampoo_conformance.bench.anchors", *session.posargs,
                env=blas_env())
    if not session.posargs:  # FSDP2 per rank at 1, 2, 4 gloo ranks, ours and Meta's
        session.run("python", "-m", "shampoo_conformance.bench.fsdp2", env=blas_env())


@nox.session
def bench_scale(session: nox.Session) -> None:
    """Shampoo's cost against AdamW at block sizes 256-2048 and widths 512-4096 (torch).

    A fresh process per (width, block, optimizer): amortized step time, root
    step, state and peak RSS, and a plot (docs/results.md); about 10 minutes on
    2 cores. Args go to ``python -m shampoo_conformance.bench.scale`` (e.g.
    ``-- --optimizers ours meta adamw`` adds Meta's, installed from
    ../shared/thirdparty).
    """
    install_members(session, "matplotlib")
    if "meta" in session.posargs and not install_snapshot(session, "meta"):
        session.error(f"{ANCHOR_LIBRARIES['meta'][0]} not found in {THIRDPARTY}")
    args = session.posargs or ["--plot", os.path.join("docs", "img", "scale_torch.png")]
    session.run("python", "-m", "shampoo_conformance.bench.scale", *args, env=blas_env())


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with mkdocs, strict (broken links fail). Args go to mkdocs.

    The site's code examples run in ``docs/tests`` (part of ``tests``).
    """
    session.install(*CONSTRAINTS, "mkdocs", "mkdocs-material")
    site = os.path.join(session.create_tmp(), "site")
    session.run(
        "mkdocs", "build", "--strict", "--site-dir", site, *session.posargs,
        # mkdocs-material 9.8 prints an end-of-life banner unless this is set.
        env={"NO_MKDOCS_2_WARNING": "1"},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Lint the whole tree with ruff (config in the root pyproject.toml). Args go to ruff."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", *(session.posargs or ["."]))


@nox.session
def typecheck(session: nox.Session) -> None:
    """Type-check every member's sources with mypy (root pyproject.toml). Args go to mypy.

    The frameworks are installed so that their own type information is used.
    """
    install_members(session, "mypy", "pytest", "hypothesis", "scikit-learn", "matplotlib")
    sources = [f"{member}/src" for member in MEMBERS]
    session.run("mypy", *(session.posargs or sources))
