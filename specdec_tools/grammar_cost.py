"""What a grammar costs: each grammar engine's compile and per-token mask time on the target's vocabulary
(`engines`), and plain decoding's tokens/s with a schema against without (`decode`), interleaved in one run.

`engines` walks, for each schema of the json workload, a small valid instance token by token through
xgrammar (ours), llguidance and outlines-core (those installed: `pip install llguidance outlines-core`),
timing the mask before each token. `decode` decodes each json-workload prompt plainly under its schema,
then without it for the same number of tokens (end of sequence banned), then under it again.

    python -m specdec_tools.grammar_cost engines --config configs/default.yaml
    python -m specdec_tools.grammar_cost decode --config configs/default.yaml --limit 12 --max-tokens 256
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from collections.abc import Callable

import jsonschema
from tqdm import tqdm

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.grammar import Grammars, GrammarSpec
from specdec_core.models.loading import load_runner
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from . import measurement
from .bench.prompts import DEFAULT_PROMPTS, encode
from .bench.workloads import JSON_TEXTS, workloads

FORMAT_EXAMPLES = {"date": "2027-03-15", "time": "11:15:00Z", "date-time": "2027-03-15T11:15:00Z", "email": "ada@example.com"}
PATTERN_EXAMPLES = {"^[A-Z0-9]{6}$": "QX7T4M", "^[A-Z]{3}$": "OSL"}


def instance(schema: dict) -> object:
    """A valid instance of a json-workload schema: every property, the first enum value, the smallest number,
    two array items where allowed."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {name: instance(sub) for name, sub in schema["properties"].items()}
    if kind == "array":
        return [instance(schema["items"])] * min(2, schema.get("maxItems", 2))
    if kind in ("integer", "number"):
        return schema.get("minimum", 7)
    if kind == "boolean":
        return True
    text = PATTERN_EXAMPLES.get(schema.get("pattern"), FORMAT_EXAMPLES.get(schema.get("format"), "Lyon"))
    return text[: schema.get("maxLength", len(text))]


Walker = Callable[[dict], tuple[Callable[[], None], Callable[[int], bool]]]  # schema to (fill a mask, accept a token)


def _xgrammar(runner) -> Walker:
    grammars = Grammars(runner.tokenizer, runner.vocab_size, {runner.tokenizer.eos_token_id})

    def walker(schema: dict) -> tuple[Callable[[], None], Callable[[int], bool]]:
        state = grammars.state(grammars.compile(GrammarSpec("json_schema", json.dumps(schema)), "schema"))
        masks = state._masks(1)
        return lambda: state.matcher.fill_next_token_bitmask(masks, 0), state.matcher.accept_token

    return walker


def _llguidance(runner) -> Walker:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(runner.tokenizer, n_vocab=runner.vocab_size)
    masks = llguidance.torch.allocate_token_bitmask(1, runner.vocab_size)

    def walker(schema: dict) -> tuple[Callable[[], None], Callable[[int], bool]]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return lambda: llguidance.torch.fill_next_token_bitmask(matcher, masks, 0), matcher.consume_token

    return walker


def _outlines_core(runner) -> Walker:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = runner.tokenizer.eos_token_id
    byte_of = {char: byte for byte, char in _byte_level().items()}
    tokens: dict[str, list[int]] = {}
    for token, token_id in runner.tokenizer.get_vocab().items():
        if token_id != eos and all(char in byte_of for char in token):
            tokens.setdefault(bytes(byte_of[c] for c in token).decode("latin-1"), []).append(token_id)
    vocabulary = Vocabulary(eos, tokens)

    def walker(schema: dict) -> tuple[Callable[[], None], Callable[[int], bool]]:
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

        def accept(token: int) -> bool:
            if token == eos:  # its index ends in a final state rather than taking the end-of-sequence token
                return guide.is_finished()
            guide.advance(token)
            return True

        return guide.get_tokens, accept

    return walker


def _byte_level() -> dict[int, str]:
    """GPT-2's map of bytes to the printable characters byte-level BPE vocabularies spell them with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


ENGINES = {"xgrammar": (_xgrammar, "xgrammar"), "llguidance": (_llguidance, "llguidance"),
           "outlines-core": (_outlines_core, "outlines_core")}


def engines(config: Config) -> dict:
    runner = load_runner(config.model.target, config.model)
    eos = runner.tokenizer.eos_token_id
    items = [json.loads(line) for line in JSON_TEXTS.read_text().splitlines()]
    results = {}
    for name, (make, module) in ENGINES.items():
        if importlib.util.find_spec(module) is None:
            results[name] = "not installed"
            continue
        compile_s, mask_s = [], []
        walker = make(runner)  # the engine's view of the vocabulary, once
        for item in tqdm(items, desc=name):
            start = time.perf_counter()
            fill, accept = walker(item["schema"])
            compile_s.append(time.perf_counter() - start)
            for token in runner.tokenizer.encode(json.dumps(instance(item["schema"]))) + [eos]:
                start = time.perf_counter()
                fill()
                mask_s.append(time.perf_counter() - start)
                if not accept(token):
                    raise RuntimeError(f"{name} refused token {token} of {item['id']}'s instance")
        results[name] = {"compile_ms_median": 1e3 * statistics.median(compile_s), "mask_us_median": 1e6 * statistics.median(mask_s),
                         "mask_us_mean": 1e6 * statistics.mean(mask_s), "mask_us_max": 1e6 * max(mask_s), "tokens": len(mask_s)}
    return {"target": config.model.target, "vocab_size": runner.vocab_size, "schemas": len(items), "engines": results}


def decode(config: Config, limit: int, max_tokens: int) -> dict:
    engine = build_engine(config, drafter="none")
    target = engine.target
    grammars = Grammars(target.tokenizer, target.vocab_size, engine.eos_token_ids)
    prompts = [session().send(None) for session in workloads(DEFAULT_PROMPTS)["json"].sessions(limit)]
    no_eos = {token: -float("inf") for token in engine.eos_token_ids}
    rows = []
    for prompt in tqdm(prompts, desc="prompts"):
        ids = encode(target.tokenizer, prompt)
        compiled = grammars.compile(GrammarSpec("json_schema", json.dumps(prompt.schema)), prompt.id)

        def run(constrained: bool, tokens: int) -> tuple[Sequence, float, float]:
            params = SamplingParams(temperature=0, logit_bias={} if constrained else no_eos)
            seq = Sequence(prompt.id, ids, params, tokens, grammar=grammars.state(compiled) if constrained else None)
            engine.add(seq)
            start, mask_s = time.perf_counter(), 0.0
            for report in engine.generate():
                mask_s += report.grammar_s
            return seq, time.perf_counter() - start, mask_s

        # Schema, free, schema again: drift over the three cancels in the mean of the first and last.
        seq, first_s, mask_s = run(True, max_tokens)
        n = len(seq.output_ids)
        _, free_s, _ = run(False, n)
        _, last_s, _ = run(True, max_tokens)
        schema_s = (first_s + last_s) / 2
        rows.append({"prompt": prompt.id, "tokens": n, "schema_tok_s": n / schema_s, "free_tok_s": n / free_s,
                     "ratio": free_s / schema_s, "mask_ms_per_token": 1e3 * mask_s / n,
                     "finish": seq.finish_reason, "valid": valid(target, seq.output_ids, prompt.schema)})
    stopped = [row for row in rows if row["finish"] == "stop"]
    return {"target": config.model.target, "weights": config.model.weights, "max_tokens": max_tokens, "prompts": rows,
            "median_ratio": statistics.median(row["ratio"] for row in rows),
            "valid_of_stopped": f"{sum(row['valid'] for row in stopped)}/{len(stopped)}"}


def valid(target, output: list[int], schema: dict) -> bool:
    """Whether the decoded output parses as JSON valid against the schema."""
    try:
        jsonschema.validate(json.loads(target.tokenizer.decode(output, skip_special_tokens=True)), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__, prompts=None)
    parser.add_argument("what", choices=["engines", "decode"])
    parser.add_argument("--limit", type=int, default=12, help="decode: json-workload prompts")
    parser.add_argument("--max-tokens", type=int, default=256, help="decode: most tokens under the schema")
    args = parser.parse_args(argv)
    config = Config.load(args.config)
    result = engines(config) if args.what == "engines" else decode(config, args.limit, args.max_tokens)
    measurement.report(result, args.out, __spec__.name, argv)


if __name__ == "__main__":
    main()
