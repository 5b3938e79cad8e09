"""The playground page (server/playground/) and the request extensions it is built on.

The extensions (speculation: false, return_token_sources, stream_options.continuous_usage_stats) are tested on
the tiny random model, as the other server tests are. The page is tested in a real Chromium (tests/browser.py)
against SmolLM2-135M with the suffix drafter: a person's chat, stop, comparison, key, errors, keyboard, contrast
and phone width. Those skip, saying why, where no Chromium is installed. Answers rendered from markdown are tested
with scripted streams (the page's fetch answered by the test), whose text and token sources are known.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.routes import PLAYGROUND, PLAYGROUND_ASSETS
from tests.browser import MISSING, chromium, idle, open_page, send, wait
from tests.test_server import MODEL, NO_EOS, ROOT, Served, make_config, running

ASK = [{"role": "user", "content": "Say something."}]
KEY = "sk-playground-test-key"
browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with running(make_config(speculation={"gamma": 2, "drafter": "suffix"})) as served:
        yield served


@pytest.fixture
def slow_steps(monkeypatch):
    """Slows a served engine's steps (by `delay_s` each), so that a request is surely still running while the
    test acts: another request joins its batch, a person presses Stop."""

    def slow(served: Served, delay_s: float) -> list[int]:
        engine = served.app.state.scheduler.engine
        step, batches = engine.step, []

        def slowed():
            time.sleep(delay_s)
            batches.append(len(engine.seqs))
            return step()

        monkeypatch.setattr(engine, "step", slowed)
        return batches

    return slow


def chat(served: Served, **fields) -> dict:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "logit_bias": NO_EOS} | fields
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(served: Served, **fields) -> list[dict]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "logit_bias": NO_EOS, "stream": True} | fields
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- the request extensions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_off_decodes_plainly_with_the_same_text(served, temperature):
    chat(served, temperature=temperature, seed=5)  # the suffix drafter remembers it: the next one drafts
    off = chat(served, temperature=temperature, seed=5, speculation=False)
    on = chat(served, temperature=temperature, seed=5)
    assert off["choices"][0]["message"]["content"] == on["choices"][0]["message"]["content"]
    assert on["usage"]["speculative"]["draft_tokens"] > 0
    assert off["usage"]["speculative"]["draft_tokens"] == 0 and off["usage"]["speculative"]["verify_steps"] == 0


def test_speculation_off_holds_for_its_row_only_in_a_batch(served, slow_steps):
    batches = slow_steps(served, 0.02)
    with httpx.Client(timeout=120) as client:
        bodies = [{"model": MODEL, "messages": ASK, "max_tokens": 40, "logit_bias": NO_EOS, "n": 2, "seed": 3,
                   "temperature": 0.8, "speculation": speculation} for speculation in (False, True)]
        with ThreadPoolExecutor(2) as pool:
            off, on = pool.map(lambda body: client.post(f"{served.url}/v1/chat/completions", json=body).json(), bodies)
    assert [c["message"]["content"] for c in off["choices"]] == [c["message"]["content"] for c in on["choices"]]
    assert off["usage"]["speculative"]["draft_tokens"] == 0 < on["usage"]["speculative"]["draft_tokens"]
    assert max(batches) == 4  # both requests' rows decoded together


def test_token_sources_count_what_usage_counts(served):
    chat(served, temperature=0)  # remembered by the suffix drafter: the next one drafts
    whole = chat(served, return_token_sources=True, temperature=0)
    sources, usage = whole["choices"][0]["token_sources"], whole["usage"]
    assert len(sources) == usage["completion_tokens"] == 40
    counts = Counter(sources)
    assert counts["drafter"] == usage["speculative"]["accepted_tokens"] > 0
    assert counts["grammar"] == usage["speculative"]["grammar_accepted_tokens"] == 0
    assert set(counts) <= {"drafter", "grammar", "target"}
    # Drafts never reach past max_tokens: the last token is the target's, as every step's last is.
    assert sources[-1] == "target"


def test_token_sources_are_opt_in_and_cover_the_generated_tokens_only(served):
    assert "token_sources" not in chat(served)["choices"][0]
    assert all("token_sources" not in choice for chunk in streamed(served) for choice in chunk["choices"])
    echoed = served.client.completions.create(model=MODEL, prompt="x y", max_tokens=0, echo=True, logprobs=1,
                                              extra_body={"return_token_sources": True})
    assert echoed.choices[0].model_extra["token_sources"] == []


def test_streamed_sources_and_continuous_usage_agree_with_the_final_usage(served):
    chat(served, temperature=0)  # remembered by the suffix drafter: the next one drafts
    chunks = streamed(served, return_token_sources=True, temperature=0,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    sources = [source for chunk in chunks for choice in chunk["choices"] for source in choice.get("token_sources", [])]
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and len(sources) == final["completion_tokens"]
    assert Counter(sources)["drafter"] == final["speculative"]["accepted_tokens"] > 0
    running = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert running == sorted(running) and running[-1] == final["completion_tokens"]
    # As vLLM's: continuous usage comes with include_usage, not without.
    chunks = streamed(served, stream_options={"continuous_usage_stats": True})
    assert all("usage" not in chunk for chunk in chunks)


def test_grammar_drafts_are_marked_as_the_grammars(served):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    whole = chat(served, response_format=fmt, return_token_sources=True, logit_bias={})
    counts = Counter(whole["choices"][0]["token_sources"])
    assert counts["grammar"] == whole["usage"]["speculative"]["grammar_accepted_tokens"] > 0


def test_the_readmes_first_request_runs(served, capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A first request"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[: code.index("```")].replace("http://127.0.0.1:8000", served.url).replace("qwen2.5-coder-1.5b", MODEL)
    exec(compile(code, "README.md", "exec"), {})
    assert "'draft_tokens'" in capsys.readouterr().out


def test_the_api_pages_extension_example_runs(served, capsys):
    page = (ROOT / "docs" / "API.md").read_text()
    section = page[page.index("## Request extensions"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    exec(compile(code[: code.index("```")], "docs/API.md", "exec"), {"client": served.client, "model": MODEL})
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "0" and any("'target'" in line for line in printed)


def test_the_extensions_are_declared_and_checked(served):
    body = {"model": MODEL, "messages": ASK, "speculation": "no"}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and "speculation" in response.json()["error"]["message"]
    schema = httpx.get(f"{served.url}/openapi.json").json()["components"]["schemas"]
    assert {"speculation", "return_token_sources"} <= set(schema["ChatRequest"]["properties"])


# -- the page, served -------------------------------------------------------------------------------------------


def test_the_page_and_its_files_are_served_with_a_strict_policy(served):
    for path in ("/", "/playground"):
        page = httpx.get(served.url + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        for asset in re.findall(r'(?:href|src)="(playground/[^"]+)"', page.text):  # relative: prefixes work
            assert httpx.get(f"{served.url}/{asset}").status_code == 200
    assert httpx.get(f"{served.url}/playground/nothing.js").status_code == 404
    assert httpx.get(f"{served.url}/playground/vendor/VENDOR.md").status_code == 404  # the listed files only
    assert httpx.get(f"{served.url}/v1/models").json()["data"][0]["drafter"] == "suffix"


def test_the_vendored_libraries_are_the_pinned_ones():
    table = (PLAYGROUND / "vendor/VENDOR.md").read_text()
    listed = re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", table, re.M)
    assert {f"vendor/{name}" for name, _ in listed} == {name for name in PLAYGROUND_ASSETS if "/" in name}
    for name, sha256 in listed:
        assert hashlib.sha256((PLAYGROUND / "vendor" / name).read_bytes()).hexdigest() == sha256, name


def test_the_page_holds_no_secret_and_its_api_calls_need_the_key():
    config = make_config(security={"api_keys": [KEY], "metrics": "key"})
    with running(config) as keyed:
        assert httpx.get(f"{keyed.url}/").status_code == 200
        script = httpx.get(f"{keyed.url}/playground/playground.js").text
        paths = set(re.findall(r'api\("([^"]*)"', script))
        assert paths == {"v1/models", "v1/chat/completions", "metrics"}
        for path in paths:  # every call the page makes is the public API's, and needs the key
            method = httpx.post if path.endswith("completions") else httpx.get
            assert method(f"{keyed.url}/{path}").status_code == 401
        assert httpx.get(f"{keyed.url}/docs").status_code == 401  # nothing else opened up


def test_the_playground_can_be_turned_off():
    with running(make_config(server={"playground": False})) as plain:
        assert httpx.get(f"{plain.url}/").status_code == 404
        assert httpx.get(f"{plain.url}/playground/playground.js").status_code == 404


# -- the page, in a browser -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_served(smollm2_dir) -> Iterator[Served]:
    # int8 weights: row-invariant passes, so Compare's texts are equal by the server's guarantee (bf16's are not).
    config = make_config("configs/smollm2.yaml", model={"weights": "int8"}, speculation={"drafter": "suffix", "gamma": 4},
                         security={"metrics": "key", "api_keys": [KEY]})
    with running(config) as served:
        yield served


@pytest.fixture
def page(smollm2_served):
    """The playground in a fresh Chromium, past the key dialog."""
    with chromium() as driver:
        driver.get(smollm2_served.url)
        wait(driver, lambda d: d.find_element("id", "key-dialog").get_attribute("open") is not None, "the key dialog")
        driver.find_element("id", "key").send_keys(KEY + "\n")
        open_page(driver, smollm2_served.url)  # the key stays in session storage: the reload does not ask again
        yield driver
        # The page's own failures (a script error, a refused policy); the API's 4xx are the tests' to look at.
        errors = [entry for entry in driver.get_log("browser")
                  if entry["level"] == "SEVERE" and entry["source"] != "network"]
        assert not errors, errors


REFLOW = (320, 640)  # WCAG 2.1's reflow width: no horizontal scrolling at 320 CSS pixels
REPEAT = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."


def marked_runs(driver, selector: str) -> list[list[str]]:
    """[source, text] of each mark under `selector`, with its whitespace (WebDriver's .text trims it), read in one
    script: a streaming answer is rendered anew each frame, which leaves elements found before stale."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])]"
                                 ".map((span) => [span.className.split(' ')[1], span.textContent])", selector)


def marks(driver) -> Counter:
    return Counter(source for source, _ in marked_runs(driver, "#conversation > li:last-child .tok"))


def last_answer(driver) -> dict:
    """The tab's record of the last answer: its raw text and its pieces, [text, source, tokens] a chunk."""
    return driver.execute_script("return JSON.parse(sessionStorage.getItem('specdec-conversation')).at(-1)")


SCRIPTED = """
const chunks = arguments[0];
let hold = arguments[1]; // the first stream to reach this chunk waits there; later ones do not
window.requests = [];
const fetched = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).endsWith("v1/chat/completions")) return fetched(url, options);
  window.requests.push(JSON.parse(options.body));
  const bytes = new TextEncoder();
  const body = new ReadableStream({ async start(stream) {
    for (const [index, [text, sources]] of chunks.entries()) {
      if (index === hold) {
        hold = null;
        await new Promise((go) => { window.release = go; });
      }
      const chunk = { choices: [{ index: 0, delta: { content: text }, token_sources: sources }] };
      stream.enqueue(bytes.encode(`data: ${JSON.stringify(chunk)}\\n\\n`));
      await new Promise((next) => setTimeout(next, 5));
    }
    stream.enqueue(bytes.encode("data: [DONE]\\n\\n"));
    stream.close();
  } });
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""


def scripted(driver, chunks: list[tuple[str, list[str]]], hold: int | None = None) -> None:
    """The page's chats answered by these (text, token sources) chunks, not the model; with `hold`, the first
    stream waits before that chunk until the test runs window.release()."""
    driver.execute_script(SCRIPTED, [[text, sources] for text, sources in chunks], hold)


D, T = "drafter", "target"
CODE_ANSWER = [("Here it is:\n\n", [T] * 4), ("```python\n", [D] * 3), ("def square", [D, D]), ("(x):\n", [T]),
               ("    return x * x", [D] * 4), ("\n```\n", [T]), ("Done.", [D])]
WIDE = "x" * 300
WIDE_ANSWER = [("See [the docs](https://example.com/docs) and `inline code`.\n\n> quoted\n\n", [T] * 9),
               (f"```\n{WIDE} = 1\n```\n\n", [D] * 6),
               ("| " + " | ".join(f"column_{i}_heading" for i in range(12)) + " |\n" + "|---" * 12 + "|\n", [T] * 12),
               ("| " + " | ".join(f"value {i}" for i in range(12)) + " |\n", [D] * 12)]


@browser
def test_a_keyed_server_asks_for_the_key_once_and_the_tab_alone_keeps_it(page, smollm2_served):
    # The fixture answered the dialog; the reload it did since found the key and asked nothing.
    assert page.find_element("id", "key-dialog").get_attribute("open") is None
    stored = page.execute_script("return [sessionStorage.getItem('specdec-api-key'), localStorage.length, document.cookie]")
    assert stored == [KEY, 0, ""]
    with chromium() as other:  # another tab, or the next session: asked again
        other.get(smollm2_served.url)
        wait(other, lambda d: d.find_element("id", "key-dialog").get_attribute("open") is not None, "the key dialog")
        other.find_element("id", "key").send_keys("sk-wrong\n")  # refused: asked again, still not connected
        wait(other, lambda d: d.execute_script("return sessionStorage.getItem('specdec-api-key')") == "sk-wrong"
             and d.find_element("id", "key-dialog").get_attribute("open") is not None, "the dialog to ask again")
        assert "valid API key" in other.find_element("id", "key-reason").text
        assert not other.find_element("id", "server-line").text.startswith("Model")
        other.find_element("id", "key-cancel").click()  # no dead end: Connect asks again
        wait(other, lambda d: d.find_element("id", "connect").is_displayed(), "the Connect button")
        assert "needs an API key" in other.find_element("id", "error").text
        other.find_element("id", "connect").click()
        wait(other, lambda d: d.find_element("id", "key-dialog").get_attribute("open") is not None, "the key dialog")
        other.find_element("id", "key").send_keys(KEY + "\n")
        wait(other, lambda d: d.find_element("id", "server-line").text.startswith("Model"), "the page to connect")


@browser
def test_a_chat_streams_with_marks_that_match_the_streams_counts(page, smollm2_served, slow_steps):
    slow_steps(smollm2_served, 0.05)
    send(page, REPEAT)
    wait(page, lambda d: marks(d), "the first token")
    assert not idle(page)  # tokens arrive while the request runs
    wait(page, idle, "the reply to finish")
    answer = last_answer(page)  # the marks are on rendered text: the tokens are counted from the record
    counts = Counter()
    for _, source, tokens in answer["pieces"]:
        counts[source] += tokens
    assert answer["content"] == "".join(text for text, _, _ in answer["pieces"])
    assert sum(counts.values()) == int(page.find_element("id", "live-tokens").text)
    assert counts["drafter"] + counts["grammar"] == int(page.find_element("id", "live-kept").text)
    assert counts["drafter"] > 0 and counts["target"] > 0 and marks(page)["drafter"] > 0 and marks(page)["target"] > 0
    assert page.find_element("id", "live-acceptance").text.endswith("%")
    summary = page.find_element("css selector", "#conversation > li:last-child .summary").text
    assert summary.startswith(f"{sum(counts.values())} tokens: {counts['drafter']} drafted and kept")
    # The conversation goes on: the second turn carries the first.
    send(page, "Once more.")
    wait(page, lambda d: len(d.find_elements("css selector", "#conversation > li")) == 4 and idle(d),
         "the second reply")
    assert page.find_element("id", "error").get_attribute("hidden") is not None


@browser
def test_stop_cancels_the_request_on_the_server(page, smollm2_served, slow_steps):
    slow_steps(smollm2_served, 0.05)
    page.find_element("id", "max-tokens").clear()
    page.find_element("id", "max-tokens").send_keys("2000")
    send(page, "Write a long story about a lighthouse keeper.")
    wait(page, lambda d: sum(marks(d).values()) >= 5, "some tokens")
    page.find_element("id", "stop").click()
    scheduler = smollm2_served.app.state.scheduler
    smollm2_served.wait_until(lambda: not scheduler._jobs and not scheduler.engine.seqs, "the server to free the slot")
    assert "(stopped)" in page.find_element("css selector", "#conversation > li:last-child .who").text
    assert idle(page)


@browser
def test_a_streamed_code_block_renders_as_code_with_its_marks(page):
    scripted(page, CODE_ANSWER, hold=5)  # held before the closing fence: the block is still open
    send(page, "Write a function.")
    code = "#conversation > li:last-child pre > code"

    def code_text(driver) -> str:
        return driver.execute_script(f"return document.querySelector('{code}')?.textContent ?? ''")

    wait(page, lambda d: "return x * x" in code_text(d), "the open block")
    assert not idle(page)
    streaming = marked_runs(page, f"{code} .tok")
    assert streaming == [[D, "def square"], [T, "(x):\n"], [D, "    return x * x"]]
    page.execute_script("window.release()")
    wait(page, idle, "the reply to finish")
    assert len(page.find_elements("css selector", "#conversation > li:last-child pre")) == 1
    assert marked_runs(page, f"{code} .tok") == [*streaming, [T, "\n"]]  # the newline before the fence, come since
    assert code_text(page) == "def square(x):\n    return x * x\n"
    assert marked_runs(page, "#conversation > li:last-child p .tok") == [[T, "Here it is:"], [D, "Done."]]
    summary = page.find_element("css selector", "#conversation > li:last-child .summary").text
    assert summary == "16 tokens: 10 drafted and kept"
    # The record is the raw text, markdown and all: the tab keeps it, and the next turn sends it.
    raw = "".join(text for text, _ in CODE_ANSWER)
    assert last_answer(page)["content"] == raw
    send(page, "Thanks.")
    wait(page, lambda d: len(d.find_elements("css selector", "#conversation > li")) == 4 and idle(d),
         "the second reply")
    assert {"role": "assistant", "content": raw} in page.execute_script("return window.requests.at(-1).messages")


@browser
def test_markdown_renders_with_the_marks_on_its_words(page):
    scripted(page, [("# Title\n\nSome ", [T, T]), ("**bold**", [D, D]), (" and *em*.\n\n", [T] * 3),
                    ("- one\n- two\n\n", [D] * 4), ("| L | R |\n|:--|--:|\n| a | b |\n", [T] * 6)])
    send(page, "Format something.")
    wait(page, idle, "the reply")
    answer = "#conversation > li:last-child .markdown"
    assert marked_runs(page, f"{answer} h1 .tok") == [[T, "Title"]]
    assert marked_runs(page, f"{answer} p .tok") == [[T, "Some "], [D, "bold"], [T, " and "], [T, "em"], [T, "."]]
    assert page.find_element("css selector", f"{answer} strong").text == "bold"
    assert marked_runs(page, f"{answer} ul > li .tok") == [[D, "one"], [D, "two"]]
    assert marked_runs(page, f"{answer} td .tok") == [[T, "a"], [T, "b"]]
    cells = page.execute_script(f"return [...document.querySelectorAll('{answer} :is(th, td)')]"
                                ".map((cell) => getComputedStyle(cell).textAlign)")
    assert cells == ["left", "right", "left", "right"]
    item = page.find_element("css selector", f"{answer} li")  # a list item of the answer's, not of the conversation
    assert [item.value_of_css_property(name) for name in ("border-top-style", "list-style-type")] == ["none", "disc"]


@browser
def test_html_and_script_in_an_answer_never_run(page):
    hostile = ('<img src=x onerror="window.ran = 1"> <script>window.ran = 2</script>\n\n'
               '<svg onload="window.ran = 3"></svg> [click](javascript:window.ran=4) [ok](https://example.com/)'
               ' ![pixel](https://example.com/pixel.png)\n\n<iframe src="https://example.com/"></iframe>\n\n'
               '<script>window.ran = 5</script>\n')
    scripted(page, [(hostile[i:i + 7], [T]) for i in range(0, len(hostile), 7)])
    send(page, "Say something hostile.")
    wait(page, idle, "the reply")
    answer = page.find_element("css selector", "#conversation > li:last-child .markdown")
    assert page.execute_script("return window.ran") is None
    assert not answer.find_elements("css selector", "img, script, svg, iframe, [onerror], [onload], [style]")
    assert '<img src=x onerror="window.ran = 1">' in answer.text and "<script>window.ran = 2</script>" in answer.text
    links = page.execute_script("return [...arguments[0].querySelectorAll('a')].map((a) => [a.textContent, "
                                "a.getAttribute('href'), a.target, a.rel])", answer)
    assert links == [["click", None, "", ""], ["ok", "https://example.com/", "_blank", "noopener noreferrer"],
                     ["pixel", "https://example.com/pixel.png", "_blank", "noopener noreferrer"]]


@browser
def test_a_rendered_answers_links_and_code_are_reached_from_the_keyboard(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    scripted(page, WIDE_ANSWER)
    send(page, "Show me wide things.")
    wait(page, idle, "the reply")

    def press(*keys, shift: bool = False) -> str:
        actions = ActionChains(page)
        if shift:
            actions.key_down(Keys.SHIFT)
        actions.send_keys(*keys)
        if shift:
            actions.key_up(Keys.SHIFT)
        actions.perform()
        return page.execute_script("const at = document.activeElement;"
                                   "return (at.closest('#conversation') ? 'answer ' : '') + at.tagName")

    page.find_element("id", "prompt").click()
    # Back from the message box: the table and the code block, too wide for their boxes, are stops of their own.
    assert [press(Keys.TAB, shift=True) for _ in range(3)] == ["answer TABLE", "answer PRE", "answer A"]
    assert press(Keys.TAB) == "answer PRE"
    press(Keys.ARROW_RIGHT)  # which scrolls it
    wait(page, lambda d: d.execute_script("return document.activeElement.scrollLeft") > 0, "the block to scroll")


@browser
def test_compare_shows_the_same_text_and_the_speedup(page):
    page.find_element("id", "prompt").send_keys(REPEAT)
    page.find_element("id", "compare").click()
    verdict = wait(page, lambda d: idle(d) and d.find_element("id", "comparison-verdict").text, "the comparison", 300)
    assert verdict.startswith("The same text") and "x as fast" in verdict
    plain, speculative = (page.find_element("id", f"{kind}-text").text for kind in ("plain", "speculative"))
    assert plain == speculative and plain
    assert not page.find_elements("css selector", "#plain-text .tok.drafter")  # plain decoding drafts nothing
    assert page.find_elements("css selector", "#speculative-text .tok.drafter")


@browser
def test_the_decoding_setting_turns_drafts_off(page):
    from selenium.webdriver.support.ui import Select

    Select(page.find_element("id", "decoding")).select_by_value("plain")
    send(page, REPEAT)
    wait(page, lambda d: idle(d) and marks(d), "the reply")
    assert set(marks(page)) == {"target"}


@browser
def test_errors_show_the_servers_message(page, smollm2_served, monkeypatch):
    page.find_element("id", "max-tokens").clear()
    page.find_element("id", "max-tokens").send_keys("100000")
    send(page, "Hello")
    error = page.find_element("id", "error")
    wait(page, lambda d: error.is_displayed(), "the error")
    assert "max_tokens" in error.text and "16384" in error.text
    assert page.find_element("id", "prompt").get_attribute("value") == "Hello"  # kept, to send again
    # A failure inside the server, after the stream began: its message, not a blank page.
    engine = smollm2_served.app.state.scheduler.engine
    real_step = engine.step

    def failing_step():
        monkeypatch.setattr(engine, "step", real_step)
        raise RuntimeError("injected")

    monkeypatch.setattr(engine, "step", failing_step)
    page.find_element("id", "max-tokens").clear()
    page.find_element("id", "max-tokens").send_keys("20")
    send(page, "Hello")
    wait(page, lambda d: "incident" in error.text and idle(d), "the server's error")
    assert "server's fault" in error.text


@browser
def test_keyboard_alone_reaches_every_control_sends_and_stops(page, smollm2_served, slow_steps):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    def press(*keys) -> str:
        ActionChains(page).send_keys(*keys).perform()
        return page.execute_script("return document.activeElement.id")

    page.execute_script("document.activeElement.blur()")
    reached = [press(Keys.TAB) for _ in range(30)]
    controls = {"prompt", "send", "compare", "clear", "decoding", "system", "temperature", "top-p", "max-tokens",
                "seed", "stop-strings"}
    assert controls <= set(reached)
    for _ in range(40):  # on round to the message box (bounded: a trap would fail here, not hang)
        if press(Keys.TAB) == "prompt":
            break
    assert page.execute_script("return document.activeElement.id") == "prompt"
    assert press("Hi there", Keys.ENTER) == "prompt"  # Enter in the box sends, and the box keeps the focus
    wait(page, lambda d: idle(d) and marks(d), "the reply")
    # The Send button, from the keyboard: while the request runs, the focus moves to Stop, and Enter stops it.
    slow_steps(smollm2_served, 0.05)
    page.find_element("id", "max-tokens").clear()
    page.find_element("id", "max-tokens").send_keys("500")
    page.find_element("id", "prompt").send_keys("Write a long story about a lighthouse keeper.")
    assert press(Keys.TAB) == "send"
    assert press(Keys.ENTER) == "stop"
    wait(page, lambda d: sum(marks(d).values()) >= 3, "some tokens")
    press(Keys.ENTER)
    wait(page, idle, "the request to stop")
    assert "(stopped)" in page.find_element("css selector", "#conversation > li:last-child .who").text
    assert page.execute_script("return document.activeElement.id") == "prompt"


CONTRAST = """
function luminance(colour) {
  const [r, g, b] = colour.match(/[\\d.]+/g).slice(0, 3).map(Number).map((v) => {
    v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}
function background(element) {
  for (let e = element; e; e = e.parentElement) {
    const colour = getComputedStyle(e).backgroundColor;
    const alpha = colour.match(/[\\d.]+/g).length === 4 ? Number(colour.match(/[\\d.]+/g)[3]) : 1;
    if (alpha > 0) return colour;
  }
  return "rgb(255, 255, 255)";
}
const found = [];
for (const element of document.querySelectorAll("body *")) {
  const text = [...element.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
  const box = element.getBoundingClientRect();
  if (!text || box.width === 0 || element.closest("[hidden]") || element.disabled) continue;
  const style = getComputedStyle(element);
  const [a, b] = [luminance(style.color), luminance(background(element))];
  const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  const size = parseFloat(style.fontSize), bold = Number(style.fontWeight) >= 700;
  const large = size >= 24 || (bold && size >= 18.66);
  const within = ["PRE", "CODE", "A", "TH", "BLOCKQUOTE"].find((tag) => element.closest(tag));
  found.push([element.tagName + "#" + element.id + "." + element.className + (within ? " in " + within : ""),
    ratio, large ? 3 : 4.5]);
}
return found;
"""


@browser
def test_every_text_meets_wcag_aa_contrast(page):
    send(page, REPEAT)
    wait(page, lambda d: idle(d) and marks(d)["drafter"], "a reply with drafts")
    scripted(page, WIDE_ANSWER)  # and a rendered one: code, a link, a quote, a table, marks on them
    send(page, "Show me wide things.")
    wait(page, lambda d: idle(d) and d.find_elements("css selector", "#conversation > li:last-child table"),
         "the table")
    page.execute_script("document.getElementById('error').hidden = false;"
                        "document.getElementById('error').textContent = 'an error';"
                        "document.getElementById('comparison').hidden = false;")
    measured = page.execute_script(CONTRAST)
    assert len(measured) > 30 and any("drafter" in name for name, _, _ in measured)
    for rendered in ("drafter in PRE", "target in CODE", "target in A", "target in BLOCKQUOTE", "target in TH"):
        assert any(name.endswith(rendered) for name, _, _ in measured), rendered
    failing = [(name, round(ratio, 2)) for name, ratio, least in measured if ratio < least]
    assert not failing, failing


@browser
def test_the_metrics_panel_says_where_metrics_are_on_their_own_port():
    with running(make_config(security={"metrics": "port", "metrics_port": 0})) as served, chromium() as driver:
        open_page(driver, served.url)
        note = driver.find_element("id", "metrics-note")
        wait(driver, lambda d: "own port" in note.text, "the panel's note")
        assert not driver.find_element("id", "metrics-figures").is_displayed()


@browser
def test_the_conversation_survives_a_reload_in_the_tab(page, smollm2_served):
    send(page, "Hi")
    wait(page, lambda d: idle(d) and marks(d), "the reply")
    before = page.find_element("id", "conversation").text
    open_page(page, smollm2_served.url)
    assert page.find_element("id", "conversation").text == before and marks(page)
    page.find_element("id", "clear").click()
    open_page(page, smollm2_served.url)
    assert page.find_element("id", "conversation").text == ""


@browser
def test_the_page_works_at_phone_width(page):
    page.set_window_size(*REFLOW)
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    send(page, "Hi")
    wait(page, lambda d: idle(d) and marks(d), "the reply")
    for control in ("prompt", "send", "compare", "decoding"):
        element = page.find_element("id", control)
        box = element.rect
        assert element.is_displayed() and box["x"] >= 0 and box["x"] + box["width"] <= REFLOW[0]
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    # A wide code block and a wide table scroll inside their own boxes; the page does not.
    scripted(page, WIDE_ANSWER)
    send(page, "Show me wide things.")
    wait(page, lambda d: idle(d) and d.find_elements("css selector", "#conversation > li:last-child table"),
         "the table")
    boxes = page.execute_script("return [...document.querySelectorAll('#conversation > li:last-child :is(pre, table)')]"
                                ".map((box) => [box.scrollWidth > box.clientWidth, box.getBoundingClientRect().right])")
    assert len(boxes) == 2 and all(scrolls and right <= REFLOW[0] for scrolls, right in boxes), boxes
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
