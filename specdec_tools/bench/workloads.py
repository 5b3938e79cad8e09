"""Serving workloads for `specdec bench --workload NAME`: sequences of requests replayed against one engine
per method, so that what a drafter remembers across requests counts as it would in a server.

- `spec-bench`: Spec-Bench's first turns, every category (Apache-2.0).
- `multi-turn`: Spec-Bench's two-turn questions (MT-bench's 80, Apache-2.0): the first turn, then the
  second with the first answer in its context.
- `code-edit`: functions of Python's standard library (this interpreter's; PSF licence), each given with an
  instruction to change it (type hints, docstrings, renames, f-strings, validation) and return the whole code.
- `agentic`: a coding agent's loop over a standard-library module, a function per step. Each request resends
  the whole conversation with new tool output: the file as read back after the agent's last edit (applied
  when the answer holds a complete code block) and the edit's unified diff.
- `json`: JSON extraction under a schema (response_format): 12 short texts written for this project (a job
  posting, an invoice, a flight booking...), each with a schema of nested objects, enums, bounded arrays and
  number ranges; every request decodes under its schema's grammar, plain decoding too.
- `chat-ui`: a chat UI's conversation, CHAT_TURNS turns over a long system prompt (a standard-library module's
  source, about 2,000 tokens, as a documentation assistant's context), each turn resending the
  whole history, as chat UIs do.

Every answer in a later request's context is plain decoding's, so every method sees the same requests.
Each workload runs twice over the same requests: cold (every memory of earlier requests emptied first, a
server just started) and warm (after an unmeasured replay of the workload's warm-up sessions, disjoint from
the measured ones, through the methods that remember). Within a replay memories grow as in a server.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import itertools
import json
import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .prompts import Prompt, load_prompts, stratified
from .runner import Bench, Method, Run, run_block

# A session yields its requests one at a time and is sent each one's answer (decoded text) before the next.
Session = Generator[Prompt, str, None]

INSTRUCTIONS = (
    "Add type hints to every parameter and return value.",
    "Add a Google-style docstring to every function that lacks one.",
    "Rename the local variables to longer, descriptive names.",
    "Rewrite all string formatting (% or str.format) as f-strings, and any string concatenation that builds a message.",
    "Add input validation: raise TypeError or ValueError, with a clear message, for arguments of the wrong type or range.",
)

# Standard-library functions to edit: pure Python (not frozen, not C), 15-60 lines, from many modules.
CODE_EDIT_FUNCTIONS = (
    "textwrap.dedent", "statistics.quantiles", "urllib.parse.urlsplit", "difflib.get_close_matches",
    "ipaddress.summarize_address_range", "email.utils.formataddr", "glob.iglob", "colorsys.rgb_to_hls",
    "shutil.get_terminal_size", "quopri.decode", "statistics.correlation", "configparser.RawConfigParser.get",
    "heapq.nsmallest", "base64._85encode", "textwrap.TextWrapper._handle_long_word",
    "json.encoder.py_encode_basestring_ascii", "statistics.linear_regression", "dataclasses.astuple",
    "ipaddress.collapse_addresses", "urllib.parse.quote_from_bytes",
)

# Modules whose first top-level functions an agent edits, one per step.
AGENT_MODULES = ("colorsys", "fnmatch", "textwrap", "shlex", "bisect", "glob", "html", "heapq")
AGENT_FILE_LINES = 70  # at most this many lines of a module's functions make the agent's file
AGENT_STEPS = 3
CHAT_TURNS = 6
CHAT_SYSTEM_CHARACTERS = 8_000  # about 2,000 tokens of Python source
CHAT_MODULES = ("textwrap", "shlex", "heapq", "statistics", "difflib", "calendar", "string", "base64")


@dataclass(frozen=True)
class Workload:
    """A named sequence of sessions: `sessions(n)` the first n, measured; `warmup(n)` the next n (fewer where the
    workload runs out: 20 code edits, 8 agent modules), for the warm run."""

    name: str
    source: str  # where its text comes from, and under which licence
    sessions: Callable[[int], list[Callable[[], Session]]]

    def warmup(self, count: int) -> list[Callable[[], Session]]:
        return self.sessions(2 * count)[count:]


def _spec_bench(path: Path) -> Callable[[int], list[Callable[[], Session]]]:
    def make(count: int) -> list[Callable[[], Session]]:
        # Stratified over the file's categories, as the plain bench selects its prompts.
        return [_single(Prompt(f"spec-bench/{p.id}", "spec-bench", p.text)) for p in stratified(load_prompts(path), count)]

    return make


def _single(prompt: Prompt) -> Callable[[], Session]:
    def session() -> Session:
        yield prompt

    return session


def _multi_turn(path: Path) -> Callable[[int], list[Callable[[], Session]]]:
    def make(count: int) -> list[Callable[[], Session]]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        questions = {str(q["question_id"]): q for q in rows if len(q.get("turns", ())) == 2}
        tagged = [Prompt(i, q["category"], q["turns"][0]) for i, q in questions.items()]
        return [_conversation(f"multi-turn/{p.id}", questions[p.id]["turns"]) for p in stratified(tagged, count)]

    return make


def _conversation(name: str, turns: Sequence[str]) -> Callable[[], Session]:
    def session() -> Session:
        history: tuple[tuple[str, str], ...] = ()
        for number, turn in enumerate(turns, start=1):
            answer = yield Prompt(f"{name}/{number}", f"multi-turn {number}", turn, history)
            history += ((turn, answer),)

    return session


def _stdlib_source(qualname: str) -> tuple[str, str] | None:
    """(module, dedented source) of a standard-library function, or None where this Python lacks it."""
    for split in range(qualname.count("."), 0, -1):
        module_name, *attrs = qualname.rsplit(".", split)
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
            return module_name, inspect.cleandoc("\n" + inspect.getsource(obj)) + "\n"
        except (AttributeError, OSError, TypeError):
            return None
    return None


def _code_edit(count: int) -> list[Callable[[], Session]]:
    found = [(name, _stdlib_source(name)) for name in CODE_EDIT_FUNCTIONS]
    sessions = []
    for number, (name, (module, source)) in enumerate((n, s) for n, s in found if s):
        instruction = INSTRUCTIONS[number % len(INSTRUCTIONS)]
        text = (f"Here is a function from Python's `{module}` module:\n\n```python\n{source}```\n\n{instruction} "
                "Return the whole code, changed, in one ```python block.")
        sessions.append(_single(Prompt(f"code-edit/{name}", "code-edit", text)))
    return sessions[:count]


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _first_line(node: ast.FunctionDef) -> int:
    """Where a function's source starts: its first decorator, else its def (1-based)."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def agent_file(module_name: str) -> tuple[str, list[str]]:
    """The agent's file: a module's first top-level functions (at most AGENT_FILE_LINES lines), and their names."""
    source = inspect.getsource(importlib.import_module(module_name))
    lines = source.splitlines(keepends=True)
    chunks, names = [], []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            chunk = "".join(lines[_first_line(node) - 1 : node.end_lineno])
            if len("\n\n".join([*chunks, chunk]).splitlines()) > AGENT_FILE_LINES:
                break
            chunks.append(chunk)
            names.append(node.name)
    return "\n\n".join(chunks), names


_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def apply_edit(file: str, name: str, answer: str) -> str | None:
    """The file with function `name` replaced by its new version from the answer's code block, or None where the
    answer holds no complete block that defines it (truncated, or not code). Whatever else the block holds (the
    rest of the file, again) is left out."""
    for block in _PYTHON_BLOCK.findall(answer):
        try:
            new = _function(ast.parse(block), name)
        except SyntaxError:
            continue
        if new is not None:
            block_lines = block.splitlines(keepends=True)
            current = _function(ast.parse(file), name)
            lines = file.splitlines(keepends=True)
            replacement = "".join(block_lines[_first_line(new) - 1 : new.end_lineno]).rstrip("\n") + "\n"
            return "".join(lines[: _first_line(current) - 1]) + replacement + "".join(lines[current.end_lineno :])
    return None


def _agent_session(module_name: str) -> Callable[[], Session]:
    def session() -> Session:
        file, names = agent_file(module_name)
        path = f"lib/{module_name}.py"
        task = (f"You are a coding agent. Your task: add type hints and a docstring to every function in {path}, one "
                "function per step. Each step, answer with the function you changed, whole, in one ```python "
                "block; the harness applies it and shows you the file again.")
        text = f"{task}\n\nTool output (read_file {path}):\n```python\n{file}```\n\nChange `{names[0]}`."
        history: tuple[tuple[str, str], ...] = ()
        for step, name in enumerate(names[:AGENT_STEPS]):
            answer = yield Prompt(f"agentic/{module_name}/{step + 1}", "agentic", text, history)
            history += ((text, answer),)
            edited = apply_edit(file, name, answer)
            if edited is None:
                outcome = f"Tool output (apply_edit {path}): failed, no complete ```python block defines `{name}`; unchanged:"
            else:
                diff = "".join(difflib.unified_diff(file.splitlines(keepends=True), edited.splitlines(keepends=True),
                                                    f"a/{path}", f"b/{path}"))
                outcome = f"Tool output (apply_edit {path}):\n```diff\n{diff}```\n\nTool output (read_file {path}):"
                file = edited
            following = names[step + 1] if step + 1 < len(names) else None
            text = f"{outcome}\n```python\n{file}```\n\n" + (f"Change `{following}`." if following else "Done?")

    return session


def _agentic(count: int) -> list[Callable[[], Session]]:
    return [_agent_session(m) for m in AGENT_MODULES[:count]]


def _chat_session(module_name: str) -> Callable[[], Session]:
    def session() -> Session:
        source = inspect.getsource(importlib.import_module(module_name))[:CHAT_SYSTEM_CHARACTERS]
        system = (f"You are a documentation assistant for Python's `{module_name}` module. Answer from its source, "
                  f"briefly.\n\n```python\n{source}\n```")
        tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
        names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                 and not node.name.startswith("_") and node.lineno <= source.count("\n")]
        topics = (names * CHAT_TURNS)[:CHAT_TURNS] if names else [module_name] * CHAT_TURNS
        history: tuple[tuple[str, str], ...] = ()
        for turn, name in enumerate(topics, start=1):
            text = f"What does `{name}` do? Give one example call." if turn % 2 else f"When would I not use `{name}`?"
            answer = yield Prompt(f"chat-ui/{module_name}/{turn}", f"chat-ui {turn}", text, history, system)
            history += ((text, answer),)

    return session


def _chat_ui(count: int) -> list[Callable[[], Session]]:
    return [_chat_session(m) for m in CHAT_MODULES[:count]]


JSON_TEXTS = Path(__file__).with_name("data") / "json_extraction.jsonl"


def _json(count: int) -> list[Callable[[], Session]]:
    sessions = []
    for line in JSON_TEXTS.read_text().splitlines():
        item = json.loads(line)
        text = (f"Extract the information in this text as JSON, following this JSON Schema:\n\n```json\n"
                f"{json.dumps(item['schema'])}\n```\n\nText:\n{item['text']}")
        sessions.append(_single(Prompt(f"json/{item['id']}", "json", text, schema=item["schema"])))
    return sessions[:count]


def workloads(spec_bench: Path) -> dict[str, Workload]:
    """Every workload, by name; Spec-Bench's file gives the first two."""
    return {
        "spec-bench": Workload("spec-bench", f"Spec-Bench first turns ({spec_bench}), Apache-2.0", _spec_bench(spec_bench)),
        "multi-turn": Workload("multi-turn", f"Spec-Bench's two-turn (MT-bench) questions ({spec_bench}), Apache-2.0",
                               _multi_turn(spec_bench)),
        "code-edit": Workload("code-edit", "functions of this Python's standard library, PSF licence", _code_edit),
        "agentic": Workload("agentic", "an agent loop over this Python's standard-library modules, PSF licence", _agentic),
        "chat-ui": Workload("chat-ui", "a documentation chat over this Python's standard-library modules, PSF licence",
                            _chat_ui),
        "json": Workload("json", f"texts written for this project, each with a JSON Schema to fill ({JSON_TEXTS.name})", _json),
    }


def tagged(prompt: Prompt, phase: str) -> Prompt:
    """The prompt as measured in one phase: its own id (seed, cached ids) and a category per workload and phase."""
    return replace(prompt, id=f"{phase}/{prompt.id}", category=f"{prompt.category} {phase}")


def drive(session: Callable[[], Session], answer: Callable[[Prompt], str]) -> int:
    """Runs a session through, each request answered by `answer`; the number of requests."""
    requests = session()
    prompt, count = next(requests), 0
    while True:
        count += 1
        try:
            prompt = requests.send(answer(prompt))
        except StopIteration:
            return count


PHASES = ("cold", "warm")


def replay(
    bench: Bench, methods: Sequence[Method], workload: Workload, count: int, max_tokens: int, plain_every: int,
    first_block: int = 0, on_run: Callable[[Run], None] = lambda run: None,
    on_block: Callable[[list[Run]], None] = lambda runs: None,
) -> list[Run]:
    """A workload's `count` sessions, cold then warm, every request a block of every method beside plain."""
    runs: list[Run] = []
    numbers = itertools.count(first_block)  # block numbers: each block rotates the method order
    text = bench.target.tokenizer.decode
    for phase in PHASES:
        bench.forget()
        if phase == "warm":
            for method in (m for m in methods if bench.remembers(m)):
                for session in workload.warmup(count):
                    # Unmeasured, and each method's conversation goes on with its own answers.
                    drive(session, lambda prompt, m=method: text(
                        bench.run(m, [tagged(prompt, f"warm-up/{m.label}")], max_tokens, block=-1).outputs[0],
                        skip_special_tokens=True))

        def measured(prompt: Prompt, phase: str = phase) -> str:
            block = run_block(bench, methods, [tagged(prompt, phase)], max_tokens, next(numbers), plain_every, on_run)
            on_block(block)
            runs.extend(block)
            return text(block[0].outputs[0], skip_special_tokens=True)  # plain's answer: the same for every method

        for session in workload.sessions(count):
            drive(session, measured)
    return runs


def requests_in(workload: Workload, count: int) -> int:
    """How many requests `count` sessions hold (answers stand in as empty: the count does not depend on them)."""
    return sum(drive(session, lambda prompt: "") for session in workload.sessions(count))
