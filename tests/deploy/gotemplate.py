"""A Go text/template interpreter for the part of the language, and of Helm's
and Sprig's functions, that deploy/helm/turbokv uses, so that the chart can
be rendered and checked where helm is not installed (it is not packaged for
Debian 12).

It keeps the Go and Helm behaviour a chart can trip on: Helm decodes every
number in the values as a float64, so `eq`/`gt` between a value and an
integer literal fail as in Go unless the chart converts with `int`, and
numbers of a million and more print as 1e+06; a field of a missing map is an
error while a missing key is empty; `{{-` and `-}}` trim whitespace; `and`
and `or` return an operand and stop early; `range` over a map goes in key
order; `define`d templates are shared by all files; `indent` pads every
line, empty ones too; `fail` stops the rendering with its message, and
`required` does so when its value is nil or an empty string; `kindIs`
tells a value's reflect kind (a null or missing value is "invalid");
`.Capabilities.APIVersions.Has` finds only the API versions (and
"group/version/Kind" resources) the render is given beside Kubernetes' own,
as `helm template --api-versions` does; `lookup` finds nothing, as in
`helm template` (no cluster); `randAlphaNum` is random. Templates in
subdirectories of templates/ (tests/) are rendered too. Printing
a map or list (Go writes map[...]) is refused, since a chart means toYaml
there. Any other function or action (template, block, tpl, ...)
raises TemplateError naming it."""

import base64
import glob
import json
import os
import re
import secrets
import string
from decimal import Decimal

import yaml


class TemplateError(Exception):
    pass


def truth(value) -> bool:
    return not (value is None or value is False or (isinstance(value, (int, float)) and value == 0)
                or (isinstance(value, (str, list, dict)) and len(value) == 0))


def helm_values(value):
    """What Helm's YAML decoding makes of values: every number a float."""
    if isinstance(value, dict):
        return {k: helm_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [helm_values(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def format_value(value) -> str:
    """fmt's %v (strconv's shortest %g for floats); nil prints empty, as in Helm."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        number = Decimal(repr(value)).normalize()
        sign, digits, exponent = number.as_tuple()
        point = len(digits) + exponent - 1
        minus = "-" if sign else ""
        if point < -4 or point >= 6:
            mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
            return f"{minus}{mantissa}e{'+' if point >= 0 else '-'}{abs(point):02d}"
        return minus + format(abs(number), "f")
    if isinstance(value, (dict, list)):
        raise TemplateError(f"printing a map or list as text ({value!r}): use toYaml")
    return str(value)


def to_yaml(value) -> str:
    """Helm's toYaml: YAML with sorted keys, whole floats as integers, no final newline."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return v
    return yaml.safe_dump(plain(value), default_flow_style=False, sort_keys=True).rstrip("\n")


def _compare(name, a, b):
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        if type(a) is not type(b):
            raise TemplateError(f"{name}: incompatible types for comparison ({a!r}, {b!r})")
    elif isinstance(a, numbers) and isinstance(b, numbers):
        if type(a) is not type(b):
            raise TemplateError(f"{name}: incompatible types for comparison ({a!r}, {b!r}); convert with int")
    elif type(a) is not type(b) and a is not None and b is not None:
        raise TemplateError(f"{name}: incompatible types for comparison ({a!r}, {b!r})")
    return a, b


def _printf(fmt, *args):
    args = list(args)

    def verb(match):
        if match.group(0) == "%%":
            return "%"
        if match.group(0) not in ("%s", "%v"):
            raise TemplateError(f"printf {fmt!r}: unsupported verb {match.group(0)}")
        if not args:
            raise TemplateError(f"printf {fmt!r}: missing argument")
        return format_value(args.pop(0))
    out = re.sub(r"%.", verb, fmt)
    if args:
        raise TemplateError(f"printf {fmt!r}: extra arguments {args!r}")
    return out


def _to_int(value):
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        try:
            return int(float(value))
        except ValueError:
            return 0
    return 0


def _indent(width, text):
    pad = " " * int(width)
    return pad + str(text).replace("\n", "\n" + pad)


def _trunc(width, text):
    width = int(width)
    if width >= 0:
        return text[:width]
    return text[width:] if len(text) > -width else text


def _quote(*values):
    return " ".join(json.dumps(format_value(v)) for v in values if v is not None)


def _kind(value):
    """Sprig's kindOf: the reflect kind of a value as Helm holds it (nil is "invalid")."""
    if value is None:
        return "invalid"
    for types, kind in ((bool, "bool"), (float, "float64"), (int, "int"), (str, "string"), (dict, "map"),
                        (list, "slice")):
        if isinstance(value, types):
            return kind
    raise TemplateError(f"kindIs: no kind for {value!r}")


def _fail(message):
    """Helm's fail: rendering stops with the chart's message."""
    raise TemplateError(f"execution error: {message}")


def _required(message, value=None):
    """Helm's required: the value, unless it is nil or an empty string (0 and false pass)."""
    if value is None or value == "":
        _fail(message)
    return value


# The built-in API versions a chart may render (what `helm template` assumes
# of a cluster without custom resources), for .Capabilities.APIVersions.Has.
KUBERNETES_API_VERSIONS = frozenset({"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
                                     "rbac.authorization.k8s.io/v1", "autoscaling/v2"})


FUNCTIONS = {
    "default": lambda fallback, value=None: value if truth(value) else fallback,
    "toYaml": to_yaml,
    "nindent": lambda width, text: "\n" + _indent(width, text),
    "indent": _indent,
    "trunc": _trunc,
    "trimSuffix": lambda suffix, text: text[: -len(suffix)] if suffix and text.endswith(suffix) else text,
    "replace": lambda old, new, text: text.replace(old, new),
    "contains": lambda part, text: part in text,
    "hasPrefix": lambda prefix, text: text.startswith(prefix),
    "kindIs": lambda kind, value: _kind(value) == kind,
    "fail": _fail,
    "required": _required,
    "printf": _printf,
    "quote": _quote,
    "int": _to_int,
    "not": lambda v: not truth(v),
    "eq": lambda a, *others: any(x == y for x, y in (_compare("eq", a, b) for b in others)),
    "gt": lambda a, b: (lambda x, y: x > y)(*_compare("gt", a, b)),
    "lookup": lambda api_version, kind, namespace, name: {},
    "randAlphaNum": lambda n: "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(int(n))),
    "b64enc": lambda text: base64.b64encode(text.encode()).decode(),
}

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<variable>\$[A-Za-z_]\w*|\$)
  | (?P<field>(?:\.[A-Za-z_]\w*)+|\.)
  | (?P<word>[A-Za-z_]\w*)
  | (?P<punct>[()|,])
""", re.X)


def _lex(text):
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise TemplateError(f"cannot read {text[pos:]!r} in {{{{ {text} }}}}")
        pos = match.end()
        kind = match.lastgroup
        if kind == "space":
            continue
        value = match.group()
        # A field chain right after a variable: $.Values.x, $v.name.
        if kind == "field" and tokens and tokens[-1][0] == "variable" and match.start() == tokens[-1][2]:
            tokens[-1] = ("variable", tokens[-1][1] + value, pos)
            continue
        tokens.append((kind, value, pos))
    return [(kind, value) for kind, value, _ in tokens]


class _Parser:
    """Pipelines: [$v[, $w] :=] command ('|' command)*; a command is operands."""

    def __init__(self, text):
        self.text = text
        self.tokens = _lex(text)
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def take(self):
        token = self.peek()
        self.pos += 1
        return token

    def pipeline(self):
        declared, mode = [], None
        save = self.pos
        while self.peek()[0] == "variable" and "." not in self.peek()[1]:
            declared.append(self.take()[1])
            if self.peek()[1] == ",":
                self.take()
                continue
            break
        if declared and self.peek()[0] in ("declare", "assign"):
            mode = self.take()[0]
        else:
            self.pos, declared = save, []
        commands = [self.command()]
        while self.peek()[1] == "|":
            self.take()
            commands.append(self.command())
        return {"declare": declared, "mode": mode, "commands": commands}

    def command(self):
        operands = []
        while self.peek()[0] is not None and self.peek()[1] not in ("|", ")", ","):
            operands.append(self.operand())
        if not operands:
            raise TemplateError(f"empty command in {{{{ {self.text} }}}}")
        return operands

    def operand(self):
        kind, value = self.take()
        if kind == "punct" and value == "(":
            inner = self.pipeline()
            if self.take()[1] != ")":
                raise TemplateError(f"unclosed ( in {{{{ {self.text} }}}}")
            return ("pipeline", inner)
        if kind == "string":
            return ("literal", json.loads(value))
        if kind == "raw":
            return ("literal", value[1:-1])
        if kind == "number":
            return ("literal", float(value) if "." in value else int(value))
        if kind == "word" and value in ("true", "false", "nil"):
            return ("literal", {"true": True, "false": False, "nil": None}[value])
        if kind in ("field", "variable", "word"):
            return (kind, value)
        raise TemplateError(f"unexpected {value!r} in {{{{ {self.text} }}}}")

    def done(self):
        if self.pos != len(self.tokens):
            raise TemplateError(f"unexpected {self.tokens[self.pos][1]!r} in {{{{ {self.text} }}}}")


def _parse_pipeline(text):
    parser = _Parser(text)
    pipeline = parser.pipeline()
    parser.done()
    return pipeline


_ACTION = re.compile(r"{{(-\s)?(.*?)(\s-)?}}", re.S)


def _pieces(source, name):
    """Text and actions, with the trim markers applied."""
    out, pos = [], 0
    for match in _ACTION.finditer(source):
        text = source[pos:match.start()]
        if match.group(1):
            text = text.rstrip()
        out.append(("text", text))
        out.append(("action", match.group(2).strip()))
        pos = match.end()
        if match.group(3):
            rest = source[pos:]
            pos += len(rest) - len(rest.lstrip())
    out.append(("text", source[pos:]))
    if "{{" in "".join(t for k, t in out if k == "text"):
        raise TemplateError(f"{name}: unclosed action")
    return out


def _parse(source, name, templates):
    """The node tree of one file; its defines go into templates."""
    pieces = _pieces(source, name)
    root = []
    stack = [("root", root, None)]
    for kind, text in pieces:
        nodes = stack[-1][1]
        if kind == "text":
            if text:
                nodes.append(("text", text))
            continue
        if text.startswith("/*"):
            if not text.endswith("*/"):
                raise TemplateError(f"{name}: bad comment {text!r}")
            continue
        keyword, _, rest = text.partition(" ")
        rest = rest.strip()
        if keyword in ("if", "with", "range"):
            node = {"kind": keyword, "branches": [(_parse_pipeline(rest), [])], "else": None}
            nodes.append(("block", node))
            stack.append((keyword, node["branches"][0][1], node))
        elif keyword == "define":
            body = []
            templates[json.loads(rest)] = body
            stack.append(("define", body, None))
        elif keyword == "else":
            block, _, node = stack.pop()
            if node is None:
                raise TemplateError(f"{name}: else outside if/with/range")
            if rest.startswith("if ") and block == "if":
                branch = (_parse_pipeline(rest[3:]), [])
                node["branches"].append(branch)
                stack.append((block, branch[1], node))
            elif rest:
                raise TemplateError(f"{name}: unsupported else {rest!r}")
            else:
                node["else"] = []
                stack.append((block, node["else"], node))
        elif keyword == "end":
            if len(stack) == 1:
                raise TemplateError(f"{name}: end without a block")
            stack.pop()
        elif keyword in ("template", "block", "break", "continue"):
            raise TemplateError(f"{name}: unsupported action {keyword!r}")
        else:
            nodes.append(("action", _parse_pipeline(text)))
    if len(stack) != 1:
        raise TemplateError(f"{name}: {stack[-1][0]} without end")
    return root


# The value a command gets piped in when there is none (None is a value).
_NOTHING = object()


class Chart:
    """Renders a chart directory's templates as Helm would for given values."""

    def __init__(self, directory):
        self.directory = directory
        with open(os.path.join(directory, "Chart.yaml")) as f:
            self.chart = yaml.safe_load(f)
        self.templates, self.files = {}, {}
        templates = os.path.join(directory, "templates")
        for path in sorted(glob.glob(os.path.join(templates, "**", "*"), recursive=True)):
            if os.path.isfile(path):
                name = os.path.relpath(path, templates)
                with open(path) as f:
                    self.files[name] = _parse(f.read(), name, self.templates)

    def render(self, values, release="demo", namespace="default", api_versions=()):
        """{file name (relative to templates/): rendered text} for every
        template but the _*.tpl partials. api_versions: what the cluster
        serves beyond Kubernetes' built-in APIs, e.g. a custom resource's
        "monitoring.coreos.com/v1/PodMonitor"."""
        served = KUBERNETES_API_VERSIONS | set(api_versions)
        context = {
            "Values": helm_values(values),
            "Release": {"Name": release, "Namespace": namespace, "Service": "Helm",
                        "IsInstall": True, "IsUpgrade": False},
            "Chart": {"Name": self.chart["name"], "Version": self.chart["version"],
                      "AppVersion": self.chart.get("appVersion")},
            "Files": {"Get": self._file},
            "Capabilities": {"APIVersions": {"Has": lambda version: version in served}},
        }
        return {name: self._run(nodes, context, [{"$": context}])
                for name, nodes in self.files.items() if not os.path.basename(name).startswith("_")}

    def _file(self, path):
        with open(os.path.join(self.directory, path)) as f:
            return f.read()

    def _run(self, nodes, dot, scopes):
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "action":
                value = self._pipeline(node[1], dot, scopes)
                if not node[1]["declare"]:
                    out.append(format_value(value))
            else:
                out.append(self._block(node[1], dot, scopes))
        return "".join(out)

    def _include(self, name, argument):
        if name not in self.templates:
            raise TemplateError(f"no template {name!r}")
        return self._run(self.templates[name], argument, [{"$": argument}])

    def _block(self, node, dot, scopes):
        kind = node["kind"]
        for pipeline, body in node["branches"]:
            inner = scopes + [{}]
            value = self._pipeline(pipeline, dot, inner)
            if kind == "range":
                if value is None:
                    items = []
                elif isinstance(value, dict):
                    items = sorted(value.items())
                elif isinstance(value, list):
                    items = list(enumerate(value))
                else:
                    raise TemplateError(f"range over {value!r}")
                if items:
                    out = []
                    for key, item in items:
                        names = pipeline["declare"]
                        if len(names) == 2:
                            inner[-1].update({names[0]: key, names[1]: item})
                        elif len(names) == 1:
                            inner[-1][names[0]] = item
                        out.append(self._run(body, item, inner))
                    return "".join(out)
                break
            if truth(value):
                return self._run(body, value if kind == "with" else dot, inner)
        if node["else"] is not None:
            return self._run(node["else"], dot, scopes + [{}])
        return ""

    def _pipeline(self, pipeline, dot, scopes):
        value, piped = None, False
        for command in pipeline["commands"]:
            value = self._command(command, dot, scopes, value if piped else _NOTHING)
            piped = True
        names = pipeline["declare"]
        if names and pipeline["mode"] == "declare" and len(names) == 1:
            scopes[-1][names[0]] = value
        elif names and pipeline["mode"] == "assign":
            for scope in reversed(scopes):
                if names[0] in scope:
                    scope[names[0]] = value
                    break
            else:
                raise TemplateError(f"undefined variable {names[0]}")
        return value

    def _command(self, operands, dot, scopes, piped):
        head = operands[0]
        rest = operands[1:]
        if head[0] == "word":
            name = head[1]
            if name in ("and", "or"):
                args = [lambda o=o: self._operand(o, dot, scopes) for o in rest]
                if piped is not _NOTHING:
                    args.append(lambda: piped)
                value = None
                for arg in args:
                    value = arg()
                    if truth(value) != (name == "and"):
                        return value
                return value
            args = [self._operand(o, dot, scopes) for o in rest]
            if piped is not _NOTHING:
                args.append(piped)
            if name == "include":
                return self._include(*args)
            if name not in FUNCTIONS:
                raise TemplateError(f"unsupported function {name!r}")
            try:
                return FUNCTIONS[name](*args)
            except TypeError as e:
                raise TemplateError(f"{name}: wrong arguments {args!r} ({e})") from e
        value = self._operand(head, dot, scopes)
        if callable(value):
            args = [self._operand(o, dot, scopes) for o in rest]
            if piped is not _NOTHING:
                args.append(piped)
            return value(*args)
        if rest or piped is not _NOTHING:
            raise TemplateError(f"{head[1]!r} is not a function")
        return value

    def _operand(self, operand, dot, scopes):
        kind, value = operand
        if kind == "literal":
            return value
        if kind == "pipeline":
            return self._pipeline(value, dot, scopes + [{}])
        if kind == "word":
            raise TemplateError(f"function {value!r} used as a value")
        if kind == "variable":
            name, _, path = value.partition(".")
            for scope in reversed(scopes):
                if name in scope:
                    base = scope[name]
                    break
            else:
                raise TemplateError(f"undefined variable {name}")
            return self._fields(base, path, value)
        return self._fields(dot, value.lstrip("."), value)

    @staticmethod
    def _fields(base, path, text):
        value = base
        for key in [k for k in path.split(".") if k]:
            if value is None:
                raise TemplateError(f"nil pointer evaluating {text} (at .{key})")
            if not isinstance(value, dict):
                raise TemplateError(f"can't evaluate field {key} in {text}: not a map")
            value = value.get(key)
        return value

