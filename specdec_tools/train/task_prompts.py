"""Prompts at data scale for the target's own answers (the data engine, train/answers.py): thousands, written
here from real code and real tasks, never from Spec-Bench.

- code: functions of Python's standard library (6-40 lines, tests and GUI packages left out), each under one
  task: explain, document, test, refactor, fix, extend, port, complexity;
- general: instructions composed from the lists below (writing, role play, reasoning, arithmetic, science and
  humanities, advice), and summaries, extractions and translations of real text (the standard library's module
  docstrings and the first lines of its functions' docstrings).

The list depends on the Python whose standard library it reads, so it is made once and committed
(``data/train/prompts.jsonl.gz``): the answers' shards index it, and a later session on another Python resumes
them with the same prompts.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import random
import sysconfig
from pathlib import Path

SKIPPED_PACKAGES = ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "tkinter", "ensurepip", "pydoc_data")
FUNCTION_LINES = (6, 40)

CODE_TASKS = {
    "explain": "Explain what this function from Python's `{module}` module does, step by step, and when one would use it.",
    "document": "Write a clear docstring for `{name}` below (arguments, return value, exceptions) and add comments where "
                "the logic is not obvious. Return the documented function.",
    "test": "Write pytest unit tests for `{name}` below. Cover the normal cases, the edge cases and the errors it raises.",
    "refactor": "Refactor `{name}` to be easier to read without changing its behaviour, and explain each change.",
    "fix": "Review `{name}` for bugs, unhandled edge cases and unclear names. List what you find, then give a corrected "
           "version.",
    "extend": "Add type hints to `{name}` and extend it to validate its arguments with helpful error messages. Show the "
              "new version and an example call.",
    "port": "Port this Python function to {language}, keeping its behaviour. Point out where the two languages differ.",
    "complexity": "What are the time and space complexity of `{name}`? Explain why, and say whether it could be faster.",
}
LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "Java", "C++", "C#", "Kotlin", "Swift", "Ruby")

TOPICS = (
    "urban gardening", "learning a second language as an adult", "remote work", "the history of the printing press",
    "electric bicycles", "sleep and memory", "public libraries", "ocean tides", "volunteering", "home energy saving",
    "the first moon landing", "board games", "recycling plastics", "running a small bakery", "bird migration",
    "open-source software", "train travel in Europe", "the invention of the telephone", "minimalism", "coral reefs",
    "budgeting for students", "jazz music", "beekeeping", "the Silk Road", "photography for beginners",
    "desert ecosystems", "chess strategy", "water conservation", "the Renaissance", "vaccines", "wind power",
    "time management", "street food", "the human immune system", "video game design", "ancient Egypt",
    "mountain hiking safety", "recorded music formats", "composting", "the stock market", "volcanoes",
    "team sports for children", "the history of maps", "cybersecurity at home", "meditation", "glaciers",
    "community theatre", "the Industrial Revolution", "pet adoption", "solar panels", "handwriting",
    "the invention of the bicycle", "astronomy as a hobby", "food waste", "public speaking", "rainforests",
    "the history of coffee", "3D printing", "first aid", "the Roman roads", "museum visits", "cycling to work",
)
AUDIENCES = ("a new team member", "a landlord", "a customer who received a damaged order", "a former teacher",
             "the city council", "a conference organizer", "a neighbour", "a hiring manager", "a group of parents",
             "a software vendor", "a club's members", "a professor")
PERSONAS = ("a lighthouse keeper", "a medieval blacksmith", "a ship's navigator in 1800", "a museum guide",
            "a chef in a busy kitchen", "a park ranger", "a retired astronaut", "a detective in the 1920s",
            "a marathon coach", "a librarian", "a travelling musician", "a beekeeper")
PEOPLE = ("a shy inventor", "an old fisherman", "two rival bakers", "a robot learning to paint", "a lost tourist",
          "a girl who can talk to birds", "a night-shift nurse", "a retired spy", "a young chess champion",
          "a village postman")
SITUATIONS = ("finds a map in a library book", "has one day to save the town fair", "misses the last train home",
              "discovers a hidden garden", "must cross a frozen lake", "receives a letter from the future",
              "loses their voice before a big speech", "wins a prize they did not enter for")
CONCEPTS = ("compound interest", "photosynthesis", "inflation", "natural selection", "the greenhouse effect",
            "supply and demand", "plate tectonics", "opportunity cost", "the placebo effect", "entropy",
            "the water cycle", "herd immunity", "game theory", "the scientific method", "confirmation bias",
            "the Doppler effect", "comparative advantage", "machine learning", "blockchains", "the Pythagorean theorem",
            "probability", "gravity", "democracy", "the immune response", "antibiotic resistance", "black holes",
            "DNA replication", "the law of diminishing returns", "cognitive dissonance", "the tragedy of the commons")
PAIRS = (("a Roth IRA", "a traditional IRA"), ("renting", "buying a home"), ("nuclear", "solar power"),
         ("cats", "dogs as pets"), ("SQL", "NoSQL databases"), ("weather", "climate"), ("viruses", "bacteria"),
         ("stocks", "bonds"), ("speed", "velocity"), ("socialism", "capitalism"), ("TCP", "UDP"),
         ("baking soda", "baking powder"), ("a novel", "a novella"), ("mitosis", "meiosis"))
GENERAL_TASKS = (
    "Write a blog post about {topic} for readers who know nothing about it.",
    "Write a persuasive email to {audience} about {topic}.",
    "Write a short story in which {people} {situation}.",
    "Write a poem about {topic}, in four stanzas.",
    "Write a speech of about two minutes to open a local event about {topic}.",
    "Write a product description for a new gadget that helps with {topic}.",
    "Pretend you are {persona}. Describe an ordinary day in your work, in the first person.",
    "Act as {persona} and give advice to someone just starting out in your trade.",
    "Explain {concept} to a ten-year-old, with an everyday example.",
    "Explain {concept} as you would to a university student, then give two common misconceptions about it.",
    "Compare {a} and {b}: how do they differ, and when is each the better choice?",
    "Give me a week-long plan to get started with {topic}.",
    "What are the main arguments for and against {topic}? Give each side fairly.",
    "Summarize the history of {topic} in five key moments.",
    "I am writing a school report on {topic}. Suggest an outline with headings and what to put under each.",
    "Write a dialogue between {people} and {persona} about {topic}.",
    "List ten questions a curious person might ask about {concept}, and answer the first three.",
    "Write a respectful reply to {audience} who disagrees with me about {topic}.",
)
ARITHMETIC = (
    "A shop sells notebooks for ${a} each and pens for ${b} each. Maya buys {c} notebooks and {d} pens and pays with "
    "a ${e} bill. How much change does she get? Show your working.",
    "A train leaves at 9:{m:02d} and travels {km} km at {v} km/h. At what time does it arrive? Explain each step.",
    "A rectangle has a perimeter of {p} cm and one side of {s} cm. What is its area? Explain your reasoning.",
    "There are {a} red, {b} blue and {c} green marbles in a bag. Two are drawn without replacement. What is the "
    "probability that both are red? Give the answer as a fraction and explain.",
    "If {a} workers build a wall in {b} days, how long do {c} workers take at the same pace? Explain the reasoning.",
    "Solve for x: {a}x + {b} = {c}x - {d}. Show each step and check your answer.",
    "A price rises by {a}% and then falls by {b}%. Is it higher or lower than at the start, and by how much percent?",
)
TEXT_TASKS = (
    "Summarize the following documentation in three sentences for a beginner:\n\n{text}",
    "Extract every technical term from the text below and define each in one line:\n\n{text}",
    "Turn the following text into a list of key facts, as JSON with a \"facts\" array of strings:\n\n{text}",
    "Rewrite the following text in plain, friendly language:\n\n{text}",
    "Translate the following text into {natural}:\n\n{text}",
    "Write three quiz questions, with answers, that check someone understood this text:\n\n{text}",
)
NATURAL_LANGUAGES = ("French", "Spanish", "German", "Chinese", "Japanese", "Portuguese", "Italian", "Korean")


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    return [path for path in sorted(STDLIB.rglob("*.py"))
            if not any(part in SKIPPED_PACKAGES for part in path.relative_to(STDLIB).parts[:-1])
            and not path.name.startswith("test_")]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(STDLIB).with_suffix("").parts).removesuffix(".__init__")


@functools.cache
def stdlib_sources() -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """From one read of the standard library: (module, function name, source) of its functions of FUNCTION_LINES
    lines, and (module, text) of its module docstrings of 200-1,500 characters, in file order."""
    functions, texts = [], []
    for path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = _module_name(path)
        doc = ast.get_docstring(tree)
        if doc and 200 <= len(doc) <= 1500:
            texts.append((module, doc.strip()))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                source = ast.get_source_segment(text, node, padded=True)
                if FUNCTION_LINES[0] <= lines <= FUNCTION_LINES[1] and source:
                    functions.append((module, node.name, _dedent(source)))
    return functions, texts


def _dedent(source: str) -> str:
    lines = source.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def code_prompts(count: int, rng: random.Random) -> list[dict]:
    """`count` code tasks over distinct standard-library functions (fewer when the library has fewer)."""
    functions = stdlib_sources()[0]
    chosen = rng.sample(functions, min(count, len(functions)))
    prompts = []
    for module, name, source in chosen:
        task = rng.choice(sorted(CODE_TASKS))
        ask = CODE_TASKS[task].format(module=module, name=name, language=rng.choice(LANGUAGES))
        prompts.append({"kind": "code", "task": task, "source": f"{module}:{name}",
                        "text": f"{ask}\n\n```python\n{source}\n```"})
    return prompts


def general_prompts(count: int, rng: random.Random) -> list[dict]:
    """`count` general instructions: composed tasks, arithmetic with drawn numbers, and tasks over real text."""
    texts = stdlib_sources()[1]
    prompts, seen = [], set()
    while len(prompts) < count:
        draw = rng.random()
        if draw < 0.6:
            a, b = rng.choice(PAIRS)
            text = rng.choice(GENERAL_TASKS).format(
                topic=rng.choice(TOPICS), audience=rng.choice(AUDIENCES), persona=rng.choice(PERSONAS),
                people=rng.choice(PEOPLE), situation=rng.choice(SITUATIONS), concept=rng.choice(CONCEPTS), a=a, b=b)
            task, source = "instruction", "composed"
        elif draw < 0.7:
            numbers = {key: rng.randint(2, 30) for key in "abcd"}
            text = rng.choice(ARITHMETIC).format(**numbers, e=rng.choice((50, 100)), m=rng.randint(0, 59),
                                                 km=rng.randint(40, 600), v=rng.choice((60, 80, 90, 120)),
                                                 p=rng.randint(20, 80) * 2, s=rng.randint(3, 9))
            task, source = "arithmetic", "composed"
        else:
            module, doc = rng.choice(texts)
            text = rng.choice(TEXT_TASKS).format(text=doc, natural=rng.choice(NATURAL_LANGUAGES))
            task, source = "text", module
        if text not in seen:
            seen.add(text)
            prompts.append({"kind": "general", "task": task, "source": source, "text": text})
    return prompts


def build_prompts(code: int, general: int, seed: int = 0) -> list[dict]:
    """`code` code tasks and `general` general instructions, shuffled together (so any prefix of the list mixes
    both), each with its index as "id"."""
    rng = random.Random(seed)
    prompts = code_prompts(code, rng) + general_prompts(general, rng)
    rng.shuffle(prompts)
    return [{"id": i, **prompt} for i, prompt in enumerate(prompts)]


def write_prompts(prompts: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    # mtime=0: the same prompts give the same bytes, so a rebuilt file shows no change in git.
    with gzip.GzipFile(partial, "wb", mtime=0) as out:
        out.write("".join(json.dumps(prompt, ensure_ascii=False) + "\n" for prompt in prompts).encode())
    partial.replace(path)


def read_prompts(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]
