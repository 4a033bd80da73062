"""Imports follow the layers (docs/architecture.md): every product module under services/, gateway/, rest/, runtime/
and clients/python/glmimage/ is read with ast (nothing is imported), put in a layer, and each of its imports checked
against what that layer may see. A failure names the module, the line and the rule."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each top-level package's source lives (glmimage is installed from clients/python).
SOURCES = {"services": ROOT / "services", "gateway": ROOT / "gateway", "rest": ROOT / "rest",
           "runtime": ROOT / "runtime", "glmimage": ROOT / "clients/python/glmimage"}
# The model libraries: only the model layer and the two workers load them.
HEAVY = frozenset({"torch", "diffusers", "transformers"})


@dataclass(frozen=True)
class Layer:
    name: str
    rule: str  # what a failure says
    packages: tuple[str, ...] = ()  # these modules and everything under them
    modules: tuple[str, ...] = ()  # exactly these
    may_import: frozenset[str] = frozenset()  # the other layers it may see (its own is always allowed)
    # Modules of other layers it may see, for a layer that sees only part of one.
    may_import_modules: frozenset[str] = frozenset()
    heavy: bool = False  # may import torch, diffusers, transformers
    stdlib_only: bool = False  # no third-party package at all
    forbidden_stdlib: frozenset[str] = frozenset()


LAYERS = (
    Layer("protocol", "the protocol (glmimage.v1, glmimage.wire) sees only grpc, protobuf and the stdlib",
          packages=("glmimage.v1", "glmimage.wire")),
    Layer("sdk", "the SDK sits on the protocol and sees nothing of the servers",
          packages=("glmimage",), may_import=frozenset({"protocol"})),
    Layer("runtime", "runtime is torch-free and sees only the protocol",
          packages=("runtime",), may_import=frozenset({"protocol"})),
    Layer("model", "services.model sees the runtime and the protocol, never a worker, the gateway or the SDK",
          packages=("services.model",), may_import=frozenset({"protocol", "runtime"}), heavy=True),
    Layer("ar", "the AR worker sees the model, the runtime and the protocol; never the denoiser, gateway or SDK",
          packages=("services.ar",), may_import=frozenset({"protocol", "runtime", "model"}), heavy=True),
    Layer("denoiser", "the denoiser sees the model, the runtime and the protocol; never the AR, gateway or SDK",
          packages=("services.denoiser",), may_import=frozenset({"protocol", "runtime", "model"}), heavy=True),
    Layer("scheduler", "the scheduler is pure: the stdlib (no asyncio), runtime.errors and .priority only",
          packages=("gateway.scheduler",),
          may_import_modules=frozenset({"runtime.errors", "runtime.priority"}),
          stdlib_only=True, forbidden_stdlib=frozenset({"asyncio"})),
    # What the gateway and the REST front both need of jobs: the job data, its JSON, where the embedded store lives,
    # the image stores and their signed links (the gateways write and sign, the REST front serves and checks).
    Layer("jobs", "the jobs' shared parts (data, JSON, defaults, image stores, links) see the runtime and the "
          "protocol only", modules=("gateway.jobs", "gateway.jobs.model", "gateway.jobs.render",
                                    "gateway.jobs.defaults", "gateway.jobs.images", "gateway.jobs.urls"),
          may_import=frozenset({"protocol", "runtime"})),
    Layer("gateway", "the gateway server sees the scheduler, the jobs' shared parts, the runtime and the protocol; "
          "never the REST front, a worker, the model or the SDK", packages=("gateway",),
          may_import=frozenset({"protocol", "runtime", "scheduler", "jobs"})),
    Layer("rest", "the REST front is a client of the gateway at the protocol's level: it sees the jobs' shared parts, "
          "the runtime and the protocol; never the SDK, gateway server modules, a worker or the model",
          packages=("rest",), may_import=frozenset({"protocol", "runtime", "jobs"})),
    Layer("supervisor", "the supervisor spawns processes by command line; it imports no server module",
          modules=("services.supervisor",), may_import=frozenset({"runtime", "protocol"})),
    Layer("launcher", "the launcher sees the supervisor, the runtime, the model (the tiny checkpoint) and the jobs' "
          "defaults and secrets; it starts servers by command line, never by import",
          modules=("services.launcher", "services.launcher_control"),
          may_import=frozenset({"runtime", "model", "supervisor", "protocol", "jobs"})),
    Layer("root", "the services package itself imports nothing", modules=("services",)),
)
BY_NAME = {layer.name: layer for layer in LAYERS}


def layer_of(module: str) -> Layer | None:
    """The layer a module of ours belongs to: an exact name first, then the longest package that holds it."""
    for layer in LAYERS:
        if module in layer.modules:
            return layer
    best: tuple[int, Layer | None] = (-1, None)
    for layer in LAYERS:
        for package in layer.packages:
            if (module == package or module.startswith(package + ".")) and len(package) > best[0]:
                best = (len(package), layer)
    return best[1]


@dataclass
class Module:
    path: str
    imports: list[tuple[int, str]] = field(default_factory=list)  # (line, module imported)


def module_name(path: Path) -> str:
    for top, source in SOURCES.items():
        if path.is_relative_to(source):
            parts = (top, *path.relative_to(source).with_suffix("").parts)
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def product_files() -> list[Path]:
    return sorted(p for source in SOURCES.values() for p in source.rglob("*.py")
                  if not p.is_relative_to(SOURCES["glmimage"] / "v1"))  # generated stubs: protocol by definition


def read_imports(path: Path, name: str, known: set[str]) -> list[tuple[int, str]]:
    """Every import in the file, wherever it sits (a function-level import counts too), as absolute module names.
    ``from X import y`` is X.y when that is a module of ours, else X."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base))
    return list(dict.fromkeys(found))  # one report per line and module, however many names it takes


def product_modules() -> dict[str, Module]:
    files = product_files()
    known = {module_name(p) for p in files}
    known |= {module_name(p) for p in (SOURCES["glmimage"] / "v1").rglob("*.py")}
    return {module_name(p): Module(str(p.relative_to(ROOT)), read_imports(p, module_name(p), known)) for p in files}


def violations(modules: Mapping[str, Module]) -> list[str]:
    """One line per import that breaks a rule: where it is, what it imports and the rule it breaks."""
    found = []
    for name, module in sorted(modules.items()):
        layer = layer_of(name)
        if layer is None:
            found.append(f"{module.path}: {name} is in no layer; give it one in tests/test_layers.py")
            continue
        for line, target in module.imports:
            where = f"{module.path}:{line}: {name} ({layer.name}) imports {target}"
            top = target.split(".")[0]
            if top == "__future__":
                continue
            if top in SOURCES:
                other = layer_of(target)
                allowed = (other is layer or (other is not None and other.name in layer.may_import)
                           or target in layer.may_import_modules)
                if not allowed:
                    found.append(f"{where} ({other.name if other else 'no layer'}): {layer.rule}")
            elif top in HEAVY and not layer.heavy:
                found.append(f"{where}: no torch, diffusers or transformers outside the model and workers: "
                             f"{layer.rule}")
            elif layer.stdlib_only and (top not in sys.stdlib_module_names or top in layer.forbidden_stdlib):
                found.append(f"{where}: {layer.rule}")
    return found


def test_imports_follow_the_layers() -> None:
    modules = product_modules()
    assert {"glmimage.wire.channels", "runtime.admission", "gateway.scheduler.core",
            "rest.app"} <= modules.keys()  # the walk found the tree
    problems = violations(modules)
    assert not problems, "imports against the layers (docs/architecture.md):\n" + "\n".join(problems)


def test_the_check_fails_on_wrong_imports() -> None:
    # A synthetic module map, one wrong import per rule: each must be reported with its module, line and rule.
    wrong = {
        "glmimage.wire.formats": ("glmimage.client", "the protocol"),
        "runtime.limits": ("torch", "no torch"),
        "runtime.tls": ("glmimage.client", "runtime is torch-free"),
        "services.ar.engine": ("services.denoiser.engine", "never the denoiser"),
        "services.denoiser.servicer": ("glmimage", "never the AR, gateway or SDK"),
        "gateway.scheduler.core": ("asyncio", "the scheduler is pure"),
        "gateway.scheduler.pool": ("grpc", "the scheduler is pure"),
        "gateway.scheduler.types": ("runtime.limits", "the scheduler is pure"),
        "gateway.driver": ("rest.errors", "the gateway server sees"),
        "gateway.servicer": ("glmimage.client", "the gateway server sees"),
        "rest.limits": ("gateway.servicer", "the REST front is a client"),
        "rest.upstream": ("glmimage.client", "never the SDK"),
        "rest.app": ("services.model.device", "the REST front is a client"),
        "rest.errors": ("torch", "no torch"),
        "services.launcher": ("services.ar.servicer", "the launcher sees"),
        "services.supervisor": ("gateway.config", "the supervisor spawns"),
        "glmimage.client": ("runtime.errors", "the SDK sits on the protocol"),
    }
    modules = {name: Module(f"{name}.py", [(7, "__future__"), (8, target)]) for name, (target, _) in wrong.items()}
    modules["services.extra"] = Module("services/extra.py")
    problems = violations(modules)
    for name, (target, rule) in wrong.items():
        assert [p for p in problems if p.startswith(f"{name}.py:8: {name} ") and target in p and rule in p], \
            (name, problems)
    assert any("services.extra is in no layer" in p for p in problems)
    assert len(problems) == len(wrong) + 1

    # And the allowed directions stay quiet.
    right = {"rest.limits": ["runtime.admission", "glmimage.wire.sizes", "gateway.jobs.urls"],
             "gateway.scheduler.core": ["runtime.errors", "dataclasses", "gateway.scheduler.types"],
             "services.ar.engine": ["torch", "services.model.tiny", "runtime.limits", "glmimage.v1"],
             "gateway.servicer": ["gateway.scheduler.core", "runtime.admission", "grpc"],
             "glmimage.cli": ["glmimage.wire.sizes", "glmimage.client"]}
    assert violations({n: Module(f"{n}.py", [(1, t) for t in ts]) for n, ts in right.items()}) == []


def test_every_layer_rule_is_used() -> None:
    # No layer left behind by a rename: each one holds a product module.
    held = {layer_of(name).name for name in product_modules()}  # type: ignore[union-attr]
    assert held == set(BY_NAME), set(BY_NAME) - held


def _fresh_modules(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    return done.stdout.split()


def test_the_protocol_loads_no_sdk() -> None:
    # A server importing the stubs and the wire helpers does not load the client (glmimage's SDK names are lazy).
    stubs = sorted(p.stem for p in (SOURCES["glmimage"] / "v1").glob("*_pb2*.py"))
    wire = sorted(p.stem for p in (SOURCES["glmimage"] / "wire").glob("*.py") if p.stem != "__init__")
    assert stubs and set(wire) == {"formats", "sizes", "channels", "keepalive"}
    code = "\n".join([*(f"import glmimage.v1.{s}" for s in stubs), *(f"import glmimage.wire.{w}" for w in wire)])
    loaded = _fresh_modules(code)
    assert "glmimage.wire.channels" in loaded
    assert not [m for m in loaded if m in ("glmimage.client", "glmimage.results", "glmimage.cli")], loaded


def test_the_sdk_names_still_come_from_glmimage() -> None:
    import glmimage
    from glmimage import Client, client

    assert Client is client.Client
    assert all(getattr(glmimage, name) is getattr(client, name) for name in glmimage.__all__)
    assert set(glmimage.__all__) <= set(dir(glmimage))


def _iter_targets(modules: Mapping[str, Module], prefix: str) -> Iterable[str]:
    return (t for name, m in modules.items() if name.startswith(prefix) for _, t in m.imports)


def test_the_rest_front_uses_the_shared_admission() -> None:
    # The one set of admission rules: the gateway servicer and the REST front both read runtime.admission.
    modules = product_modules()
    assert "runtime.admission" in set(_iter_targets(modules, "rest."))
    assert "runtime.admission" in set(_iter_targets(modules, "gateway.servicer"))
