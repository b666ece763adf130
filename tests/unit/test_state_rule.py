"""The library state rule: no module of the package and no root script writes the state of a TRL, transformers,
accelerate, peft or vLLM object (its attributes, the containers they hold, its namespace), except at the few sites
listed with their reasons; and the rule finds each kind of write, in snippets and inserted into the repository."""

import ast
import functools
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The library code whose classes' stores on `self` name the state of the objects the repository holds: TRL whole
# (its trainers, callbacks, generation), transformers' trainer (`Trainer`, `TrainingArguments`, the callbacks,
# `TrainerState`/`TrainerControl`, the trainer's helpers), accelerate whole (the accelerator, its optimizer and
# scheduler wrappers), peft whole (models, tuners), vLLM's offline entry point (`LLM`) and its engine.
LIBRARY_SOURCES = {
    "trl": ("**/*.py",),
    "transformers": ("trainer*.py", "training_args.py"),
    "accelerate": ("**/*.py",),
    "peft": ("**/*.py",),
    "vllm": ("entrypoints/llm.py", "v1/engine/**/*.py"),
}
CONSTRUCTORS = ("__init__", "__post_init__")
# On another object the rule takes the attributes a library class sets as it runs (outside its constructor):
# the state it changes and reads back. Those it sets only while constructing itself are configuration, and their
# names are everyday ones (`pad_token`, `dtype`, `generation_config`, `use_vllm`): counted too, they would find
# a loaded tokenizer given its pad token or a config its dtype through the library's own setters.
# The library's dataclasses that are a trainer's running state field by field (TrainerState: its step, epoch, log
# history, best metric; TrainerControl: the switches its loop resets every step). Their generated constructors set
# the fields, so no store on `self` names them: each field counts as set while the library runs.
RUNNING_DATACLASSES = ("TrainerState", "TrainerControl")
# transformers hands a TrainerControl to every `on_*` event of a TrainerCallback for the callback to set: its
# documented way to ask for a save, an evaluation, a log or a stop. Those stores on the event's `control` are public.
CALLBACK_BASE, CONTROL = "TrainerCallback", "TrainerControl"
# The methods that change the list, dict, set or deque they are called on; those of them whose first argument is
# the key they change (on an object's namespace, the attribute).
MUTATORS = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "sort", "reverse", "update", "setdefault",
    "add", "discard", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__", "__iadd__", "__ior__",
})  # fmt: skip
KEYED = frozenset({"pop", "setdefault", "__setitem__", "__delitem__"})
LIBRARY = "<library>"  # what a name or an annotation is bound to when that is a library object


class Where(NamedTuple):
    """Where a node of a module is: `cls`, the class whose `self` is in scope (in its methods and the functions
    nested in them); `method`, the method's name (`<locals>` in a function nested in it); `function`, the module's
    function or the class's method around it (None outside any); `qualname`, the qualified name of the innermost
    function around it (`C.m.<locals>.f`, as Python's `__qualname__`; `<module>` outside any)."""

    cls: str | None
    method: str | None
    function: ast.AST | None
    qualname: str


def scoped(tree: ast.AST):
    """(node, Where) of every node of `tree`, parents before children."""
    functions = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda

    def visit(node, where: Where, outer: str, in_function: bool):
        for child in ast.iter_child_nodes(node):
            yield child, where
            if isinstance(child, ast.ClassDef | functions):
                name = getattr(child, "name", "<lambda>")
                qualname = f"{outer}{'.<locals>.' if in_function else '.'}{name}" if outer else name
            if isinstance(child, ast.ClassDef):
                yield from visit(child, Where(child.name, None, None, where.qualname), qualname, False)
            elif isinstance(child, functions):
                outermost = where.function is None and not isinstance(child, ast.Lambda)
                method = (name if isinstance(node, ast.ClassDef) else "<locals>") if where.cls else None
                inner = Where(where.cls, method, child if outermost else where.function, qualname)
                yield from visit(child, inner, qualname, True)
            else:
                yield from visit(child, where, outer, in_function)

    yield from visit(tree, Where(None, None, None, "<module>"), "", False)


class Write(NamedTuple):
    """A write in a module: `kind` "store" (`x.a = v`, setattr), "delete" (`del x.a`, delattr), "namespace" (a key
    of `vars(x)` or `x.__dict__`) or "container" (`c[k] = v`, `del c[k]`, `c[k] += v`, `c.append(v)` and the other
    MUTATORS); `obj` and `attr` the object and the attribute written (attr None: computed), or `container` the
    container changed; `text`, the write as it reads."""

    node: ast.AST
    kind: str
    obj: ast.expr | None
    attr: str | None
    container: ast.expr | None
    text: str
    where: Where


def writes(tree: ast.AST):
    """Each Write of `tree`: an attribute stored (any target: unpacking, `for`, `with ... as`, augmented) or deleted,
    `setattr`/`delattr` (`object.__setattr__`/`__delattr__` too), a key of `vars(x)` or `x.__dict__` stored,
    deleted or changed by a mutator, an item of any other container stored or deleted, a container mutated."""
    for node, where in scoped(tree):
        if (write := _write(node, where)) is not None:
            yield write


def _write(node: ast.AST, where: Where) -> Write | None:
    """The Write that `node` is, if it is one."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
        deleted = isinstance(node.ctx, ast.Del)
        text = f"del {ast.unparse(node)}" if deleted else ast.unparse(node)
        return Write(node, "delete" if deleted else "store", node.value, node.attr, None, text, where)
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
        text = f"del {ast.unparse(node)}" if isinstance(node.ctx, ast.Del) else ast.unparse(node)
        if (owner := _namespace(node.value)) is not None:
            return Write(node, "namespace", owner, _constant(node.slice), None, text, where)
        return Write(node, "container", None, None, node.value, text, where)
    if not isinstance(node, ast.Call):
        return None
    if (named := _attribute_call(node)) is not None:
        return Write(node, *named, where)
    if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        text, changed = f"{ast.unparse(node.func)}(...)", node.func.value
        if (owner := _namespace(changed)) is not None:
            key = _constant(node.args[0]) if node.func.attr in KEYED and node.args else None
            return Write(node, "namespace", owner, key, None, text, where)
        return Write(node, "container", None, None, changed, text, where)
    return None


def _attribute_call(call: ast.Call) -> tuple | None:
    """(kind, object, attribute, None, text) of `setattr(x, "a", v)` or `delattr(x, "a")` (`object.__setattr__`,
    `object.__delattr__`; attribute None: computed); None for any other call."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "object":
        name = func.attr.strip("_")
    else:
        name = func.id if isinstance(func, ast.Name) else None
    if name not in ("setattr", "delattr") or len(call.args) < 2:
        return None
    obj, attr = call.args[0], _constant(call.args[1])
    kind = "store" if name == "setattr" else "delete"
    if attr is None:
        return kind, obj, None, None, f"{name}({ast.unparse(obj)}, <computed>)"
    text = f"{ast.unparse(obj)}.{attr}"
    return kind, obj, attr, None, text if kind == "store" else f"del {text}"


def _namespace(expr: ast.expr) -> ast.expr | None:
    """`x` of `vars(x)` or `x.__dict__`: the object whose attributes that dict holds."""
    if isinstance(expr, ast.Attribute) and expr.attr == "__dict__":
        return expr.value
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id == "vars"
        and expr.args
    ):
        return expr.args[0]
    return None


def _constant(expr: ast.expr) -> str | None:
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None


@functools.cache
def library_attributes() -> tuple[
    frozenset[str], frozenset[str], frozenset[str], dict[str, tuple[frozenset, tuple]]
]:
    """(every, running, mutated, classes): the attributes the classes of LIBRARY_SOURCES store on `self`; those of
    them they store outside their constructor (`__init__`, `__post_init__`), the state they change as they run,
    with the fields of RUNNING_DATACLASSES; the attributes of `self` whose containers they change in place outside
    their constructor (`self.callbacks.append(cb)`); and per class name, the attributes that class stores on
    `self` (its fields, for those) and its bases' names. Read once per test session (~3 s)."""
    import importlib.util

    every, running, mutated, classes = set(), set(), set(), {}
    for library, patterns in LIBRARY_SOURCES.items():
        root = Path(importlib.util.find_spec(library).submodule_search_locations[0])
        for path in sorted({p for pattern in patterns for p in root.glob(pattern)}):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    attrs, bases = classes.setdefault(node.name, (set(), set()))
                    bases |= {_class_name(b) for b in node.bases} - {None}
                    if node.name in RUNNING_DATACLASSES:
                        fields = {f.target.id for f in node.body if isinstance(f, ast.AnnAssign)}
                        attrs |= fields
                        every |= fields
                        running |= fields
            for write in writes(tree):
                obj, attr, where = write.obj, write.attr, write.where
                if write.kind == "store" and attr and isinstance(obj, ast.Name) and obj.id == "self":
                    every.add(attr)
                    if where.method not in CONSTRUCTORS:
                        running.add(attr)
                    if where.cls is not None:
                        classes[where.cls][0].add(attr)
                elif write.kind == "container" and where.method not in CONSTRUCTORS:
                    container = write.container
                    while isinstance(container, ast.Subscript):
                        container = container.value
                    if isinstance(container, ast.Attribute) and _is_self(container.value, where):
                        mutated.add(container.attr)
    frozen = {name: (frozenset(attrs), tuple(sorted(bases))) for name, (attrs, bases) in classes.items()}
    return frozenset(every), frozenset(running), frozenset(mutated), frozen


def library_lineage(name: str) -> frozenset[str]:
    """`name` and the names of its bases, and of theirs, among the classes of LIBRARY_SOURCES."""
    classes = library_attributes()[3]
    seen, todo = set(), [name]
    while todo:
        if (current := todo.pop()) not in seen:
            seen.add(current)
            todo.extend(classes.get(current, ((), ()))[1])
    return frozenset(seen)


def library_class_attributes(name: str) -> frozenset[str] | None:
    """The attributes that the library class `name` and its bases (those of LIBRARY_SOURCES) store on `self`;
    None if LIBRARY_SOURCES define no class of that name. Classes of one name are taken together."""
    classes = library_attributes()[3]
    if name not in classes:
        return None
    return frozenset().union(*(classes[c][0] for c in library_lineage(name) if c in classes))


def _class_name(expr: ast.expr) -> str | None:
    """`Trainer` of the base or annotation `Trainer`, `transformers.Trainer` or `Generic[T]`-like `Base[T]`."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    return ast.unparse(expr).split(".")[-1] if isinstance(expr, ast.Name | ast.Attribute) else None


def _library_names(tree: ast.AST) -> set[str]:
    """The names a module binds by importing from a library of LIBRARY_SOURCES (`import trl`, `from peft
    import PeftModel as P`: trl, P)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if a.name.split(".")[0] in LIBRARY_SOURCES
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module.split(".")[0] in LIBRARY_SOURCES
        ):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(expr: ast.expr) -> str | None:
    while isinstance(expr, ast.Attribute | ast.Call | ast.Subscript):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _annotation(expr: ast.expr | None) -> ast.expr | None:
    """The class expression of an annotation: `Job` of `Job`, `'Job'` or `Job | None`."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        expr = ast.parse(expr.value, mode="eval").body
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        sides = [s for s in (expr.left, expr.right) if not (isinstance(s, ast.Constant) and s.value is None)]
        expr = sides[0] if len(sides) == 1 else None
    return expr


def _getattr(expr: ast.expr) -> tuple[ast.expr, str | None] | None:
    """(x, "a") of `getattr(x, "a")` (attribute None: computed)."""
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id == "getattr"
        and expr.args
    ):
        return expr.args[0], _constant(expr.args[1]) if len(expr.args) > 1 else None
    return None


def _is_self(expr: ast.expr, where: Where) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("self", "cls") and where.cls is not None


class Finding(NamedTuple):
    """A write of library state: where it is, how it reads (`store`), and its `site` for KEPT_LIBRARY_WRITES:
    (path, the qualified name of the function around it, its line's text, stripped)."""

    path: str
    line: int
    store: str
    site: tuple[str, str, str]

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.store}"


class Scope(NamedTuple):
    """What a function (its nested scopes included) binds its names to: `kinds`, per name, (the class of `sources`
    it is bound to, LIBRARY or None: unknown; the function whose parameter it is, or None); `bound`, per single
    target of an assignment, (how: "call", "annotation" or "name"; the callee, annotation or name); `values`, per
    name, the expressions it is bound to or iterates over; `params`, per name, the functions with such a parameter."""

    kinds: dict[str, set]
    bound: dict[ast.AST, tuple[str, ast.expr]]
    values: dict[str, list[ast.expr]]
    params: dict[str, list[ast.AST]]


class Repository:
    """The modules of `sources` (path -> Python source), indexed for `library_state_writes`: their classes,
    functions, methods and library imports; which of their classes derive from library classes and what those
    bring; each call's arguments with the parameters they bind; and what their names and attributes are bound to."""

    def __init__(self, sources: dict[str, str]):
        self.every, self.running, self.mutated, self.library_classes = library_attributes()
        self.trees = {path: ast.parse(source) for path, source in sources.items()}
        self.lines = {path: source.splitlines() for path, source in sources.items()}
        self.library = {path: _library_names(tree) for path, tree in self.trees.items()}
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.functions: dict[str, list[tuple[ast.AST, int]]] = {}  # name -> (def, parameters a call skips)
        for path, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.functions.setdefault(node.name, []).append((node, 0))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((path, node))
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            static = any(ast.unparse(d) == "staticmethod" for d in item.decorator_list)
                            self.functions.setdefault(item.name, []).append((item, 0 if static else 1))
        self.lineage = self._lineage()
        self.inherited = {name: self._brought(lineage) for name, lineage in self.lineage.items() if lineage}
        self.writes: dict[str, list[Write]] = {path: [] for path in self.trees}
        self.calls = []  # (def, parameter, argument, Where, path) of each argument a call passes a function
        self.field_values = []  # (class, attribute, value, Where, path) of each `self.a = value`
        for path, tree in self.trees.items():
            for node, where in scoped(tree):
                if (write := _write(node, where)) is not None:
                    self.writes[path].append(write)
                if isinstance(node, ast.Call):
                    self.calls += [(*bound, where, path) for bound in self._arguments(node)]
                elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                    if isinstance(target, ast.Attribute) and _is_self(target.value, where):
                        self.field_values.append((where.cls, target.attr, node.value, where, path))
        self._scopes, self._typed, self._bindings = {}, {}, {}
        self.distrusted = {
            (d, p) for d, p, arg, where, path in self.calls if self.library_object(arg, where, path)
        }
        self.fields = self._fields()
        self.tainted_params, self.tainted_fields = set(), set()
        while True:  # a container reaches parameters and attributes, and through them further ones
            params = {
                (d, p) for d, p, arg, where, path in self.calls if self.library_container(arg, where, path)
            }
            fields = {
                (c, a) for c, a, v, where, path in self.field_values if self.library_container(v, where, path)
            }
            if (params, fields) == (self.tainted_params, self.tainted_fields):
                break
            self.tainted_params, self.tainted_fields = params, fields

    # -- classes ---------------------------------------------------------------------------------------------------
    def _lineage(self) -> dict[str, frozenset[str]]:
        """Per class of `sources`, the library classes it derives from (through classes of `sources` too): a base
        imported from a library, with its bases among LIBRARY_SOURCES."""
        lineage: dict[str, frozenset[str]] = {}
        while True:
            grown = {}
            for name, defs in self.classes.items():
                found = set()
                for path, node in defs:
                    for base in node.bases:
                        if _root(base) in self.library[path]:
                            found |= library_lineage(_class_name(base))
                        elif (own := self.named_class(base, path)) is not None:
                            found |= lineage.get(own, frozenset())
                grown[name] = frozenset(found)
            if grown == lineage:
                return lineage
            lineage = grown

    def _brought(self, lineage: frozenset[str]) -> frozenset[str]:
        """The attributes the library classes of `lineage` store on `self` (any in `every` for a class that
        LIBRARY_SOURCES do not define)."""
        classes = self.library_classes
        return frozenset().union(*(classes[c][0] if c in classes else self.every for c in lineage))

    def named_class(self, expr: ast.expr | None, path: str) -> str | None:
        """The class of `sources` that the base, annotation or callee `expr` names (`Job`, `'Job | None'`,
        `module.Job`), by name; None for a name imported from a library or no class of `sources`."""
        expr = _annotation(expr)
        if not isinstance(expr, ast.Name | ast.Attribute) or _root(expr) in self.library[path]:
            return None
        name = ast.unparse(expr).split(".")[-1]
        return name if name in self.classes else None

    def own_class(self, expr: ast.expr | None, path: str) -> str | None:
        """The class that `expr` names when that is certainly a class of the repository's own: it derives from no
        library class, it is the only class of `sources` of its name, no library class has that name, and the
        module `path` binds the name to it (defines it, or imports it from the module of `sources` that does)."""
        name = self.named_class(expr, path)
        if name is None or self.lineage[name] or len(self.classes[name]) > 1 or name in self.library_classes:
            return None
        expr = _annotation(expr)
        return (
            name
            if isinstance(expr, ast.Name) and self.binding(path, name) == self.classes[name][0][0]
            else None
        )

    def binding(self, path: str, name: str, depth: int = 0) -> str | None:
        """The module of `sources` whose class `name` is what the module `path` means by `name`: the class it
        defines, or the one a module of `sources` it imports the name from means; None for a name it binds
        otherwise (an import from elsewhere, an assignment, a parameter, a function) or more than one way."""
        if path not in self._bindings:
            self._bindings[path] = self._names(path)
        found = {
            path if how == "class" else self.binding(how, imported, depth + 1) if how and depth < 8 else None
            for how, imported in self._bindings[path].get(name, ())
        }
        return found.pop() if len(found) == 1 else None

    def _names(self, path: str) -> dict[str, list[tuple[str | None, str | None]]]:
        """Per name the module `path` binds, how, each time: ("class", None) where it defines a class of that name;
        (module, its name there) where it imports it from a module of `sources`; (None, None) otherwise."""
        names: dict[str, list] = {}
        for node in ast.walk(self.trees[path]):
            if isinstance(node, ast.ClassDef):
                names.setdefault(node.name, []).append(("class", None))
            elif isinstance(node, ast.ImportFrom):
                module = self._module(node, path)
                for a in node.names:
                    names.setdefault(a.asname or a.name, []).append(
                        (module, a.name) if module else (None, None)
                    )
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names.setdefault(a.asname or a.name.split(".")[0], []).append((None, None))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.setdefault(node.id, []).append((None, None))
            elif isinstance(node, ast.arg | ast.FunctionDef | ast.AsyncFunctionDef):
                names.setdefault(getattr(node, "arg", None) or node.name, []).append((None, None))
        return names

    def _module(self, node: ast.ImportFrom, path: str) -> str | None:
        """The module of `sources` that `from ... import` in `path` imports from."""
        parts = node.module.split(".") if node.module else []
        if node.level:
            base = Path(path).parents[node.level - 1]
            stem = base.joinpath(*parts).as_posix()
        else:
            stem = "/".join(parts)
        return next((m for m in (f"{stem}.py", f"{stem}/__init__.py") if m in self.trees), None)

    # -- names -----------------------------------------------------------------------------------------------------
    def kind(self, expr: ast.expr | None, path: str) -> str | None:
        """What the annotation or callee `expr` makes of an object: a class of the repository's own (`own_class`),
        LIBRARY (a class imported from a library, or a class of `sources` deriving from one), or None."""
        if (own := self.own_class(expr, path)) is not None:
            return own
        expr = _annotation(expr)
        if isinstance(expr, ast.Name | ast.Attribute) and (
            _root(expr) in self.library[path] or self.lineage.get(self.named_class(expr, path))
        ):
            return LIBRARY
        return None

    def scope(self, function: ast.AST, path: str) -> Scope:
        """What `function` binds its names to (`Scope`), read once per function."""
        if (function, path) in self._scopes:
            return self._scopes[(function, path)]
        kinds, bound, values, params = {}, {}, {}, {}
        for node in ast.walk(function):  # breadth first: an assignment comes before its targets
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]:
                    params.setdefault(arg.arg, []).append(node)
                    kinds.setdefault(arg.arg, set()).add((self.kind(arg.annotation, path), node))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                value = node.value
                if isinstance(value, ast.Call | ast.Name):
                    bound[node.targets[0]] = (
                        ("call", value.func) if isinstance(value, ast.Call) else ("name", value)
                    )
                if isinstance(node.targets[0], ast.Name):
                    values.setdefault(node.targets[0].id, []).append(value)
            elif isinstance(node, ast.AnnAssign):
                bound[node.target] = ("annotation", node.annotation)
                if isinstance(node.target, ast.Name) and node.value is not None:
                    values.setdefault(node.target.id, []).append(node.value)
            elif isinstance(node, ast.NamedExpr):
                values.setdefault(node.target.id, []).append(node.value)
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                for name, container in _iterated(node.target, node.iter):
                    values.setdefault(name, []).append(container)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                how, what = bound.get(node, (None, None))
                kind = self.kind(what, path) if how in ("call", "annotation") else None
                kinds.setdefault(node.id, set()).add((kind, None))
        self._scopes[(function, path)] = Scope(kinds, bound, values, params)
        return self._scopes[(function, path)]

    def typed(self, function: ast.AST, path: str) -> dict[str, str]:
        """The names `function` binds only to objects of one class of the repository's own (`own_class`): a
        parameter annotated with it that no call passes a library object, a local built by it or annotated so."""
        if (function, path) not in self._typed:
            typed = {}
            for name, entries in self.scope(function, path).kinds.items():
                kinds = {
                    None if kind == LIBRARY or (owner, name) in self.distrusted else kind
                    for kind, owner in entries
                }
                if len(kinds) == 1 and None not in kinds:
                    typed[name] = kinds.pop()
            self._typed[(function, path)] = typed
        return self._typed[(function, path)]

    def library_object(self, expr: ast.expr, where: Where, path: str) -> bool:
        """Whether `expr` is statically a library object: `self` of a class deriving from a library class or an
        attribute its library bases store, an object annotated with or built by a library class, or a name
        imported from a library."""
        if _is_self(expr, where):
            return where.cls in self.inherited
        if isinstance(expr, ast.Attribute) and _is_self(expr.value, where):
            return expr.attr in self.inherited.get(where.cls, ())
        if isinstance(expr, ast.Name) and where.function is not None:
            kinds = self.scope(where.function, path).kinds.get(expr.id, ())
            if any(kind == LIBRARY for kind, _ in kinds):
                return True
        if isinstance(expr, ast.Call):
            return self.kind(expr.func, path) == LIBRARY
        return _root(expr) in self.library[path]

    def _arguments(self, call: ast.Call):
        """(def, parameter, argument) of each argument of `call` and each function of `sources` it may call, by
        the callee's name: a module's function or a class (its `__init__`) for `f(...)`, a method or a module's
        function for `x.f(...)`."""
        func = call.func
        if isinstance(func, ast.Name):
            defs = [(d, skip) for d, skip in self.functions.get(func.id, []) if skip == 0]
            defs += [
                (item, 1)
                for _, c in self.classes.get(func.id, [])
                for item in c.body
                if isinstance(item, ast.FunctionDef) and item.name == "__init__"
            ]
        elif isinstance(func, ast.Attribute):
            defs = self.functions.get(func.attr, [])
        else:
            return
        for d, skip in defs:
            a = d.args
            positional = [*a.posonlyargs, *a.args][skip:]
            for arg, param in zip(call.args, positional, strict=False):
                if isinstance(arg, ast.Starred):
                    break
                yield d, param.arg, arg
            names = {p.arg for p in [*positional, *a.kwonlyargs]}
            yield from ((d, k.arg, k.value) for k in call.keywords if k.arg in names)

    # -- attributes ------------------------------------------------------------------------------------------------
    def _fields(self) -> dict[str, dict[str, set]]:
        """Per class of `sources`, per attribute: the classes of the repository's own it is bound to (None:
        unknown), from its annotations in the class body and its stores on `self`."""
        fields: dict[str, dict[str, set]] = {}
        for path, tree in self.trees.items():
            for cls in (c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)):
                for item in cls.body:  # a dataclass's fields
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs = fields.setdefault(cls.name, {})
                        attrs.setdefault(item.target.id, set()).add(self.own_class(item.annotation, path))
            for w in self.writes[path]:
                if w.kind == "store" and _is_self(w.obj, w.where) and w.attr:
                    bound = self._bound(w.node, w.where.function, path) if w.where.function else None
                    fields.setdefault(w.where.cls, {}).setdefault(w.attr, set()).add(bound)
        return fields

    def _bound(self, target: ast.AST, function: ast.AST, path: str) -> str | None:
        """The class of the repository's own that the single target `target` of an assignment is bound to."""
        how, what = self.scope(function, path).bound.get(target, (None, None))
        if how == "name":
            return self.typed(function, path).get(what.id)
        kind = self.kind(what, path) if how is not None else None
        return None if kind == LIBRARY else kind

    def class_of(self, expr: ast.expr, where: Where, path: str) -> str | None:
        """The class of `sources` that `expr` (a name, or an attribute of one) is statically an object of: `self`'s
        class, a name `typed` so, or an attribute its class binds only to objects of one class of the repository's
        own and no library base of the class stores."""
        if isinstance(expr, ast.Name):
            if _is_self(expr, where):
                return where.cls
            return self.typed(where.function, path).get(expr.id) if where.function is not None else None
        if isinstance(expr, ast.Attribute) and (owner := self.class_of(expr.value, where, path)):
            if expr.attr in self.inherited.get(owner, ()):
                return None
            kinds = self.fields.get(owner, {}).get(expr.attr, {None})
            return next(iter(kinds)) if len(kinds) == 1 and None not in kinds else None
        return None

    def library_attribute(
        self, obj: ast.expr, attr: str | None, where: Where, path: str, writing: bool
    ) -> bool:
        """Whether `obj.attr` (attr None: computed) is library state, by (a) and (b) of `library_state_writes`;
        `writing`: the attribute itself is written (a constructor may set its class's up), not a container it holds
        changed (which counts the attributes the library changes in place as it runs, too)."""
        if _is_self(obj, where):  # (b)
            constructing = writing and where.method in CONSTRUCTORS
            return (
                where.cls in self.inherited
                and not constructing
                and (attr is None or attr in self.inherited[where.cls])
            )
        owner = self.class_of(obj, where, path)
        if owner and owner not in self.inherited:
            return False
        if (
            isinstance(obj, ast.Name) and obj.id == "control" and (where.method or "").startswith("on_")
            and CALLBACK_BASE in self.lineage.get(where.cls, ()) and attr in library_class_attributes(CONTROL)
        ):  # fmt: skip
            return False
        changed = self.running if writing else self.running | self.mutated
        return attr is None or attr.startswith("_") or attr in changed  # (a)

    def library_container(
        self, expr: ast.expr, where: Where, path: str, seen: frozenset = frozenset()
    ) -> bool:
        """Whether `expr` is, or is an item of, a container that is library state: (c) of `library_state_writes`."""
        while isinstance(expr, ast.Subscript):
            if (owner := _namespace(expr.value)) is not None:
                return self.library_attribute(owner, _constant(expr.slice), where, path, writing=False)
            expr = expr.value
        if (owner := _namespace(expr)) is not None:
            return self.library_attribute(owner, None, where, path, writing=False)
        if (named := _getattr(expr)) is not None or isinstance(expr, ast.Attribute):
            obj, attr = named or (expr.value, expr.attr)
            if (self.class_of(obj, where, path), attr) in self.tainted_fields:
                return True
            return self.library_attribute(obj, attr, where, path, writing=False)
        if isinstance(expr, ast.Name) and where.function is not None and expr.id not in seen:
            scope = self.scope(where.function, path)
            if any((d, expr.id) in self.tainted_params for d in scope.params.get(expr.id, ())):
                return True
            seen = seen | {expr.id}
            return any(self.library_container(v, where, path, seen) for v in scope.values.get(expr.id, ()))
        return False

    def findings(self) -> list[Finding]:
        found = []
        for path, ws in self.writes.items():
            for w in ws:
                if w.kind == "container":
                    hit = self.library_container(w.container, w.where, path)
                else:
                    hit = self.library_attribute(w.obj, w.attr, w.where, path, writing=True)
                if hit:
                    line = w.node.lineno
                    site = (path, w.where.qualname, self.lines[path][line - 1].strip())
                    found.append(Finding(path, line, w.text, site))
        return found


def _iterated(target: ast.expr, iterated: ast.expr):
    """(name, container) for each name a loop binds to items of a container: `for x in c`, `for x in c.values()`,
    `for k, x in c.items()`."""
    method = (
        iterated.func.attr
        if isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Attribute)
        else None
    )
    if isinstance(target, ast.Name) and method in ("values", None):
        yield target.id, iterated.func.value if method else iterated
    elif isinstance(target, ast.Tuple) and method == "items" and len(target.elts) == 2:
        if isinstance(target.elts[1], ast.Name):
            yield target.elts[1].id, iterated.func.value


def library_state_writes(sources: dict[str, str]) -> list[Finding]:
    """The writes of library state in `sources` (path -> Python source). A write is an attribute stored or deleted
    (`x.a = v`, `x.a += v`, `del x.a`, setattr, delattr, a key of `vars(x)` or `x.__dict__`), or a container changed
    in place (`c[k] = v`, `del c[k]`, `c[k] += v`, `c.append(v)` and the other MUTATORS). With the attribute names
    of `library_attributes` (every, running):

    (a) an attribute written on an object other than a method's `self` that is private (`_x`, dunders included), in
        `running` (TrainerState's and TrainerControl's fields among them), or computed; unless the object is
        certainly of a class of the repository's own (below), or is the `control` that a TrainerCallback's `on_*`
        event is given and the attribute one of TrainerControl's switches;
    (b) an attribute written on `self` outside the constructor, in a class that derives from a library class (a base
        imported from a library, or a class of `sources` deriving from one), that one of its library bases stores on
        `self` (`library_class_attributes`; any in `every` for a base outside LIBRARY_SOURCES), or computed;
    (c) a container changed in place (in a constructor too) that is, or is an item of, an attribute (a) or (b) would
        count: reached directly, through `vars(x)`, `x.__dict__` or `getattr(x, "a")`, through a local bound to it or
        a loop over it, through a parameter that a call of `sources` passes it, or through an attribute of `self`
        that its class binds to it.

    An object is certainly of a class of the repository's own only if that class derives from no library class, is
    the one class of `sources` of its name, shares it with no library class, and is what the module means by the
    name (it defines the class, or imports it from the module of `sources` that does); and the object is a
    parameter annotated with it that no call of `sources` passes a library object (`self` of a class deriving from
    a library class, an attribute its library bases store, an object annotated with or built by a library class),
    a local annotated with it or bound only to a call of it, or an attribute of such an object (or of `self`) that
    its class binds only so and none of its library bases stores. Calls are matched to the functions of `sources`
    by name, every function of that name taken.

    Not seen: a library object handed over where nothing types it (an unannotated parameter, a call's result); a
    container returned by a call; writes through `operator`, `exec`, or references kept outside `sources`."""
    return Repository(sources).findings()


def unexplained_writes(found: list[Finding]) -> list[Finding]:
    """The writes of `found` that KEPT_LIBRARY_WRITES does not explain: a kept site explains one write, the first
    at it; a second write at the same site, or a write of the same text in another function, is unexplained."""
    at: dict[tuple, list[Finding]] = {}
    for finding in found:
        at.setdefault(finding.site, []).append(finding)
    unexplained = []
    for site, findings in at.items():
        unexplained += findings[1:] if site in KEPT_LIBRARY_WRITES else findings
    return sorted(unexplained, key=lambda f: (f.path, f.line))


def repository_sources() -> dict[str, str]:
    """The package's modules and the root scripts: path -> source."""
    paths = sorted(ROOT.glob("opsd/**/*.py")) + sorted(ROOT.glob("*.py"))
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in paths}


def test_the_library_attributes_hold_the_state_the_repository_must_not_write():
    every, running, mutated, _ = library_attributes()
    # TRL's generation and accelerate's optimizer change these as they run; the trainer's, its own.
    assert (
        {"_llm_weights_sleeping", "_is_overflow", "lr_scheduler", "current_step", "llm"} <= running <= every
    )
    assert {"_step", "_last_loaded_step", "_buffered_inputs", "lr_scheduler"} <= library_class_attributes(
        "SDFTTrainer"
    )
    assert {"_metrics", "_step"} <= library_class_attributes("GRPOTrainer")
    # TrainerState's and TrainerControl's fields, set by their generated constructors and by the trainer's loop.
    assert {"global_step", "log_history", "best_metric", "should_save", "should_training_stop"} <= running
    # Containers the libraries fill as they run: TRL's logging window, the trainer's callback list.
    assert {"_metrics", "callbacks"} <= mutated
    # Set only while a class constructs itself: configuration, which (a) leaves to the library's public API.
    assert "pad_token" in every - running
    assert library_class_attributes("TrainerCallback") == frozenset()
    assert "TrainerCallback" in library_lineage("DefaultFlowCallback")


TRAINER = "from trl.experimental.sdft import SDFTTrainer\n\n\nclass Trainer(SDFTTrainer):\n"
LEDGER = (
    "class Ledger:\n    def __init__(self, window):\n        self.window = window\n\n    def close(self):\n"
)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        # (1) a direct write in a trainer method: plain, augmented, in a closure of the constructor, through a
        # subclass of the repository's trainer class
        (TRAINER + "    def training_step(self, model, inputs):\n        self._buffered_inputs = None\n", ["6: self._buffered_inputs"]),
        (TRAINER + "    def step(self):\n        self._step += 1\n", ["6: self._step"]),
        (TRAINER + "    def __init__(self):\n        def later():\n            self.lr_scheduler = None\n", ["7: self.lr_scheduler"]),
        (TRAINER + "    pass\n\n\nclass Mine(Trainer):\n    def f(self):\n        self._last_loaded_step = 3\n", ["10: self._last_loaded_step"]),
        # (2) a setattr: on another object, through object.__setattr__, with a computed name, on the trainer
        ("def wake(generation):\n    setattr(generation, '_llm_weights_sleeping', False)\n", ["2: generation._llm_weights_sleeping"]),
        ("def f(trainer):\n    object.__setattr__(trainer, '_step', 0)\n", ["2: trainer._step"]),
        ("def replaced(module, name, value):\n    setattr(module, name, value)\n", ["2: setattr(module, <computed>)"]),
        (TRAINER + "    def f(self):\n        setattr(self, 'lr_scheduler', None)\n", ["6: self.lr_scheduler"]),
        # (3) a write in a helper module's function: private, public running state, annotated, unpacked, nested
        ("def sync(gen):\n    gen._llm_weights_sleeping = False\n", ["2: gen._llm_weights_sleeping"]),
        ("def skip(optimizer, skipped):\n    optimizer._is_overflow = skipped\n", ["2: optimizer._is_overflow"]),
        ("def f(trainer):\n    trainer.lr_scheduler: object = None\n", ["2: trainer.lr_scheduler"]),
        ("def f(trainer):\n    trainer.engine.llm, n = None, 2\n", ["2: trainer.engine.llm"]),
        ("import vllm\n\n\ndef patch(init):\n    vllm.LLM.__init__ = init\n", ["5: vllm.LLM.__init__"]),
        # an object of a class of the repository's own that derives from a library class is a library object
        ("from transformers import TrainingArguments\n\n\nclass Config(TrainingArguments):\n    pass\n\n\n"
         "def f(config: Config):\n    config._n_gpu = 2\n", ["9: config._n_gpu"]),
        # a local the rule cannot type: bound to the repository's class and to something else
        ("class Clock:\n    pass\n\n\ndef f(other):\n    clock = Clock()\n    clock = other\n    clock._step = 1\n", ["8: clock._step"]),
        # (4) through the object's namespace: a key of vars(x) or x.__dict__ stored, deleted or changed by a mutator
        (TRAINER + "    def f(self):\n        vars(self)['_buffered_inputs'] = None\n", ["6: vars(self)['_buffered_inputs']"]),
        ("def f(trainer):\n    trainer.__dict__['_step'] = 0\n", ["2: trainer.__dict__['_step']"]),
        ("def f(gen):\n    del vars(gen)['_llm_weights_sleeping']\n", ["2: del vars(gen)['_llm_weights_sleeping']"]),
        ("def f(trainer, saved):\n    vars(trainer).update(saved)\n", ["2: vars(trainer).update(...)"]),
        (TRAINER + "    def f(self):\n        self.__dict__.pop('_step')\n", ["6: self.__dict__.pop(...)"]),
        # (5) a deletion: del, delattr (through object.__delattr__, with a computed name)
        (TRAINER + "    def f(self):\n        del self._buffered_inputs\n", ["6: del self._buffered_inputs"]),
        ("def f(gen):\n    delattr(gen, '_llm_weights_sleeping')\n", ["2: del gen._llm_weights_sleeping"]),
        ("def f(trainer, name):\n    object.__delattr__(trainer, name)\n", ["2: delattr(trainer, <computed>)"]),
        # (6) TrainerState's and TrainerControl's fields; the switches outside a callback's event
        ("def rewind(trainer):\n    trainer.state.global_step = 0\n", ["2: trainer.state.global_step"]),
        ("def f(state):\n    state.best_metric = 1.0\n", ["2: state.best_metric"]),
        ("def f(trainer):\n    trainer.control.should_save = True\n", ["2: trainer.control.should_save"]),
        ("from transformers import TrainerCallback\n\n\nclass CB(TrainerCallback):\n    def stop(self, control):\n"
         "        control.should_training_stop = True\n", ["6: control.should_training_stop"]),
        # (7) a container of library state changed in place: by a mutator, an item stored, augmented or deleted,
        # reached through getattr; in a constructor too
        (TRAINER + "    def f(self):\n        self._metrics['train'].clear()\n", ["6: self._metrics['train'].clear(...)"]),
        ("def f(trainer):\n    trainer._metrics['train']['loss'].append(1.0)\n", ["2: trainer._metrics['train']['loss'].append(...)"]),
        ("def f(trainer):\n    trainer._metrics['train']['loss'] += [1.0]\n", ["2: trainer._metrics['train']['loss']"]),
        ("def f(trainer):\n    del trainer._metrics['eval']\n", ["2: del trainer._metrics['eval']"]),
        ("def f(trainer):\n    getattr(trainer, '_metrics').setdefault('train', {})\n", ["2: getattr(trainer, '_metrics').setdefault(...)"]),
        ("def f(state):\n    state.log_history.append({})\n", ["2: state.log_history.append(...)"]),
        ("def f(trainer, cb):\n    trainer.callback_handler.callbacks.insert(0, cb)\n", ["2: trainer.callback_handler.callbacks.insert(...)"]),
        (TRAINER + "    def __init__(self):\n        self._metrics['train']['x'] = []\n", ["6: self._metrics['train']['x']"]),
        # (8) ... through a local bound to it, a loop over it, a parameter a call passes it, an attribute bound to it
        ("def f(trainer):\n    window = trainer._metrics['train']\n    window['loss'].append(1.0)\n", ["3: window['loss'].append(...)"]),
        ("def f(trainer):\n    for mode, window in trainer._metrics.items():\n        window.clear()\n", ["3: window.clear(...)"]),
        ("def note(window, value):\n    window['loss'].append(value)\n\n\ndef f(trainer):\n    note(trainer._metrics['train'], 1.0)\n", ["2: window['loss'].append(...)"]),
        (LEDGER + "        self.window['loss'].append(1.0)\n\n\ndef build(trainer):\n    return Ledger(window=trainer._metrics['train'])\n", ["6: self.window['loss'].append(...)"]),
        (TRAINER + "    def __init__(self):\n        self.window = self._metrics['train']\n\n    def f(self):\n        self.window['x'] = [1.0]\n", ["9: self.window['x']"]),
        # (9) an annotation not taken on trust: a library object passed for it, a name the module binds otherwise, a
        # name a library class has too
        ("from trl import GRPOTrainer\n\n\nclass Clock:\n    pass\n\n\ndef tick(clock: Clock):\n    clock._step = 1\n\n\n"
         "class T(GRPOTrainer):\n    def f(self):\n        tick(self)\n", ["9: clock._step"]),
        ("class Clock:\n    pass\n\n\ndef tick(clock: Clock, trainer):\n    clock._step = 1\n\n\ndef f(trainer: 'SDFTTrainer'):\n"
         "    tick(trainer, None)\n\n\nfrom trl.experimental.sdft import SDFTTrainer\n", ["6: clock._step"]),
        ("class Clock:\n    pass\n\n\nClock = object\n\n\ndef tick(clock: Clock):\n    clock._step = 1\n", ["9: clock._step"]),
        ("class AcceleratorState:\n    pass\n\n\ndef f(state: AcceleratorState):\n    state._shared_state = {}\n", ["6: state._shared_state"]),
    ],
)  # fmt: skip
def test_the_library_state_rule_finds_each_write(snippet, expected):
    found = library_state_writes({"snippet.py": snippet})
    assert [str(f) for f in found] == [f"snippet.py:{e}" for e in expected]


def test_an_annotation_names_the_repositorys_class_only_where_the_module_means_it():
    """A class name two modules of the repository define, or that a module imports from elsewhere, types nothing;
    one imported from the module that defines it does."""
    clock = "class Clock:\n    pass\n"
    tick = "def tick(clock: Clock):\n    clock._step = 1\n"
    found = library_state_writes({"a.py": clock + "\n\n" + tick, "b.py": clock})
    assert [str(f) for f in found] == ["a.py:6: clock._step"]
    found = library_state_writes({"a.py": clock, "b.py": "from c import Clock\n\n\n" + tick})
    assert [str(f) for f in found] == ["b.py:5: clock._step"]
    assert library_state_writes({"a.py": clock, "b.py": "from a import Clock\n\n\n" + tick}) == []
    assert library_state_writes({"p/a.py": clock, "p/b.py": "from .a import Clock\n\n\n" + tick}) == []


@pytest.mark.parametrize(
    "snippet",
    [
        # the trainer's constructor sets library state up; its own attributes are its own anywhere
        TRAINER + "    def __init__(self):\n        self._step = 0\n        self.lr_scheduler = None\n        self.mine = 1\n"
        "    def f(self):\n        self.mine = 2\n        self._own = 3\n",
        # objects of the repository's own classes: a parameter annotated, a local built, an attribute bound so
        "class Job:\n    proc: object = None\n\n\ndef start(job: 'Job | None'):\n    job.proc = 1\n    job._started = 2\n",
        "class Clock:\n    def tick(self):\n        self._step = 1\n\n\ndef run():\n    clock = Clock()\n    clock._step = 2\n"
        "    setattr(clock, 'lr_scheduler', 3)\n",
        "class Seeds:\n    pass\n\n\nclass Engine:\n    def __init__(self, seeds: Seeds):\n        self.seeds = seeds\n\n"
        "    def generate(self, step):\n        self.seeds.current_step = step\n",
        # an annotation of the repository's own class, where every call passes an object of it
        "class Clock:\n    pass\n\n\ndef tick(clock: Clock):\n    clock._step = 1\n\n\ndef run():\n    tick(Clock())\n",
        # TrainerCallback stores nothing on `self`: a callback's attributes are its own
        "from transformers import TrainerCallback\n\n\nclass CB(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n        self.accelerator = kwargs['accelerator']\n",
        # a callback's event sets the switches of the `control` it is given, as transformers documents
        "from transformers import TrainerCallback\n\n\nclass Stop(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n        control.should_save = True\n"
        "        control.should_training_stop = True\n",
        # a dataclass's own fields after its generated constructor
        "from transformers import TrainingArguments\n\n\nclass Config(TrainingArguments):\n"
        "    def __post_init__(self):\n        self.output_dir = 'x'\n",
        # configuration a library sets only in constructors, through its public setter
        "def load(tok):\n    tok.pad_token = tok.eos_token\n",
        # reading a namespace or a library container; changing a copy of one
        "def f(obj, trainer):\n    seen = vars(obj)['x'], obj.__dict__.get('y'), len(trainer._metrics['train'])\n"
        "    window = dict(trainer._metrics['train'])\n    window.clear()\n    return seen\n",
        # containers of the repository's own: on `self` of its classes and of a trainer, in locals and parameters
        "class Own:\n    def __init__(self):\n        self.mine = []\n\n    def f(self):\n        self.mine.append(1)\n"
        "        del self.mine[0]\n        vars(self)['mine'] = []\n        del self.mine\n",
        TRAINER + "    def f(self):\n        self.mine.append(1)\n        self.window['x'] = 2\n        vars(self)['mine'] = []\n",
        "def f(own_dict, k, rows):\n    del own_dict[k]\n    own_dict[k] = 1\n    own_dict.update(a=1)\n    rows.append(own_dict)\n",
        LEDGER + "        self.window['loss'].append(1.0)\n\n\ndef build():\n    return Ledger(window={})\n",
    ],
)  # fmt: skip
def test_the_library_state_rule_passes_what_is_not_library_state(snippet):
    assert library_state_writes({"snippet.py": snippet}) == []


def function_named(tree: ast.AST, qualname: str) -> ast.FunctionDef:
    """The function of `tree` whose qualified name (`f`, `C.m`) is `qualname`."""

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef):
                name = prefix + child.name
                if name == qualname and isinstance(child, ast.FunctionDef):
                    return child
                inner = ".<locals>." if isinstance(child, ast.FunctionDef) else "."
                if (found := visit(child, name + inner)) is not None:
                    return found
        return None

    return visit(tree, "")


def insert(sources: dict[str, str], path: str, qualname: str | None, text: str) -> tuple[int, int, int]:
    """Puts the statements `text` into `sources[path]` (a new module if there is none): before the last statement of
    the function `qualname`, at its indentation, or at the module's end with qualname None. (the first inserted
    statement's line, the first line that moved or was added, how many lines were added)."""
    lines = sources.get(path, "").splitlines(keepends=True)
    block = [line + "\n" for line in text.splitlines()]
    if qualname is None:
        at, first, block = len(lines) + 1, len(lines) + 3, ["\n", "\n", *block]
    else:
        last = function_named(ast.parse(sources[path]), qualname).body[-1]
        at = first = last.lineno
        block = [lines[at - 1][: last.col_offset] + line for line in block]
    sources[path] = "".join(lines[: at - 1] + block + lines[at - 1 :])
    return first, at, len(block)


@functools.cache
def shipped_writes() -> tuple[dict[str, str], list[tuple[str, int, str]]]:
    """The repository's sources as this session first read them, and their unexplained writes (path, line, store),
    read once for the insertion tests (another process may edit the files meanwhile)."""
    sources = repository_sources()
    return sources, [(f.path, f.line, f.store) for f in unexplained_writes(library_state_writes(sources))]


SAMPLE = ("opsd_trainer.py", "OPSDTrainer._sample")
HELPER = ("opsd_trainer.py", None)


@pytest.mark.parametrize(
    "insertions",
    [
        # the kinds the rule has long found: a store on the trainer, a setattr on a library object it holds
        pytest.param([(*SAMPLE, "self._buffered_inputs = None", [(1, "self._buffered_inputs")])], id="store"),
        pytest.param([(*SAMPLE, "setattr(self.accelerator, 'step', 0)", [(1, "self.accelerator.step")])], id="setattr"),
        pytest.param([("opsd/run/inserted.py", None, "def sync(gen):\n    gen._llm_weights_sleeping = False", [(2, "gen._llm_weights_sleeping")])], id="new-module"),
        # through the object's namespace
        pytest.param([(*SAMPLE, "vars(self)['_buffered_inputs'] = None", [(1, "vars(self)['_buffered_inputs']")])], id="vars"),
        pytest.param([(*SAMPLE, "self.accelerator.__dict__['step'] = 0", [(1, "self.accelerator.__dict__['step']")])], id="__dict__"),
        # a deletion
        pytest.param([(*SAMPLE, "delattr(self, '_buffered_inputs')", [(1, "del self._buffered_inputs")])], id="delattr"),
        pytest.param([(*SAMPLE, "del self._last_loaded_step", [(1, "del self._last_loaded_step")])], id="del"),
        # TrainerState's and TrainerControl's fields
        pytest.param([(*SAMPLE, "self.state.global_step = 0", [(1, "self.state.global_step")])], id="state"),
        pytest.param([(*SAMPLE, "self.control.should_save = True", [(1, "self.control.should_save")])], id="control"),
        # a container of library state changed in place: directly, through a local, through a helper's parameter
        pytest.param([(*SAMPLE, "self._metrics['train'].clear()", [(1, "self._metrics['train'].clear(...)")])], id="clear"),
        pytest.param([(*SAMPLE, "self.state.log_history.append({})", [(1, "self.state.log_history.append(...)")])], id="log-history"),
        pytest.param([(*SAMPLE, "window = self._metrics['train']\nwindow['rollout/n'].append(1.0)", [(2, "window['rollout/n'].append(...)")])], id="alias"),
        pytest.param([(*SAMPLE, "_note(self._metrics['train'])", []),
                      (*HELPER, "def _note(window):\n    window['rollout/n'] += [1.0]", [(2, "window['rollout/n']")])], id="parameter"),
        # a helper's parameter annotated with a class of the repository's own and handed the trainer; one
        # annotated with the trainer's class
        pytest.param([(*SAMPLE, "_rewind(self)", []),
                      (*HELPER, "def _rewind(builder: PromptBuilder):\n    builder._step = 0", [(2, "builder._step")])], id="annotation"),
        pytest.param([(*SAMPLE, "_rewind(self)", []),
                      (*HELPER, "def _rewind(trainer: OPSDTrainer):\n    trainer._step = 0", [(2, "trainer._step")])], id="library-class"),
        # the kept setattr of `_replaced`, which the engine's generate reaches: a look-alike in another function,
        # a second one at the kept site
        pytest.param([("opsd/method/engine_vllm.py", "VLLMRolloutEngine.generate", "setattr(module, name, value)", [(1, "setattr(module, <computed>)")])], id="look-alike"),
        pytest.param([("opsd/method/engine_vllm.py", "_replaced", "setattr(module, name, value)", [(1, "setattr(module, <computed>)")])], id="second-at-site"),
    ],
)  # fmt: skip
def test_the_rule_finds_each_write_inserted_into_the_repository(insertions):
    """Each kind of write, inserted into the trainer's `_sample` or a helper it calls, is found there, and it
    alone is new among the repository's unexplained writes."""
    shipped, before = shipped_writes()
    sources, wanted = dict(shipped), []
    for path, qualname, text, expected in insertions:
        first, at, added = insert(sources, path, qualname, text)

        def moved(found, path=path, at=at, added=added):
            return [(p, line + added if p == path and line >= at else line, s) for p, line, s in found]

        before, wanted = moved(before), moved(wanted)
        wanted += [(path, first + offset - 1, store) for offset, store in expected]
    after = [(f.path, f.line, f.store) for f in unexplained_writes(library_state_writes(sources))]
    assert sorted(after) == sorted(before + wanted)


def test_the_repository_writes_no_library_state():
    """No module of the package and no root script writes the state of a TRL, transformers, accelerate, peft or
    vLLM object (`library_state_writes`) but at the sites of KEPT_LIBRARY_WRITES, once each: each owns its own
    state, and reaches the libraries' through their constructors, arguments and public methods."""
    sources = repository_sources()
    assert "opsd_trainer.py" in sources and "opsd/run/step_watch.py" in sources
    found = library_state_writes(sources)
    unexplained = unexplained_writes(found)
    assert unexplained == [], "library state written at:\n" + "\n".join(map(str, unexplained))
    # Each kept site is still there: one that went leaves the list too.
    stale = set(KEPT_LIBRARY_WRITES) - {f.site for f in found}
    assert not stale, stale


# The library state the repository writes on purpose, where no constructor argument or public method does it, each
# at its one site (module, function, the line's text), with its reason; any other write, and a second one at a kept
# site, fails `test_the_repository_writes_no_library_state`.
KEPT_LIBRARY_WRITES = {
    ("opsd/method/engine_classes.py", "own_classes", "module.__class__ = own[cls]"): (
        "the trainer's model objects get private subclasses of their own classes, because vLLM's Transformers "
        "backend decorates the transformers classes in place when a colocated engine starts"
    ),
    ("opsd/method/engine_vllm.py", "per_row_params", "sp.seed = seed"): (
        "the seed of a copy (`SamplingParams.clone`) made for one row and never shared; vLLM has no constructor "
        "for the same parameters with another seed"
    ),
    ("opsd/method/engine_vllm.py", "_replaced", "setattr(module, name, value)"): (
        "the one temporary stand-in for vLLM's `LLM` in TRL's `trl.generation.vllm_generation`, while "
        "`OPSDGeneration.__init__` runs TRL's constructor, undone on exit; tests/e2e/test_engine_injection.py "
        "checks the modules afterwards"
    ),
    ("opsd/method/engine_vllm.py", "_replaced", "setattr(module, name, original)"): (
        "the stand-in undone when the block exits, however it exits: the module's attribute is TRL's again"
    ),
    (
        "opsd/speed/compiled_layers.py",
        "compile_decoder_layers",
        "layer.forward = functools.partial(_cache_free, torch.compile(eager, backend=backend), eager)",
    ): (
        "a decoder layer's forward routed through torch.compile on the instance, so parameter names, state dict "
        "and hooks stay as they are (a wrapper module would rename them)"
    ),
}
