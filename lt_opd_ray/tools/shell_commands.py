"""Reads a shell command line without running it: which Ray nodes it starts, and with what environment.

Ray's cluster launcher runs each entry of a command list as its own `bash --login -i -c` on the node, so every
entry is read alone: `export` in one entry does not reach the next. The reader follows bash's grammar as far as a
launcher command needs it (`;`, `&&`, `||`, `|`, `&`, subshells, `{ ...; }` groups, redirections, quotes,
`$(...)` and backticks, `VAR=value` prefixes and `export` / `unset`, the wrappers `env`, `sudo`, `nohup`, `exec`,
`command`, `nice`, `timeout`, `setsid`, `stdbuf`, `time`, and `sh` / `bash -c '...'`), and reports what it cannot
follow instead of guessing: a here-document, control flow (`if`, `for`, `case`, ...), `eval` of an expansion, a
program named by an expansion. A Ray start (`ray start`, `ray symmetric-run`, `python -m ray.scripts.scripts
start`, any path to `ray`) is token-authenticated only where RAY_AUTH_MODE is proven to be `token` in the
environment the command gets: a variable inherited from the login shell (~/.bashrc) proves nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

UNKNOWN = "<unknown>"  # a variable whose value this reader cannot know (inherited, computed, maybe set)
UNSET = "<unset>"

OPERATORS = sorted(
    ["&&", "||", ";;", ";&", ";;&", "|&", "&>>", "&>", ">>", "<<<", "<<-", "<<", "<>", ">&", "<&", ">|",
     ";", "&", "|", "(", ")", "<", ">", "\n"],
    key=len, reverse=True,
)
REDIRECTIONS = {"<", ">", ">>", "<<<", "<>", ">&", "<&", ">|", "&>", "&>>"}
CONTROL_WORDS = {"if", "then", "elif", "else", "fi", "while", "until", "do", "done", "for", "case", "esac",
                 "select", "function", "coproc", "in"}
SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}
RAY_STARTS = {"start", "symmetric-run"}  # the `ray` commands that start a Ray node on this machine
RAY_GLOBAL_OPTIONS = {"--logging-level", "--logging-format"}
# what a start command may run besides Ray: shell built-ins and tools that start nothing
WRAPPER_FLAGS = {  # programs that run the command that follows their options
    "env": {"-i", "-", "--ignore-environment", "-0", "--null"}, "nice": set(), "exec": {"-c", "-l"},
    "timeout": {"--foreground", "--preserve-status", "-v", "--verbose"}, "nohup": set(), "command": {"-p", "-v", "-V"},
    "setsid": {"-c", "--ctty", "-f", "--fork", "-w", "--wait"}, "stdbuf": set(),
    "time": {"-p", "-a", "--append", "-v", "--verbose", "-q", "--quiet", "--portability"},
    "sudo": {"-E", "--preserve-env", "-H", "--set-home", "-n", "--non-interactive", "-b", "--background", "-S", "--stdin",
             "-P", "--preserve-groups", "-k", "--reset-timestamp", "-A", "--askpass", "-B", "--bell", "-i", "--login",
             "-s", "--shell"},
}
WRAPPER_VALUED = {
    "env": {"-u", "--unset", "-C", "--chdir"}, "nice": {"-n", "--adjustment"},
    "timeout": {"-s", "--signal", "-k", "--kill-after"}, "exec": {"-a"}, "nohup": set(), "command": set(),
    "setsid": set(), "stdbuf": {"-i", "-o", "-e", "--input", "--output", "--error"},
    "time": {"-o", "--output", "-f", "--format"},
    "sudo": {"-u", "--user", "-g", "--group", "-h", "--host", "-p", "--prompt", "-r", "--role", "-t", "--type",
             "-C", "--close-from", "-D", "--chdir", "-U", "--other-user", "-T", "--command-timeout"},
}
PLAIN_PROGRAMS = {"ulimit", "export", "unset", "echo", "printf", "true", "false", ":", "sleep", "cd", "mkdir",
                  "test", "[", "which", "set"}
NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# `ray` as a word of its own: the program, a path to it, `ray.` module paths, `ray[default]`, RAY_ variables, a quoted
# `'ray start ...'`; not `lt-opd-ray`, `lt_opd_ray`, `ray-cluster.yaml` or the directory `.ray`
RAY_WORD = re.compile(r"(?<![A-Za-z0-9_.$\-])ray(?![A-Za-z0-9_\-])|RAY_AUTH", re.I)
# files every later command reads before it runs: the launcher runs each as `bash --login -i -c`, so a function, an
# alias or a variable written into one changes what a proven `ray start` runs; Python's start-up hooks likewise
STARTUP_FILES = {".bashrc", ".bash_profile", ".bash_login", ".profile", ".bash_aliases", ".bash_logout",
                 ".pam_environment", ".inputrc", ".zshrc", ".zshenv", ".zprofile", "sitecustomize.py", "usercustomize.py"}
ETC_STARTUP = re.compile(r"(^|/)etc/(profile|profile\.d(/.*)?|bash\.bashrc|bashrc|environment|bash_completion\.d(/.*)?)$")
# a home directory or /etc as a whole: a recursive copy or an archive unpacked there may write a start-up file
HOME_OR_ETC = re.compile(r"(~[A-Za-z0-9_-]*|\$HOME|\$\{HOME\}|/root|/home/[^/]+|/etc|/etc/profile\.d|\.|)/?(\.)?")
COPIERS = {"cp", "mv", "rsync", "install", "ln", "scp", "ditto"}
UNPACKERS = {"tar", "bsdtar", "unzip", "cpio"}
OUTPUTS = {">", ">>", ">|", "&>", "&>>", "<>", ">&"}
PACKAGE_MANAGERS = {"pip", "uv", "conda", "mamba", "micromamba", "poetry", "pipenv", "pdm", "easy_install", "pipx", "rye"}
INSTALL_FIX = "let the image carry Ray (cluster/Dockerfile and the runtime extra of pyproject.toml pin it) and install no other"
STARTUP_FIX = "leave the shell start-up files and ~/.ray to the image and file_mounts (the token comes from file_mounts)"


def _path_of(text: str) -> str:
    """The path a word names: `of=~/.bashrc` and `--target-directory=~/.ray` name their value."""
    return text.split("=", 1)[1] if re.match(r"-*[A-Za-z][A-Za-z0-9_-]*=", text) else text


def protected_path(text: str) -> str | None:
    """What a path is, where writing it changes what later commands run or which token Ray uses; None otherwise."""
    path = _path_of(text).rstrip("/")
    parts = path.split("/")
    if ".ray" in parts or parts[-1] == "auth_token":
        return "Ray's directory ~/.ray, where its auth token lives"
    if parts[-1] in STARTUP_FILES or parts[-1].endswith(".pth") or ETC_STARTUP.search(path):
        return "a shell or Python start-up file, which every later command reads (`bash --login -i`)"
    return None


def ray_word(words) -> str | None:
    """The first word that names Ray (the program, a `ray.` module, a RAY_ variable), as written."""
    return next((w.raw for w in words if RAY_WORD.search(w.text)), None)


class Unreadable(Exception):
    """Raised with a phrase saying what the reader cannot follow ("uses a here-document")."""


@dataclass
class Word:
    text: str  # after quote removal; expansions are kept as written
    raw: str  # as written
    dynamic: bool = False  # holds an expansion ($VAR, $(...), a glob): its value is not known here
    substitutions: list[str] = field(default_factory=list)  # commands run by $(...), `...`, <(...)
    end: int = 0
    redirect: str = ""  # the operator of the redirection this word is the target of (">", ">>", "<", ...)


@dataclass
class Op:
    text: str
    start: int


@dataclass
class RayStart:
    """One command that starts a Ray node, with what its environment is proven to hold."""

    command: str
    subcommand: str
    auth_mode: str  # RAY_AUTH_MODE's value, or UNKNOWN / UNSET
    token_path: str  # RAY_AUTH_TOKEN_PATH's value, or UNKNOWN / UNSET
    token: str  # RAY_AUTH_TOKEN's value, or UNKNOWN / UNSET
    under_sudo: bool
    head: bool
    dashboard_host: str | None
    system_config_auth: bool  # --system-config names an auth setting (or cannot be read)


@dataclass
class Reading:
    starts: list[RayStart] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # phrases: "runs ~/start.sh, a script check-cluster cannot read"
    fixes: list[str | None] = field(default_factory=list)  # for each phrase, what to do instead (None: start Ray with token auth)

    def refuse(self, phrase: str, fix: str | None = None):
        self.unreadable.append(phrase)
        self.fixes.append(fix)


# ---------------------------------------------------------------- lexer


def _balanced(line: str, i: int, close: str = ")") -> int:
    """Index just past the `)` closing the group whose body starts at i (quotes and nesting respected)."""
    depth = 1
    while i < len(line):
        c = line[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            j = line.find("'", i + 1)
            if j < 0:
                raise Unreadable("has an unclosed quote")
            i = j + 1
            continue
        if c == '"':
            i = _double_quoted_end(line, i + 1)
            continue
        if c == "(":
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise Unreadable("has an unclosed parenthesis")


def _double_quoted_end(line: str, i: int) -> int:
    while i < len(line):
        if line[i] == "\\":
            i += 2
        elif line[i] == '"':
            return i + 1
        elif line.startswith("$(", i):
            i = _balanced(line, i + 2)
        else:
            i += 1
    raise Unreadable("has an unclosed quote")


def _expansion(line: str, i: int, word: Word) -> int:
    """Reads the expansion at line[i] == '$' into word; returns the index after it."""
    if line.startswith("$'", i):
        raise Unreadable("uses $'...' quoting")
    if line.startswith("$((", i):
        end = _balanced(line, i + 3)
        inner = line[i + 3:end - 1]
        if "$(" in inner or "`" in inner:
            raise Unreadable("runs a command inside an arithmetic expansion")
        word.dynamic = True
        word.text += line[i:end + 1]
        return end + 1
    if line.startswith("$(", i):
        end = _balanced(line, i + 2)
        word.substitutions.append(line[i + 2:end - 1])
        word.dynamic = True
        word.text += line[i:end]
        return end
    if line.startswith("${", i):
        end = line.find("}", i)
        if end < 0:
            raise Unreadable("has an unclosed ${")
        if "$(" in line[i:end] or "`" in line[i:end]:
            raise Unreadable("runs a command inside a ${...} expansion")
        word.dynamic = True
        word.text += line[i:end + 1]
        return end + 1
    match = re.match(r"\$(" + NAME + r"|[0-9@*#?$!-])", line[i:])
    if match:
        word.dynamic = True
        word.text += match.group(0)
        return i + len(match.group(0))
    word.text += "$"
    return i + 1


def _backtick(line: str, i: int, word: Word) -> int:
    j = i + 1
    while j < len(line) and line[j] != "`":
        j += 2 if line[j] == "\\" else 1
    if j >= len(line):
        raise Unreadable("has an unclosed backtick")
    word.substitutions.append(re.sub(r"\\([$`\\])", r"\1", line[i + 1:j]))
    word.dynamic = True
    word.text += line[i:j + 1]
    return j + 1


def tokenize(line: str) -> list[Word | Op]:
    tokens: list[Word | Op] = []
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in " \t":
            i += 1
            continue
        if c == "\\" and line.startswith("\\\n", i):
            i += 2
            continue
        if c == "#":  # a comment runs to the end of the line
            while i < n and line[i] != "\n":
                i += 1
            continue
        if c in "<>" and line.startswith("(", i + 1):  # process substitution
            end = _balanced(line, i + 2)
            tokens.append(Word(line[i:end], line[i:end], True, [line[i + 2:end - 1]], end))
            i = end
            continue
        op = next((o for o in OPERATORS if line.startswith(o, i)), None)
        if op is not None:
            tokens.append(Op(op, i))
            i += len(op)
            continue
        word, start = Word("", ""), i
        while i < n and line[i] not in " \t\n;&|()<>":
            c = line[i]
            if c == "\\":
                if i + 1 < n and line[i + 1] == "\n":
                    i += 2
                    continue
                word.text += line[i + 1:i + 2]
                i += 2
            elif c == "'":
                j = line.find("'", i + 1)
                if j < 0:
                    raise Unreadable("has an unclosed quote")
                word.text += line[i + 1:j]
                i = j + 1
            elif c == '"':
                i += 1
                while True:
                    if i >= n:
                        raise Unreadable("has an unclosed quote")
                    c = line[i]
                    if c == '"':
                        i += 1
                        break
                    if c == "\\" and i + 1 < n and line[i + 1] in '$`"\\\n':
                        word.text += line[i + 1] if line[i + 1] != "\n" else ""
                        i += 2
                    elif c == "$":
                        i = _expansion(line, i, word)
                    elif c == "`":
                        i = _backtick(line, i, word)
                    else:
                        word.text += c
                        i += 1
            elif c == "$":
                i = _expansion(line, i, word)
            elif c == "`":
                i = _backtick(line, i, word)
            else:
                if c in "*?" or (c == "{" and i > start) or (c == "{" and i + 1 < n and line[i + 1] not in " \t\n"):
                    word.dynamic = True  # a glob or a brace expansion: the words it becomes are not known here
                word.text += c
                i += 1
        word.raw, word.end = line[start:i], i
        tokens.append(word)
    return tokens


# ---------------------------------------------------------------- parser
# list: and_or ((';' | '&' | newline) and_or)* ; and_or: pipeline (('&&' | '||') pipeline)* ;
# pipeline: ['!'] command ('|' command)* ; command: simple | '(' list ')' | '{' list '}'


@dataclass
class Simple:
    words: list[Word]
    redirect_targets: list[Word]


@dataclass
class Group:
    body: list  # a list node
    subshell: bool


class _Parser:
    def __init__(self, tokens: list[Word | Op]):
        self.tokens, self.i = tokens, 0

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def parse_list(self, closer: str | None = None) -> list:
        """[(and_or, background)]; stops before `closer` (")" or the word "}")."""
        items = []
        while True:
            while isinstance(self.peek(), Op) and self.peek().text in (";", "\n"):
                self.i += 1
            token = self.peek()
            if token is None or self._closes(token, closer):
                return items
            and_or = self.parse_and_or(closer)
            background = False
            token = self.peek()
            if isinstance(token, Op) and token.text in (";", "&", "\n"):
                background = token.text == "&"
                self.i += 1
            elif token is not None and not self._closes(token, closer):
                raise Unreadable(f"has {token.text!r} where a command ends")
            items.append((and_or, background))

    @staticmethod
    def _closes(token, closer):
        if closer == ")":
            return isinstance(token, Op) and token.text == ")"
        return closer is not None and isinstance(token, Word) and token.raw == closer

    def parse_and_or(self, closer):
        pipelines, ops = [self.parse_pipeline(closer)], []
        while isinstance(self.peek(), Op) and self.peek().text in ("&&", "||"):
            ops.append(self.peek().text)
            self.i += 1
            while isinstance(self.peek(), Op) and self.peek().text == "\n":
                self.i += 1
            pipelines.append(self.parse_pipeline(closer))
        return pipelines, ops

    def parse_pipeline(self, closer):
        commands = [self.parse_command(closer)]
        while isinstance(self.peek(), Op) and self.peek().text in ("|", "|&"):
            self.i += 1
            commands.append(self.parse_command(closer))
        return commands

    def parse_command(self, closer):
        token = self.peek()
        while isinstance(token, Word) and token.raw in ("!", "time"):
            self.i += 1  # `! cmd`, bash's `time [-p] cmd`: the command runs as written
            if token.raw == "time" and isinstance(self.peek(), Word) and self.peek().raw == "-p":
                self.i += 1
            token = self.peek()
        if token is None:
            raise Unreadable("ends where a command should follow")
        if isinstance(token, Op) and token.text == "(":
            self.i += 1
            body = self.parse_list(")")
            self._expect(")", Op)
            return Group(body, subshell=True), self._redirections([])
        if isinstance(token, Word) and token.raw == "{":
            self.i += 1
            body = self.parse_list("}")
            self._expect("}", Word)
            return Group(body, subshell=False), self._redirections([])
        if isinstance(token, Word) and token.raw in CONTROL_WORDS:
            raise Unreadable(f"uses shell control flow ({token.raw} ...), which check-cluster does not follow")
        if isinstance(token, Word) and token.raw == "[[":
            raise Unreadable("uses a [[ ... ]] test, which check-cluster does not follow")
        words: list[Word] = []
        targets: list[Word] = []
        while True:
            token = self.peek()
            if isinstance(token, Word):
                if closer == "}" and token.raw == "}" and not words:
                    break
                words.append(token)
                self.i += 1
            elif isinstance(token, Op) and token.text in ("<<", "<<-"):
                raise Unreadable("uses a here-document")
            elif isinstance(token, Op) and token.text in REDIRECTIONS:
                if words and words[-1].end == token.start and words[-1].raw.isdigit():
                    words.pop()  # `2>`: a file descriptor, not an argument
                targets += self._redirections([])
            elif isinstance(token, Op) and token.text in (";;", ";&", ";;&"):
                raise Unreadable("uses a case statement, which check-cluster does not follow")
            else:
                break
        if not words and not targets:
            raise Unreadable(f"has {token.text!r} where a command should be" if token else "ends where a command should follow")
        return Simple(words, targets), []

    def _redirections(self, targets):
        while isinstance(self.peek(), Op) and self.peek().text in REDIRECTIONS:
            operator = self.peek().text
            self.i += 1
            target = self.peek()
            if not isinstance(target, Word):
                raise Unreadable("has a redirection without a target")
            target.redirect = operator
            targets.append(target)
            self.i += 1
        return targets

    def _expect(self, text, kind):
        token = self.peek()
        if not isinstance(token, kind) or (token.text if kind is Op else token.raw) != text:
            raise Unreadable(f"has no closing {text!r}")
        self.i += 1


# ---------------------------------------------------------------- evaluation


@dataclass
class State:
    """What the shell knows of its variables: exported (the environment of what it runs) and its own."""

    exported: dict[str, str] = field(default_factory=dict)
    default: str = UNKNOWN  # the value of a variable not in `exported`: inherited (unknown) or UNSET after `env -i`
    local: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> str:
        return self.exported.get(name, self.default)

    def copy(self) -> State:
        return State(dict(self.exported), self.default, dict(self.local))

    def child(self) -> State:
        """What a program started from here gets: the exported variables only."""
        return State(dict(self.exported), self.default, {})


def merge(a: State, b: State) -> State:
    """What is known after either a or b."""
    merged = State(default=a.default if a.default == b.default else UNKNOWN)
    for name in set(a.exported) | set(b.exported):
        merged.exported[name] = a.get(name) if a.get(name) == b.get(name) else UNKNOWN
    for name in set(a.local) | set(b.local):
        merged.local[name] = a.local.get(name) if a.local.get(name) == b.local.get(name) else UNKNOWN
    return merged


def _assignment(word: Word) -> tuple[str, str] | None:
    match = re.match(r"(" + NAME + r")(\+?)=", word.raw)
    if not match:
        return None
    value = word.text[word.text.index("=") + 1:]
    return match.group(1), UNKNOWN if (match.group(2) or word.dynamic) else value


def _basename(word: Word) -> str | None:
    """The program's name, or None where an expansion makes it (a directory from $HOME is fine)."""
    name = word.text.rsplit("/", 1)[-1]
    return None if not name or re.search(r"[$`*?]", name) or (word.dynamic and "/" not in word.text) else name


def _node_words(node) -> list[Word]:
    """Every word of a command node (a simple command or a group), redirection targets included."""
    command, targets = node
    if isinstance(command, Simple):
        return command.words + command.redirect_targets + targets
    words = list(targets)
    for and_or, _background in command.body:
        for pipeline in and_or[0]:
            for inner in pipeline:
                words += _node_words(inner)
    return words


def _is_fd(target: Word) -> bool:
    return target.redirect in (">&", "<&") and re.fullmatch(r"\d*-?", target.text) is not None


def _writes_file(target: Word) -> bool:
    return target.redirect in OUTPUTS and not _is_fd(target) and target.text not in ("/dev/null", "/dev/stdout", "/dev/stderr")


def _requirement_problem(word: Word, conda: bool = False) -> str | None:
    """Why installing this requirement may bring a Ray check-cluster cannot vouch for; None where it names another project."""
    text = word.text.strip()
    if word.dynamic:
        return f"installs {word.raw}, a requirement check-cluster cannot read"
    if "://" in text or re.match(r"[A-Za-z]+\+[A-Za-z]+:", text) or text.startswith("git@"):
        return f"installs from {word.raw}, a URL check-cluster cannot read"
    base = text.rstrip("/").rsplit("/", 1)[-1]
    pattern = r"(.*::)?ray(-[a-z]+)?\s*([=<>!~\[ ]|$)" if conda else r"ray(\[[^\]]*\])?\s*([<>=!~;@(,]|$)"
    if re.match(pattern, text, re.I) or re.match(r"ray-\d.*\.(whl|tar\.gz|zip)$", base, re.I):
        return (f"installs Ray ({word.raw}), whose version check-cluster cannot prove honours RAY_AUTH_MODE "
                "(a Ray older than token auth ignores it)")
    return None


PIP_FILES = {"-r", "--requirement", "-c", "--constraint", "--build-constraints", "--overrides", "--override",
             "--constraints", "--requirements", "--file"}
PIP_VALUED = {"-e", "--editable", "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-t", "--target",
              "--prefix", "--root", "--src", "--upgrade-strategy", "--platform", "--python-version", "--implementation",
              "--abi", "--no-binary", "--only-binary", "--progress-bar", "--cache-dir", "--log", "--proxy", "--retries",
              "--timeout", "--trusted-host", "--cert", "--client-cert", "--exists-action", "--global-option",
              "--config-settings", "-C", "--python", "-p", "--report", "--root-user-action", "--keyring-provider",
              "--index", "--default-index", "--group", "--extra", "--optional", "--dev-group", "--source", "--channel",
              "-n", "--name", "--spec", "--with", "--directory", "--project", "--package", "--suffix", "--pip-args"}


def _install_problem(name: str, args: list[Word]) -> str | None:
    """Why a package manager's command may install a Ray check-cluster cannot vouch for (None: it installs none)."""
    conda = name in ("conda", "mamba", "micromamba")
    positional: list[Word] = []
    i = 0
    while i < len(args):
        arg, text = args[i], args[i].text
        if arg.dynamic and text.startswith("-"):
            return f"gives {name} the option {arg.raw}, which check-cluster cannot read"
        if not text.startswith("-") or text == "-":
            positional.append(arg)
            i += 1
            continue
        if text in ("--all", "--update-all") and conda:
            return f"upgrades every package with {text}, Ray among them, to a version check-cluster cannot prove honours RAY_AUTH_MODE"
        option, eq, value = text.partition("=") if text.startswith("--") else (text[:2], "", text[2:])
        if option in PIP_FILES or option in PIP_VALUED or (conda and option in ("-f", "-c", "-n", "-p")):
            if not value and not eq:
                i += 1
                value_word = args[i] if i < len(args) else Word("", "")
            else:
                value_word = Word(value, value, arg.dynamic)
            if (option in PIP_FILES and not (conda and option == "-c")) or (conda and option == "-f"):
                return f"installs from {value_word.raw or text}, a file check-cluster cannot read"
            if option in ("-e", "--editable", "--with", "--spec") and (why := _requirement_problem(value_word, conda)):
                return why
        i += 1
    if not positional:
        return None
    sub, rest = positional[0].text, positional[1:]
    if name == "uv" and sub == "pip" and rest:
        sub, rest = rest[0].text, rest[1:]
        name = "uv pip"
    if conda and sub == "env":
        return f"runs {name} env {rest[0].raw if rest else ''}, which installs from an environment file check-cluster cannot read"
    if sub in ("sync", "lock") or (sub in ("install", "update", "upgrade") and name in ("poetry", "pdm", "rye", "uv")) or (
            sub == "install" and name == "pipenv" and not rest):
        return f"runs {name} {sub}, which installs what a project or lock file check-cluster cannot read lists"
    if sub in ("install", "add", "create", "update", "upgrade", "inject") or name == "easy_install":
        targets = positional if name == "easy_install" else rest
        for word in targets:
            if why := _requirement_problem(word, conda):
                return why
    return None


class _Reader:
    def __init__(self, strict: bool, reading: Reading):
        self.strict, self.reading = strict, reading
        self.pipe_words: list[Word] = []  # the words of the pipeline a command is part of (what it may read from)
        self.outputs: list[Word] = []  # the files what runs now writes to (its own and its groups' redirections)
        self.inputs: list[Word] = []  # the files and here-strings it reads
        self.names_ray = False  # the command line names Ray somewhere

    def opaque(self, phrase: str, words: list[Word]):
        """Something a command runs that check-cluster cannot see into: a start command may run none; a setup command
        may, unless it is given (or fed through a pipe) a word that names Ray, or a path that changes what later runs."""
        for word in words:
            if what := protected_path(word.text):
                self.unreadable(f"{phrase}, on {word.raw}, {what}", STARTUP_FIX)
                return
        if name := ray_word(words + self.inputs + self.pipe_words):
            self.unreadable(f"{phrase}, with {name} among the words it is given")
            return
        if self.names_ray and (dynamic := next((w for w in words[1:] if w.dynamic), None)):
            self.unreadable(f"{phrase}, with {dynamic.raw}, an expansion, in a command that names Ray")
            return
        if self.strict:
            self.unreadable(phrase)

    def unreadable(self, phrase: str, fix: str | None = None):
        self.reading.refuse(phrase, fix)

    def redirections(self, targets: list[Word]):
        """A redirection may not write a start-up file, Ray's directory, a program named ray, or a file it cannot name."""
        for target in targets:
            if not _writes_file(target):
                continue
            base = target.text.rstrip("/").rsplit("/", 1)[-1]
            if what := protected_path(target.text):
                self.unreadable(f"writes {target.raw}, {what}", STARTUP_FIX)
            elif base == "ray":
                self.unreadable(f"writes {target.raw}, a program named ray, which a later `ray start` may run", STARTUP_FIX)
            elif target.dynamic and re.search(r"[$`*?\[{]", base):
                self.unreadable(f"writes {target.raw}, a file check-cluster cannot name (it may be a shell start-up file)", STARTUP_FIX)

    def copies(self, name: str, args: list[Word], words: list[Word]) -> bool:
        """cp -r, rsync, an archive unpacked into a home directory or /etc: it may write a start-up file unseen."""
        options = [a.text for a in args if a.text.startswith("-")]
        paths = [a for a in args if not a.text.startswith("-")]
        home = next((a for a in paths if HOME_OR_ETC.fullmatch(a.text)), None)
        if name in UNPACKERS:
            extracts = name in ("unzip", "cpio") or any(
                o in ("--extract", "--get") or (not o.startswith("--") and "x" in o) for o in options) or (
                paths and re.fullmatch(r"[a-zA-Z]*x[a-zA-Z]*", paths[0].text))
            into = next((args[k + 1] for k, a in enumerate(args[:-1]) if a.text in ("-C", "--directory", "-d")), None)
            into = into or next((Word(a.text.split("=", 1)[1], a.raw) for a in args if a.text.startswith("--directory=")), None)
            if extracts and (into is None or HOME_OR_ETC.fullmatch(into.text)):
                where = into.raw if into else "the home directory it runs in"
                self.unreadable(f"runs {words[0].raw}, which unpacks an archive into {where}, where it may write a shell start-up file", STARTUP_FIX)
                return True
            return False
        recursive = name == "rsync" or any(re.fullmatch(r"-[A-Za-z]*[rRa][A-Za-z]*|--recursive|--archive", o) for o in options)
        if home is not None and (recursive or any(a.dynamic for a in paths)):
            self.unreadable(f"runs {words[0].raw}, which copies what check-cluster cannot list into {home.raw}, where it may write a shell start-up file", STARTUP_FIX)
            return True
        return False

    def text(self, line: str, state: State) -> State:
        tokens = tokenize(line)
        parser = _Parser(tokens)
        body = parser.parse_list()
        if parser.peek() is not None:
            raise Unreadable(f"has an unmatched {parser.peek().text!r}")
        return self.list_(body, state)

    def list_(self, items, state: State) -> State:
        for and_or, background in items:
            after = self.and_or(and_or, state if not background else state.copy())
            state = state if background else after  # `cmd &` runs in a subshell
        return state

    def and_or(self, node, state: State) -> State:
        pipelines, ops = node
        starts = [state]
        afters = []
        for k, pipeline in enumerate(pipelines):
            if k:
                start = afters[-1]
                if k >= 2 and ops[k - 2] != ops[k - 1]:  # the one before may have been skipped and this one still runs
                    start = merge(start, starts[-1])
                starts.append(start)
            afters.append(self.pipeline(pipeline, starts[-1]))
        end = afters[-1]
        for skipped in starts[1:]:  # any pipeline after the first may not run, and the rest with it
            end = merge(end, skipped)
        return end

    def pipeline(self, commands, state: State) -> State:
        if len(commands) == 1:
            return self.command(commands[0], state)
        saved = self.pipe_words
        self.pipe_words = saved + [word for command in commands for word in _node_words(command)]
        try:
            for command in commands:  # every part of a pipeline runs in a subshell of its own
                self.command(command, state.copy())
        finally:
            self.pipe_words = saved
        return state

    def command(self, node, state: State) -> State:
        command, targets = node
        for target in targets:
            self.substitutions(target, state)
        if isinstance(command, Simple):
            for target in command.redirect_targets:
                self.substitutions(target, state)
            targets = targets + command.redirect_targets
        self.redirections(targets)
        saved = self.outputs, self.inputs
        self.outputs = self.outputs + [t for t in targets if _writes_file(t)]
        self.inputs = self.inputs + [t for t in targets if t.redirect in ("<", "<<<", "<>")]
        try:
            if isinstance(command, Group):
                after = self.list_(command.body, state.copy())
                return state if command.subshell else after
            return self.simple(command.words, state)
        finally:
            self.outputs, self.inputs = saved

    def substitutions(self, word: Word, state: State):
        for inner in word.substitutions:
            self.text(inner, state.copy())

    def simple(self, words: list[Word], state: State) -> State:
        for word in words:
            self.substitutions(word, state)
        assignments = []
        while words and (assignment := _assignment(words[0])):
            assignments.append(assignment)
            words = words[1:]
        if not words:  # shell variables: they reach the environment only where the name is exported already
            state = state.copy()
            for name, value in assignments:
                if state.get(name) not in (UNKNOWN, UNSET):  # exported with a known value: the new one is exported
                    state.exported[name] = value
                state.local[name] = value  # unknown stays unknown (~/.bashrc may export it), unset stays unset
            return state
        env = state.child()
        env.exported.update(dict(assignments))
        return self.run(words, env, state, in_shell=True, under_sudo=False)

    # a program and its arguments, in the environment `env`; `state` is the shell's (changed by built-ins)
    def run(self, words: list[Word], env: State, state: State, in_shell: bool, under_sudo: bool) -> State:
        program = words[0]
        name = _basename(program)
        if name is None:
            self.opaque(f"runs {program.raw}, a program named by an expansion", words)
            return state
        args = words[1:]
        if in_shell and name in ("export", "unset", "declare", "typeset", "local", "readonly", "source", ".", "eval"):
            return self.builtin(name, args, state)
        wrapped = self.wrapper(name, args, env)
        if wrapped is not None:
            rest, env, sudo = wrapped
            if rest:
                self.run(rest, env, state, in_shell=False, under_sudo=under_sudo or sudo)
            return state
        if name in SHELLS:
            self.shell(name, args, env, under_sudo)
        elif re.fullmatch(r"python(\d+(\.\d+)?)?", name):
            self.python(args, env, under_sudo)
        elif name == "ray":
            self.ray(args, env, under_sudo)
        elif name in PACKAGE_MANAGERS or re.fullmatch(r"pip\d*(\.\d+)?", name):
            self.package(name, words)
        elif name in ("echo", "printf"):
            written = next((t for t in self.outputs if _writes_file(t)), None)
            if written is not None and (ray := ray_word(args)):
                self.unreadable(f"writes {ray} into {written.raw}, a file a later command may run or read")
        elif name not in PLAIN_PROGRAMS:
            if not ((name in COPIERS or name in UNPACKERS) and self.copies(name, args, words)):
                self.opaque(f"runs {program.raw}, which check-cluster cannot read", words)
        return state

    def package(self, name: str, words: list[Word]):
        """pip, uv, conda, ...: an install that may bring a Ray other than the image's is refused, in every list."""
        if why := _install_problem(name, words[1:]):
            self.unreadable(why, INSTALL_FIX)
        else:
            self.opaque(f"runs {words[0].raw}, which check-cluster cannot read", words)

    def builtin(self, name: str, args: list[Word], state: State) -> State:
        state = state.copy()
        if name in ("source", ".", "eval"):
            if name == "eval" and args and not any(a.dynamic for a in args):
                return self.text(" ".join(a.text for a in args), state)
            self.opaque(f"runs {name} {' '.join(a.raw for a in args)}, which check-cluster cannot read", args)
            return State()  # anything may have changed
        options = [a.text for a in args if a.text.startswith("-")]
        for arg in args:
            if arg.text.startswith("-"):
                continue
            assignment = _assignment(arg)
            var = assignment[0] if assignment else arg.text
            if name == "unset":
                state.exported[var] = UNSET
                state.local.pop(var, None)
            elif name == "export" and not options:
                value = assignment[1] if assignment else state.local.get(var, state.get(var))
                state.exported[var] = value
                state.local[var] = value
            else:  # declare -x, export -n, readonly, local: not followed
                state.exported[var] = UNKNOWN
                state.local[var] = UNKNOWN
        return state

    def wrapper(self, name: str, args: list[Word], env: State) -> tuple[list[Word], State, bool] | None:
        """(the wrapped command, its environment, whether under sudo) for a program that runs another; None otherwise."""
        if name not in WRAPPER_VALUED:
            return None
        flags, valued = WRAPPER_FLAGS[name], WRAPPER_VALUED[name]
        env = env.copy()

        def flag(option: str) -> bool:  # False: the wrapper runs nothing (`command -v`)
            nonlocal env
            if (name == "env" and option in ("-i", "-", "--ignore-environment")) or (name == "exec" and option == "-c"):
                env = State(default=UNSET)
            return not (name == "command" and option in ("-v", "-V"))

        i = 0
        while i < len(args):
            arg, text = args[i], args[i].text
            if arg.dynamic and text.startswith("-"):
                self.unreadable(f"gives {name} the option {arg.raw}, which check-cluster cannot read")
                return [], env, False
            if text == "--":
                i += 1
                break
            if text == "-" and name == "env":
                flag("-")
            elif not text.startswith("-") or text == "-":
                break
            elif name == "nice" and re.fullmatch(r"-\d+", text):
                pass
            elif text.startswith("--"):
                option, eq, value = text.partition("=")
                if option in flags and not eq:
                    if not flag(option):
                        return [], env, False
                elif option in valued:
                    if not eq:
                        i += 1
                        value = args[i].text if i < len(args) else ""
                    if name == "env" and option == "--unset":
                        env.exported[value] = UNSET
                else:
                    self.unreadable(f"gives {name} the option {arg.raw}, which check-cluster does not follow")
                    return [], env, False
            else:
                for j in range(1, len(text)):
                    option = "-" + text[j]
                    if option in flags:
                        if not flag(option):
                            return [], env, False
                        continue
                    if option in valued:
                        value = text[j + 1:]
                        if not value:
                            i += 1
                            value = args[i].text if i < len(args) else ""
                        if name == "env" and option == "-u":
                            env.exported[value] = UNSET
                        break
                    self.unreadable(f"gives {name} the option {arg.raw}, which check-cluster does not follow")
                    return [], env, False
            i += 1
        if name == "timeout":  # the duration comes before the command
            i += 1
        rest = args[i:]
        if name == "sudo":  # sudo's policy (env_reset, env_keep, secure_path, the home) decides the command's environment
            env = State()
        if name in ("env", "sudo"):
            while rest and re.match(r"[^=]+=", rest[0].text):
                var, _, value = rest[0].text.partition("=")
                env.exported[var] = UNKNOWN if rest[0].dynamic else value
                rest = rest[1:]
        return rest, env, name == "sudo"

    def shell(self, name: str, args: list[Word], env: State, under_sudo: bool):
        login, i = False, 0
        while i < len(args):
            arg, text = args[i], args[i].text
            if arg.dynamic or not re.match(r"[-+]", text) or text in ("-", "--"):
                break
            if text in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file"):
                i += 2
                continue
            if text.startswith("--"):
                login = login or text == "--login"
            elif re.fullmatch(r"[-+][A-Za-z]+", text):
                login = login or (text[0] == "-" and ("l" in text or "i" in text))
                if text[0] == "-" and "c" in text:
                    rest = args[i + 1:]
                    if not rest or rest[0].dynamic:
                        self.unreadable(f"runs {name} -c with a command check-cluster cannot read")
                        return
                    shell_env = State() if login else env.child()  # a login or interactive shell reads ~/.profile, ~/.bashrc
                    before = len(self.reading.starts)
                    self.text(rest[0].text, shell_env)
                    for start in self.reading.starts[before:]:
                        start.under_sudo = start.under_sudo or under_sudo
                    return
            i += 1
        self.opaque(f"runs {name} on a script or its input, which check-cluster cannot read", [Word(name, name), *args])

    def python(self, args: list[Word], env: State, under_sudo: bool):
        i = 0
        while i < len(args):
            arg, text = args[i], args[i].text
            if arg.dynamic:
                break
            match = re.fullmatch(r"-([bBdEhiIOqsSuvVx]*)([mc])(.*)", text)
            if match:
                value = match.group(3)
                if not value:
                    i += 1
                    if i >= len(args):
                        return
                    if args[i].dynamic:
                        self.unreadable("runs Python code or a module named by an expansion")
                        return
                    value = args[i].text
                if match.group(2) == "c":
                    if re.search(r"\bray\b", value):
                        self.unreadable("runs Python code that uses Ray, which check-cluster cannot read")
                    else:
                        self.opaque("runs Python code, which check-cluster cannot read", args)
                elif value in ("pip", "pip3"):
                    self.package("pip", [Word("python -m pip", "python -m pip"), *args[i + 1:]])
                elif value == "ray.scripts.scripts":
                    self.ray(args[i + 1:], env, under_sudo, command=None)
                elif value == "ray" or value.startswith("ray."):
                    self.unreadable(f"runs the Python module {value}, which check-cluster cannot read")
                else:
                    self.opaque(f"runs the Python module {value}, which check-cluster cannot read", args)
                return
            if text in ("-W", "-X", "--check-hash-based-pycs"):
                i += 2
                continue
            if not text.startswith("-") or text == "-":
                break
            i += 1
        self.opaque("runs a Python script, which check-cluster cannot read", args)

    def ray(self, args: list[Word], env: State, under_sudo: bool, command: str | None = None):
        i = 0
        while i < len(args):
            arg = args[i]
            if arg.dynamic:
                self.unreadable(f"runs ray with {arg.raw}, which check-cluster cannot read")
                return
            option = arg.text.partition("=")[0]
            if option in RAY_GLOBAL_OPTIONS:
                i += 1 if "=" in arg.text else 2
                continue
            if arg.text in ("--version", "--help", "-h"):
                return
            if arg.text.startswith("-"):
                self.unreadable(f"gives ray the option {arg.raw} before its command, which check-cluster does not follow")
                return
            break
        if i >= len(args):
            self.unreadable("runs ray without a command check-cluster can read")
            return
        sub = args[i].text
        if sub == "up":
            self.unreadable("runs ray up, which starts a cluster from a config check-cluster does not see")
        if sub not in RAY_STARTS:
            return
        options = args[i + 1:]
        host, system_config = None, False
        for k, arg in enumerate(options):
            option, has_value, value = arg.text.partition("=")
            if option in ("--dashboard-host", "--system-config"):
                if not has_value:
                    value = options[k + 1].text if k + 1 < len(options) and not options[k + 1].dynamic else UNKNOWN
                elif arg.dynamic:
                    value = UNKNOWN
                if option == "--dashboard-host":
                    host = value
                else:
                    try:
                        parsed = json.loads(value)
                        system_config = not isinstance(parsed, dict) or any("auth" in str(key).lower() for key in parsed)
                    except ValueError:
                        system_config = True
        self.reading.starts.append(RayStart(
            command=command or " ".join(a.raw for a in args), subcommand=sub,
            auth_mode=env.get("RAY_AUTH_MODE"), token_path=env.get("RAY_AUTH_TOKEN_PATH"), token=env.get("RAY_AUTH_TOKEN"),
            under_sudo=under_sudo, head=any(a.text == "--head" for a in options), dashboard_host=host,
            system_config_auth=system_config,
        ))


def read_command(line: str, strict: bool) -> Reading:
    """What one launcher command runs. `strict` (a start command): everything it runs must be readable and plain;
    otherwise (a setup command) only the Ray starts it makes, and anything about Ray it cannot read, are reported."""
    reading = Reading()
    reader = _Reader(strict, reading)
    reader.names_ray = RAY_WORD.search(line) is not None
    try:
        reader.text(line, State())
    except Unreadable as exc:
        reading.refuse(str(exc))
    return reading
