"""The container images, checked statically (no Docker engine here): multi-stage builds on
pinned base images, a non-root user, no build tools (but the GPU worker's C compiler for
Triton) or HEALTHCHECK in the final stages, COPY sources that exist, entrypoints that are real
modules, vLLM and CUDA in the worker only, every package pinned by the lock (the GPU worker's
by lock-gpu.txt, hash-checked), and dependency layers before the code."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT
from tests.unit.test_locks import make_dry_run
from tokenmesh.localmesh.relay_module import FLAGS, RELAY_LIBRARY, RELAY_SOURCE

DOCKER = ROOT / "docker"
# The final stage(s) of each Dockerfile, i.e. the images `make images` builds.
FINAL_STAGES = {
    "gateway": ["final"],
    "reranker": ["final"],
    "controlplane": ["final"],
    "worker": ["gpu", "cpu"],
    "envoy": ["final"],
}
# The images of the Python services (pip, the lock, the project); the Envoy image has none.
PYTHON_IMAGES = sorted(set(FINAL_STAGES) - {"envoy"})
# The Envoy image's entrypoint: the official image's binary (not its entrypoint script).
ENVOY_ENTRYPOINT = ["/usr/local/bin/envoy"]
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|clang|make|cmake|build-essential|git|[\w.+-]+-dev)\b")
# Build tools a final stage needs at run time: Triton compiles its kernels' C launchers when
# they are first used (a C compiler, libc's and Python's headers), on the GPU worker only.
RUNTIME_COMPILER = {("worker", "gpu"): {"gcc", "libc6-dev", "python3.12-dev"}}
# The oldest pip known to check hashes from a constraints file and to refuse a package it does
# not name (26.3 does; 24.0, Ubuntu 24.04's, takes none and fails).
PIP_WITH_HASHED_CONSTRAINTS = (26, 3)
LOCK = "requirements/lock-cpu.txt"
GPU_LOCK = "requirements/lock-gpu.txt"
# The lock each build stage installs under (the CPU one unless named here).
STAGE_LOCKS = {("worker", "build-gpu"): GPU_LOCK}
# What a build stage may have copied when it installs the dependencies: not the code.
DEPENDENCY_INPUTS = {"pyproject.toml", LOCK, GPU_LOCK, "docker/requirements.py"}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    result = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, args = current.partition(" ")
        result.append((keyword.upper(), args.strip()))
        current = ""
    return result


def stages(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages (unnamed ones are called "final")."""
    args: dict[str, str] = {}
    found: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else "final"
            found.append(Stage(name, base))
        elif not found and keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif found:
            found[-1].instructions.append((keyword, rest))
    return args, found


def dockerfiles() -> list[str]:
    return sorted(path.name.removesuffix(".Dockerfile") for path in DOCKER.glob("*.Dockerfile"))


def test_one_dockerfile_per_service() -> None:
    assert dockerfiles() == sorted(FINAL_STAGES)


@pytest.mark.parametrize("image", sorted(FINAL_STAGES))
def test_multi_stage_on_pinned_base_images(image: str) -> None:
    _, found = stages(DOCKER / f"{image}.Dockerfile")
    assert len(found) >= 2, "build and runtime stages"
    names = {stage.name for stage in found}
    for stage in found:
        if stage.base in names:
            continue
        _, _, tag = stage.base.partition(":")
        # An exact version (digits and dots, at least major.minor) in the tag, or a digest.
        assert "@sha256:" in stage.base or re.search(r"\d+\.\d+", tag), stage.base
        assert tag and tag != "latest", stage.base


@pytest.mark.parametrize("image", sorted(FINAL_STAGES))
def test_final_stages_run_a_real_module_as_non_root_without_build_tools(image: str) -> None:
    _, found = stages(DOCKER / f"{image}.Dockerfile")
    by_name = {stage.name: stage for stage in found}
    for name in FINAL_STAGES[image]:
        stage = by_name[name]
        users = stage.all("USER")
        assert users, f"{image}:{name} sets no USER"
        user = users[-1].split(":")[0]
        assert user not in {"root", "0"}
        entrypoint = json.loads(stage.all("ENTRYPOINT")[-1])
        if image == "envoy":
            assert entrypoint == ENVOY_ENTRYPOINT
        else:
            assert entrypoint[:2] == ["python", "-m"]
            module = entrypoint[2]
            assert module == f"tokenmesh.{image}"
            assert (ROOT / "services" / Path(*module.split(".")) / "__main__.py").is_file()
        allowed = RUNTIME_COMPILER.get((image, name), set())
        for command in stage.all("RUN"):
            installs = " ".join(re.findall(r"apt-get install([^&;]*)", command))
            packages = [word for word in installs.split() if word not in allowed]
            assert not BUILD_TOOLS.search(" ".join(packages)), f"{image}:{name}: {installs}"
            assert "pip install" not in command, "packages are installed in the build stage"
    text = (DOCKER / f"{image}.Dockerfile").read_text()
    assert not any(kw == "HEALTHCHECK" for kw, _ in instructions(text)), "Kubernetes probes"


@pytest.mark.parametrize("image", sorted(FINAL_STAGES))
def test_copy_sources_exist(image: str) -> None:
    _, found = stages(DOCKER / f"{image}.Dockerfile")
    earlier: set[str] = set()
    ignored = (ROOT / ".dockerignore").read_text().split()
    for stage in found:
        for args in stage.all("COPY"):
            words = shlex.split(args)
            options = [w for w in words if w.startswith("--")]
            sources = [w for w in words if not w.startswith("--")][:-1]
            source_stage = next((o.split("=", 1)[1] for o in options if o.startswith("--from")), "")
            if source_stage:
                assert source_stage in earlier, f"{image}: COPY --from={source_stage}"
                continue
            for source in sources:
                assert (ROOT / source).exists(), f"{image}: COPY {source}"
                assert source.split("/")[0] not in ignored, f"{image}: {source} is dockerignored"
        earlier.add(stage.name)


@pytest.mark.parametrize("image", ["gateway", "reranker", "controlplane", "envoy"])
def test_only_the_worker_gets_vllm_or_cuda(image: str) -> None:
    _, found = stages(DOCKER / f"{image}.Dockerfile")
    for stage in found:
        assert not re.search(r"vllm|cuda|nvidia", stage.base, re.I)
        for _, args in stage.instructions:
            assert not re.search(r"vllm|cuda|nvidia|worker-", args, re.I), args


def test_worker_gpu_image_is_cuda_with_pypi_vllm_and_the_cpu_image_is_not() -> None:
    _, found = stages(DOCKER / "worker.Dockerfile")
    by_name = {stage.name: stage for stage in found}
    assert by_name["gpu"].base.startswith("nvidia/cuda:")
    assert by_name["build-gpu"].base == by_name["gpu"].base
    gpu_install = " ".join(by_name["build-gpu"].all("RUN"))
    assert "docker/requirements.py worker-gpu " in gpu_install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["worker-gpu"] == ["vllm==0.32.0"]
    assert not by_name["cpu"].base.startswith("nvidia/")
    assert "docker/requirements.py worker-cpu " in " ".join(by_name["build-cpu"].all("RUN"))
    # The default target (the last stage) is the GPU image.
    assert found[-1].name == "gpu"


def test_make_images_builds_every_dockerfile() -> None:
    stdout = make_dry_run("images", "IMAGE_TAG=9.9.9")
    for image in ("gateway", "reranker", "controlplane", "envoy"):
        assert re.search(rf"for image in [\w ]*\b{image}\b", stdout), image
    assert "--target gpu -t ghcr.io/tokenmesh/worker:9.9.9 ." in stdout
    assert "--target cpu -t ghcr.io/tokenmesh/worker:9.9.9-cpu ." in stdout


def test_the_build_context_leaves_out_the_venv_and_models() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "models", ".git", ".run"} <= set(ignored)


def apt_installs(stage: Stage) -> set[str]:
    words = " ".join(re.findall(r"apt-get install([^&;]*)", " ".join(stage.all("RUN")))).split()
    return {word for word in words if not word.startswith("-")}


def test_the_gpu_worker_image_keeps_a_c_compiler_for_triton() -> None:
    _, found = stages(DOCKER / "worker.Dockerfile")
    gpu = {stage.name: stage for stage in found}["gpu"]
    assert RUNTIME_COMPILER[("worker", "gpu")] <= apt_installs(gpu)
    # The compiler's Python headers are the interpreter's own.
    assert "python3.12" in apt_installs(gpu)
    assert json.loads(gpu.all("ENTRYPOINT")[-1])[0] == "python"


def pip_installs(stage: Stage) -> list[str]:
    """Each `pip install` command of the stage's RUN instructions."""
    return [
        part.strip()
        for command in stage.all("RUN")
        for part in command.split("&&")
        if "pip install" in part
    ]


def constraint_files(command: str) -> list[str]:
    return option_values(command, "-c", "--constraint")


def requirement_files(command: str) -> list[str]:
    return option_values(command, "-r", "--requirement")


def option_values(command: str, short: str, long: str) -> list[str]:
    words = shlex.split(command)
    return [
        words[i + 1] if word in (short, long) else word.split("=", 1)[1]
        for i, word in enumerate(words)
        if word in (short, long) or word.startswith(f"{long}=")
    ]


def is_project_install(command: str) -> bool:
    words = shlex.split(command)
    return "--no-deps" in words and words[-1] == "."


def made_from(stage: Stage, path: str, lock: str) -> str | None:
    """The shell command of the stage's RUN instructions that writes path from the lock."""
    parts = [part.strip() for run in stage.all("RUN") for part in run.split("&&")]
    return next((part for part in parts if lock in part and f"> {path}" in part), None)


@pytest.mark.parametrize("image", PYTHON_IMAGES)
def test_every_package_is_pinned_by_the_lock(image: str) -> None:
    """Dependencies are installed under the stage's lock as constraints (or a file the same RUN
    makes from it), or --no-deps from a file made from the lock; the project itself with
    --no-deps. Nothing is resolved unpinned."""
    _, found = stages(DOCKER / f"{image}.Dockerfile")
    installs = 0
    for stage in found:
        lock = STAGE_LOCKS.get((image, stage.name), LOCK)
        for command in pip_installs(stage):
            installs += 1
            words = shlex.split(command)
            if is_project_install(command):
                continue
            assert not any(word.startswith(".") for word in words), "the code: --no-deps"
            if "--no-deps" in words:
                files = requirement_files(command)
                assert files, f"{image}:{stage.name}: --no-deps with no file: {command}"
                for path in files:
                    assert made_from(stage, path, lock), f"{image}:{stage.name}: {path}"
                continue
            files = constraint_files(command)
            assert files, f"{image}:{stage.name}: unconstrained: {command}"
            for path in files:
                assert path == lock or made_from(stage, path, lock), f"{image}:{stage.name}: {path}"
    assert installs


def build_gpu() -> Stage:
    _, found = stages(DOCKER / "worker.Dockerfile")
    return {stage.name: stage for stage in found}["build-gpu"]


def run_in_repo(command: str) -> list[str]:
    """The output lines of a command of the Dockerfile (a `... > file`), run in the repository."""
    words = shlex.split(command)
    words = words[: words.index(">")] if ">" in words else words
    result = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def test_the_gpu_worker_installs_only_what_the_gpu_lock_pins_and_hashes() -> None:
    """Every install of the GPU build that resolves dependencies is constrained by lock-gpu.txt
    alone, wheels only, by the lock's own pip (hash-checked from its lines of the lock), which
    takes the constraints' hashes and refuses any package the lock does not name."""
    stage = build_gpu()
    installs = [command for command in pip_installs(stage) if not is_project_install(command)]
    bootstrap, *resolving = installs
    assert resolving, "the dependencies are installed"
    for command in resolving:
        assert constraint_files(command) == [GPU_LOCK], command
        assert "--only-binary :all:" in command, "a source build would fetch its tools unpinned"
        assert "--no-deps" not in shlex.split(command)
    # The first install is pip itself, exactly the lock's pip with the lock's hashes.
    assert "--no-deps" in shlex.split(bootstrap)
    (pip_file,) = requirement_files(bootstrap)
    sed = made_from(stage, pip_file, GPU_LOCK)
    assert sed
    lines = run_in_repo(sed)
    lock = (ROOT / GPU_LOCK).read_text().splitlines()
    start = next(i for i, line in enumerate(lock) if line.startswith("pip=="))
    assert lines == lock[start : start + len(lines)]
    assert lines[0].startswith("pip==") and not lines[-1].endswith("\\")
    assert all(line.strip().startswith("--hash=sha256:") for line in lines[1:])
    version = tuple(int(part) for part in lines[0].split("==")[1].split()[0].split(".")[:2])
    assert version >= PIP_WITH_HASHED_CONSTRAINTS


def test_the_gpu_worker_extras_are_in_the_gpu_lock() -> None:
    """The extras the GPU build installs are among those `make lock-gpu` resolves."""
    runs = " ".join(build_gpu().all("RUN"))
    extras = re.findall(r"docker/requirements\.py ([\w -]+?) >", runs)
    assert extras
    stdout = make_dry_run("lock-gpu", "LOCK_GPU_VENV=/nonexistent")
    locked = set(re.findall(r"--extra (\S+)", stdout))
    assert set(" ".join(extras).split()) <= locked, locked


@pytest.mark.parametrize("image", PYTHON_IMAGES)
def test_dependencies_are_installed_before_the_code_is_copied(image: str) -> None:
    """A code change reuses the dependency layers: each build stage copies pyproject.toml and
    the lock, installs the dependencies, and only then copies services/ (installed --no-deps)."""
    _, found = stages(DOCKER / f"{image}.Dockerfile")
    built = 0
    for stage in found:
        copied: set[str] = set()
        code_copied = False
        for keyword, args in stage.instructions:
            if keyword == "COPY" and not args.startswith("--from"):
                sources = shlex.split(args)[:-1]
                code_copied = code_copied or "services" in sources
                copied.update(sources)
            if keyword != "RUN" or "pip install" not in args:
                continue
            for command in (part for part in args.split("&&") if "pip install" in part):
                if is_project_install(command):
                    assert code_copied, f"{image}:{stage.name}: the project before its code"
                    built += 1
                else:
                    assert not code_copied, f"{image}:{stage.name}: dependencies after the code"
                    assert copied <= DEPENDENCY_INPUTS, f"{image}:{stage.name}: {copied}"
    assert built == len(FINAL_STAGES[image]), "one project install per image"


def test_the_requirements_script_lists_pyproject_dependencies_and_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for path in DOCKER.glob("*.Dockerfile"):
        for extras in re.findall(r"docker/requirements\.py ([\w -]+?) >", path.read_text()):
            result = subprocess.run(
                [sys.executable, "docker/requirements.py", *extras.split()],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
            wanted = list(project["dependencies"])
            for extra in extras.split():
                wanted += project["optional-dependencies"][extra]
            assert result.stdout.split() == wanted, path.name


def stage_env(stage: Stage) -> dict[str, str]:
    """The variables the stage's ENV instructions set (KEY=value forms)."""
    pairs = (word.split("=", 1) for args in stage.all("ENV") for word in shlex.split(args))
    return {key: value for key, value in pairs}


def vllm_variables() -> str:
    """vLLM's own table of environment variables (vllm/envs.py), read, not imported."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return (Path(spec.origin).parent / "envs.py").read_text()


def test_the_gpu_worker_leaves_cudas_forward_compatibility_to_the_node() -> None:
    """The compatibility libraries of the base image are kept (the build fails without them)
    and never registered for every node: not with ldconfig, ld.so.conf.d or LD_LIBRARY_PATH,
    which would load them on drivers newer than they are (CUDA error 803). vLLM loads them when
    VLLM_ENABLE_CUDA_COMPATIBILITY=1, from the path the image sets."""
    _, found = stages(DOCKER / "worker.Dockerfile")
    by_name = {stage.name: stage for stage in found}
    gpu = by_name["gpu"]
    assert "test -e /usr/local/cuda/compat/libcuda.so.1" in gpu.all("RUN")[0]
    for stage in (by_name["build-gpu"], gpu):
        for command in stage.all("RUN"):
            assert "ldconfig" not in command and "ld.so.conf" not in command, command
        assert "compat" not in stage_env(stage).get("LD_LIBRARY_PATH", "")
    assert stage_env(gpu)["VLLM_CUDA_COMPATIBILITY_PATH"] == "/usr/local/cuda/compat"
    assert "VLLM_ENABLE_CUDA_COMPATIBILITY" not in stage_env(gpu), "a node's choice"
    variables = vllm_variables()
    assert '"VLLM_ENABLE_CUDA_COMPATIBILITY"' in variables
    assert '"VLLM_CUDA_COMPATIBILITY_PATH"' in variables


def test_the_gpu_worker_turns_flashinfers_jit_sampler_off() -> None:
    """FlashInfer's sampler compiles with nvcc and CUDA's headers at first use; the runtime
    image has neither, so vLLM's Triton sampler runs instead."""
    _, found = stages(DOCKER / "worker.Dockerfile")
    gpu = {stage.name: stage for stage in found}["gpu"]
    assert stage_env(gpu)["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert '"VLLM_USE_FLASHINFER_SAMPLER"' in vllm_variables()
    assert gpu.base.split(":")[1].split("-")[1] == "runtime", gpu.base
    assert not {word for word in apt_installs(gpu) if "nvcc" in word or "toolkit" in word}


@pytest.mark.parametrize("cuda_version", ["lock", "12.9.1"])
def test_the_gpu_build_refuses_a_base_image_of_another_cuda_major(cuda_version: str) -> None:
    """The default CUDA_IMAGE is the lock's CUDA major; the build-gpu check passes it and fails
    a CUDA 12 base (CUDA_IMAGE=nvidia/cuda:12.9.1-...)."""
    args, _ = stages(DOCKER / "worker.Dockerfile")
    script = next(run for run in build_gpu().all("RUN") if "nvidia-cuda-runtime" in run)
    default = args["CUDA_IMAGE"].split(":")[1].split("-")[0]
    version = default if cuda_version == "lock" else cuda_version
    result = subprocess.run(
        ["sh", "-c", script],
        cwd=ROOT,
        env={"CUDA_VERSION": version, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode == 0) == (cuda_version == "lock"), result.stderr


def test_the_envoy_image_is_the_charts_envoy_with_the_relay_built_as_localmesh_builds_it() -> None:
    """The relay's module, compiled with localmesh's flags from every C file of envoy/relay, in
    the directory the image's ENVOY_DYNAMIC_MODULES_SEARCH_PATH names, on the official image
    of the Envoy version the chart runs by default (the module's ABI follows it)."""
    args, found = stages(DOCKER / "envoy.Dockerfile")
    by_name = {stage.name: stage for stage in found}
    build = " ".join(by_name["build"].all("RUN"))
    compile_command = re.search(r"gcc (-[^&;]*)", build)
    assert compile_command, build
    words = compile_command.group(1).split()
    assert words[: len(FLAGS)] == FLAGS
    assert words[len(FLAGS) : len(FLAGS) + 2] == ["-o", f"/out/{RELAY_LIBRARY}"]
    assert words[len(FLAGS) + 2 :] == [f"{RELAY_SOURCE}/*.c"]
    final = by_name["final"]
    search = dict(env.split("=", 1) for env in final.all("ENV"))[
        "ENVOY_DYNAMIC_MODULES_SEARCH_PATH"
    ]
    assert final.all("COPY") == [f"--from=build /out/{RELAY_LIBRARY} {search}/"]
    values = yaml.safe_load((ROOT / "helm" / "tokenmesh" / "values.yaml").read_text())
    image = values["envoy"]["image"]
    # The chart runs this image (the stream relay is on by default), built on the official
    # image of its Envoy tag.
    assert image["repository"] == "ghcr.io/tokenmesh/envoy"
    assert final.base == f"envoyproxy/envoy:{image['tag']}" == args["ENVOY_IMAGE"]
