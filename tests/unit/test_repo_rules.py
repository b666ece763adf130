"""Rules the repository keeps, checked without a model or an engine: it stands on its own, its configs take
TRL/open-r1's shape, the published recipe and each choice have one source, no script edits sys.path, its
package's imports run down its floor plan with no cycle, and its generated docs are current."""

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]


# -- standing on its own -----------------------------------------------------------------------------------


def test_no_tracked_file_points_outside_the_repo():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    # Assembled from pieces so that this file does not match itself.
    words = [r"\.\./" + "shared", "SP" + "EC", "not " + "lent", "with" + "held", "carry" + " call",
             "device" + " time", "issue" + " #"]  # fmt: skip
    res = subprocess.run(
        ["git", "grep", "-nE", "|".join(words)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert res.returncode == 1 and not res.stdout, res.stdout


def path_edits(source: str) -> list[int]:
    """The lines of `source` that add a folder to sys.path (insert, append or extend)."""
    pattern = re.compile(r"\bsys\.path\.(insert|append|extend)\b")
    return [n for n, line in enumerate(source.splitlines(), 1) if pattern.search(line)]


def test_no_tracked_module_edits_sys_path():
    """Scripts import the installed package (opsd, opsd.testing, the root entry points) and, in bench/, their
    siblings from their own folder; none reaches into the checkout through sys.path."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert "bench/learning.py" in tracked and "tests/conftest.py" in tracked
    found = {name: path_edits((ROOT / name).read_text()) for name in tracked if (ROOT / name).is_file()}
    edits = {name: lines for name, lines in found.items() if lines}
    assert not edits, f"sys.path edited at these lines: {edits}"


# Assembled from pieces so that this file does not match itself.
@pytest.mark.parametrize(
    "snippet",
    [
        "sys.path." + "insert(0, str(ROOT))",
        "import sys\nsys.path." + "append('..')",
        "  sys.path." + "extend([p])",
    ],
)
def test_the_sys_path_check_finds_an_edit(snippet):
    assert path_edits(snippet), snippet
    assert not path_edits("print(sys.path)\nfrom common import write")


def shared_module_names(paths: list[str]) -> dict[str, list[str]]:
    """File names that more than one module under opsd/ and bench/ carries (package markers aside)."""
    seen: dict[str, list[str]] = {}
    for path in sorted(set(paths)):
        name = Path(path).name
        if (
            path.startswith(("opsd/", "bench/"))
            and name.endswith(".py")
            and name not in ("__init__.py", "__main__.py")
        ):
            seen.setdefault(name, []).append(path)
    return {name: where for name, where in seen.items() if len(where) > 1}


def test_no_two_modules_share_a_name():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert "opsd/experiment/commands.py" in tracked
    assert not shared_module_names(tracked)
    # The check finds a clash, between the package and bench as within the package.
    assert shared_module_names(
        ["opsd/run/report.py", "bench/report.py", "opsd/a/__init__.py", "bench/__init__.py"]
    )
    assert not shared_module_names(["opsd/run/report.py", "tests/report.py"])


def test_no_two_exception_classes_share_a_name():
    """An error caught or raised by name is one class: a second `UserError` in another module would shadow the
    one `opsd.errors` defines wherever it is imported instead (evaluation once had its own)."""
    sources = [*ROOT.glob("opsd/**/*.py"), *ROOT.glob("*.py")]
    defined: dict[str, list[str]] = {}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name | ast.Attribute) and ast.unparse(b).endswith(("Error", "Exception"))
                for b in node.bases
            ):
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert "UserError" in defined and "RunFailed" in defined
    assert not {name: where for name, where in defined.items() if len(where) > 1}


def shared_top_level_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """Public functions and classes defined at the top of more than one module (`main`, each script's entry,
    aside), from {path: source}."""
    defined: dict[str, list[str]] = {}
    for path, text in sources.items():
        for node in ast.parse(text).body:
            public = not node.name.startswith("_") if hasattr(node, "name") else False
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and public and node.name != "main":
                defined.setdefault(node.name, []).append(path)
    return {name: where for name, where in defined.items() if len(where) > 1}


def test_no_two_public_functions_or_classes_share_a_name():
    """One name, one thing: a reader who meets `check_resume`, `Job` or `resolve` knows which it is
    (training's resume check and evaluation's, an experiment's job and an evaluation's, were once
    namesakes)."""
    sources = {
        str(p.relative_to(ROOT)): p.read_text() for p in [*ROOT.glob("opsd/**/*.py"), *ROOT.glob("*.py")]
    }
    assert "opsd/evaluation/job.py" in sources
    assert not shared_top_level_names(sources)
    # The check finds a clash; private helpers and entry points may share names.
    assert shared_top_level_names({"a.py": "class Job: ...", "b.py": "def Job(): ..."}) == {
        "Job": ["a.py", "b.py"]
    }
    assert not shared_top_level_names(
        {"a.py": "def _x(): ...\ndef main(): ...", "b.py": "def _x(): ...\ndef main(): ..."}
    )


def test_pointers_to_the_key_lists_name_the_module_that_holds_them():
    """The recipe whitelist and the budget keys (RECIPE_KEYS, OPERATIONAL_KEYS, BUDGET_KEYS: each switch's role,
    declared with it) live in opsd/configuration/switches.py; a comment, doc or error that sends the reader to
    another module for them (two lines at a time: a pointer may wrap) sends them to the wrong file."""
    from opsd.configuration import switches

    names = [n for n in vars(switches) if n.endswith("_KEYS")]
    assert {"RECIPE_KEYS", "OPERATIONAL_KEYS", "BUDGET_KEYS"} <= set(names)
    mention = re.compile(r"\b(" + "|".join(names) + r")\b|whitelist in")
    module = re.compile(r"opsd/configuration/(?:\w+/)?(\w+)\.py")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    wrong = []
    for name in files.split():
        if name.startswith("tests/") or not name.endswith((".py", ".md", ".sh", ".env")):
            continue
        if not (ROOT / name).is_file():  # deleted in the working tree, not yet in the index
            continue
        lines = (ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines()
        for n, pair in enumerate(zip(lines, [*lines[1:], ""], strict=True), 1):
            text = " ".join(pair)
            if mention.search(text) and any(m != "switches" for m in module.findall(text)):
                # a line that names switches.py and another module (a table of the modules) points at it too
                if "opsd/configuration/switches.py" not in text:
                    wrong.append(f"{name}:{n}: {pair[0].strip()}")
    assert not wrong, "\n".join(wrong)


def test_method_doc_has_every_section_the_code_cites():
    method = (ROOT / "docs" / "method.md").read_text()
    headings = set(re.findall(r"^#+ (\d+(?:\.\d+)?)[ .]", method, flags=re.M))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    cited = set()
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".env", ".yaml", ".sh"} and path.is_file():
            cited |= set(re.findall(r"docs/method\.md §(\d+(?:\.\d+)?)", path.read_text(errors="ignore")))
    assert cited, "nothing cites docs/method.md"
    assert cited <= headings, f"cited sections without a heading: {sorted(cited - headings)}"
    assert "2601.18734" in method and "github.com/siyan-zhao/OPSD" in method


# -- configuration in TRL's shape --------------------------------------------------------------------------


def _parse(argv, environ=None):
    from opsd.launch.command_line import parse_config

    return parse_config(argv, environ=environ or {})[0]


def test_open_r1_style_yaml_is_accepted(tmp_path):
    cfg_file = tmp_path / "openr1.yaml"
    cfg_file.write_text(
        "model_name_or_path: Qwen/Qwen3-1.7B\nmodel_revision: v1.0\ntorch_dtype: bfloat16\n"
        "lora_target_modules:\n  - q_proj\n  - k_proj\noutput_dir: " + str(tmp_path / "out") + "\n"
    )
    cfg = _parse(["--config", str(cfg_file)])
    assert cfg.model_revision == "v1.0"
    assert cfg.dtype == "bfloat16"
    assert cfg.lora_target_modules == ["q_proj", "k_proj"]


@pytest.mark.parametrize(
    "argv, environ, expected",
    [
        (["--lora_target_modules", "q_proj", "v_proj"], {}, ["q_proj", "v_proj"]),  # upstream CLI form
        (["--lora_target_modules", "q_proj,o_proj"], {}, ["q_proj", "o_proj"]),
        ([], {"OPSD_LORA_TARGET_MODULES": "gate_proj, up_proj"}, ["gate_proj", "up_proj"]),
        ([], {}, ["auto"]),  # resolved on the model: the published q..down projections on a dense model
    ],
)
def test_lora_target_modules_forms(tmp_path, argv, environ, expected):
    cfg = _parse(["--output_dir", str(tmp_path), *argv], environ)
    assert cfg.lora_target_modules == expected


def test_bad_model_settings_are_refused_before_loading(tmp_path):
    from opsd.configuration.config import OPSDConfig

    with pytest.raises(ValueError, match="names no module"):
        OPSDConfig(output_dir=str(tmp_path), lora_target_modules=[" , "])
    with pytest.raises(ValueError, match="auto stands alone"):
        OPSDConfig(output_dir=str(tmp_path), lora_target_modules="auto,q_proj")
    with pytest.raises(ValueError, match="torch_dtype='float16' and dtype='bfloat16' disagree"):
        OPSDConfig(output_dir=str(tmp_path), torch_dtype="float16", dtype="bfloat16")


def test_every_choice_is_declared_once_and_enforced_everywhere(tmp_path):
    from opsd.configuration.config import OPSDConfig
    from opsd.configuration.sources import RecipeError, env_overrides
    from opsd.configuration.switches import CHOICES, env_name

    assert set(CHOICES) >= {"method", "clip_mode", "loss_type", "teacher_contrast", "rollout_engine", "dtype"}
    declared = OPSDConfig.__dataclass_fields__
    for name, allowed in CHOICES.items():
        assert declared[name].metadata.copy()["choices"] == allowed  # what the CLI's argparse enforces
        for value in allowed:  # every allowed value passes config and recipe validation
            env_overrides({env_name(name): value})
        with pytest.raises(ValueError, match=re.escape(str(list(allowed)))):
            OPSDConfig(output_dir=str(tmp_path), **{name: "bogus"})
        with pytest.raises(RecipeError, match="bogus"):
            env_overrides({env_name(name): "bogus"})
    # No module restates a set of choices, in any spelling: the values live only in their switch's declaration,
    # opsd/configuration/switches.py.
    home = ROOT / "opsd" / "configuration" / "switches.py"
    modules = [*(ROOT / "opsd").rglob("*.py"), *ROOT.glob("*.py"), *(ROOT / "bench").glob("*.py")]
    assert home in modules and ROOT / "opsd_train.py" in modules  # subpackages and the entry points
    restated = {}
    for path in modules:
        found = restated_choices(path.read_text()) if path != home else []
        if found:
            restated[str(path.relative_to(ROOT))] = found
    assert not restated, f"read these from opsd.configuration.switches.CHOICES instead: {restated}"


def restated_choices(source: str) -> list[str]:
    """Each tuple, list or set literal of two or more strings in `source` whose values, as a set, are the
    allowed values of a choice switch (`CHOICES`), as "line N: switch"."""
    from opsd.configuration.switches import CHOICES

    switch_of = {frozenset(allowed): name for name, allowed in CHOICES.items()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or len(node.elts) < 2:
            continue
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            name = switch_of.get(frozenset(e.value for e in node.elts))
            if name:
                found.append(f"line {node.lineno}: {name}")
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "modes = ['rescale','none','token','element']",
        'if mode not in {"none", "element", "rescale", "token"}:\n    pass',
        "f(engine, allowed=('vllm', 'transformers', 'auto'))",
        'LOSSES = (\n    "sampled_token",\n    "jsd",\n    "fixed_advantage",\n)',
        "def f(x=['matched', 'empty', 'shuffled']): return x",
    ],
)
def test_the_restatement_check_finds_any_spelling(snippet):
    assert restated_choices(snippet), snippet


def test_the_restatement_check_passes_what_is_not_a_choice_set():
    reading = "from opsd.configuration.switches import CHOICES\nmodes = CHOICES['clip_mode']"
    assert restated_choices(reading) == []
    assert restated_choices("modes = ('element', 'token')") == []  # a part of a choice set is not it
    assert restated_choices("modes = ('element', 'token', 'rescale', 'none', 'other')") == []


def test_every_range_is_declared_with_its_switch():
    """A numeric switch's range is declared once, in its field's metadata (opsd/configuration/switches.py; TRL's
    fields in its TRL_SWITCHES, eval_aime.py's flags in EVAL_RANGES, opsd/configuration/checks.py): no other module
    builds a `Range`, and every reader takes it from `RANGES`."""
    from opsd.configuration.switches import RANGES, Switches

    homes = {ROOT / "opsd" / "configuration" / "switches.py", ROOT / "opsd" / "configuration" / "checks.py"}
    modules = [*(ROOT / "opsd").rglob("*.py"), *ROOT.glob("*.py"), *(ROOT / "bench").glob("*.py")]
    built = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in modules
        if path not in homes
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "Range"
    ]
    assert not built, f"declare these ranges with their switch instead: {built}"
    fields = Switches.__dataclass_fields__.values()
    declared = {f.name: f.metadata["range"] for f in fields if "range" in f.metadata}
    assert declared and all(RANGES[name] is allowed for name, allowed in declared.items())


def test_generation_window_other_than_whole_optimizer_steps_is_refused(tmp_path):
    from opsd.configuration.config import OPSDConfig

    # Each optimizer step is normalised by its own tokens: TRL's window (in micro-batches) must be
    # steps_per_rollout whole steps, and is set through steps_per_rollout.
    for extra in ({"steps_per_generation": 1}, {"steps_per_generation": 4}, {"generation_batch_size": 16}):
        with pytest.raises(ValueError, match="set steps_per_rollout"):
            OPSDConfig(output_dir=str(tmp_path), gradient_accumulation_steps=2, **extra)
    cfg = OPSDConfig(output_dir=str(tmp_path), gradient_accumulation_steps=2, steps_per_generation=2)
    assert cfg.steps_per_generation == 2
    cfg = OPSDConfig(
        output_dir=str(tmp_path), gradient_accumulation_steps=2, steps_per_generation=4, steps_per_rollout=2
    )
    assert cfg.generation_batch_size == 4 * cfg.per_device_train_batch_size


# -- one source for the published recipe -------------------------------------------------------------------

# Keys of a shipped config that say where a run reads and writes, not how it trains.
RUN_KEYS = {"model_name_or_path", "dataset_name", "output_dir"}


def test_published_yaml_restates_the_defaults_exactly(tmp_path):
    from opsd.configuration.config import OPSDConfig

    defaults = OPSDConfig(output_dir=str(tmp_path))
    values = yaml.safe_load((ROOT / "configs" / "qwen3_1.7b_published.yaml").read_text())
    assert set(values) - RUN_KEYS, "the published YAML sets nothing"
    for key, value in values.items():
        if key in RUN_KEYS:
            continue
        default = getattr(defaults, key)
        if key == "bf16":  # the config turns bf16 off on a machine without a GPU
            default = True
        assert default == value, f"{key}: YAML {value!r} != default {default!r}"


def test_accelerate_configs_differ_only_in_the_number_of_processes():
    main = yaml.safe_load((ROOT / "accelerate.yaml").read_text())
    assert main["num_processes"] == 4 and main["deepspeed_config"]["zero_stage"] == 2
    for name, processes in [("zero2_1gpu.yaml", 1), ("zero2_2gpu.yaml", 2), ("zero2_8gpu.yaml", 8)]:
        other = yaml.safe_load((ROOT / "configs" / "accelerate" / name).read_text())
        assert other["num_processes"] == processes, name
        assert {**other, "num_processes": 4} == main, (
            f"{name} differs from accelerate.yaml beyond num_processes"
        )


# -- provenance --------------------------------------------------------------------------------------------


def test_provenance_names_versions_and_revision():
    from opsd.run.provenance import provenance

    found = provenance()
    assert found["versions"]["torch"] == torch.__version__
    assert found["versions"]["trl"] and found["versions"]["transformers"]
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        assert found["git"]["commit"] == head.strip()
        assert isinstance(found["git"]["dirty"], bool)


# -- training curves ---------------------------------------------------------------------------------------


def _metrics_file(run, records):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "lo')


def test_plot_draws_the_panels_a_run_has(tmp_path):
    from opsd.run.curves import main, read_metrics

    run = tmp_path / "run"
    records = [
        {"step": s, "loss": 1.0 / s, "opsd/divergence": 0.5 / s, "time/step_s": 2.0, "grad_norm": 0.1}
        for s in range(1, 6)
    ]
    records += [{"step": 0, "probe/divergence": 0.4}, {"step": 5, "probe/divergence": 0.2}]
    _metrics_file(run, records)
    metrics = read_metrics(run)
    assert metrics["loss"] == [(s, 1.0 / s) for s in range(1, 6)]
    assert metrics["probe/divergence"] == [(0, 0.4), (5, 0.2)]  # the cut last line is skipped
    assert main([str(run)]) == 0
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from opsd.run.curves import training_curves

    titles = training_curves({"run": metrics}, tmp_path / "x.png")
    assert titles == ["loss", "divergence D_β (per token)", "seconds per step", "gradient norm"]


def test_plot_refuses_a_directory_without_metrics(tmp_path, capsys):
    from opsd.run.curves import main

    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


# -- the package and its generated docs --------------------------------------------------------------------


def package_import_graph() -> dict[str, set[str]]:
    """Each module of opsd -> the modules of opsd it imports, at the top or inside a function."""
    modules = {}
    for path in (ROOT / "opsd").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    assert "opsd.evaluation.eval_config" in graph["opsd.evaluation.evaluate"]  # the walk sees real edges
    return graph


# The floor plan of docs/decisions.md (Structure), lowest first: a module imports only from a lower floor or
# from its own folder (errors, paths and rundir, the ground floor, from each other).
FLOORS = [
    {"errors", "paths", "rundir", "grading", "methods"},
    {"configuration"},
    {"method", "data", "models"},
    {"speed", "run"},
    {"rl"},
    {"launch", "evaluation"},
    {"experiment"},
    {"testing"},
]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The edges of `graph` that do not run down the floor plan, as "importer -> imported"."""
    floor = {part: n for n, parts in enumerate(FLOORS) for part in parts}

    def part(module: str) -> str:
        return module.split(".")[1] if module.count(".") else "opsd"

    found = []
    for name, targets in graph.items():
        for target in targets:
            a, b = part(name), part(target)
            if a == b or "opsd" in (a, b) or (floor[a] == floor[b] == 0) or floor[b] < floor[a]:
                continue
            found.append(f"{name} -> {target}")
    return sorted(found)


def test_imports_only_run_down_the_floor_plan():
    graph = package_import_graph()
    parts = {m.split(".")[1] for m in graph if m.count(".")}
    assert parts == set().union(*FLOORS), "a folder or top module missing from FLOORS"
    assert upward_imports(graph) == []
    assert upward_imports({"opsd.configuration.config": {"opsd.speed.microbatch"}}) == [
        "opsd.configuration.config -> opsd.speed.microbatch"
    ]
    assert upward_imports(
        {"opsd.method.loss": {"opsd.launch.capped"}, "opsd.run.probe": {"opsd.speed.microbatch"}}
    )


def test_the_package_import_graph_has_no_cycle():
    """No module of opsd imports (at the top or inside a function) one that imports it back, directly or not."""
    graph = package_import_graph()

    def path_back(start, node, seen):
        for nxt in graph[node]:
            if nxt == start:
                return [node, nxt]
            if nxt not in seen:
                seen.add(nxt)
                rest = path_back(start, nxt, seen)
                if rest:
                    return [node, *rest]
        return None

    for name in graph:
        cycle = path_back(name, name, set())
        assert cycle is None, " -> ".join(cycle)


def test_the_configuration_doc_is_generated_from_the_config():
    """docs/configuration.md's switch table is what the switches declare (python -m opsd.configuration.docs
    rewrites it)."""
    from opsd.configuration import docs
    from opsd.configuration.config import OPSDConfig
    from opsd.configuration.switches import Switches

    text = docs.DOC.read_text(encoding="utf-8")
    assert docs.replaced(text) == text, "out of date: python -m opsd.configuration.docs"
    table = docs.render()
    declared = Switches.__dict__["__annotations__"]
    assert set(declared) <= set(OPSDConfig.__dataclass_fields__) and "beta" in declared
    for name in declared:
        assert f"| `{name}` | `OPSD_{name.upper()}` |" in table
    assert docs.main(["--check"]) == 0


# -- functions short enough to read ----------------------------------------------------------------------------

MAX_FUNCTION_LINES = 60


def long_functions(sources: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:name (lines)` of every function of `sources` ({path: text}) longer than `limit` lines: def and async
    def, methods and nested functions included, counted from the `def` line to the last (decorators excluded)."""
    found = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source, filename=path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((path, node.lineno, f"{path}:{node.name} ({lines})"))
    return [text for *_, text in sorted(found)]


def _function(name: str, lines: int, indent: str = "") -> str:
    """A function of exactly `lines` lines (its def, then assignments)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_the_function_length_rule_finds_a_61_line_function():
    assert long_functions({"snippet.py": _function("f", 61)}) == ["snippet.py:f (61)"]
    assert long_functions({"snippet.py": _function("f", 60)}) == []
    # decorators are not counted; methods, async and nested functions are
    decorated = "import functools\n\n\n@functools.cache\n@functools.wraps(print)\n" + _function("g", 60)
    assert long_functions({"snippet.py": decorated}) == []
    method = "class C:\n" + _function("m", 61, indent="    ")
    assert long_functions({"snippet.py": method}) == ["snippet.py:m (61)"]
    asynchronous = "async " + _function("a", 61)
    assert long_functions({"snippet.py": asynchronous}) == ["snippet.py:a (61)"]
    nested = "def outer():\n" + _function("inner", 61, indent="    ") + "    return inner\n"
    assert long_functions({"snippet.py": nested}) == ["snippet.py:outer (63)", "snippet.py:inner (61)"]


def test_no_function_of_the_package_is_over_60_lines():
    """Every function of opsd/ (methods and nested functions included) fits in 60 lines: a longer one is cut
    into named steps."""
    paths = sorted((ROOT / "opsd").rglob("*.py"))
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths}
    assert "opsd/method/loss.py" in sources
    offenders = long_functions(sources)
    assert not offenders, f"over {MAX_FUNCTION_LINES} lines: {', '.join(offenders)}"


def test_the_trainer_and_the_configuration_keep_their_ceilings():
    """The trainer reads in one sitting (at most 500 lines) and the configuration is at most 6 files: each switch
    declared once (opsd/configuration/switches.py), not spread over a folder of tables."""
    trainer = (ROOT / "opsd_trainer.py").read_text().splitlines()
    assert len(trainer) <= 500, f"opsd_trainer.py is {len(trainer)} lines"
    configuration = sorted(p.name for p in (ROOT / "opsd" / "configuration").rglob("*.py"))
    assert len(configuration) <= 6, configuration


MAX_MODULE_LINES = 700


def test_no_module_of_the_package_is_over_700_lines():
    """Every module of opsd/ reads in one sitting (at most 700 lines): a longer one is split where its concerns
    part. The switches' declarations (opsd/configuration/switches.py, one field's metadata after another) aside."""
    lengths = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "opsd").rglob("*.py")
    }
    assert "opsd/configuration/switches.py" in lengths
    over = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    over.pop("opsd/configuration/switches.py", None)
    assert not over, f"over {MAX_MODULE_LINES} lines: {over}"
