"""The chat page of `infer.serve` in headless Chromium (Debian's `chromium` and `chromium-driver`, `.ci/run` installs
them) under Selenium, on the demo pair; and the stream's `eagle` extension under the `openai` client."""

import re
import shutil
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("selenium")

from test_serve import client, start_server  # noqa: E402

from eagle_jax.serving import api  # noqa: E402
from instruments.screenshot import CHROMEDRIVER, CHROMIUM, browser, fill, wait_for  # noqa: E402

LONG = "Tell me about the history of the bicycle in a few sentences."  # the demo pair answers it to any length
SHORT = "How do I make a cup of tea?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `infer.serve` of the demo pair for the module, one row."""
    proc, url, log = start_server(["--max-batch", "1", "--max-len", "512"], tmp_path_factory.mktemp("web"))
    yield url, log
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def page(server):
    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), "install chromium and chromium-driver (apt-get)"
    driver = browser(width=420)  # a phone's width
    yield driver
    driver.quit()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def ask(page, url: str, message: str, max_tokens: int, compare: bool = False, send: bool = True) -> None:
    """A fresh page, its settings, the message typed and (`send`) sent with Enter."""
    page.get(url)
    wait_for(lambda: page.find_element("id", "model").text)
    fill(page, "temperature", 0)
    fill(page, "max-tokens", max_tokens)
    if compare:
        page.find_element("id", "compare").click()
    page.find_element("id", "prompt").send_keys(message + ("\n" if send else ""))


def answers(page) -> list:
    return page.find_elements("css selector", ".msg.assistant")


def settled(page) -> str:
    """The state of the page's first answer once it no longer streams."""
    state = lambda: answers(page) and answers(page)[0].get_attribute("data-state")  # noqa: E731
    return wait_for(lambda: state() not in (None, [], "streaming") and state())


def test_the_page_is_served_next_to_the_api_and_needs_nothing_else(server, page):
    url, log = server
    assert f"its chat page on {url}/" in log.read_text()
    page.get(url)
    assert page.title == "eagle-jax chat" and page.find_element("id", "legend").is_displayed()
    assert wait_for(lambda: page.find_element("id", "model").text) == "target"
    files = [p.read_text() for p in api.WEB.iterdir()]
    assert len(files) == 3 and not any(re.search(r"(https?:)?//[a-z]", f) for f in files)  # no address elsewhere


def test_a_streamed_answer_is_the_apis_and_shows_where_its_tokens_came_from(server, page):
    """Greedy: the page's streamed answer equals the API's whole answer to the same request, and its plain twin;
    its tokens carry the sources of the demo's head tree (drafts accepted), the stats show tau above 1."""
    url, _ = server
    ask(page, url, SHORT, 40, compare=True)
    wait_for(lambda: page.find_element("id", "versus").is_displayed() or page.find_element("id", "error").text)
    assert not page.find_element("id", "error").text
    expected = client(url).chat.completions.create(
        model="target", messages=[{"role": "user", "content": SHORT}], max_tokens=40, temperature=0
    )
    spec, plain = answers(page)
    text = lambda div: "".join(s.get_attribute("textContent") for s in div.find_elements("css selector", ".tok"))  # noqa: E731
    assert text(spec) == text(plain) == expected.choices[0].message.content
    sources = [s.get_attribute("data-source") for s in spec.find_elements("css selector", ".tok")]
    assert sources[0] == "target" and "head" in sources and set(sources) <= {"target", "head", "context"}
    assert {s.get_attribute("data-source") for s in plain.find_elements("css selector", ".tok")} == {"target"}
    assert float(page.find_element("id", "tau").text) > 1 and page.find_element("id", "tree").text == "4/3/1"
    assert page.find_element("id", "identical").text == "identical text"
    assert float(page.find_element("id", "plain-tps").text) > 0


def test_stop_frees_the_row_on_the_server(server, page):
    """Stop, a few tokens into a 450-token answer: the row is free (no running row on /metrics) well before the
    answer could have ended, and the server generated far fewer tokens than asked for."""
    url, _ = server
    before = metric(url, "eagle_jax_generated_tokens_total")
    ask(page, url, LONG, 450)
    wait_for(lambda: answers(page) and len(answers(page)[0].find_elements("css selector", ".tok")) >= 5, every=0.005)
    page.execute_script("document.getElementById('stop').click()")  # the growing answer may cover it mid-reflow
    assert settled(page) == "stopped"
    wait_for(lambda: metric(url, "eagle_jax_running_rows") == 0, timeout=10)
    time.sleep(0.5)
    assert metric(url, "eagle_jax_generated_tokens_total") - before < 300
    assert not page.find_element("id", "error").text and page.find_element("id", "send").is_enabled()


def test_a_refused_request_shows_its_error(server, page):
    """A max tokens beyond the context: the server's 400 and its message are in the page."""
    url, _ = server
    ask(page, url, SHORT, 100000)
    assert settled(page) == "error"
    error = page.find_element("id", "error").text
    assert error.startswith("400: this server's context holds") and "max_tokens" in error


def test_openai_parses_every_chunk_with_the_extension(server):
    """Every chunk of a traced stream parses; its `eagle` field splits the chunk's text into spans, and the cycles'
    sources count every generated token; without speculation the same text comes with nothing accepted."""
    url, _ = server
    streams = {}
    for speculate in (True, False):
        chunks = list(
            client(url).chat.completions.create(
                model="target",
                messages=[{"role": "user", "content": SHORT}],
                max_tokens=40,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"eagle": {"trace": True, "speculate": speculate}},
            )
        )
        traced = [c for c in chunks if c.choices and c.choices[0].finish_reason is None and c.choices[0].delta.content]
        assert traced and all(c.model_extra["eagle"]["spans"] for c in traced)
        for c in traced:
            assert "".join(s["text"] for s in c.model_extra["eagle"]["spans"]) == c.choices[0].delta.content
        cycles = [cy for c in chunks if "eagle" in c.model_extra for cy in c.model_extra["eagle"]["cycles"]]
        assert sum(len(cy["source"]) for cy in cycles) == chunks[-1].usage.completion_tokens
        assert all(cy["accepted"] == len(cy["source"]) - 1 and cy["source"][0] == "target" for cy in cycles)
        streams[speculate] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), cycles
    (spec, spec_cycles), (plain, plain_cycles) = streams[True], streams[False]
    assert spec == plain and len(spec_cycles) < len(plain_cycles)
    assert sum(c["accepted"] for c in spec_cycles) > 0 and sum(c["accepted"] for c in plain_cycles) == 0
    untraced = client(url).chat.completions.create(
        model="target", messages=[{"role": "user", "content": SHORT}], max_tokens=5, stream=True
    )
    assert not any("eagle" in c.model_extra for c in untraced)
