"""tools/docs_check.py's parsing, markers and anchors on tiny pages (no Chromium needed)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_docs_check():
  spec = importlib.util.spec_from_file_location("docs_check", ROOT / "tools" / "docs_check.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["docs_check"] = module  # dataclasses looks its module up there
  spec.loader.exec_module(module)
  return module


docs_check = _load_docs_check()

GUIDE = """<html><head><title>Guide</title><style>.issue-1 { color: red }</style></head>
<body><h2 id="setup">Setup</h2><a name="legacy"></a>
<p>See <a href="#setup">setup</a>, <a href="#nowhere">nowhere</a>, <a href="#">top</a>,
<a href="api.html#jls.scale">scale</a>, <a href="api.html#gone">gone</a>,
<a href="missing.html">missing</a>, <a href="https://example.org/a.html#x">out</a>,
<a href="../data/file.py#L3">source</a>, <a href="api.html#a%20b">spaced</a>.</p>
<script>const note = "round 3";</script>
<pre><code>scale = 2.0  # docs: not run - a reason</code></pre>
</body></html>"""

API = """<html><body><h1 id="jls.scale">scale</h1><div id="a b"></div>
<p>Fixed in issue 43, round 2.</p></body></html>"""


def test_parse_page_reads_ids_links_and_text_outside_scripts():
  page = docs_check.parse_page(GUIDE)
  assert page.ids == {"setup", "legacy"}
  assert page.links == [
    "#setup",
    "#nowhere",
    "#",
    "api.html#jls.scale",
    "api.html#gone",
    "missing.html",
    "https://example.org/a.html#x",
    "../data/file.py#L3",
    "api.html#a%20b",
  ]
  assert "round 3" not in page.text  # a script is not rendered text
  assert "issue-1" not in page.text  # nor a style sheet
  assert page.text.startswith("Guide Setup See setup , nowhere , top ,")
  assert page.text.endswith("scale = 2.0 # docs: not run - a reason")


def test_find_markers_finds_issue_and_round_numbers_and_the_test_marker():
  assert docs_check.find_markers(docs_check.parse_page(GUIDE).text) == [
    "', out , source , spaced . scale = 2.0 # docs: not run - a reason'"
  ]
  found = docs_check.find_markers(docs_check.parse_page(API).text)
  assert found == ["'scale Fixed in issue 43, round 2.'"] * 2
  assert docs_check.find_markers("Issue 7 and ROUND 12") == [
    "'Issue 7 and ROUND 12'",
    "'Issue 7 and ROUND 12'",
  ]
  # Words that only contain the markers, or no number after them, are not markers.
  assert (
    docs_check.find_markers("tissue 4, around 3, issues 5, round-trip, rounds 2, issue #4") == []
  )


def test_broken_links_names_missing_ids_and_pages_only():
  root = "file:///site/"
  pages = {
    root + "guides/guide.html": docs_check.parse_page(GUIDE),
    root + "guides/api.html": docs_check.parse_page(API),
  }
  assert docs_check.broken_links(pages, root) == [
    f"{root}guides/guide.html: link '#nowhere': no id 'nowhere' on {root}guides/guide.html",
    f"{root}guides/guide.html: link 'api.html#gone': no id 'gone' on {root}guides/api.html",
    f"{root}guides/guide.html: link 'missing.html': no page {root}guides/missing.html",
  ]


def test_site_pages_leaves_out_the_servers_404_page(tmp_path):
  for name in ("index.html", "404.html", "guides/404.html", "guides/a.html", "search/index.js"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("<html></html>")
  pages = docs_check.site_pages(tmp_path)
  assert [p.relative_to(tmp_path).as_posix() for p in pages] == [
    "guides/404.html",
    "guides/a.html",
    "index.html",
  ]


def test_main_without_chromium_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
  (tmp_path / "index.html").write_text("<html></html>")
  monkeypatch.delenv("CHROMIUM", raising=False)
  monkeypatch.setenv("PATH", str(tmp_path))
  assert docs_check.main(["docs_check.py", str(tmp_path)]) == 2
  assert "Chromium not found" in capsys.readouterr().out
  assert docs_check.main(["docs_check.py", str(tmp_path / "nothing")]) == 2
  assert "build the site first (make docs)" in capsys.readouterr().out
