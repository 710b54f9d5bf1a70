"""Opens every page of the built docs site in headless Chromium and fails on what a reader sees.

``make docs-check`` (after ``make docs``): each ``site/**/*.html`` is opened from disk
(``file://``, as a reader who downloads the site does) and checked for

* a missing image: an ``<img>`` whose ``naturalWidth`` is 0 once loaded;
* a console error: ``console.error``, an uncaught exception, or an error Chromium logs (a
  resource that does not load, a blocked worker);
* a broken anchor: a link to ``#fragment`` (on its own page or on another page of the site)
  whose target page has no element with that ``id`` once rendered, or a link to a page of
  the site that does not exist;
* an internal marker in the rendered text (:data:`MARKERS`): a tracker's issue or round
  number, or the tests' ``docs: not run`` marker of a code block;

and that search works from disk: a query typed into the search box of ``index.html`` lists
results.

Chromium is driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``:
file descriptors 3 and 4, NUL-terminated JSON), so nothing but the standard library is
needed. Without Chromium (``chromium`` or ``chromium-browser`` on ``PATH``, or ``CHROMIUM``)
the script says so and exits with status 2.

Usage: ``python tools/docs_check.py [SITE_DIR]`` (default ``site``).
"""

from __future__ import annotations

import dataclasses
import html.parser
import json
import os
import pathlib
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse

# Text of the rendered pages that must not reach a reader.
MARKERS = (
  re.compile(r"\bissue \d+\b", re.I),
  re.compile(r"\bround \d+\b", re.I),
  re.compile(r"docs: not run"),
)
# Elements whose content is not rendered text.
_NOT_TEXT = frozenset({"script", "style", "template", "noscript"})
# What a search from disk must find (it names the package's main entry point).
SEARCH_QUERY = "dynamic_loss_scale"
PAGE_TIMEOUT_S = 30.0


@dataclasses.dataclass
class Page:
  """What the checks read of one rendered page: its ids, its links and its text."""

  ids: set[str]
  links: list[str]
  text: str


class _PageParser(html.parser.HTMLParser):
  def __init__(self) -> None:
    super().__init__(convert_charrefs=True)
    self.page = Page(ids=set(), links=[], text="")
    self._skip = 0
    self._text: list[str] = []

  def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
    values = {name: value for name, value in attrs if value}
    if "id" in values:
      self.page.ids.add(values["id"])
    if tag == "a" and "name" in values:
      self.page.ids.add(values["name"])
    if tag == "a" and "href" in values:
      self.page.links.append(values["href"])
    if tag in _NOT_TEXT:
      self._skip += 1

  def handle_endtag(self, tag: str) -> None:
    if tag in _NOT_TEXT and self._skip:
      self._skip -= 1

  def handle_data(self, data: str) -> None:
    if not self._skip:
      self._text.append(data)

  def close(self) -> None:
    super().close()
    self.page.text = " ".join(" ".join(self._text).split())


def parse_page(source: str) -> Page:
  """The ids, links (``href`` as written) and rendered text (whitespace collapsed) of a page."""
  parser = _PageParser()
  parser.feed(source)
  parser.close()
  return parser.page


def find_markers(text: str) -> list[str]:
  """Each internal marker of :data:`MARKERS` in ``text``, with a little context."""
  found = []
  for marker in MARKERS:
    for m in marker.finditer(text):
      found.append(repr(text[max(0, m.start() - 40) : m.end() + 40]))
  return found


def broken_links(pages: dict[str, Page], root: str) -> list[str]:
  """Links between pages of the site (URLs under ``root``) to a page or ``#id`` that is not there.

  ``pages`` maps each page's URL to its :class:`Page`. A link outside ``root``, to a file
  that is not a page (``.html``), or to an empty fragment (``#``) is not checked here.
  """
  problems = []
  for url, page in sorted(pages.items()):
    for href in page.links:
      target, fragment = urllib.parse.urldefrag(urllib.parse.urljoin(url, href))
      if not target.startswith(root) or not target.endswith(".html"):
        continue
      if target not in pages:
        problems.append(f"{url}: link {href!r}: no page {target}")
      elif fragment and urllib.parse.unquote(fragment) not in pages[target].ids:
        problems.append(f"{url}: link {href!r}: no id {fragment!r} on {target}")
  return problems


def find_chromium() -> str | None:
  """The Chromium to run: ``$CHROMIUM``, else ``chromium`` or ``chromium-browser`` on PATH."""
  if os.environ.get("CHROMIUM"):
    return os.environ["CHROMIUM"]
  return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
  """Headless Chromium, one tab, driven by the DevTools protocol over a pipe."""

  def __init__(self, executable: str, profile: str) -> None:
    to_chrome_r, self._to_chrome = os.pipe()
    self._from_chrome, from_chrome_w = os.pipe()

    def fds_3_and_4() -> None:  # the pipe's ends where Chromium reads and writes them
      read_end, write_end = os.dup(to_chrome_r), os.dup(from_chrome_w)
      os.dup2(read_end, 3)
      os.dup2(write_end, 4)

    args = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    args += ["--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"]
    self._process = subprocess.Popen(
      args,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      preexec_fn=fds_3_and_4,  # no threads here
      pass_fds=(3, 4),
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    self._buffer = b""
    self._next_id = 0
    self.events: list[dict] = []
    target = self.call("Target.createTarget", url="about:blank")["targetId"]
    self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
      self.call(f"{domain}.enable", session=True)

  def _read_message(self) -> dict:
    while b"\0" not in self._buffer:
      if not select.select([self._from_chrome], [], [], PAGE_TIMEOUT_S)[0]:
        raise RuntimeError(f"Chromium sent nothing in {PAGE_TIMEOUT_S} s")
      chunk = os.read(self._from_chrome, 1 << 20)
      if not chunk:
        raise RuntimeError("Chromium closed the DevTools pipe")
      self._buffer += chunk
    message, self._buffer = self._buffer.split(b"\0", 1)
    return json.loads(message)

  def call(self, method: str, session: bool = False, **params: object) -> dict:
    """Sends one command and returns its result; the events read meanwhile go to ``events``."""
    self._next_id += 1
    message: dict = {"id": self._next_id, "method": method, "params": params}
    if session:
      message["sessionId"] = self._session
    os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
    while True:
      reply = self._read_message()
      if reply.get("id") == self._next_id:
        if "error" in reply:
          raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]
      self.events.append(reply)

  def evaluate(self, expression: str) -> object:
    """The value of a JavaScript expression (awaited if a promise) in the tab."""
    result = self.call(
      "Runtime.evaluate", session=True, expression=expression, awaitPromise=True, returnByValue=True
    )
    if "exceptionDetails" in result:
      raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails']}")
    return result["result"].get("value")

  def open(self, url: str) -> None:
    """Navigates the tab to ``url`` and waits for its load event."""
    self.events.clear()
    self.call("Page.navigate", session=True, url=url)
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
      if time.monotonic() > deadline:
        raise RuntimeError(f"{url}: no load event in {PAGE_TIMEOUT_S} s")
      self.events.append(self._read_message())

  def errors(self) -> list[str]:
    """The console errors, uncaught exceptions and logged errors since the last :meth:`open`."""
    found = []
    for event in self.events:
      method, params = event.get("method"), event.get("params", {})
      if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
        found.append(
          "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
        )
      elif method == "Runtime.exceptionThrown":
        details = params["exceptionDetails"]
        found.append(
          "exception: " + details.get("exception", {}).get("description", details["text"])
        )
      elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
        entry = params["entry"]
        found.append(f"log: {entry['text']} {entry.get('url', '')}".rstrip())
    return found

  def close(self) -> None:
    self._process.kill()
    self._process.wait()
    os.close(self._to_chrome)
    os.close(self._from_chrome)


# Every image loaded (lazy ones made eager), then the rendered DOM and the images that did not load.
_RENDERED = """(async () => {
  const images = [...document.images];
  images.forEach((img) => { img.loading = "eager"; });
  await Promise.all(images.map((img) => img.decode().catch(() => null)));
  await new Promise((resolve) => setTimeout(resolve, 100));
  return {
    html: document.documentElement.outerHTML,
    missing: images.filter((img) => img.naturalWidth === 0).map((img) => img.getAttribute("src")),
  };
})()"""

# Types SEARCH_QUERY into the search box and waits (5 s at most) for a result to be listed.
_SEARCH = """(async () => {
  const input = document.querySelector("[data-md-component=search-query]");
  if (!input) return -1;
  input.focus();
  input.value = %s;
  input.dispatchEvent(new Event("focus"));
  input.dispatchEvent(new Event("input", {bubbles: true}));
  input.dispatchEvent(new KeyboardEvent("keyup", {bubbles: true, key: "e"}));
  for (let i = 0; i < 50; i++) {
    const n = document.querySelectorAll(".md-search-result__item").length;
    if (n > 0) return n;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  return 0;
})()"""


def site_pages(site: pathlib.Path) -> list[pathlib.Path]:
  """The pages of ``site`` a reader opens: every ``.html`` but the server's ``404.html``.

  ``404.html`` links its assets from the server's root (``/assets/...``), for the URL it
  stands in for; from disk none of them loads.
  """
  return [path for path in sorted(site.rglob("*.html")) if path != site / "404.html"]


def check_site(site: pathlib.Path, executable: str) -> list[str]:
  """Every problem found on the pages of ``site``, each a line naming its page."""
  site = site.resolve()
  root = site.as_uri() + "/"
  problems = []
  pages = {}
  with tempfile.TemporaryDirectory(prefix="docs-check-") as profile:
    browser = Browser(executable, profile)
    try:
      for path in site_pages(site):
        url = path.as_uri()
        browser.open(url)
        rendered = browser.evaluate(_RENDERED)
        assert isinstance(rendered, dict)
        name = path.relative_to(site).as_posix()
        problems += [f"{name}: missing image {src!r}" for src in rendered["missing"]]
        problems += [f"{name}: {error}" for error in browser.errors()]
        pages[url] = parse_page(rendered["html"])
        problems += [f"{name}: internal marker {m}" for m in find_markers(pages[url].text)]
      browser.open((site / "index.html").as_uri())
      results = browser.evaluate(_SEARCH % json.dumps(SEARCH_QUERY))
      if not isinstance(results, int) or results <= 0:
        problems.append(
          f"index.html: search for {SEARCH_QUERY!r} from disk lists no result ({results})"
        )
      problems += [f"index.html (search): {error}" for error in browser.errors()]
    finally:
      browser.close()
  problems += [line.replace(root, "") for line in broken_links(pages, root)]
  return problems


def main(argv: list[str]) -> int:
  site = pathlib.Path(argv[1] if len(argv) > 1 else "site")
  if not (site / "index.html").is_file():
    print(f"docs-check: no {site}/index.html: build the site first (make docs)")
    return 2
  executable = find_chromium()
  if executable is None:
    print(
      "docs-check: Chromium not found (chromium or chromium-browser on PATH, or CHROMIUM=...);"
      " on Debian or Ubuntu: apt-get install chromium"
    )
    return 2
  start = time.monotonic()
  problems = check_site(site, executable)
  n_pages = len(site_pages(site))
  for problem in problems:
    print(problem)
  verdict = f"{len(problems)} problem(s)" if problems else "ok"
  print(f"docs-check: {n_pages} pages of {site} in {time.monotonic() - start:.0f} s: {verdict}")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
