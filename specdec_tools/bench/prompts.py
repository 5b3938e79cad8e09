"""Benchmark prompts: reading a JSONL file, stratified selection, chat encoding.

Spec-Bench's question.jsonl has `question_id`, `category` and `turns`; only the
first turn is used (later turns presuppose the model's own earlier answer).
Other files may give a `prompt` string instead; a missing category is "default".
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# ../shared/data/spec_bench/question.jsonl relative to the repository, which sits beside the shared folder.
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the last user turn
    history: tuple[tuple[str, str], ...] = ()  # earlier (user, assistant) turns of the conversation, oldest first
    system: str = ""  # the system prompt, if the conversation has one
    schema: dict | None = None  # the JSON Schema the answer must follow (response_format), if any

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages, ending with the user's turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        turns = [m for user, answer in self.history
                 for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
        return system + turns + [{"role": "user", "content": self.text}]


def load_prompts(path: str | Path) -> list[Prompt]:
    """Every prompt of a JSONL file with a `prompt` or `turns` field per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompts file {path} does not exist; point --prompts at a JSONL file "
            "with a 'prompt' or 'turns' field per line (e.g. Spec-Bench's question.jsonl)"
        )
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" in row:
            text = row["prompt"]
        elif row.get("turns"):
            text = row["turns"][0]
        else:
            raise ValueError(f"{path}:{number}: a line needs a 'prompt' or a non-empty 'turns' field")
        prompts.append(Prompt(str(row.get("question_id", row.get("id", number))), row.get("category", "default"), text))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def categories_of(prompts: Sequence[Prompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def stratified(prompts: Sequence[Prompt], count: int) -> list[Prompt]:
    """`count` prompts taken round-robin over the categories, each category in file order.

    Round-robin keeps every category represented as evenly as `count` allows
    (13 prompts from Spec-Bench: one per category), and file order makes the
    selection the same on every run. A category that runs out leaves its turns
    to the others.
    """
    queues = [[p for p in prompts if p.category == c] for c in categories_of(prompts)]
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < count and any(len(q) > depth for q in queues):
        chosen.extend(q[depth] for q in queues if len(q) > depth)
        depth += 1
    return chosen[:count]


def _prompt(prompt: Prompt | str) -> Prompt:
    return Prompt("", "", prompt) if isinstance(prompt, str) else prompt


def chat_text(tokenizer, prompt: Prompt | str) -> str:
    """A prompt (or a lone user turn) through the chat template, as text (for tools that tokenize it themselves)."""
    messages = _prompt(prompt).messages()
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(m["content"] for m in messages)


def encode(tokenizer, prompt: Prompt | str) -> list[int]:
    """Token ids of a prompt (or a lone user turn) through the chat template (instruct models give junk on raw text)."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(_prompt(prompt).messages(), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids)
    return tokenizer.encode(chat_text(tokenizer, prompt))


def add_prompts_argument(parser: argparse.ArgumentParser) -> None:
    """--prompts, as the bench and calibrate take it."""
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                        help="JSONL with a 'prompt' or 'turns' field per line (default: Spec-Bench's question.jsonl)")
