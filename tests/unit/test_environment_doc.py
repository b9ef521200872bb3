"""docs/environment.md lists every environment variable ds_odc reads, and nothing it no longer reads.

The source is read, not run: ``ds_odc/``, ``ds_odc_autoload.py`` and ``ds_odc_import_hooks.py`` are parsed with
``ast``, and a variable counts as read where its name is the key of ``os.environ.get`` / ``.setdefault`` /
``.pop``, ``os.environ[...]``, ``... in os.environ`` or ``os.getenv`` (``environ`` as a bare name too: a
parameter that receives ``os.environ``). A key given by a constant is followed through module-level
assignments, aliases and imports to its string; a key the test cannot follow fails it, so a read cannot hide
behind an expression. Module-level string constants named ``ENV_*``, ``*_SWITCH`` or ``*_VAR``, or whose value
starts with ``DS_ODC_``, count as read too: they are how the package names its variables."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "environment.md")
SECTION = "## Variables ds_odc reads"
#: What a variable's name looks like (a prefix such as ``"DS_ODC_"`` is not one).
VARIABLE = re.compile(r"^[A-Z][A-Z0-9_]*[A-Z0-9]$")
#: Constants that name a variable by their own name, or by their value's prefix.
CONSTANT_NAME = re.compile(r"^(ENV_\w+|\w+_SWITCH|\w+_VAR)$")
VALUE_PREFIX = "DS_ODC_"
#: Text without these reads no variable, and text that NAMING does not find names none.
READ_WORDS = ("environ", "getenv")
NAMING = re.compile(r"^(ENV_\w+|\w+_SWITCH|\w+_VAR)\b|^\w+\s*(:[^=]+)?=\s*[\"']DS_ODC_", re.M)


def _sources() -> dict:
    """module name -> (source text, is a package)."""
    paths = glob.glob(os.path.join(ROOT, "ds_odc", "**", "*.py"), recursive=True)
    paths += [os.path.join(ROOT, "ds_odc_autoload.py"), os.path.join(ROOT, "ds_odc_import_hooks.py")]
    sources = {}
    for path in paths:
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        package = name.endswith(".__init__")
        with open(path) as handle:
            sources[name[:-len(".__init__")] if package else name] = (handle.read(), package)
    return sources


class _Module:
    """A module's top-level names: string constants, aliases of other names, and imported names."""

    def __init__(self, name: str, tree: ast.Module, package: bool):
        self.name, self.tree = name, tree
        self.strings, self.aliases, self.imported, self.modules = {}, {}, {}, {}
        base = name if package else name.rpartition(".")[0]
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if not isinstance(target, ast.Name):
                        continue
                    if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                        self.strings[target.id] = node.value.value
                    elif isinstance(node.value, ast.Name):
                        self.aliases[target.id] = node.value.id
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    parent = base
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    source = f"{parent}.{source}".strip(".")
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.modules[alias.asname or alias.name.split(".")[0]] = alias.name


class _Reads:
    """Every variable the modules read, and the keys that could not be followed to a name. A module is parsed only
    where its text may read the environment or name a variable, or where a key's name is imported from it."""

    def __init__(self, sources: dict):
        self.sources, self.parsed = sources, {}
        self.read, self.unresolved = set(), []
        for name, (text, _) in sources.items():
            reads, names = any(word in text for word in READ_WORDS), NAMING.search(text) is not None
            if reads or names:
                module = self.module(name)
                self._constants(module)
                for node in ast.walk(module.tree) if reads else ():
                    for key in _keys(node):
                        self._count(module, key, node)

    def module(self, name: str):
        """The parsed module ``name``, or None for one outside the sources."""
        if name not in self.parsed and name in self.sources:
            text, package = self.sources[name]
            self.parsed[name] = _Module(name, ast.parse(text), package)
        return self.parsed.get(name)

    def resolve(self, module: "_Module", name: str, depth: int = 0):
        if depth > 20:
            return None
        if name in module.strings:
            return module.strings[name]
        if name in module.aliases:
            return self.resolve(module, module.aliases[name], depth + 1)
        if name in module.imported:
            source, original = module.imported[name]
            if self.module(source) is not None:
                return self.resolve(self.module(source), original, depth + 1)
        return None

    def _constants(self, module: "_Module") -> None:
        for name in set(module.strings) | set(module.aliases):
            value = self.resolve(module, name)
            if isinstance(value, str) and VARIABLE.match(value) and (CONSTANT_NAME.match(name)
                                                                      or value.startswith(VALUE_PREFIX)):
                self.read.add(value)

    def _count(self, module: "_Module", key: ast.AST, node: ast.AST) -> None:
        value = None
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            value = key.value
        elif isinstance(key, ast.Name):
            value = self.resolve(module, key.id)
        elif isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name):  # a module's constant
            base = key.value.id
            imported = ".".join(module.imported[base]) if base in module.imported else None
            target = module.modules.get(base) or imported
            if target is not None and self.module(target) is not None:
                value = self.resolve(self.module(target), key.attr)
        if value is None:
            self.unresolved.append(f"{module.name}:{node.lineno}: {ast.unparse(key)}")
        else:
            self.read.add(value)


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _keys(node: ast.AST):
    """The keys ``node`` reads the environment with (none for most nodes)."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") and _is_environ(func.value):
            yield node.args[0]
        elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or \
                (isinstance(func, ast.Name) and func.id == "getenv"):
            yield node.args[0]
    elif isinstance(node, ast.Subscript) and _is_environ(node.value):
        yield node.slice
    elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
            and _is_environ(node.comparators[-1]):
        yield node.left


def _documented() -> list:
    """The variables of the page's first table, one entry per row's name."""
    with open(PAGE) as handle:
        text = handle.read()
    assert SECTION in text, f"docs/environment.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1])
    return names


def test_every_variable_ds_odc_reads_has_a_row_and_every_row_is_still_read():
    reads = _Reads(_sources())
    assert not reads.unresolved, ("environment reads whose key this test cannot follow to a name (use a string "
                                  "or a module-level constant): " + "; ".join(reads.unresolved))
    documented = _documented()
    assert len(documented) == len(set(documented)), f"a variable has two rows: {sorted(documented)}"
    missing = sorted(reads.read - set(documented))
    assert not missing, f"read by ds_odc but without a row in docs/environment.md: {missing}"
    stale = sorted(set(documented) - reads.read)
    assert not stale, f"rows of docs/environment.md's '{SECTION}' that ds_odc no longer reads: {stale}"
    assert {"DS_ODC_STAGE3", "DS_ODC_OPTIONS", "DS_ODC_AUTOLOAD", "ACCELERATE_DEEPSPEED_ZERO_STAGE"} <= reads.read


def test_the_collector_sees_each_way_of_reading_a_variable_and_refuses_a_key_it_cannot_follow():
    sources = {
        "pkg": ("", True),
        "pkg.names": ('OFF_SWITCH = "DS_ODC_A"\nOTHER = "NOT_A_VARIABLE_CONSTANT"\nENV_B = "B_VAR"\n'
                      'PREFIX = "DS_ODC_"\nSPARE = "DS_ODC_SPARE"\n', False),
        "pkg.user": ("import os\nfrom os import environ, getenv\nfrom pkg.names import OFF_SWITCH as SWITCH\n"
                     "from . import names\nALIAS = SWITCH\n"
                     "def f(env=os.environ):\n"
                     "    os.environ.get(ALIAS)\n    environ['C']\n    getenv('D')\n    os.getenv(names.OTHER)\n"
                     "    return 'E' in os.environ, os.environ.setdefault('F', '1'), os.environ.pop('G', None)\n",
                     False),
    }
    reads = _Reads(sources)
    assert reads.read == {"DS_ODC_A", "B_VAR", "C", "D", "NOT_A_VARIABLE_CONSTANT", "E", "F", "G", "DS_ODC_SPARE"}
    assert not reads.unresolved
    hidden = _Reads({"m": ("import os\ndef f(name):\n    return os.environ[name + '_X']\n", False)})
    assert hidden.unresolved == ["m:3: name + '_X'"]
